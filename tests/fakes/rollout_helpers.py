"""Test and benchmark helpers: an independent HF recompute and a stand-in weight sender.

- `HfScorer` recomputes the logprobs of given completion tokens with transformers and
  `parity.sampling` (float32), independently of either rollout engine. `score_keep` replays an
  in-flight keep-mode update: KV before the switch from the old weights, the rest from the new.
- `run_on_one_engine` runs several scenarios on one started engine (a vLLM start is the costliest
  step of the suite), each bounded and with its failure kept apart from the others.
- `push_weights` plays the broadcast service's part of the update protocol for one worker: it
  hosts the TCPStore, joins as rank 0, and sends the tensors with the real `TransferGroup` (gloo)
  while the worker's `UpdateWeights` RPC runs. Only the broadcast *service* is stood in.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from parity.sampling import SamplingTransform, token_logprobs


def perturbed_state_dict(model_dir: Path, seed: int, scale: float = 0.5) -> dict:
    """The model's weights plus seeded Gaussian noise (relative `scale`): a clearly different version."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in model.state_dict().items():
        noise = torch.randn(tensor.shape, generator=generator) * tensor.float().std().clamp_min(1e-3) * scale
        state[name] = (tensor.float() + noise).contiguous()
    if getattr(model.config, "tie_word_embeddings", False):
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


class HfScorer:
    """Float32 transformers model whose weights can be swapped, for independent recomputes."""

    def __init__(self, model_dir: Path, threads: int | None = 1) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)  # a shared 2-core box: more threads are 100x slower

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.initial = {k: v.clone() for k, v in self.model.state_dict().items()}

    def load(self, state: dict | None) -> None:
        """Load `state` (None: the checkpoint's own weights)."""
        self.model.load_state_dict(self.initial if state is None else state, strict=False)

    def logits(self, ids: Sequence[int], past=None):
        import torch

        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([list(ids)]), past_key_values=past, use_cache=True)
        return out.logits[0].float(), out.past_key_values

    def score(
        self,
        prompt: Sequence[int],
        completion: Sequence[int],
        transform: SamplingTransform,
        raw: bool = False,
    ) -> list[float]:
        """Logprob of each completion token given the prompt and the previous completion tokens."""
        import torch

        logits_TV, _ = self.logits(list(prompt) + list(completion))
        logits_TV = logits_TV[len(prompt) - 1 : len(prompt) - 1 + len(completion)]
        tokens_T = torch.tensor(list(completion))
        if raw:
            return logits_TV.log_softmax(-1).gather(-1, tokens_T[:, None]).squeeze(-1).tolist()
        return token_logprobs(logits_TV, tokens_T, transform)[0].tolist()

    def score_keep(
        self,
        prompt: Sequence[int],
        completion: Sequence[int],
        switch_at: int,
        old_state: dict | None,
        new_state: dict | None,
        transform: SamplingTransform,
    ) -> list[float]:
        """Keep-mode replay: tokens [0, switch_at) sampled by the old weights; from token switch_at on
        the new weights run over KV the old weights computed for positions before token switch_at-1."""
        import torch

        assert 0 < switch_at < len(completion)
        ids = list(prompt) + list(completion)
        self.load(old_state)
        old_logits, cache = self.logits(ids[: len(prompt) + switch_at - 1])
        self.load(new_state)
        new_logits, _ = self.logits(ids[len(prompt) + switch_at - 1 : -1], past=cache)
        logits_TV = torch.cat([old_logits[len(prompt) - 1 :], new_logits])
        return token_logprobs(logits_TV, torch.tensor(list(completion)), transform)[0].tolist()


def transfer_plan(state: dict, version: int, bucket_bytes: int = 1 << 20, timeout_s: float = 60.0):
    """(plan for the worker as rank 1, rendezvous for the sender as rank 0, tensors in plan order)."""
    from parity.ports import free_port
    from parity.v1 import common_pb2
    from parity.weights import checksum

    names = sorted(state)
    tensors = [state[n] for n in names]
    rendezvous = common_pb2.Rendezvous(
        host="127.0.0.1",
        port=free_port(),
        rank=1,
        world_size=2,
        backend="gloo",
        group_name=f"test-v{version}-{uuid.uuid4().hex[:8]}",
        timeout_s=timeout_s,
        secret=uuid.uuid4().hex,  # the join's proof of the group secret (parity.weights.rendezvous)
    )
    plan = common_pb2.TransferPlan(
        version=version,
        tensors=checksum.describe(zip(names, tensors, strict=True)),
        bucket_bytes=bucket_bytes,
        checksum_algorithm=common_pb2.CHECKSUM_ALGORITHM_WSUM64,
        rendezvous=rendezvous,
    )
    sender = common_pb2.Rendezvous()
    sender.CopyFrom(rendezvous)
    sender.rank = 0
    return plan, sender, tensors


def send_as_rank0(sender_rdv, tensors, bucket_bytes: int, errors: list[BaseException]) -> None:
    """The sender's side of `transfer_plan` (for a thread): host the store, join as rank 0, send.
    An exception is appended to `errors` for the test to surface."""
    from parity.weights.wire import TransferGroup

    try:
        group = TransferGroup.join(sender_rdv, host_store=True)
        try:
            group.send(tensors, bucket_bytes)
        finally:
            group.close()
    except BaseException as exc:
        errors.append(exc)


def push_weights(stub, state: dict, version: int, metadata=(), timeout_s: float = 120.0, **request_fields):
    """Send `state` as `version` to the worker behind `stub` (a RolloutService stub). Returns the reply."""
    from parity.v1 import rollout_pb2

    plan, sender_rdv, tensors = transfer_plan(state, version)
    errors: list[BaseException] = []
    thread = threading.Thread(
        target=send_as_rank0, args=(sender_rdv, tensors, plan.bucket_bytes, errors), daemon=True
    )
    thread.start()
    reply = stub.UpdateWeights(
        rollout_pb2.UpdateWeightsRequest(plan=plan, **request_fields), timeout=timeout_s, metadata=metadata
    )
    thread.join(timeout_s)
    if errors:
        raise errors[0]
    return reply


def run_on_one_engine(
    engine, scenarios: dict[str, Callable[[], Awaitable]], timeout_s: float = 300.0
) -> dict[str, object]:
    """Start `engine`, await each scenario in turn (at most `timeout_s` each), shut it down. Per name:
    what the scenario returned, or the exception it raised (the next scenario still runs)."""
    results: dict[str, object] = {}

    async def run_all() -> None:
        await engine.start()
        try:
            for name, scenario in scenarios.items():
                try:
                    results[name] = await asyncio.wait_for(scenario(), timeout_s)
                except Exception as exc:  # this scenario's failure; the next one still runs
                    results[name] = exc
        finally:
            await engine.shutdown()

    asyncio.run(run_all())
    return results
