"""The snapshot's fast path: narrowing through per-(slot, row bucket) CUDA graphs.

CPU tests check the bucket rule and the ``graphs`` argument; the GPU tests compare every byte a
graphed snapshot delivers with the source (row counts at every bucket edge, stamps, poisoned host
and staging buffers, two threads; launched through the runtime and replayed through torch), against
the direct launch, and check that the caller's stream and device are restored and ``guard_source``
still orders the next step's writes, on every ``narrow_path``.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from gpu_helpers import sleep_ms
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import bucket_row_counts
from threads import run_threads

from moe_ops import TransferPipeline
from moe_ops.transfer import pipeline as pipeline_module
from moe_ops.transfer.paths import graph_bucket, graph_buckets

POISON = 0x5A  # neither a source id below 200 nor the stale fill (255)


@settings(max_examples=300)
@given(max_rows=st.integers(0, 70_000), data=st.data())
def test_graph_bucket_is_the_smallest_listed_bucket_that_holds_the_rows(max_rows, data):
    n = data.draw(bucket_row_counts(max_rows))
    buckets = graph_buckets(max_rows)
    bucket = graph_bucket(n, max_rows)
    if n == 0:
        assert bucket == 0
        return
    assert bucket in buckets and n <= bucket <= max_rows
    assert bucket == min(b for b in buckets if b >= n)
    assert bucket < 2 * n, "a graph narrows less than twice the rows asked for"


def test_graph_buckets_are_powers_of_two_then_max_rows():
    assert graph_buckets(0) == []
    assert graph_buckets(1) == [1]
    assert graph_buckets(8) == [1, 2, 4, 8]
    assert graph_buckets(300) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300]
    assert len(graph_buckets(32768)) == 16 and len(graph_buckets(32769)) == 17


def test_graphs_argument_on_cpu():
    source = torch.zeros(8, 2, 2, dtype=torch.int32)
    for graphs in (None, False):
        pipe = TransferPipeline(source, np.uint8, graphs=graphs)
        assert not pipe.graphed
        with pipe.snapshot(8) as h:
            assert (h.result() == 0).all()
    with pytest.raises(ValueError, match=r"graphs=True needs a CUDA source.*got a cpu source"):
        TransferPipeline(source, np.uint8, graphs=True)
    with pytest.raises(TypeError, match="graphs must be None, True or False, got int"):
        TransferPipeline(source, np.uint8, graphs=1)


# ----------------------------------------------------------------------------------------------- GPU

MAX_ROWS, LAYERS, TOP_K = 300, 5, 3  # max_rows not a power of two: the last bucket is capped


def _edge_rows(max_rows: int) -> list[int]:
    rows = {0, 1, max_rows - 1, max_rows}
    for k in range(max_rows.bit_length()):
        rows |= {2**k - 1, 2**k, 2**k + 1}
    return sorted(r for r in rows if 0 <= r <= max_rows)


# narrow_path -> the TransferPipeline arguments that select it on a CUDA machine ("torch" also needs
# Triton reported as not running on the device: _path_pipeline)
PATH_KWARGS = {
    "graph_launch": {"graphs": True},
    "graph_replay": {"graphs": True, "cudart": False},
    "kernel": {"graphs": False},
    "torch": {"graphs": False},
}


def _path_pipeline(device, path: str, monkeypatch, *, stamped: bool, depth: int = 2):
    """A pipeline on narrow path ``path``; skips graph_launch where this torch cannot hand out a
    graph's exec."""
    if path == "graph_launch" and not hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec"):
        pytest.skip("this torch's CUDAGraph has no raw_cuda_graph_exec")
    if path == "torch":  # the CUDA path without Triton: the PyTorch twin narrows
        monkeypatch.setattr(pipeline_module, "triton_runs_on", lambda device: False)
    pipe = _pipeline(device, stamped=stamped, depth=depth, **PATH_KWARGS[path])
    assert pipe.narrow_path == path
    return pipe


def _pipeline(device, *, stamped: bool, graphs, depth: int = 2, cudart=None):
    g = torch.Generator().manual_seed(0)
    source = torch.randint(0, 200, (MAX_ROWS, LAYERS, TOP_K), generator=g, dtype=torch.int32).to(device)
    stamps = step = None
    if stamped:
        stamps = torch.tensor([4, 3, 4, 1, 4], dtype=torch.int32, device=device)  # layers 1, 3 stale
        step = torch.tensor([4], dtype=torch.int32, device=device)
    return TransferPipeline(
        source, np.uint8, depth=depth, layer_stamps=stamps, step_tensor=step, graphs=graphs, cudart=cudart
    )


def _expected(pipe: TransferPipeline, n: int) -> np.ndarray:
    rows = pipe.source[:n].cpu().numpy().astype(np.uint8)
    if pipe.layer_stamps is not None:
        stale = (pipe.layer_stamps != pipe.step_tensor).cpu().numpy()
        rows[:, stale] = 255  # -1 as uint8
    return rows


def _poison(pipe: TransferPipeline) -> None:
    for slot in pipe._ring.slots:
        slot.staging.fill_(POISON)
        slot.host.fill_(POISON)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("stamped", [False, True], ids=["plain", "stamps"])
