"""How a snapshot narrows (``TransferPipeline.narrow_path``) and the per-call fast path.

CPU tests: the path decision (``choose_narrow_path``) and the enqueue function each pair of paths
runs, the bucket lookup by bit length the fast path
uses instead of :func:`graph_bucket`, that the argument checks are exactly those of before (every
accepted and refused ``num_rows`` / ``timeout`` kind, and a refused call takes no slot and no
sequence number), and that concurrent snapshots number themselves once each. GPU tests: the
``graph_launch`` path is the one taken where torch hands out the graph exec, its bytes equal the
source at every bucket edge (0, 1, powers of two and one off, ``max_rows``; stamps, poisoned host
and staging, three widths), it makes no current-stream or device switch, and two threads get their
own rows through it.
"""

from __future__ import annotations

import enum
import math
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import bucket_row_counts
from threads import run_threads

from moe_ops import TransferPipeline
from moe_ops.transfer import pipeline as pipeline_module
from moe_ops.transfer.paths import (
    COPY_PATHS,
    NARROW_PATHS,
    choose_narrow_path,
    graph_bucket,
    graph_buckets,
)

POISON = 0x5A  # neither a source id below 200 nor the stale fill


@pytest.mark.parametrize(
    "cuda, graphed, triton_narrow, copy_path, raw_exec, want, enqueue",
    [
        (True, True, True, "cudaMemcpyAsync", True, "graph_launch", "_enqueue_graph_launch"),
        # torch without raw_cuda_graph_exec
        (True, True, True, "cudaMemcpyAsync", False, "graph_replay", "_enqueue_cudart"),
        # cudart=False: no runtime to launch with
        (True, True, True, "copy_", True, "graph_replay", "_enqueue_torch"),
        (True, True, True, "copy_", False, "graph_replay", "_enqueue_torch"),
        (True, False, True, "cudaMemcpyAsync", True, "kernel", "_enqueue_cudart"),  # graphs=False
        (True, False, True, "copy_", True, "kernel", "_enqueue_torch"),
        # Triton does not run on the device
        (True, False, False, "cudaMemcpyAsync", True, "torch", "_enqueue_cudart"),
        (True, False, False, "copy_", False, "torch", "_enqueue_torch"),
        (False, False, False, "cpu", True, "cpu", "_enqueue_cpu"),
        (False, False, True, "cpu", False, "cpu", "_enqueue_cpu"),
    ],
)
def test_narrow_path_decision(cuda, graphed, triton_narrow, copy_path, raw_exec, want, enqueue):
    """The narrowing path of each case, and the one enqueue function that pair of paths runs."""
    assert choose_narrow_path(cuda, graphed, triton_narrow, copy_path, raw_exec) == want
    assert want in NARROW_PATHS and copy_path in COPY_PATHS
    assert pipeline_module._enqueue_for(copy_path, want) is getattr(pipeline_module, enqueue)


def test_narrow_path_decision_rejects_what_cannot_run():
    with pytest.raises(
        ValueError, match=r"copy_path must be one of cudaMemcpyAsync, copy_, cpu, got 'memcpy'"
    ):
        choose_narrow_path(True, True, True, "memcpy", True)
    for cuda, triton_narrow in [(True, False), (False, True), (False, False)]:
        with pytest.raises(ValueError, match="graphed=True needs cuda=True and triton_narrow=True"):
            choose_narrow_path(cuda, True, triton_narrow, "cudaMemcpyAsync" if cuda else "cpu", True)


def test_a_cpu_pipeline_narrows_on_the_host_whatever_it_is_asked():
    source = torch.arange(24, dtype=torch.int32).view(4, 3, 2)
    for graphs in (None, False):
        for cudart in (None, False):
            pipe = TransferPipeline(source, np.uint8, graphs=graphs, cudart=cudart)
            assert (pipe.narrow_path, pipe.copy_path, pipe.graphed) == ("cpu", "cpu", False)
            assert pipe._enqueue is pipeline_module._enqueue_cpu
            with pipe.snapshot(3) as h:
                assert np.array_equal(h.result(), source[:3].numpy().astype(np.uint8))


