"""The data plane (parity.weights: layout, wire, group, verify, checksum) over real gloo groups in
real processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
import traceback

import pytest

from parity.ports import free_port
from parity.v1 import common_pb2
from parity.weights import checksum
from parity.weights.group import GroupHolder
from parity.weights.layout import Layout, TransferError, allocate_packed, pack, packed_in_place
from parity.weights.rendezvous import check_rendezvous, serve_store
from parity.weights.verify import StreamVerifier
from parity.weights.wire import TransferGroup

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


SECRET = "0123456789abcdef0123456789abcdef"


def _rendezvous(
    port: int, rank: int, world_size: int, timeout_s: float, name: str, secret: str = SECRET
) -> common_pb2.Rendezvous:
    return common_pb2.Rendezvous(
        host="127.0.0.1",
        port=port,
        rank=rank,
        world_size=world_size,
        backend="gloo",
        group_name=name,
        timeout_s=timeout_s,
        secret=secret,
    )


def _run_rank(
    rank: int, world_size: int, port: int, host_rank: int, name: str, results, layout: str = "scattered"
) -> None:
    try:
        rdv = _rendezvous(port, rank, world_size, 20.0, name)
        group = TransferGroup.join(rdv, host_store=(rank == host_rank))
        metas = checksum.describe(_named(7))
        if rank == 0:
            tensors = [t for _, t in _named(7)]
            if layout == "packed":  # as the trainer's flattened parameters: sent with no packing copy
                _, tensors = allocate_packed(tensors)
            sent = group.send(tensors, BUCKET_BYTES)
            results.put((rank, "sent", sent))
        else:
            import torch

            buffer = torch.empty(Layout.of(metas).total_bytes, dtype=torch.uint8)
            verifier = StreamVerifier(buffer, metas)
            # rank 1 posts every bucket at once, rank 2 one at a time; both checksum while receiving
            group.recv_packed(metas, BUCKET_BYTES, out=buffer, progress=verifier.advance, ahead=rank - 1)
            got = verifier.tensors
            results.put((rank, "mismatched", checksum.mismatched(metas, got) + verifier.mismatched()))
            results.put((rank, "checksums", [checksum.tensor_checksum(t) for t in got]))
        group.close()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))


PORT_TAKEN = "Address already in use"


def _spawn(world_size: int, host_rank: int, layout: str = "scattered") -> dict:
    """Every rank in its own process; the host rank serves the store on a port found free here. The
    port stays unbound until that process has started and imported torch (seconds), and on a busy
    box another process's connection can take it meanwhile: then the ranks run again on a new port
    (at most three tries). Any other error fails the test."""
    for _ in range(3):
        out = _spawn_once(world_size, host_rank, layout)
        if out is not None:
            return out
    raise AssertionError(f"the store's port was taken on each of three tries ({PORT_TAKEN})")


def _spawn_once(world_size: int, host_rank: int, layout: str) -> dict | None:
    """The ranks' results, or None when the host rank found its port taken."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_run_rank, args=(r, world_size, port, host_rank, f"t{world_size}", results, layout)
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict = {}
    expected = 1 + 2 * (world_size - 1)
    deadline = time.monotonic() + 90
    try:
        while len(out) < expected and time.monotonic() < deadline:
            rank, key, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            if key == "error" and rank == host_rank and PORT_TAKEN in value:
                return None
            assert key != "error", f"rank {rank}:\n{value}"
            out[(rank, key)] = value
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "world_size,host_rank,layout", [(2, 1, "scattered"), (3, 2, "scattered"), (2, 1, "packed")]
)
def test_bucketed_transfer_delivers_identical_bytes(world_size: int, host_rank: int, layout: str) -> None:
    out = _spawn(world_size, host_rank, layout)
    expected = Layout.of(checksum.describe(_named(7))).total_bytes
    assert out[(0, "sent")] == expected
    trainer_sums = [m.checksum for m in checksum.describe(_named(7))]
    for rank in range(1, world_size):
        assert out[(rank, "mismatched")] == []
        assert out[(rank, "checksums")] == trainer_sums


def _join_alone(port: int, results) -> None:
    import torch.distributed  # noqa: F401  (imported before the clock: a cold import is not the join)

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
    outcome = results.get(timeout=120)
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
    outcome = results.get(timeout=120)
    sender.kill()
    receiver.join(10)
    sender.join(10)
    assert outcome[0] == "raised", outcome
    assert 2.0 <= outcome[1] < 15.0, f"recv gave up after {outcome[1]:.1f}s with timeout_s=3"


