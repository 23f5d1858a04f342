"""RoutingCapturer: persistent buffers, live counts, model-layer mapping, compile and CUDA graphs."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from gpu_helpers import sleep_ms
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import POISON

from moe_ops import BatchLayout, RoutingCapturer, RoutingShape, check_capture_errors
from moe_ops.graphs import CompileCounters

# model layers 0..4; 0 and 3 are dense
SHAPE = RoutingShape(num_layers=3, num_experts=64, top_k=2, moe_layers=(1, 2, 4), num_model_layers=5)
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _ids(n: int, seed: int, device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, SHAPE.num_experts, (n, SHAPE.top_k), generator=g).to(device)
        for _ in SHAPE.moe_layers
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_steps_capture_model_layers_into_the_moe_axis(device):
    cap = RoutingCapturer(SHAPE, 16, device, ring_depth=2)
    buffer_ptr, counts_ptr = cap.buffer.data_ptr(), cap.token_counts.data_ptr()
    assert cap.buffer.shape == (16, 3, 2) and cap.pipeline.out_dtype == np.uint8
    for step, n in enumerate([5, 0, 16, 9]):
        cap.set_step([n])
        assert cap.num_tokens == n
        ids = _ids(min(n + 3, 16), step, device)  # padding rows past the count
        for layer, t in zip(SHAPE.moe_layers, ids):
            cap.capture(layer, t)
        with cap.snapshot() as handle:
            rows = handle.result()
        expected = torch.stack([t[:n] for t in ids], dim=1).cpu().numpy().astype(np.uint8)
        assert np.array_equal(rows, expected), f"step {step}: rows differ"
    assert cap.buffer.data_ptr() == buffer_ptr and cap.token_counts.data_ptr() == counts_ptr
    assert check_capture_errors(cap.device) == 0


def test_dense_and_out_of_range_layers_raise():
    cap = RoutingCapturer(SHAPE, 8, "cpu")
    cap.set_step([2])
    ids = torch.zeros(2, 2, dtype=torch.int32)
    before = cap.buffer.clone()
    with pytest.raises(ValueError, match="model layer 3 is dense"):
        cap.capture(3, ids)
    with pytest.raises(IndexError, match=r"\[0, 5\)"):
        cap.capture(5, ids)
    assert torch.equal(cap.buffer, before)


@settings(max_examples=80)
@given(
    layout=st.sampled_from([BatchLayout.LOCAL, BatchLayout.GATHERED, BatchLayout.SHARDED]),
    counts=st.lists(st.integers(0, 6), min_size=3, max_size=3),
    pad=st.integers(0, 3),
    rank=st.integers(0, 2),
    seed=st.integers(0, 2**31),
)
def test_layouts_read_the_capturer_counts(layout, counts, pad, rank, seed):
    """GATHERED/SHARDED use the capturer's shard_sizes; the rows are this rank's, per the layout."""
    spr = 2 if layout == BatchLayout.SHARDED else 1
    cap = RoutingCapturer(
        SHAPE,
        12,
        "cpu",
        dp_size=3,
        dp_rank=rank,
        shards_per_rank=None if layout == BatchLayout.LOCAL else spr,
    )
    padded = [c + pad for c in counts]
    rng = np.random.default_rng(seed)
    if layout == BatchLayout.LOCAL:
        n_rows, start, sizes = padded[rank], 0, None
    elif layout == BatchLayout.GATHERED:
        n_rows, start, sizes = sum(padded), sum(padded[:rank]), padded
    else:
        per = [-(-p // spr) for p in padded]
        sizes = [s for s in per for _ in range(spr)]
        n_rows, start = sum(sizes), sum(sizes[: rank * spr])
    cap.set_step(counts, sizes)
    ids = [torch.from_numpy(rng.integers(0, 64, size=(n_rows, 2))) for _ in SHAPE.moe_layers]
    for layer, t in zip(SHAPE.moe_layers, ids):
        cap.capture(layer, t, layout)
    c = counts[rank]
    with cap.snapshot() as handle:
        rows = handle.result()
    expected = np.stack([t[start : start + c].numpy() for t in ids], axis=1)
    assert np.array_equal(rows, expected.astype(np.uint8))


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda c: c.set_step([1, 2]), ValueError, "token_counts must have 1 entries"),
        (lambda c: c.set_step([-1]), ValueError, "non-negative"),
        (
            lambda c: c.set_step([9]),
            ValueError,
            r"token_counts\[0\]=9 \(this rank\) exceeds max_num_tokens=8",
        ),
        (lambda c: c.set_step(["a"]), TypeError, "sequence of ints"),
        (lambda c: c.set_step([1], [1]), ValueError, "shard_sizes given but this capturer has none"),
        (lambda c: c.snapshot(9), ValueError, r"num_rows must be in \[0, 8\]"),
    ],
)
def test_bad_step_input_leaves_counts_untouched(call, exc, match):
    cap = RoutingCapturer(SHAPE, 8, "cpu")
    cap.set_step([3])
    with pytest.raises(exc, match=match):
        call(cap)
    assert cap.token_counts.tolist() == [3] and cap.num_tokens == 3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_num_tokens=0), "max_num_tokens must be an int >= 1"),
        (dict(dtype=torch.float32), "dtype must be torch.int16, torch.int32 or torch.int64"),
        (dict(dp_size=2, dp_rank=2), r"dp_rank must be an int in \[0, 2\)"),
        (dict(dp_size=0), "dp_size must be an int >= 1"),
        (dict(shards_per_rank=0), "shards_per_rank must be None or an int >= 1"),
        (dict(ring_depth=0), "depth must be an int >= 1"),
    ],
)
def test_constructor_validates(kwargs, match):
    args = dict(shape=SHAPE, max_num_tokens=8, device="cpu")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        RoutingCapturer(**args)


def test_int16_buffer_must_hold_the_ids():
    big = RoutingShape(1, 40000, 2)
    with pytest.raises(ValueError, match="cannot hold expert ids up to 39999"):
        RoutingCapturer(big, 4, "cpu", dtype=torch.int16)
    cap = RoutingCapturer(RoutingShape(1, 300, 2), 4, "cpu", dtype=torch.int16)
    assert cap.pipeline.out_dtype == np.uint16


def test_sharded_needs_shard_sizes_every_step():
    cap = RoutingCapturer(SHAPE, 8, "cpu", dp_size=2, shards_per_rank=2)
    with pytest.raises(
        ValueError, match=r"shard_sizes is required every step.*dp_size=2 x shards_per_rank=2"
    ):
        cap.set_step([1, 1])
    with pytest.raises(ValueError, match="shard_sizes must have 4 entries"):
        cap.set_step([1, 1], [1, 1])


class _Model(torch.nn.Module):
    """Routes through the dense/MoE model layers of SHAPE and captures into a capturer."""

    def __init__(self, capturer: RoutingCapturer, hidden: int = 16):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.capturer = capturer
        self.gates = torch.nn.Parameter(torch.randn(SHAPE.num_model_layers, hidden, 64, generator=g))
        self.mix = torch.nn.Parameter(torch.randn(SHAPE.num_model_layers, hidden, hidden, generator=g) / 4)

    def forward(self, x):
        out = []
        for layer in range(SHAPE.num_model_layers):
            if layer in SHAPE.moe_layers:
                ids = torch.topk(x @ self.gates[layer], SHAPE.top_k, dim=-1).indices
                self.capturer.capture(layer, ids)
                out.append(ids)
            x = torch.tanh(x @ self.mix[layer]) + x
        return torch.stack(out, dim=1)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_forward_follows_set_step_without_recompiling(device):
    cap = RoutingCapturer(SHAPE, 16, device)
    model = _Model(cap).to(device)
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(1)).to(device)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with CompileCounters() as cc:
        for n in (5, 16, 0, 11):
            cap.set_step([n])
            cap.buffer.fill_(POISON)
            ids = compiled(x)
            with cap.snapshot() as handle:
                rows = handle.result()
            assert np.array_equal(rows, ids[:n].cpu().numpy().astype(np.uint8)), f"n={n}"
            assert (cap.buffer[n:] == POISON).all()
    assert cc.graph_breaks == 0 and cc.graphs <= 1


@pytest.mark.gpu
def test_reduce_overhead_cuda_graphs_see_live_counts(cuda_device):
    cap = RoutingCapturer(SHAPE, 16, cuda_device, ring_depth=4)
    model = _Model(cap).to(cuda_device)
    x = torch.randn(16, 16, device=cuda_device)
    torch._dynamo.reset()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    handles = []
    with CompileCounters() as cc:
        for step, n in enumerate([5, 16, 0, 11, 3, 7, 16]):
            cap.set_step([n])
            ids = compiled(x).clone()
            handles.append((cap.snapshot(), ids[:n].cpu().numpy().astype(np.uint8)))
            if len(handles) == 3:  # three steps in flight, then the oldest is consumed
                handle, expected = handles.pop(0)
                assert np.array_equal(handle.result(), expected), f"step {step - 2}"
                handle.release()
    for handle, expected in handles:
        assert np.array_equal(handle.result(), expected)
        handle.release()
    assert cc.cudagraph_skips == 0, "inductor skipped CUDA graphs (the capturer's buffers must be static)"
    assert cc.graph_breaks == 0


@pytest.mark.gpu
def test_manual_cuda_graph_replays_with_set_step(cuda_device):
    cap = RoutingCapturer(SHAPE, 16, cuda_device)
    # zeros, not empty: the warm-up step records them, and garbage ids would count as faults
    ids = [torch.zeros(16, 2, dtype=torch.int64, device=cuda_device) for _ in SHAPE.moe_layers]

    def step():
        for layer, t in zip(SHAPE.moe_layers, ids):
            cap.capture(layer, t)

    cap.set_step([16])
    step()  # warm-up: kernel compile, fault counter
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for n in (4, 0, 16, 9):
        for t in ids:
            t.random_(0, 64)
        cap.set_step([n])
        graph.replay()
        with cap.snapshot() as handle:
            expected = torch.stack([t[:n] for t in ids], dim=1).cpu().numpy().astype(np.uint8)
            assert np.array_equal(handle.result(), expected), f"replay with n={n}"


@pytest.mark.gpu
def test_steps_queued_behind_a_long_kernel_keep_their_own_counts(cuda_device):
    """Ten steps (set_step, capture, snapshot) queued behind a 200 ms kernel: the host never waits,
    and each step's capture reads its own count (queued count copies never share staging memory)."""
    cap = RoutingCapturer(SHAPE, 16, cuda_device, ring_depth=10)
    layer = SHAPE.moe_layers[0]
    ids = {n: torch.full((16, 2), n, dtype=torch.int64, device=cuda_device) for n in range(2, 12)}
    cap.set_step([1])
    cap.capture(layer, ids[2])  # warm-up: kernel compile, fault counter
    with cap.snapshot(16) as warm:  # and the snapshot's kernels (lazy module loading may synchronise)
        warm.result()
    cap.buffer.fill_(-1)
    torch.cuda.synchronize()
    done = torch.cuda.Event()
    sleep_ms(200)
    done.record()
    start = time.perf_counter()
    handles = {}
    for n in range(2, 12):  # counts grow: step n writes n into rows [0, n); later rows stay -1
        cap.set_step([n])
        cap.capture(layer, ids[n])
        handles[n] = cap.snapshot(16)
    elapsed = time.perf_counter() - start
    assert not done.query(), "the test kernel finished before the steps were queued: it cannot tell"
    assert elapsed < 0.1, f"queuing ten steps took {elapsed * 1e3:.1f} ms: something waited on the host"
    for n, handle in handles.items():
        col = handle.result()[:, 0, 0].astype(np.int64)
        expected = np.where(np.arange(16) < n, n, 255)  # never-written rows: the -1 fill as uint8
        assert np.array_equal(col, expected), f"step with count {n} captured rows {col.tolist()}"
        handle.release()


