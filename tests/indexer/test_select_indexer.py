"""The indexer's top-k selection (DSA rule) against a first-principles oracle: ties to the lower
position, NaN lowest, keys beyond kv_lens never chosen, -1 padding; strided and low-precision
scores; the capture it fuses against capture_indexer's contract; torch.compile and CUDA graphs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gpu_helpers import skip_unless_triton_runs
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import POISON

from moe_ops import BatchLayout
from moe_ops.capture.errors import FaultCounter
from moe_ops.capture.target import CaptureTarget
from moe_ops.graphs import CompileCounters
from moe_ops.indexer.select import (
    _MIN_CHUNK,
    SELECT_CAPTURE_OP,
    _programs_per_row,
    select_indexer_topk,
    select_topk_torch,
    select_topk_triton,
)

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def oracle(scores: np.ndarray, k: int, lens) -> np.ndarray:
    """Sort each row's allowed keys by (score descending, NaN last, position), keep k, ascending."""
    n, t = scores.shape
    out = np.full((n, k), -1, dtype=np.int64)
    for i in range(n):
        limit = t if lens is None else max(0, min(int(lens[i]), t))
        keys = sorted(
            range(limit),
            key=lambda p: (math.isnan(scores[i, p]), -scores[i, p] if not math.isnan(scores[i, p]) else 0, p),
        )
        chosen = sorted(keys[:k])
        out[i, : len(chosen)] = chosen
    return out


@st.composite
def select_cases(draw, ks=(1, 3, 8, 64)):
    n = draw(st.integers(0, 5))
    t = draw(st.sampled_from([1, 5, 17, 100, 300]))
    k = draw(st.sampled_from(ks))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["random", "ties", "special"]))
    if kind == "random":
        scores = rng.standard_normal((n, t)).astype(np.float32)
    elif kind == "ties":
        scores = rng.integers(0, 3, size=(n, t)).astype(np.float32)
    else:
        scores = rng.choice(
            np.array([np.nan, -np.inf, np.inf, -0.0, 0.0, 1.5, -3.0], np.float32), size=(n, t)
        )
    lens = None
    if draw(st.booleans()):
        lens = rng.integers(-2, t + 3, size=n)
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    view = draw(st.sampled_from(["contiguous", "transposed", "sliced"]))
    return scores, k, lens, dtype, view


def _tensor(scores, dtype, view, device):
    t = torch.from_numpy(scores).to(dtype)
    if view == "transposed":
        t = t.t().contiguous().t()
    elif view == "sliced":
        wide = torch.full((t.shape[0], t.shape[1] + 3), 7.0, dtype=dtype)
        wide[:, 1 : 1 + t.shape[1]] = t
        t = wide[:, 1 : 1 + t.shape[1]]
    return t.to(device)


@pytest.mark.parametrize("impl", ["triton", "triton-split", "torch", "op"])
@settings(max_examples=60, deadline=None)
@given(case=select_cases())
def test_selection_is_the_oracle(impl, case):
    """ "triton-split": rows split into programs of >= 4 keys (a GPU splits rows of >= 4096 keys
    when the rows alone leave SMs idle), so chunks meet ties and kv_lens mid-row."""
    scores, k, lens, dtype, view = case
    if impl.startswith("triton"):
        skip_unless_triton_runs("cpu")
    s = _tensor(scores, dtype, view, "cpu")
    want = oracle(s.float().numpy(), k, lens)  # the oracle sees the scores as the kernel does
    lens_t = None if lens is None else torch.from_numpy(lens).to(torch.int32)
    out = torch.full((s.shape[0], k), POISON, dtype=torch.int32)
    no_lens = torch.empty(0, dtype=torch.int32)
    if impl == "op":
        select_indexer_topk(s, k, kv_lens=lens_t, out=out)
    elif impl == "torch":
        select_topk_torch(out, s, lens_t if lens_t is not None else no_lens)
    else:
        chunk = 4 if impl == "triton-split" else _MIN_CHUNK
        select_topk_triton(out, s, lens_t if lens_t is not None else no_lens, min_chunk=chunk)
    assert np.array_equal(out.numpy(), want)


def test_rows_split_as_the_gpu_is_filled():
    """Programs per row: >= 4 per SM in flight, chunks of >= min_chunk keys, whole 1024-key blocks."""
    cuda = torch.device("cuda")
    cases = {
        (1, 131072): 32, (128, 131072): 5, (4096, 131072): 1, (1, 8192): 2, (1, 4096): 1, (600, 8192): 1,
    }  # fmt: skip
    for (n, t), parts in cases.items():
        got, chunk = _programs_per_row(n, t, cuda, _MIN_CHUNK, sm_count=132)
        assert got == parts, (n, t, got)
        assert (got - 1) * chunk < t <= got * chunk and (got == 1 or chunk % 1024 == 0)
    assert _programs_per_row(0, 100, cuda, 4, sm_count=132) == (1, 100)