def _chain_rank(rank: int, port: int, results) -> None:
    import os
    import signal

    import torch

    start = time.monotonic()
    try:
        group = TransferGroup.join(_rendezvous(port, rank, 3, 10.0, "chain-death"), host_store=(rank == 0))
        start = time.monotonic()  # from the joined group: the ranks' spawn and imports are not timed
        assert group.algorithm == "chain"
        metas = [common_pb2.TensorMeta(name="flat", shape=[40 * BUCKET_BYTES], dtype="uint8")]
        if rank == 0:
            group.send_packed(torch.ones(40 * BUCKET_BYTES, dtype=torch.uint8), BUCKET_BYTES)
        else:

            def progress(end: int) -> None:
                if rank == 1 and end >= 2 * BUCKET_BYTES:  # the middle of the chain dies mid-transfer
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(0.05)

            group.recv_packed(metas, BUCKET_BYTES, progress=progress, ahead=1)
        results.put((rank, "returned", time.monotonic() - start, ""))
    except TransferError as exc:
        results.put((rank, "raised", time.monotonic() - start, str(exc)))
    except Exception:
        results.put((rank, "error", time.monotonic() - start, traceback.format_exc()))


@pytest.mark.slow
def test_a_chain_whose_middle_rank_dies_fails_downstream_within_the_timeout() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_chain_rank, args=(rank, port, results)) for rank in range(3)]
    for proc in procs:
        proc.start()
    outcomes = {}
    for _ in range(2):  # rank 1 is killed and reports nothing
        rank, what, elapsed, detail = results.get(timeout=120)
        outcomes[rank] = (what, elapsed, detail)
    for proc in procs:
        proc.join(15)
    assert procs[1].exitcode == -9
    # the last rank never gets the rest: it fails on the dead link, well before its 10 s timeout
    assert outcomes[2][0] == "raised" and outcomes[2][1] < 8.0, outcomes
    assert outcomes[0][0] in ("returned", "raised") and outcomes[0][1] < 20.0, outcomes  # no hang


@pytest.fixture(params=["c", "numpy"])
def checksum_path(request, monkeypatch) -> str:
    """Each checksum test runs on the compiled one-pass kernel and on numpy's two passes."""
    if request.param == "numpy":
        monkeypatch.setattr(checksum, "run_sums", lambda: None)
    else:
        assert checksum.run_sums() is not None, "the checksum kernel is not built: run scripts/setup.sh"
    return request.param