@pytest.mark.gpu
def test_set_step_accepts_device_counts(cuda_device):
    cap = RoutingCapturer(SHAPE, 16, cuda_device)
    cap.set_step(torch.tensor([7], dtype=torch.int32, device=cuda_device))
    assert cap.num_tokens is None
    with pytest.raises(ValueError, match="num_rows is required"):
        cap.snapshot()
    with pytest.raises(ValueError, match=r"\(1,\) int32"):
        cap.set_step(torch.tensor([7], dtype=torch.int64, device=cuda_device))
    for layer, t in zip(SHAPE.moe_layers, _ids(9, 0, cuda_device)):
        cap.capture(layer, t)
    with cap.snapshot(7) as h:
        assert h.result().shape == (7, 3, 2)


# ---------------------------------------------------------------- target(): routers that capture themselves


@settings(max_examples=30)
@given(
    layout=st.sampled_from([BatchLayout.LOCAL, BatchLayout.GATHERED, BatchLayout.SHARDED]),
    counts=st.lists(st.integers(0, 5), min_size=2, max_size=2),
    pad=st.integers(0, 3),
    rank=st.integers(0, 1),
    padded_gather=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_target_records_what_capture_records(layout, counts, pad, rank, padded_gather, seed):
    """route(capture=capturer.target(layer, layout)) writes the same cells as route then capture()."""
    from moe_ops import RoutingMethod, route

    spr = 2 if layout == BatchLayout.SHARDED else 1
    has_sizes = layout == BatchLayout.SHARDED or (layout == BatchLayout.GATHERED and padded_gather)
    fused, separate = (
        RoutingCapturer(SHAPE, 12, "cpu", dp_size=2, dp_rank=rank, shards_per_rank=spr if has_sizes else None)
        for _ in range(2)
    )
    padded = [c + pad for c in counts]
    if layout == BatchLayout.LOCAL:
        n_rows, sizes = padded[rank], None
    elif layout == BatchLayout.GATHERED:
        n_rows, sizes = (sum(padded), padded) if padded_gather else (sum(counts), None)
    else:
        sizes = [-(-p // spr) for p in padded for _ in range(spr)]
        n_rows = sum(sizes)
    g = torch.Generator().manual_seed(seed)
    for cap in (fused, separate):
        cap.buffer.fill_(POISON)
        cap.set_step(counts, sizes)
    for layer in SHAPE.moe_layers:
        logits = torch.randn(n_rows, SHAPE.num_experts, generator=g)
        target = fused.target(layer, layout)
        assert target.buffer is fused.buffer and target.token_counts is fused.token_counts
        assert target.layer_id == SHAPE.buffer_layer(layer)
        assert (target.shard_sizes is not None) == has_sizes
        _, ids = route(logits, SHAPE.top_k, RoutingMethod.RENORMALIZE, capture=target, backend="torch")
        _, ref_ids = route(logits, SHAPE.top_k, RoutingMethod.RENORMALIZE, backend="torch")
        separate.capture(layer, ref_ids, layout)
        assert torch.equal(ids, ref_ids)
    assert torch.equal(fused.buffer, separate.buffer)


def test_target_rejects_dense_and_out_of_range_layers():
    cap = RoutingCapturer(SHAPE, 8, "cpu")
    with pytest.raises(ValueError, match="model layer 3 is dense"):
        cap.target(3)
    with pytest.raises(IndexError, match=r"\[0, 5\)"):
        cap.target(5)
    with pytest.raises(ValueError, match="SHARDED"):
        cap.target(1, BatchLayout.SHARDED)  # no shard_sizes on this capturer


# ------------------------------------------------------------------ one target per layer and layout


def test_routing_capturer_is_a_capturer_and_a_step_capturer():
    from moe_ops.capture import Capturer, RoutingCapturerLike, StepCapturer

    cap = RoutingCapturer(SHAPE, 8, "cpu")
    assert isinstance(cap, Capturer) and isinstance(cap, StepCapturer)
    assert RoutingCapturerLike is Capturer
    # the state part alone is not a whole Capturer (a step driver could not drive it)
    state = type(
        "State", (), dict(buffer=cap.buffer, token_counts=cap.token_counts, dp_rank=0, shard_sizes=None)
    )
    assert not isinstance(state(), Capturer)


def test_target_is_built_once_per_layer_and_layout():
    """The second call for a (layer, layout) returns the target the first built; another layer or
    layout builds its own. A layout given as its int value is the same layout."""
    cap = RoutingCapturer(SHAPE, 8, "cpu", dp_size=2, dp_rank=1, shards_per_rank=1)
    local = cap.target(2)
    assert cap.target(2) is local and cap.target(2, BatchLayout.LOCAL) is local and cap.target(2, 0) is local
    gathered = cap.target(2, BatchLayout.GATHERED)
    assert gathered is not local and cap.target(2, BatchLayout.GATHERED) is gathered
    assert cap.target(4) is not local and cap.target(4).layer_id == SHAPE.buffer_layer(4)
    assert gathered.layout == BatchLayout.GATHERED and gathered.shard_sizes is cap.shard_sizes


def test_a_cached_target_refuses_what_the_uncached_refuses():
    """Values that compare equal to a cached key but are no layer or layout (a bool, a float) are
    refused as on the first call, never answered from the cache."""
    cap = RoutingCapturer(SHAPE, 8, "cpu", dp_size=2, dp_rank=1, shards_per_rank=1)
    cap.target(1, BatchLayout.GATHERED)
    cap.target(1)
    for layout in (True, 1.0):
        with pytest.raises((TypeError, ValueError), match="layout"):
            cap.target(1, layout)
    with pytest.raises(TypeError, match="tp_group"):
        cap.target(1, BatchLayout.SEQUENCE_PARALLEL, tp_group=[0, 1])
    with pytest.raises(ValueError, match="model layer 3 is dense"):
        cap.target(3)
    with pytest.raises(ValueError, match="model layer 3 is dense"):
        cap.target(3)  # a failed build is not cached


@pytest.mark.parametrize("layout", [BatchLayout.LOCAL, BatchLayout.GATHERED], ids=["local", "gathered"])
def test_cached_targets_follow_set_step(layout):
    """One target per layer serves every step: set_step and clear_counts update the tensors it
    holds in place, so each step records exactly its own rows."""
    cap = RoutingCapturer(SHAPE, 8, "cpu", dp_size=2, dp_rank=1)
    targets = {layer: cap.target(layer, layout) for layer in SHAPE.moe_layers}
    g = torch.Generator().manual_seed(3)
    for counts in ([2, 5], [4, 0], [0, 8], [3, 3]):
        cap.set_step(counts)
        cap.buffer.fill_(POISON)
        n_rows = counts[1] if layout == BatchLayout.LOCAL else sum(counts)
        start = 0 if layout == BatchLayout.LOCAL else counts[0]
        ids = {layer: torch.randint(0, 64, (n_rows, 2), generator=g) for layer in SHAPE.moe_layers}
        for layer in SHAPE.moe_layers:
            assert cap.target(layer, layout) is targets[layer]
            cap.capture(layer, ids[layer], layout)
        for column, layer in enumerate(SHAPE.moe_layers):
            expected = ids[layer][start : start + counts[1]].to(torch.int32)
            assert torch.equal(cap.buffer[: counts[1], column], expected), f"counts {counts}"
        assert (cap.buffer[counts[1] :] == POISON).all()
    cap.clear_counts()
    cap.buffer.fill_(POISON)
    cap.capture(1, torch.zeros(8, 2, dtype=torch.int64), layout)
    assert (cap.buffer == POISON).all(), "a cleared count recorded rows through a cached target"
    assert check_capture_errors() == 0 and cap.check_errors() == 0


class _TargetModel(torch.nn.Module):
    """Three MoE layers: two record with capturer.capture, one routes and records in one call
    (route(..., capture=capturer.target(layer)))."""

    def __init__(self, capturer: RoutingCapturer, hidden: int = 16, backend: str = "torch"):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.capturer = capturer
        self.backend = backend
        self.gates = torch.nn.Parameter(torch.randn(SHAPE.num_model_layers, hidden, 64, generator=g))

    def forward(self, x):
        from moe_ops import RoutingMethod, route

        out = []
        for layer in SHAPE.moe_layers:
            logits = x @ self.gates[layer]
            if layer == SHAPE.moe_layers[-1]:
                _, ids = route(
                    logits,
                    SHAPE.top_k,
                    RoutingMethod.RENORMALIZE,
                    capture=self.capturer.target(layer),
                    backend=self.backend,
                )
            else:
                ids = torch.topk(logits, SHAPE.top_k, dim=-1).indices
                self.capturer.capture(layer, ids)
            out.append(ids.to(torch.int32))
            x = torch.tanh(logits[:, :16]) + x
        return torch.stack(out, dim=1)


@pytest.mark.parametrize("warm", [False, True], ids=["cold-cache", "warm-cache"])
def test_compiled_capture_with_cached_targets_compiles_one_frame(warm):
    """torch.compile(fullgraph) of a forward capturing 3 layers, set_step between steps: one frame,
    no recompile, whether the eager cache holds the targets before compiling or not, and each
    step's rows are its own. The eager cache still returns its targets afterwards."""
    from torch._dynamo.testing import CompileCounterWithBackend

    cap = RoutingCapturer(SHAPE, 16, "cpu")
    model = _TargetModel(cap)
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(1))
    if warm:
        cap.set_step([16])
        model(x)
    before = {layer: cap.target(layer) for layer in SHAPE.moe_layers} if warm else {}
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with CompileCounters() as cc:
        for n in (5, 16, 0, 11, 3):
            cap.set_step([n])
            cap.buffer.fill_(POISON)
            ids = compiled(x)
            assert torch.equal(cap.buffer[:n], ids[:n]), f"n={n}"
            assert (cap.buffer[n:] == POISON).all(), f"n={n}"
    assert counter.frame_count == 1, cc.recompile_reasons
    assert cc.graph_breaks == 0 and cc.recompile_reasons == []
    for layer, target in before.items():
        assert cap.target(layer) is target
    assert cap.check_errors() == 0


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_cached_targets_with_set_step(cuda_device):
    """A manual CUDA graph of a step whose layers record through cached targets (capture and
    route(capture=target)), LOCAL and GATHERED over two DP ranks: each replay after set_step records
    the live counts' rows, and the targets the graph baked are the ones the cache returns."""
    from moe_ops import RoutingMethod, route

    cap = RoutingCapturer(SHAPE, 16, cuda_device, dp_size=2, dp_rank=1)
    layouts = [BatchLayout.LOCAL, BatchLayout.GATHERED, BatchLayout.GATHERED]
    # LOCAL: this rank's padded batch (<= the buffer's 16 rows); GATHERED: both ranks' rows
    # zeros, not empty: the warm-up step records them, and garbage ids would be counted as faults
    ids = [torch.zeros(16 if i == 0 else 24, 2, dtype=torch.int64, device=cuda_device) for i in range(2)]
    logits = torch.randn(24, 64, device=cuda_device)
    routed = torch.empty(24, 2, dtype=torch.int32, device=cuda_device)

    def step():
        for layer, layout, t in zip(SHAPE.moe_layers[:2], layouts, ids):
            cap.capture(layer, t, layout)
        _, out = route(
            logits,
            SHAPE.top_k,
            RoutingMethod.RENORMALIZE,
            capture=cap.target(SHAPE.moe_layers[2], layouts[2]),
        )
        routed.copy_(out)

    cap.set_step([8, 16])
    step()  # warm-up: kernel compile, fault counter, the targets cached
    targets = [cap.target(layer, layout) for layer, layout in zip(SHAPE.moe_layers, layouts)]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for counts in ([4, 7], [0, 16], [8, 0], [5, 9]):
        for t in ids:
            t.random_(0, 64)
        logits.normal_()
        cap.set_step(counts)
        graph.replay()
        c, start = counts[1], counts[0]
        with cap.snapshot() as handle:
            rows = torch.from_numpy(handle.result().astype(np.int64))
        assert torch.equal(rows[:, 0], ids[0][:c].cpu()), f"LOCAL, counts {counts}"
        assert torch.equal(rows[:, 1], ids[1][start : start + c].cpu()), f"GATHERED, counts {counts}"
        assert torch.equal(rows[:, 2], routed[start : start + c].cpu().long()), f"routed, counts {counts}"
    assert all(cap.target(layer, layout) is t for layer, layout, t in zip(SHAPE.moe_layers, layouts, targets))
    assert cap.check_errors() == 0