@settings(max_examples=300)
@given(max_rows=st.integers(1, 70_000), data=st.data())
def test_the_bucket_of_n_is_graph_buckets_at_the_bit_length_of_n_minus_one(max_rows, data):
    """The fast path indexes a slot's graphs by ``(n - 1).bit_length()``; it must pick exactly the
    graph of :func:`graph_bucket`."""
    n = data.draw(bucket_row_counts(max_rows).filter(lambda r: r >= 1))
    buckets = graph_buckets(max_rows)
    index = (n - 1).bit_length()
    assert index < len(buckets), f"n={n} indexes past the {len(buckets)} buckets of {max_rows} rows"
    assert buckets[index] == graph_bucket(n, max_rows)
    # the largest index any n reaches is the last bucket (max_rows): the table is never longer
    assert (max_rows - 1).bit_length() == len(buckets) - 1


class _Rows(enum.IntEnum):
    THREE = 3


@pytest.mark.parametrize(
    "num_rows",
    [3, np.int8(3), np.int16(3), np.int32(3), np.int64(3), np.uint8(3), np.uint64(3), _Rows.THREE],
    ids=lambda v: type(v).__name__,
)
def test_snapshot_takes_every_integer_kind_as_a_plain_int(num_rows):
    source = torch.arange(40, dtype=torch.int32).view(5, 4, 2)
    pipe = TransferPipeline(source, np.uint8)
    with pipe.snapshot(num_rows) as h:
        assert type(h.num_rows) is int and h.num_rows == 3
        assert np.array_equal(h.result(), source[:3].numpy().astype(np.uint8))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"num_rows": True}, TypeError, "num_rows must be an int, got bool"),
        ({"num_rows": np.bool_(True)}, TypeError, "num_rows must be an int, got bool"),
        ({"num_rows": 3.0}, TypeError, "num_rows must be an int, got float"),
        ({"num_rows": np.float32(3)}, TypeError, "num_rows must be an int, got float32"),
        ({"num_rows": "3"}, TypeError, "num_rows must be an int, got str"),
        ({"num_rows": None}, TypeError, "num_rows must be an int, got NoneType"),
        ({"num_rows": 6}, ValueError, r"num_rows must be in \[0, 5\] \(rows of the source\), got 6"),
        ({"num_rows": -1}, ValueError, r"num_rows must be in \[0, 5\] \(rows of the source\), got -1"),
        ({"num_rows": np.int64(-1)}, ValueError, r"num_rows must be in \[0, 5\].*got -1"),
        ({"num_rows": 1, "timeout": -0.5}, ValueError, r"timeout must be None or seconds >= 0.*got -0\.5"),
        ({"num_rows": 1, "timeout": -math.inf}, ValueError, "timeout must be None or seconds >= 0"),
        ({"num_rows": 1, "timeout": math.nan}, ValueError, "timeout must be None or seconds >= 0"),
        ({"num_rows": 1, "timeout": -1}, ValueError, "timeout must be None or seconds >= 0"),
        (
            {"num_rows": 1, "timeout": True},
            TypeError,
            "timeout must be None or a number of seconds, got bool",
        ),
        ({"num_rows": 1, "timeout": "1"}, TypeError, "timeout must be None or a number of seconds, got str"),
    ],
)
def test_a_refused_snapshot_takes_no_slot_and_no_sequence_number(kwargs, error, match):
    source = torch.arange(40, dtype=torch.int32).view(5, 4, 2)
    pipe = TransferPipeline(source, np.uint8, depth=1)
    with pipe.snapshot(2) as first:
        assert first.seq == 0
    num_rows = kwargs.pop("num_rows")
    with pytest.raises(error, match=match):
        pipe.snapshot(num_rows, **kwargs)
    assert pipe.in_flight == 0
    with pipe.snapshot(5) as h:  # the ring's only slot is free and the numbering went on by one
        assert h.seq == 1
        assert np.array_equal(h.result(), source.numpy().astype(np.uint8))