@pytest.mark.parametrize("device", DEVICES)
def test_distinct_scores_choose_torch_topk_set(device):
    if device == "cpu":
        skip_unless_triton_runs(device)
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(6, 2000, generator=gen).to(device)
    out = select_indexer_topk(scores, 64)
    want = scores.topk(64, dim=-1).indices.sort(dim=-1).values.to(torch.int32)
    assert torch.equal(out, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", [BatchLayout.LOCAL, BatchLayout.GATHERED], ids=lambda v: v.name)
def test_fused_capture_records_this_ranks_rows(device, layout):
    gen = torch.Generator().manual_seed(1)
    n, t, k = 9, 50, 8
    scores = torch.randn(n, t, generator=gen).to(device)
    lens = torch.randint(1, t + 1, (n,), generator=gen, dtype=torch.int32).to(device)
    buffer = torch.full((12, 3, k), POISON, dtype=torch.int32, device=device)
    counter = FaultCounter(device)
    if layout == BatchLayout.LOCAL:
        counts, sizes, rank, start, c = torch.tensor([7], dtype=torch.int32), None, 0, 0, 7
    else:
        counts, sizes, rank, start, c = (
            torch.tensor([4, 3], dtype=torch.int32),
            torch.tensor([5, 4], dtype=torch.int32),
            1,
            5,
            3,
        )
    target = CaptureTarget(
        buffer,
        2,
        token_counts=counts.to(device),
        dp_rank=rank,
        layout=layout,
        shard_sizes=None if sizes is None else sizes.to(device),
        fault_counter=counter,
    )
    out = select_indexer_topk(scores, k, kv_lens=lens, target=target)
    assert torch.equal(out, select_indexer_topk(scores, k, kv_lens=lens))
    assert torch.equal(buffer[:c, 2], out[start : start + c])
    assert (buffer[c:] == POISON).all() and (buffer[:, :2] == POISON).all()
    assert counter.read_and_reset().total == 0
    # the twin ops write the same
    ref_out = torch.empty_like(out)
    ref_buf = torch.full_like(buffer, POISON)
    ref_target = CaptureTarget(
        ref_buf,
        2,
        token_counts=counts.to(device),
        dp_rank=rank,
        layout=layout,
        shard_sizes=None if sizes is None else sizes.to(device),
        fault_counter=FaultCounter(device),
    )
    torch.ops.moe_ops.select_indexer_topk_capture_reference_(
        *SELECT_CAPTURE_OP.join((ref_out, scores, lens), ref_target.spec)
    )
    assert torch.equal(ref_out, out) and torch.equal(ref_buf, buffer)


def test_bad_input_is_refused():
    s = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        select_indexer_topk(s, 0)
    with pytest.raises(ValueError, match="scores must be"):
        select_indexer_topk(s.long(), 2)
    with pytest.raises(ValueError, match=r"kv_lens must be \(2,\)"):
        select_indexer_topk(s, 2, kv_lens=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="out must be"):
        select_indexer_topk(s, 2, out=torch.zeros(2, 3, dtype=torch.int32))
    buf16 = torch.zeros(4, 1, 2, dtype=torch.int16)
    with pytest.raises(ValueError, match="target must record"):
        select_indexer_topk(
            s, 2, target=CaptureTarget(buf16, 0, token_counts=torch.tensor([2], dtype=torch.int32))
        )


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_selection_has_no_graph_break(device):
    if device == "cpu":
        skip_unless_triton_runs(device)
    buffer = torch.full((8, 1, 4), POISON, dtype=torch.int32, device=device)
    counts = torch.tensor([5], dtype=torch.int32, device=device)

    def step(scores, lens):
        target = CaptureTarget(buffer, 0, token_counts=counts)
        return select_indexer_topk(scores, 4, kv_lens=lens, target=target)

    scores = torch.randn(5, 40, device=device)
    lens = torch.arange(1, 6, dtype=torch.int32, device=device) * 8
    with CompileCounters() as cc:
        got = torch.compile(step, fullgraph=True)(scores, lens)
    assert cc.graph_breaks == 0
    assert torch.equal(got, select_indexer_topk(scores, 4, kv_lens=lens))
    assert torch.equal(buffer[:5, 0], got)


@pytest.mark.gpu
def test_cuda_graph_replays_with_live_counts_and_lengths(cuda_device):
    n, t, k = 16, 3000, 512
    scores = torch.randn(n, t, device=cuda_device)
    lens = torch.full((n,), t, dtype=torch.int32, device=cuda_device)
    counts = torch.tensor([n], dtype=torch.int32, device=cuda_device)
    buffer = torch.full((n, 1, k), POISON, dtype=torch.int32, device=cuda_device)
    out = torch.empty(n, k, dtype=torch.int32, device=cuda_device)
    target = CaptureTarget(buffer, 0, token_counts=counts)
    select_indexer_topk(scores, k, kv_lens=lens, out=out, target=target)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        select_indexer_topk(scores, k, kv_lens=lens, out=out, target=target)
    for live in (16, 3, 0, 9):
        scores.copy_(torch.randn(n, t, device=cuda_device))
        lens.copy_(torch.randint(1, t, (n,), dtype=torch.int32))
        counts.fill_(live)
        buffer.fill_(POISON)
        graph.replay()
        want = np.asarray(oracle(scores.cpu().numpy(), k, lens.cpu().numpy()))
        assert np.array_equal(out.cpu().numpy(), want)
        assert torch.equal(buffer[:live, 0], out[:live]) and (buffer[live:] == POISON).all()


@pytest.mark.parametrize("layout", [BatchLayout.LOCAL, BatchLayout.GATHERED], ids=lambda v: v.name)
def test_split_rows_record_as_the_twin(layout):
    """The fused capture of rows split across programs (chunks of >= 8 keys): the positions and the
    record equal the twin's, ties across chunk boundaries and kv_lens mid-chunk included."""
    skip_unless_triton_runs("cpu")
    gen = torch.Generator().manual_seed(3)
    n, t, k = 5, 70, 16
    scores = torch.randint(0, 4, (n, t), generator=gen).float()  # ties in every chunk
    lens = torch.tensor([70, 33, 0, 9, 61], dtype=torch.int32)
    if layout == BatchLayout.LOCAL:
        counts, sizes, rank = torch.tensor([4], dtype=torch.int32), None, 0
    else:
        counts, sizes, rank = (
            torch.tensor([2, 3], dtype=torch.int32),
            torch.tensor([2, 3], dtype=torch.int32),
            1,
        )
    records = []
    for launch in ("triton", "torch"):
        buffer = torch.full((6, 2, k), POISON, dtype=torch.int32)
        target = CaptureTarget(
            buffer, 1, token_counts=counts, dp_rank=rank, layout=layout, shard_sizes=sizes,
            fault_counter=FaultCounter("cpu"),
        )  # fmt: skip
        out = torch.full((n, k), POISON, dtype=torch.int32)
        if launch == "triton":
            select_topk_triton(out, scores, lens, target.spec, min_chunk=8)
        else:
            select_topk_torch(out, scores, lens, target.spec)
        records.append((out, buffer))
    (out, buffer), (ref_out, ref_buffer) = records
    assert np.array_equal(out.numpy(), oracle(scores.numpy(), k, lens.numpy()))
    assert torch.equal(out, ref_out) and torch.equal(buffer, ref_buffer)
    assert (buffer[:, 1] != POISON).any()


@pytest.mark.gpu
@pytest.mark.parametrize("n, t, k", [(1, 131072, 2048), (2, 40000, 512), (64, 20000, 2048), (300, 9000, 512)])
def test_long_rows_split_across_programs_equal_the_twin(cuda_device, n, t, k):
    """Rows long enough to split on a GPU (one program per >= 4096 keys while the rows leave SMs
    idle), with a record: positions and record equal the twin's, on distinct and on tied scores."""
    gen = torch.Generator(device=cuda_device).manual_seed(n)
    for kind in ("distinct", "ties"):
        if kind == "distinct":
            scores = torch.randn(n, t, device=cuda_device, generator=gen)
        else:
            scores = torch.randint(0, 8, (n, t), device=cuda_device, generator=gen).to(torch.bfloat16)
        lens = torch.randint(t // 2, t + 1, (n,), device=cuda_device, generator=gen, dtype=torch.int32)
        counts = torch.tensor([n], dtype=torch.int32, device=cuda_device)
        results = []
        for launch in (select_topk_triton, select_topk_torch):
            buffer = torch.full((n, 1, k), POISON, dtype=torch.int32, device=cuda_device)
            out = torch.full((n, k), POISON, dtype=torch.int32, device=cuda_device)
            launch(out, scores, lens, CaptureTarget(buffer, 0, token_counts=counts).spec)
            results.append((out, buffer))
        (out, buffer), (ref_out, ref_buffer) = results
        assert torch.equal(out, ref_out), kind
        assert torch.equal(buffer, ref_buffer), kind