def test_checksum_detects_single_word_change_and_swaps(checksum_path: str) -> None:
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
    # the implementation equals the definition sum (2c+1)(2j+1) w_i mod 2**64, i = c*C + j: a whole
    # chunk and a partial one that ends mid-row (the CPU path's row/column sums), and a small tensor
    # (its plain dot)
    chunk = checksum.CHUNK_WORDS
    for count in (chunk + 70_001, 1000):
        values = torch.randint(-(2**62), 2**62, (count,), dtype=torch.int64)
        words = values.tolist()
        expected = (
            sum((2 * (i // chunk) + 1) * (2 * (i % chunk) + 1) * (w % 2**64) for i, w in enumerate(words))
            % 2**64
        )
        assert checksum.tensor_checksum(values) == expected, count
    # a length that is not a multiple of 8 bytes: the last word is zero-padded (definition, written out)
    raw = torch.randint(0, 256, (8 * 21 + 5,), dtype=torch.uint8)
    padded = raw.tolist() + [0] * 3
    words = [int.from_bytes(bytes(padded[k : k + 8]), "little") for k in range(0, len(padded), 8)]
    expected = sum((2 * i + 1) * w for i, w in enumerate(words)) % 2**64
    assert checksum.tensor_checksum(raw) == expected
    # unaligned views (storage offset not a multiple of 8 bytes) are handled
    halves = torch.randn(101).to(torch.bfloat16)
    assert checksum.tensor_checksum(halves[1:]) == checksum.tensor_checksum(halves[1:].clone())


def test_checksum_accumulates_piece_by_piece(checksum_path: str) -> None:
    import torch

    data = torch.randint(0, 256, (3 * checksum.CHUNK_WORDS * 8 + 8 * 1500 + 5,), dtype=torch.uint8)
    whole = checksum.tensor_checksum(data)
    host = data.numpy()
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):  # random 8-byte aligned cuts, some across chunk and row boundaries
        cuts = sorted({8 * int(c) for c in torch.randint(1, host.size // 8, (6,), generator=gen)})
        total, prev = 0, 0
        for cut in [*cuts, host.size]:
            total = checksum.checksum_update(total, host[prev:cut], prev)
            prev = cut
        assert total == whole, cuts
    with pytest.raises(ValueError, match="start: 4"):
        checksum.checksum_update(0, host[4:100], 4)


def test_describe_sums_big_tensors_in_pieces_on_threads_to_the_same_value(
    checksum_path: str, monkeypatch
) -> None:
    import torch

    # pieces of 40 KiB: the big tensors are cut (one at a 4-byte element offset that is not a
    # multiple of a piece's word count), the small ones and an empty one are a piece each
    monkeypatch.setattr(checksum, "PIECE_BYTES", 40 << 10)
    gen = torch.Generator().manual_seed(5)
    tensors = [
        torch.randn(100_003, generator=gen),
        torch.randn(7, generator=gen).to(torch.bfloat16),
        torch.zeros(0),
        torch.randint(0, 2**31, (3000, 17), generator=gen, dtype=torch.int64).t(),  # not contiguous
        torch.randn(40_000, generator=gen)[1:],  # a view at an odd element offset
    ]
    expected = [checksum.tensor_checksum(t) for t in tensors]
    assert checksum.checksums(tensors) == expected
    metas = checksum.describe([(f"t{i}", t) for i, t in enumerate(tensors)])
    assert [m.checksum for m in metas] == expected and [m.name for m in metas] == [f"t{i}" for i in range(5)]
    assert checksum._checksum_pool is not None or len(os.sched_getaffinity(0)) == 1  # threads were used


def test_stream_verifier_sums_each_bucket_as_it_lands() -> None:
    import torch

    metas = checksum.describe(_named(7))
    layout = Layout.of(metas)
    source = pack([t for _, t in _named(7)], layout)
    for bucket in (7, 64, 4096, layout.total_bytes):  # odd sizes cut tensors mid-word
        out = torch.zeros_like(source)
        verifier = StreamVerifier(out, metas)
        for start, end in layout.buckets(bucket):
            out[start:end] = source[start:end]
            verifier.advance(end)
            finished = sum(1 for o, n in zip(layout.offsets, layout.nbytes, strict=True) if o + n <= end)
            assert len(verifier.checksums) == finished, (bucket, end)
        assert verifier.mismatched() == [], bucket
        assert verifier.checksums == [m.checksum for m in metas]
    # a byte flipped in the last tensor is caught, and that tensor named
    out = source.clone()
    last = len(metas) - 1
    out[layout.offsets[last] + 100] ^= 0xFF
    verifier = StreamVerifier(out, metas)
    verifier.advance(layout.offsets[last] + 64)
    assert verifier.mismatched() == [metas[last].name]


def test_mismatched_names_the_bad_tensors() -> None:
    named = _named(3)
    metas = checksum.describe(named)
    tensors = [t.clone() for _, t in named]
    assert checksum.mismatched(metas, tensors) == []
    tensors[2][0] += 1
    tensors[3] = tensors[3].float()
    assert checksum.mismatched(metas, tensors) == ["t2", "t3"]
    assert metas[0].dtype == "float32" and list(metas[0].shape) == [33, 17]


def _join_all(port: int, rdvs: list, device_uuids: list[str] | None = None) -> list:
    """Join every rendezvous from its own thread (one process, separate groups); per rank the group
    or the exception."""
    out: list = [None] * len(rdvs)

    def run(i: int) -> None:
        try:
            out[i] = TransferGroup.join(rdvs[i], device_uuid=device_uuids[i] if device_uuids else "")
        except Exception as exc:
            out[i] = exc

    serve_store("127.0.0.1", port)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(rdvs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_a_rank_without_the_groups_secret_is_refused_before_any_byte_moves() -> None:
    port = free_port()
    rdvs = [_rendezvous(port, r, 3, 10.0, "secret-test") for r in range(3)]
    rdvs[2] = _rendezvous(port, 2, 3, 10.0, "secret-test", secret="not-the-group-secret!")
    out = _join_all(port, rdvs)
    assert all(isinstance(o, TransferError) for o in out), out
    assert "rank 2 did not prove the group's secret" in str(out[0])
    rdvs = [_rendezvous(port, r, 2, 10.0, "secret-ok") for r in range(2)]
    groups = _join_all(port, rdvs)
    assert all(isinstance(g, TransferGroup) for g in groups), groups
    for group in groups:
        group.close()


def test_two_ranks_reporting_one_device_are_refused_before_the_backend_is_touched() -> None:
    port = free_port()
    rdvs = [_rendezvous(port, r, 3, 10.0, "dup-gpu") for r in range(3)]
    out = _join_all(port, rdvs, device_uuids=["GPU-a", "GPU-b", "GPU-a"])
    assert all(isinstance(o, TransferError) for o in out), out
    assert "ranks 0 and 2 of this group are on the same GPU (GPU-a)" in str(out[1])
    ok = _join_all(
        port, [_rendezvous(port, r, 2, 10.0, "distinct-gpu") for r in range(2)], ["GPU-a", "GPU-b"]
    )
    assert all(isinstance(g, TransferGroup) for g in ok), ok
    for group in ok:
        group.close()


@pytest.mark.parametrize("timeout_s", [float("nan"), float("inf"), -1.0, 0.0, 1e30, 3601.0])
def test_rendezvous_timeouts_must_be_finite_and_bounded(timeout_s: float) -> None:
    with pytest.raises(TransferError, match=r"rendezvous\.timeout_s: must be finite"):
        check_rendezvous(_rendezvous(1234, 0, 2, timeout_s, "t"))
    with pytest.raises(TransferError, match=r"rendezvous\.secret"):
        check_rendezvous(_rendezvous(1234, 0, 2, 5.0, "t", secret=""))
    check_rendezvous(_rendezvous(1234, 0, 2, 3600.0, "t"))


def test_the_store_listens_on_the_configured_host_only() -> None:
    import psutil

    store = serve_store("127.0.0.1", 0)
    listening = [
        c.laddr
        for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port
    ]
    assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening


def test_a_held_group_is_reused_per_epoch_rebuilt_on_a_new_one_and_dropped_after_a_failure() -> None:
    import torch

    port = free_port()
    serve_store("127.0.0.1", port)
    holders = [GroupHolder(), GroupHolder()]
    sent: list = []

    def rank(r: int, name: str, fail: bool = False) -> None:
        rdv = _rendezvous(port, r, 2, 3.0, name)
        try:
            with holders[r].use(rdv) as group:
                if r == 0:
                    sent.append(group)
                    if not fail:
                        group.send([torch.arange(10.0)], BUCKET_BYTES)
                    else:
                        raise TransferError("the trainer died")
                elif not fail:
                    group.recv(checksum.describe([("x", torch.arange(10.0))]), BUCKET_BYTES)
        except TransferError:
            pass

    def both(name: str, fail: bool = False) -> None:
        threads = [threading.Thread(target=rank, args=(r, name, fail)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)

    both("epoch1")
    both("epoch1")
    assert sent[0] is sent[1]  # one join for the epoch
    both("epoch2")
    assert sent[2] is not sent[1] and holders[0].name == "epoch2"
    both("epoch2", fail=True)
    assert holders[0].group is None  # a group that raised is never used again
    for holder in holders:
        holder.close()


def test_tensors_already_in_the_packed_layout_are_sent_from_their_own_buffer() -> None:
    import torch

    tensors = _tensors(3)
    layout = Layout.of(checksum.describe(_named(3)))
    assert packed_in_place(tensors, layout) is None  # separately allocated: packed as they go
    buffer, placed = allocate_packed(tensors)
    stream = packed_in_place(placed, layout)
    assert (
        stream is not None and stream.data_ptr() == buffer.data_ptr() and stream.numel() == layout.total_bytes
    )
    assert all(torch.equal(a, b) for a, b in zip(placed, tensors, strict=True))
    # a reordered or partial list is not the stream the receivers expect
    assert (
        packed_in_place(list(reversed(placed)), Layout.of(checksum.describe(list(reversed(_named(3))))))
        is None
    )
    # a suffix is still a packed stream (a view further into the buffer); a list with a gap is not
    suffix = Layout.of(checksum.describe(_named(3)[1:]))
    assert torch.equal(packed_in_place(placed[1:], suffix), pack(placed[1:], suffix))
    gap = [placed[0], placed[2]]
    assert packed_in_place(gap, Layout.of(checksum.describe([("a", gap[0]), ("b", gap[1])]))) is None


def test_flattened_parameters_keep_identity_train_in_place_and_send_without_copy() -> None:
    import torch

    from trainer.flat_params import flatten_parameters

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11))
    model[1].weight = model[0].weight  # tied, as many LMs' embedding and head
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    params_before = list(model.parameters())
    buffer = flatten_parameters(model)
    assert buffer is not None
    assert list(model.parameters()) == params_before and model[1].weight is model[0].weight
    assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.tensor([1, 2, 3])).sum().backward()
    opt.step()
    params = [p for _, p in model.named_parameters()]
    assert not torch.equal(params[0], reference["0.weight"])  # trained, and still inside the buffer
    stream = packed_in_place(
        [p.detach() for p in params], Layout.of(checksum.describe(model.named_parameters()))
    )
    assert stream is not None and stream.data_ptr() == buffer.data_ptr()


def test_the_nccl_error_setting_is_set_for_the_group_and_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """An NCCL weight group is built with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (CleanUpOnly: a failed
    transfer fails its work instead of ending the process); the process keeps its own setting
    (torchrun's for the trainer's group) before and after. The group itself needs GPUs: a fake
    constructor records the environment it was built under."""
    import torch.distributed as dist

    from parity.weights import rendezvous

    seen = []

    class FakeProcessGroupNCCL:
        Options = type("Options", (), {})

        def __init__(self, *args) -> None:
            seen.append(os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"))

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeProcessGroupNCCL, raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    port = free_port()
    serve_store("127.0.0.1", port)
    rdv = common_pb2.Rendezvous(
        host="127.0.0.1", port=port, rank=0, world_size=1, backend="nccl", group_name="nccl-env", timeout_s=5
    )
    rendezvous.open_process_group(rdv, device_uuid="GPU-fake")
    assert seen == ["2"] and os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


def test_an_nccl_receiver_keeps_a_few_buckets_posted_not_the_whole_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NCCL's watchdog times each work from when it is posted: a receiver that posted all of a
    model's buckets at once would give the whole transfer one timeout. A gloo receiver posts them
    all (disjoint views of one buffer); an NCCL one keeps NCCL_RECEIVES_POSTED. The group here is
    gloo, the receiver labelled NCCL (NCCL itself needs two GPUs)."""
    import torch

    from parity.weights import wire

    port = free_port()
    serve_store("127.0.0.1", port)
    groups: list = [None, None]

    def join(rank: int) -> None:
        groups[rank] = TransferGroup.join(_rendezvous(port, rank, 2, 10.0, "posted"), algorithm="broadcast")

    joins = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in joins:
        t.start()
    for t in joins:
        t.join(30)
    sender, receiver = groups
    tensor = torch.arange(3000, dtype=torch.float32)  # 12,000 bytes: 12 buckets of 1,000
    metas = checksum.describe([("t", tensor)])
    real_issue, real_wait = receiver._issue, receiver._wait
    try:
        for label, expected in (("nccl", wire.NCCL_RECEIVES_POSTED), ("gloo", 12)):
            receiver.backend = label
            posted, peak = [0], [0]

            def issue(buffer, posted=posted, peak=peak):
                posted[0] += 1
                peak[0] = max(peak[0], posted[0])
                return real_issue(buffer)

            def wait(work, nbytes, posted=posted):
                real_wait(work, nbytes)
                posted[0] -= 1

            monkeypatch.setattr(receiver, "_issue", issue)
            monkeypatch.setattr(receiver, "_wait", wait)
            send = threading.Thread(target=sender.send, args=([tensor], 1000))
            send.start()
            out = receiver.recv_packed(metas, 1000)
            send.join(30)
            assert torch.equal(out.view(torch.float32), tensor), label
            assert peak[0] == expected, (label, peak[0])
    finally:
        for group in groups:
            group.close()


def test_a_join_against_a_store_that_stopped_answering_fails_within_its_timeout() -> None:
    """The store's server frozen (SIGSTOP: a host frozen or cut off) after it accepted: torch's
    store timeouts do not bound reads from a server that stopped answering; the join does."""
    import signal
    import subprocess
    import sys

    port = free_port()
    code = (
        "import sys, time\n"
        "from parity.weights.rendezvous import serve_store\n"
        f"serve_store('127.0.0.1', {port})\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        server.send_signal(signal.SIGSTOP)
        outcome: list = []

        def join() -> None:
            start = time.monotonic()
            try:
                TransferGroup.join(_rendezvous(port, 1, 2, 2.0, "frozen"))
                outcome.append(("joined", time.monotonic() - start))
            except TransferError as exc:
                outcome.append((str(exc), time.monotonic() - start))

        thread = threading.Thread(target=join, daemon=True)
        thread.start()
        thread.join(60)
        assert outcome, "the join was still blocked after 60 s"
        message, took = outcome[0]
        print(f"join gave up after {took:.1f}s: {message}")
        assert "did not answer within 12s" in message and took < 30
    finally:
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait(10)
