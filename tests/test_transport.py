"""parity.transport and parity.checksum over real gloo groups in real processes."""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback

import pytest

from parity import checksum
from parity.ports import free_port
from parity.transport import Layout, TransferError, TransferGroup
from parity.v1 import common_pb2

BUCKET_BYTES = 4096  # small, so every transfer spans many buckets and splits tensors across them


def _tensors(seed: int) -> list:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(33, 17, generator=gen),
        torch.randn(5, generator=gen).to(torch.bfloat16),  # 10 bytes: unaligned tail
        torch.randint(-(2**40), 2**40, (300,), generator=gen),
        torch.randn(2, 3, 4, generator=gen).to(torch.float16),
        torch.tensor(3.5),  # 0-dim
        torch.randn(3000, generator=gen),  # 12 kB: whole buckets inside one tensor go out as views
    ]


def _named(seed: int) -> list[tuple[str, object]]:
    return [(f"t{i}", t) for i, t in enumerate(_tensors(seed))]


def _rendezvous(port: int, rank: int, world_size: int, timeout_s: float, name: str) -> common_pb2.Rendezvous:
    return common_pb2.Rendezvous(
        host="127.0.0.1",
        port=port,
        rank=rank,
        world_size=world_size,
        backend="gloo",
        group_name=name,
        timeout_s=timeout_s,
    )


def _run_rank(rank: int, world_size: int, port: int, host_rank: int, name: str, results) -> None:
    try:
        rdv = _rendezvous(port, rank, world_size, 20.0, name)
        group = TransferGroup.join(rdv, host_store=(rank == host_rank))
        metas = checksum.describe(_named(7))
        if rank == 0:
            sent = group.send([t for _, t in _named(7)], BUCKET_BYTES)
            results.put((rank, "sent", sent))
        else:
            got = group.recv(metas, BUCKET_BYTES)
            results.put((rank, "mismatched", checksum.mismatched(metas, got)))
            results.put((rank, "checksums", [checksum.tensor_checksum(t) for t in got]))
        group.close()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))


def _spawn(world_size: int, host_rank: int) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_run_rank, args=(r, world_size, port, host_rank, f"t{world_size}", results))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict = {}
    expected = 1 + 2 * (world_size - 1)
    deadline = time.monotonic() + 90
    while len(out) < expected and time.monotonic() < deadline:
        rank, key, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
        assert key != "error", f"rank {rank}:\n{value}"
        out[(rank, key)] = value
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world_size,host_rank", [(2, 1), (3, 2)])
def test_bucketed_transfer_delivers_identical_bytes(world_size: int, host_rank: int) -> None:
    out = _spawn(world_size, host_rank)
    expected = Layout.of(checksum.describe(_named(7))).total_bytes
    assert out[(0, "sent")] == expected
    trainer_sums = [m.checksum for m in checksum.describe(_named(7))]
    for rank in range(1, world_size):
        assert out[(rank, "mismatched")] == []
        assert out[(rank, "checksums")] == trainer_sums


def _join_alone(port: int, results) -> None:
    start = time.monotonic()
    try:
        TransferGroup.join(_rendezvous(port, 1, 2, 2.0, "lonely"), host_store=True)
        results.put(("joined", time.monotonic() - start))
    except TransferError as exc:
        results.put(("raised", time.monotonic() - start, str(exc)))


def _recv_from_dead_sender(port: int, results) -> None:
    try:
        group = TransferGroup.join(_rendezvous(port, 1, 2, 3.0, "dead"), host_store=True)
        start = time.monotonic()
        try:
            group.recv(checksum.describe(_named(1)), BUCKET_BYTES)
            results.put(("received", time.monotonic() - start))
        except TransferError as exc:
            results.put(("raised", time.monotonic() - start, str(exc)))
    except Exception:
        results.put(("error", traceback.format_exc()))


def _join_then_idle(port: int) -> None:
    group = TransferGroup.join(_rendezvous(port, 0, 2, 3.0, "dead"))
    time.sleep(30)  # joined (and keeps the group open) but never sends
    group.close()


@pytest.mark.slow
def test_missing_peer_raises_within_timeout_instead_of_hanging() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_join_alone, args=(free_port(), results))
    proc.start()
    outcome = results.get(timeout=60)
    proc.join(10)
    assert outcome[0] == "raised", outcome
    assert outcome[1] < 15.0, f"join took {outcome[1]:.1f}s with timeout_s=2"


@pytest.mark.slow
def test_silent_sender_makes_recv_raise_after_timeout() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    receiver = ctx.Process(target=_recv_from_dead_sender, args=(port, results))
    sender = ctx.Process(target=_join_then_idle, args=(port,))
    receiver.start()
    sender.start()
    outcome = results.get(timeout=60)
    sender.kill()
    receiver.join(10)
    sender.join(10)
    assert outcome[0] == "raised", outcome
    assert 2.0 <= outcome[1] < 15.0, f"recv gave up after {outcome[1]:.1f}s with timeout_s=3"


def test_checksum_detects_single_word_change_and_swaps() -> None:
    import torch

    base = torch.arange(1000, dtype=torch.float32)
    reference = checksum.tensor_checksum(base)
    assert 0 <= reference < 2**64
    changed = base.clone()
    changed[517] += 1.0
    assert checksum.tensor_checksum(changed) != reference
    swapped = base.clone()
    swapped[[3, 900]] = swapped[[900, 3]]
    assert checksum.tensor_checksum(swapped) != reference
    # the implementation equals the definition sum (2c+1)(2j+1) w_i mod 2**64, i = c*C + j
    big = torch.randint(-(2**62), 2**62, (checksum.CHUNK_WORDS * 2 + 3,), dtype=torch.int64)
    words = big.tolist()
    chunk = checksum.CHUNK_WORDS
    expected = (
        sum((2 * (i // chunk) + 1) * (2 * (i % chunk) + 1) * (w % 2**64) for i, w in enumerate(words)) % 2**64
    )
    assert checksum.tensor_checksum(big) == expected
    # unaligned views (storage offset not a multiple of 8 bytes) are handled
    halves = torch.randn(101).to(torch.bfloat16)
    assert checksum.tensor_checksum(halves[1:]) == checksum.tensor_checksum(halves[1:].clone())


def test_mismatched_names_the_bad_tensors() -> None:
    named = _named(3)
    metas = checksum.describe(named)
    tensors = [t.clone() for _, t in named]
    assert checksum.mismatched(metas, tensors) == []
    tensors[2][0] += 1
    tensors[3] = tensors[3].float()
    assert checksum.mismatched(metas, tensors) == ["t2", "t3"]
    assert metas[0].dtype == "float32" and list(metas[0].shape) == [33, 17]
