"""`trainer.freeze`: the named parameters stay exactly as they were through a real step, the others
train, and a pattern that matches nothing is a config error naming the field."""

from __future__ import annotations

import pytest
import torch

from parity.config.base import ConfigError
from tests.conftest import config_for


def test_frozen_parameters_do_not_move_and_the_rest_train(tmp_path) -> None:
    from tests.fakes.synthetic_rollouts import make_group
    from trainer.consumer import Batch
    from trainer.loop import Trainer
    from trainer.prepare import prepare

    frozen_patterns = "model.embed_tokens.*,model.layers.0.*"
    config = config_for(
        "trainer", model="tiny", device="cpu", run_dir=str(tmp_path / "run"), lr=1e-2, freeze=frozen_patterns
    )
    trainer = Trainer(config)
    trainer.setup_model()
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    frozen = {name for name, p in trainer.model.named_parameters() if not p.requires_grad}
    assert frozen and all(n.startswith(("model.embed_tokens.", "model.layers.0.")) for n in frozen)
    assert {n for n in before if n.startswith(("model.embed_tokens.", "model.layers.0."))} == frozen
    in_optimizer = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert all(id(p) not in in_optimizer for n, p in trainer.model.named_parameters() if n in frozen)

    groups = [
        make_group(trainer.model, "g0", (1.0, 0.0, 0.0, 1.0), generator=torch.Generator().manual_seed(0))
    ]
    sequences = prepare(Batch(groups=groups), trainer.config).sequences
    _, result = trainer.update(sequences)
    assert result.stepped
    after = dict(trainer.model.named_parameters())
    moved = {n for n in before if not torch.equal(before[n], after[n].detach())}
    assert moved and not (moved & frozen), moved & frozen
    assert moved == set(before) - frozen  # every trainable tensor moved at lr 1e-2


def test_a_freeze_pattern_that_matches_nothing_names_the_field(tmp_path) -> None:
    from trainer.loop import Trainer

    config = config_for("trainer", model="tiny", device="cpu", run_dir=str(tmp_path), freeze="model.nope.*")
    with pytest.raises(ConfigError, match=r"trainer\.freeze: pattern 'model\.nope\.\*' matches no parameter"):
        Trainer(config).setup_model()