@pytest.mark.parametrize("timeout", [0, 0.0, -0.0, 0.25, np.float32(0.25), np.float64(0.25), None, math.inf])
def test_snapshot_accepts_every_timeout_kind(timeout):
    source = torch.arange(40, dtype=torch.int32).view(5, 4, 2)
    pipe = TransferPipeline(source, np.uint8, depth=1)
    with pipe.snapshot(4, timeout=timeout) as h:
        assert np.array_equal(h.result(), source[:4].numpy().astype(np.uint8))


def test_concurrent_snapshots_number_themselves_once_each_and_get_their_own_rows():
    """Four threads share a depth-3 ring (so they wait for each other's releases): every snapshot
    gets a distinct sequence number, together exactly ``0 .. total-1``, each thread's in the order
    it took them, and every handle's rows are its own."""
    source = torch.randint(0, 200, (24, 3, 2), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    expected = source.numpy().astype(np.uint8)
    pipe = TransferPipeline(source, np.uint8, depth=3)
    per_thread, threads_n = 150, 4
    seqs: list[list[int]] = [[] for _ in range(threads_n)]
    errors: list[str] = []
    start = threading.Barrier(threads_n)

    def worker(k: int) -> None:
        rng = np.random.default_rng(k)
        start.wait()
        for _ in range(per_thread):
            n = int(rng.integers(0, 25))
            with pipe.snapshot(n, timeout=30.0) as h:
                seqs[k].append(h.seq)
                if h.num_rows != n or not np.array_equal(h.result(copy=False), expected[:n]):
                    errors.append(f"snapshot {h.seq} ({n} rows) returned wrong rows")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a snapshot() never got a slot back"
    assert errors == []
    assert sorted(s for mine in seqs for s in mine) == list(range(per_thread * threads_n))
    assert all(mine == sorted(mine) for mine in seqs)
    assert pipe.in_flight == 0


# ----------------------------------------------------------------------------------------------- GPU

MAX_ROWS, LAYERS, TOP_K = 300, 5, 3  # max_rows not a power of two: the last bucket is capped


def _edge_rows(max_rows: int) -> list[int]:
    rows = {0, 1, max_rows - 1, max_rows}
    for k in range(max_rows.bit_length()):
        rows |= {2**k - 1, 2**k, 2**k + 1}
    return sorted(r for r in rows if 0 <= r <= max_rows)


def _pipeline(device, out_dtype=np.uint8, *, max_rows=MAX_ROWS, stamped=False, depth=2, **kwargs):
    g = torch.Generator().manual_seed(3)
    source = torch.randint(-1, 200, (max_rows, LAYERS, TOP_K), generator=g, dtype=torch.int32).to(device)
    stamps = step = None
    if stamped:
        stamps = torch.tensor([4, 3, 4, 1, 4], dtype=torch.int32, device=device)  # layers 1, 3 stale
        step = torch.tensor([4], dtype=torch.int32, device=device)
    return TransferPipeline(source, out_dtype, depth=depth, layer_stamps=stamps, step_tensor=step, **kwargs)


def _expected(pipe: TransferPipeline, n: int) -> np.ndarray:
    rows = pipe.source[:n].cpu().numpy().copy()
    if pipe.layer_stamps is not None:
        rows[:, (pipe.layer_stamps != pipe.step_tensor).cpu().numpy()] = -1
    return rows.astype(pipe.out_dtype)  # numpy's integer cast wraps like the device's


def _poison(pipe: TransferPipeline) -> None:
    for slot in pipe._ring.slots:
        slot.staging.fill_(POISON)
        slot.host.fill_(POISON)
    torch.cuda.synchronize()


def _skip_without_raw_exec() -> None:
    if not hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec"):
        pytest.skip("this torch's CUDAGraph has no raw_cuda_graph_exec: the graphs replay through torch")


@pytest.mark.gpu
def test_a_cuda_pipeline_launches_its_graphs_where_torch_hands_out_the_exec(cuda_device):
    _skip_without_raw_exec()
    pipe = _pipeline(cuda_device)
    assert (pipe.narrow_path, pipe.copy_path, pipe.graphed) == ("graph_launch", "cudaMemcpyAsync", True)
    assert _pipeline(cuda_device, graphs=True, cudart=True).narrow_path == "graph_launch"
    assert _pipeline(cuda_device, cudart=False).narrow_path == "graph_replay"
    assert _pipeline(cuda_device, graphs=False).narrow_path == "kernel"
    assert _pipeline(cuda_device, graphs=False, cudart=False).narrow_path == "kernel"
    buckets = graph_buckets(MAX_ROWS)
    execs = []
    for slot in pipe._ring.slots:
        assert slot.graph_table == [slot.graphs[b] for b in buckets]
        assert slot.graph_execs == [g.raw_cuda_graph_exec() for g in slot.graph_table]
        execs += slot.graph_execs
    assert all(isinstance(e, int) and e != 0 for e in execs)
    assert len(set(execs)) == len(buckets) * pipe.depth, "every (slot, bucket) owns its own exec"
    replay = _pipeline(cuda_device, cudart=False)
    assert all(slot.graph_execs == [] for slot in replay._ring.slots)


@pytest.mark.gpu
def test_torch_twin_path_where_triton_does_not_run(cuda_device, monkeypatch):
    monkeypatch.setattr(pipeline_module, "triton_runs_on", lambda device: False)
    pipe = _pipeline(cuda_device, stamped=True)
    assert (pipe.narrow_path, pipe.graphed) == ("torch", False)
    with pytest.raises(ValueError, match="graphs=True needs a CUDA source and the Triton narrowing kernel"):
        _pipeline(cuda_device, graphs=True)
    for n in (0, 1, 7, MAX_ROWS):
        _poison(pipe)
        with pipe.snapshot(n) as h:
            assert h.result().tobytes() == _expected(pipe, n).tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [np.uint8, np.uint16, np.int32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("stamped", [False, True], ids=["plain", "stamps"])
def test_graph_launch_delivers_every_byte_at_every_bucket_edge(cuda_device, out_dtype, stamped):
    _skip_without_raw_exec()
    pipe = _pipeline(cuda_device, out_dtype, stamped=stamped)
    peer = _pipeline(cuda_device, out_dtype, stamped=stamped, cudart=False)  # graph_replay
    assert (pipe.narrow_path, peer.narrow_path) == ("graph_launch", "graph_replay")
    for n in _edge_rows(MAX_ROWS):
        _poison(pipe)
        _poison(peer)
        want = _expected(pipe, n)
        with pipe.snapshot(n) as h, peer.snapshot(n) as p:
            got = h.result()
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), f"{n} rows"
            assert p.result().tobytes() == want.tobytes(), f"graph_replay peer, {n} rows"
            slot = h._slot
            assert (slot.host[n:] == POISON).all(), f"rows past {n} reached the host"
            bucket = graph_bucket(n, MAX_ROWS)
            staged = slot.staging.cpu()
            # same bytes: uint16 stages as int16
            assert staged[:bucket].numpy().tobytes() == _expected(pipe, bucket).tobytes(), f"bucket {bucket}"
            assert (staged[bucket:] == POISON).all(), f"the graph of bucket {bucket} wrote past it"


@pytest.mark.gpu
@pytest.mark.parametrize("max_rows", [1, 2, 256, 257])
def test_graph_launch_at_every_row_count_of_small_and_power_of_two_sources(cuda_device, max_rows):
    """The bit-length table at its ends: one row, two, a power of two (no capped bucket), one past."""
    _skip_without_raw_exec()
    pipe = _pipeline(cuda_device, max_rows=max_rows, stamped=True)
    assert pipe.narrow_path == "graph_launch"
    assert len(pipe._ring.slots[0].graph_execs) == len(graph_buckets(max_rows))
    rows = range(max_rows + 1) if max_rows <= 2 else _edge_rows(max_rows)
    for n in rows:
        _poison(pipe)
        with pipe.snapshot(n) as h:
            assert h.result().tobytes() == _expected(pipe, n).tobytes(), f"{n} of {max_rows} rows"
            assert (h._slot.host[n:] == POISON).all()


@pytest.mark.gpu
@settings(max_examples=30)
@given(data=st.data())
def test_graph_launch_reads_the_source_and_stamps_when_the_copy_runs(data):
    _skip_without_raw_exec()
    pipe = _pipeline("cuda", stamped=True, depth=3)
    assert pipe.narrow_path == "graph_launch"
    for _ in range(3):
        n = data.draw(bucket_row_counts(MAX_ROWS))
        g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
        pipe.guard_source()
        pipe.source.copy_(torch.randint(0, 200, pipe.source.shape, generator=g, dtype=torch.int32))
        pipe.layer_stamps.copy_(torch.randint(0, 3, (LAYERS,), generator=g, dtype=torch.int32))
        pipe.step_tensor.fill_(data.draw(st.integers(0, 2)))
        want = _expected(pipe, n)
        _poison(pipe)
        with pipe.snapshot(n) as h:
            assert h.result().tobytes() == want.tobytes()


@pytest.mark.gpu
def test_graph_launch_switches_neither_stream_nor_device(cuda_device, monkeypatch):
    """Counts the calls into torch's real stream and device setters: none on the graph_launch path,
    two stream switches per snapshot on graph_replay (so the count can tell them apart)."""
    _skip_without_raw_exec()
    launch = _pipeline(cuda_device)
    replay = _pipeline(cuda_device, cudart=False)
    calls = {"_cuda_setStream": 0, "_cuda_setDevice": 0}
    for name in calls:
        real = getattr(torch._C, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(torch._C, name, counted)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        before = dict(calls)
        handles = [launch.snapshot(n) for n in (1, MAX_ROWS)]
        assert calls == before, f"graph_launch switched: {calls} after {before}"
        assert torch.cuda.current_stream() == side
        for h in handles:
            assert h.result().tobytes() == _expected(launch, h.num_rows).tobytes()
            h.release()
        with replay.snapshot(5) as r:
            assert calls["_cuda_setStream"] == before["_cuda_setStream"] + 2
            assert r.result().tobytes() == _expected(replay, 5).tobytes()


@pytest.mark.gpu
def test_two_threads_on_the_graph_launch_path_get_their_own_rows(cuda_device):
    _skip_without_raw_exec()
    pipe = _pipeline(cuda_device, stamped=True, depth=4)
    assert pipe.narrow_path == "graph_launch"
    expected = _expected(pipe, MAX_ROWS)
    torch.cuda.synchronize()
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for _ in range(80):
                n = int(rng.choice(_edge_rows(MAX_ROWS)))
                h = pipe.snapshot(n, timeout=30.0)
                if torch.cuda.current_stream() != stream:
                    errors.append("snapshot() left another stream current")
                if h.result().tobytes() != expected[:n].tobytes():
                    errors.append(f"snapshot {h.seq} ({n} rows) returned wrong rows")
                h.release()

    run_threads(worker, 2)
    assert errors == []
    assert pipe.in_flight == 0


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_graph_launch_from_a_thread_on_another_device():
    """A caller whose current device is cuda:1 snapshots a cuda:0 pipeline: the launch runs with
    cuda:0 current (as replay()'s device guard does) and cuda:1 is current again afterwards."""
    _skip_without_raw_exec()
    pipe = _pipeline(torch.device("cuda", 0), stamped=True)
    assert pipe.narrow_path == "graph_launch" and pipe._multi_device
    with torch.cuda.device(1):
        for n in (1, 37, MAX_ROWS):
            with pipe.snapshot(n) as h:  # recorded on cuda:0's current stream
                assert torch.cuda.current_device() == 1
                assert h.result().tobytes() == _expected(pipe, n).tobytes()
