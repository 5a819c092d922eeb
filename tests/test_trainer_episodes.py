"""The trainer on multi-turn episodes: environment tokens are context, never trained on or measured.

An episode's RolloutSample holds the whole token sequence after the prompt with a loss mask; its
logprobs and versions cover the model's tokens only (rollouts.proto). The trainer scores the whole
sequence and keeps the model's positions, so with the weights that produced the episode its
logprobs equal the engine's on every model token (mismatch ~0), and the loss and every per-token
statistic count model tokens only.
"""

from __future__ import annotations

import torch

from tests.conftest import config_for
from tests.fakes.synthetic_rollouts import make_episode_group, make_group

TURNS = (("model", 5), ("environment", 4), ("model", 6), ("environment", 3), ("model", 2))


def _trainer(tmp_path, **overrides):
    from trainer.loop import Trainer

    config = config_for("trainer", model="tiny", device="cpu", run_dir=str(tmp_path / "run"), **overrides)
    trainer = Trainer(config)
    trainer.setup_model()
    return trainer


def test_episode_model_tokens_are_scored_in_context_and_environment_tokens_never(tmp_path) -> None:
    from trainer.consumer import Batch, validate_group
    from trainer.prepare import prepare

    trainer = _trainer(tmp_path, lr=1e-3, micro_batch_size=3)
    generator = torch.Generator().manual_seed(0)
    groups = [
        make_episode_group(trainer.model, f"e{i}", (1.0, 0.0, 0.5), TURNS, generator=generator)
        for i in range(2)
    ]
    assert all(validate_group(g) == "" for g in groups)
    sequences = prepare(Batch(groups=groups), trainer.config).sequences
    model_tokens = sum(n for role, n in TURNS if role == "model")
    assert [s.num_tokens for s in sequences] == [model_tokens] * 6
    stats, result = trainer.update(sequences)
    assert result.stepped
    # Every per-token statistic covers the model's tokens, and the trainer's logprobs there equal the
    # engine's (the same weights and the same context): scoring without the observations, or at
    # shifted positions, would differ by whole nats.
    assert stats.num_tokens == stats.kl_new_old.numel() == 6 * model_tokens
    assert float((stats.trainer_logprobs - stats.rollout_logprobs).abs().max()) < 1e-5


def test_the_gradient_of_an_episode_comes_from_its_model_tokens_only(tmp_path) -> None:
    """At ratio 1 the PPO-clip gradient is -A * d logp / N summed over trained tokens. The trainer's
    gradient on an episode equals that sum over the model's tokens alone, computed by hand from the
    whole sequence's logprobs: an observation token in the loss would change it."""
    from trainer.consumer import Batch
    from trainer.policy import token_logprobs
    from trainer.prepare import prepare

    trainer = _trainer(tmp_path, lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    groups = [make_episode_group(trainer.model, "e0", (1.0, 0.0, 0.0), TURNS, generator=generator)]
    sequences = prepare(Batch(groups=groups), trainer.config).sequences
    trainer.forward_backward(sequences)
    got = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.optimizer.zero_grad(set_to_none=True)
    total_tokens = sum(s.num_tokens for s in sequences)
    loss = torch.zeros(())
    for seq in sequences:
        logprobs_T, _ = token_logprobs(trainer.scorer, [seq.inputs], with_entropy=False)
        assert logprobs_T.numel() == len(seq.inputs.completion_ids) > seq.num_tokens
        loss = loss - seq.advantage * logprobs_T[torch.tensor(seq.loss_mask)].sum() / total_tokens
    loss.backward()
    want = {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() and got
    for name, grad in got.items():
        # float32 sums in another order (the trainer writes the group's prompt once, the sum by hand
        # runs each sequence alone): measured 1.8e-5 of the largest entry; a token too many in the
        # loss moves the gradient by about 1/N of it (N ~ 100 tokens here)
        worst, scale = float((grad - want[name]).abs().max()), float(want[name].abs().max())
        assert scale > 0 and worst <= 1e-4 * scale, (name, worst, scale)


def test_an_episode_in_the_old_layout_is_malformed(tmp_path) -> None:
    """A producer that aligned per-token fields with every token (observations included), or a mask
    that disagrees with the turns, is rejected as malformed, never trained on."""
    from parity import models
    from trainer.consumer import validate_group
    from trainer.policy import load_model

    model = load_model(models.resolve("tiny"))
    group = make_episode_group(model, "e0", (1.0,), TURNS, generator=torch.Generator().manual_seed(2))
    sample = group.samples[0]
    padded = list(sample.logprobs) + [0.0] * (len(sample.token_ids) - len(sample.logprobs))
    del sample.logprobs[:]
    sample.logprobs.extend(padded)
    assert "logprobs" in validate_group(group)
    group = make_episode_group(model, "e1", (1.0,), TURNS, generator=torch.Generator().manual_seed(2))
    group.samples[0].turns[1].role = group.samples[0].turns[0].role  # an observation claimed as the model's
    assert "loss mask" in validate_group(group)
    single = make_group(model, "s0", (1.0,), generator=torch.Generator().manual_seed(3))
    assert validate_group(single) == ""
    # a non-finite reward would make its group's advantages NaN; a sampled token's logprob is finite
    bad_reward = make_group(model, "s1", (1.0, float("nan")), generator=torch.Generator().manual_seed(3))
    assert "reward nan is not finite" in validate_group(bad_reward)
    bad_logprob = make_group(model, "s2", (1.0,), generator=torch.Generator().manual_seed(3))
    bad_logprob.samples[0].logprobs[2] = float("-inf")
    assert "logprob is not finite" in validate_group(bad_logprob)


def test_episodes_cross_the_ranks_wire_with_their_masks(tmp_path) -> None:
    from trainer import scatter
    from trainer.consumer import Batch
    from trainer.prepare import prepare

    trainer = _trainer(tmp_path)
    groups = [
        make_episode_group(trainer.model, "e0", (1.0, 0.0), TURNS, generator=torch.Generator().manual_seed(4))
    ]
    groups.append(make_group(trainer.model, "s0", (1.0, 0.0), generator=torch.Generator().manual_seed(5)))
    sequences = prepare(Batch(groups=groups), trainer.config).sequences
    assert scatter.decode_sequences(*scatter.encode_sequences(sequences)) == sequences
