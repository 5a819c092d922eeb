"""Delta updates (broadcast.delta_updates): only what changed travels, and every worker still ends
on exactly the trainer's whole version.

Real processes: `parity serve broadcast --delta_updates true`, stand-in receivers
(tests/fakes/fake_receiver.py, the rollout workers' own receiver), and this process as the trainer
through the real `parity.weights.sender.Publisher` (subset sends, whole snapshots, catch-ups). The vLLM
side of a delta (its in-place reload of a few blocks) is in tests/test_broadcast_rollout.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from broadcast.delta import changed_tensors, delta_base, module_group
from parity.procs import start_service
from parity.v1 import broadcast_pb2 as pb
from parity.v1 import broadcast_pb2_grpc, common_pb2
from parity.weights import checksum
from parity.weights.sender import Publisher
from tests.test_broadcast import start_standin, state

TOKEN = "test-token"


def weights(seed: int) -> dict[str, object]:
    """A toy model laid out like a Llama checkpoint: an embedding, two blocks, a final norm."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "model.embed_tokens.weight": (2000, 128),
        "model.layers.0.self_attn.q_proj.weight": (128, 128),
        "model.layers.0.self_attn.k_proj.weight": (64, 128),
        "model.layers.0.mlp.up_proj.weight": (256, 128),
        "model.layers.0.input_layernorm.weight": (128,),
        "model.layers.1.self_attn.q_proj.weight": (128, 128),
        "model.layers.1.mlp.up_proj.weight": (256, 128),
        "model.norm.weight": (128,),
    }
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def metas(named: dict) -> list[common_pb2.TensorMeta]:
    return checksum.describe(list(named.items()))


def test_module_groups_keep_a_block_together_and_top_level_modules_apart() -> None:
    assert module_group("model.layers.3.self_attn.q_proj.weight") == "model.layers.3"
    assert module_group("model.layers.3.mlp.experts.7.w1.weight") == "model.layers.3"
    assert module_group("model.layers.3.input_layernorm.weight") == "model.layers.3"
    assert module_group("transformer.h.11.attn.c_attn.weight") == "transformer.h.11"
    assert module_group("model.embed_tokens.weight") == "model.embed_tokens"
    assert module_group("model.norm.weight") == "model.norm"
    assert module_group("lm_head.weight") == "lm_head"


def test_changed_tensors_are_the_changed_blocks_in_plan_order() -> None:
    v1 = weights(1)
    v2 = dict(v1)
    v2["model.layers.0.self_attn.q_proj.weight"] = v1["model.layers.0.self_attn.q_proj.weight"] + 1
    v2["model.norm.weight"] = v1["model.norm.weight"] * 2
    sent = [m.name for m in changed_tensors(metas(v1), metas(v2))]
    assert sent == [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",  # unchanged, but fused with q_proj in vLLM
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.norm.weight",
    ]
    assert changed_tensors(metas(v1), metas(v1)) == []
    everything = [m.name for m in changed_tensors(metas(v1), metas(weights(2)))]
    assert everything == list(v1)


def test_a_delta_needs_every_member_verified_on_the_previous_committed_version() -> None:
    assert delta_base(4, True, [4, 4]) == 4
    assert delta_base(4, True, [4, 3]) == 0  # one member behind: the whole version
    assert delta_base(4, True, [4, None]) == 0  # one member's version not verified
    assert delta_base(4, False, [4, 4]) == 0  # the previous version never committed
    assert delta_base(4, True, []) == 0  # nobody to send to
    assert delta_base(0, True, [0]) == 0  # no previous version


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.mark.slow
def test_frozen_tensors_are_not_resent_and_every_worker_ends_on_the_whole_version(tmp_path: Path) -> None:
    broadcast = start_service(
        "broadcast",
        ["--delta_updates", "true", "--heartbeat_interval_s", "0.5", "--heartbeat_timeout_s", "30",
         "--transfer_timeout_s", "20"],
        log_dir=tmp_path,
        env={"PARITY_BROADCAST_AUTH_TOKEN": TOKEN},
    ).wait_ready(240)  # fmt: skip
    receivers = {wid: start_standin(tmp_path, broadcast.address, wid) for wid in ("r0", "r1")}
    channel = grpc.insecure_channel(broadcast.address)
    stub = broadcast_pb2_grpc.WeightBroadcastServiceStub(channel)
    publisher = Publisher(broadcast.address, "toy", auth_token=TOKEN, bucket_bytes=64 * 1024)
    try:
        for receiver in receivers.values():
            receiver.wait_ready(240)
        versions = {1: weights(1)}
        # the embedding and layer 1 are frozen from version 1 on; layer 0 and the norm train
        for v in (2, 3):
            versions[v] = dict(versions[v - 1])
            for name in ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight"):
                versions[v][name] = versions[v - 1][name] + 0.01 * v
        whole = sum(t.numel() * t.element_size() for t in versions[1].values())
        changed = [
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.mlp.up_proj.weight",
            "model.layers.0.input_layernorm.weight",
            "model.norm.weight",
        ]
        changed_bytes = sum(versions[2][n].numel() * 4 for n in changed)

        first = publisher.publish_tensors(list(versions[1].items()), 1)
        assert first.committed and first.bytes_sent == whole  # nothing to build a delta on
        second = publisher.publish_tensors(list(versions[2].items()), 2)
        assert second.committed and second.bytes_sent == changed_bytes < whole / 3
        assert publisher.delta_bytes_saved == whole - changed_bytes
        expected = [str(m.checksum) for m in metas(versions[2])]
        for wid in receivers:  # the stand-ins hold the whole version 2, not just what was sent
            assert state(tmp_path, wid) == {"version": 2, "checksums": expected}
        log = broadcast.log_path.read_text()
        assert f"v2 is a delta against v1: {len(changed)} of {len(versions[2])} tensors" in log

        # A late joiner gets the whole version by a catch-up; the next version is a delta again,
        # since every member (the late joiner included) then verifiably serves version 2.
        receivers["r2"] = start_standin(tmp_path, broadcast.address, "r2")
        receivers["r2"].wait_ready(240)
        assert state(tmp_path, "r2") == {"version": 2, "checksums": expected}
        # counted by the sender's thread after its group closes: later than r2 shows the version
        _wait_for(lambda: publisher.catch_ups_sent >= 1, 60, "the catch-up was never counted")
        assert publisher.catch_ups_sent == 1

        def all_three_verified() -> bool:
            reply = stub.GetStatus(pb.WeightBroadcastServiceGetStatusRequest(), timeout=5)
            return {w.worker_id: (w.weight_version, w.verified) for w in reply.workers} == {
                wid: (2, True) for wid in receivers
            }

        _wait_for(all_three_verified, 30, "the late joiner was never recorded at version 2")
        third = publisher.publish_tensors(list(versions[3].items()), 3)
        assert third.committed and third.bytes_sent == changed_bytes
        expected = [str(m.checksum) for m in metas(versions[3])]
        for wid in receivers:
            assert state(tmp_path, wid) == {"version": 3, "checksums": expected}
        status = stub.GetStatus(pb.WeightBroadcastServiceGetStatusRequest(), timeout=5)
        assert status.updates_failed_total == 0
    finally:
        publisher.close()
        channel.close()
        for receiver in receivers.values():
            receiver.stop(10)
        broadcast.stop(10)
