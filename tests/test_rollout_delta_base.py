"""A delta whose base is not the version an engine serves: the engine takes part in the transfer
(every rank of the group must), verifies it, never applies it, and drops the staging at once instead
of holding it until the next version. Real gloo group (this process's thread is the trainer, rank 0),
the real reference engine receiving as rank 1."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from parity.ports import free_port
from parity.v1 import common_pb2
from parity.weights import checksum

SECRET = "delta-base-secret-0123456789abcdef"


def test_a_delta_against_another_base_is_verified_never_applied_and_dropped(tiny_model: Path) -> None:
    import torch

    from parity.config.rollout import RolloutConfig
    from parity.weights.receiver import process_holder
    from parity.weights.wire import TransferGroup
    from rollout.reference_engine import ReferenceEngine

    engine = ReferenceEngine(RolloutConfig(max_model_len=512, kv_cache_gib=1.0), tiny_model)
    port = free_port()

    def rendezvous(rank: int) -> common_pb2.Rendezvous:
        return common_pb2.Rendezvous(
            host="127.0.0.1", port=port, rank=rank, world_size=2, backend="gloo",
            group_name="delta-base", timeout_s=30, secret=SECRET,
        )  # fmt: skip

    async def scenario():
        await engine.start()
        served = {name: t.clone() for name, t in engine.model.state_dict().items()}
        name = "model.layers.0.mlp.up_proj.weight"
        changed = [(name, served[name] + 1.0)]  # the delta: one changed tensor
        plan = common_pb2.TransferPlan(
            version=6,
            tensors=checksum.describe(changed),
            bucket_bytes=1 << 16,
            checksum_algorithm=common_pb2.CHECKSUM_ALGORITHM_WSUM64,
            rendezvous=rendezvous(1),
            base_version=5,  # this engine serves v0
        )
        sent: list = []

        def trainer() -> None:
            group = TransferGroup.join(rendezvous(0), host_store=True)
            sent.append(group.send([t for _, t in changed], plan.bucket_bytes))
            group.close()

        sender = threading.Thread(target=trainer)
        sender.start()
        result = await engine.update_weights(plan, "keep")
        sender.join(30)
        after = engine.model.state_dict()
        unchanged = all(torch.equal(after[n], t) for n, t in served.items())
        return plan, result, sent, unchanged

    try:
        plan, result, sent, unchanged = asyncio.run(scenario())
    finally:
        process_holder().close()
        asyncio.run(engine.shutdown())
    assert sent and sent[0] > 0  # the transfer happened, with this engine as a rank
    assert result.outcome == "failed" and result.error.startswith("plan.base_version"), result
    assert result.checksums == [m.checksum for m in plan.tensors]  # received and verified
    assert result.weight_version == 0 and engine.weight_version == 0 and unchanged
    assert engine._staged is None  # dropped now, not held until the next version