@pytest.mark.parametrize("path", ["graph_launch", "graph_replay"])
def test_graphed_snapshot_delivers_every_byte_at_every_bucket_edge(cuda_device, stamped, path, monkeypatch):
    pipe = _path_pipeline(cuda_device, path, monkeypatch, stamped=stamped)
    direct = _pipeline(cuda_device, stamped=stamped, graphs=False)
    assert pipe.graphed and not direct.graphed and direct.narrow_path == "kernel"
    assert all(sorted(s.graphs) == graph_buckets(MAX_ROWS) for s in pipe._ring.slots)
    for n in _edge_rows(MAX_ROWS):
        _poison(pipe)
        want = _expected(pipe, n)
        with pipe.snapshot(n) as h, direct.snapshot(n) as d:
            got = h.result()
            assert np.array_equal(got, want), f"graphed snapshot of {n} rows"
            assert np.array_equal(d.result(), want), f"direct snapshot of {n} rows"
            slot = h._slot
            # the D2H copies exactly n rows; the graph narrows exactly its bucket's rows
            assert (slot.host_np[n:] == POISON).all(), f"rows past {n} reached the host"
            bucket = graph_bucket(n, MAX_ROWS)
            staged = slot.staging.cpu().numpy()
            assert np.array_equal(staged[:bucket], _expected(pipe, bucket)), f"bucket {bucket} staging"
            assert (staged[bucket:] == POISON).all(), f"the graph of bucket {bucket} wrote past it"


@pytest.mark.gpu
@settings(max_examples=40)
@given(data=st.data())
def test_graphed_snapshots_follow_the_source_and_the_stamps_at_copy_time(data):
    """The graphs read the source, stamps and step when they run, not what they held at capture."""
    pipe = _pipeline("cuda", stamped=True, graphs=True, depth=3)
    for _ in range(4):
        n = data.draw(bucket_row_counts(MAX_ROWS))
        seed = data.draw(st.integers(0, 2**31))
        g = torch.Generator().manual_seed(seed)
        pipe.guard_source()
        pipe.source.copy_(torch.randint(0, 200, pipe.source.shape, generator=g, dtype=torch.int32))
        pipe.layer_stamps.copy_(torch.randint(0, 3, (LAYERS,), generator=g, dtype=torch.int32))
        pipe.step_tensor.fill_(data.draw(st.integers(0, 2)))
        want = _expected(pipe, n)
        _poison(pipe)
        with pipe.snapshot(n) as h:
            assert np.array_equal(h.result(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("path", list(PATH_KWARGS))
def test_two_threads_snapshotting_get_their_own_rows(cuda_device, path, monkeypatch):
    """Two threads, each on its own forward stream, share a depth-4 ring: every snapshot's bytes
    equal the source, and each thread's current stream is its own again after every call."""
    pipe = _path_pipeline(cuda_device, path, monkeypatch, stamped=True, depth=4)
    expected = _expected(pipe, MAX_ROWS)
    torch.cuda.synchronize()
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for _ in range(60):
                n = int(rng.choice(_edge_rows(MAX_ROWS)))
                h = pipe.snapshot(n, timeout=30.0)
                if torch.cuda.current_stream() != stream:
                    errors.append("snapshot() left another stream current")
                if not np.array_equal(h.result(), expected[:n]):
                    errors.append(f"snapshot {h.seq} ({n} rows) returned wrong rows")
                h.release()

    run_threads(worker, 2)
    assert errors == []
    assert pipe.in_flight == 0


@pytest.mark.gpu
def test_snapshot_restores_the_callers_stream_and_records_on_the_given_one(cuda_device):
    pipe = _pipeline(cuda_device, stamped=False, graphs=True)
    default = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side), pipe.snapshot(7) as h:
        assert torch.cuda.current_stream() == side
        assert np.array_equal(h.result(), _expected(pipe, 7))
    assert torch.cuda.current_stream() == default
    # stream=: the rows written on `side` after a long kernel are the ones copied
    pipe.source.fill_(1)
    torch.cuda.synchronize()
    with pipe.snapshot(1) as warm:
        warm.result()
    with torch.cuda.stream(side):
        sleep_ms(100)
        pipe.source.fill_(2)
    with pipe.snapshot(MAX_ROWS, stream=side) as h:
        assert torch.cuda.current_stream() == default
        assert (h.result() == 2).all(), "the copy did not wait for the given stream"


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["graph_launch", "graph_replay", "kernel"])
def test_guard_source_orders_the_next_write_after_a_graphed_snapshot(cuda_device, path, monkeypatch):
    """The copy stream is held back; the next step's write after guard_source() must wait for the
    (graph) narrowing, so the snapshot still delivers the old rows, without a host wait."""
    pipe = _path_pipeline(cuda_device, path, monkeypatch, stamped=False)
    pipe.source.fill_(1)
    with pipe.snapshot(MAX_ROWS) as warm:
        warm.result()
    sleep_ms(1)  # calibrates outside the timed part
    torch.cuda.synchronize()
    with torch.cuda.stream(pipe.copy_stream):
        sleep_ms(100)
    handles = [pipe.snapshot(n) for n in (37, MAX_ROWS)]
    start = time.perf_counter()
    pipe.guard_source()
    pipe.source.fill_(2)
    assert time.perf_counter() - start < 0.05, "guard_source waited on the host"
    for h in handles:
        assert (h.result() == 1).all(), "the next step overwrote rows a queued snapshot had not read"
        h.release()
    torch.cuda.synchronize()
    assert (pipe.source == 2).all()
