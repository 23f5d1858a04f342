"""Routing weights beside the ids: a target's ``weights_buffer``, written by the capture op and the
router's fused capture with the ids' row rule, and carried by a capturer's snapshots.

Every layout (SEQUENCE_PARALLEL with a real gloo group of 2 too), eager and compiled, strided and
sliced weight sources, float32/bfloat16/float16 on both sides, poisoned buffers; route's own weights
recorded for every routing method; the capturer's "weights" channel; the errors of bad input.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gpu_helpers import skip_unless_triton_runs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import (
    CAPTURE_WEIGHT_DTYPES,
    MODEL_ROUTERS,
    POISON,
    W_POISON,
    capture_weights_cases,
    routed_capture_cases,
    router_configs,
    same_floats,
    shared_capture_cases,
)

import moe_ops
from moe_ops import (
    BatchLayout,
    CaptureTarget,
    LayerCapture,
    MoEDispatchConfig,
    RoutingCapturer,
    RoutingMethod,
    RoutingReplayExperts,
    RoutingShape,
    SlotStore,
    capture_routing,
    route,
)
from moe_ops.capture.capturer import weights_channel
from moe_ops.capture.errors import FaultCounter
from moe_ops.capture.op import capture_into
from moe_ops.capture.spec import CAPTURE_OP

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _target_kw(case, counts, sizes) -> dict:
    return dict(token_counts=counts, dp_rank=case.dp_rank, layout=case.layout, shard_sizes=sizes)


def _check_capture(wcase, device: str, op) -> None:
    """One capture of ``wcase`` through ``op`` (the public op, or the twin as an op): the ids and
    the weights are this rank's rows of their sources, everything else keeps its poison."""
    case = wcase.case
    buffer, topk_ids, counts, sizes = case.tensors(device)
    wbuf, topk_weights = wcase.tensors(device)
    ids_before, w_before = buffer.clone(), wbuf.clone()
    target = CaptureTarget(buffer, case.layer_id, weights_buffer=wbuf, **_target_kw(case, counts, sizes))
    moe_ops.check_capture_errors(device, raise_error=False)
    if op is None:
        capture_into(target, topk_ids, topk_weights)
    else:
        op(*CAPTURE_OP.join((topk_ids, topk_weights), target.spec))
    assert moe_ops.check_capture_errors(device, raise_error=False) == 0
    assert torch.equal(buffer, case.expected(ids_before))
    assert same_floats(wbuf, wcase.expected(w_before)), (
        f"{case.layout.name} {wcase.source_dtype}->{wcase.buffer_dtype}: weights differ from the source rows"
    )


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=80, deadline=None)
@given(wcase=capture_weights_cases())
def test_capture_op_records_the_rows_weights_in_every_layout(device, wcase):
    """The op (the interpreted Triton kernel on this machine, the CUDA kernel on a GPU): every
    layout, padding, strided/sliced/transposed weight sources, sliced buffers, every dtype pair,
    a NaN weight and one beyond float16's range (inf there, as torch casts it)."""
    skip_unless_triton_runs(device)
    _check_capture(wcase, device, None)


@settings(max_examples=80, deadline=None)
@given(wcase=capture_weights_cases())
def test_twin_records_the_rows_weights_in_every_layout(wcase):
    _check_capture(wcase, "cpu", torch.ops.moe_ops.capture_routing_reference_)


@settings(max_examples=30, deadline=None)
@given(wcase=capture_weights_cases(), seed=st.integers(0, 2**16))
def test_kernel_and_twin_write_the_same_bits(wcase, seed):
    """The kernel and its twin on the same inputs, inconsistent counts included: the same ids,
    weights and faults."""
    skip_unless_triton_runs("cpu")
    case = wcase.case
    buffer, topk_ids, counts, sizes = case.tensors("cpu")
    wbuf, topk_weights = wcase.tensors("cpu")
    counts = counts.clone()
    counts[case.dp_rank] = np.random.default_rng(seed).integers(-3, case.max_tokens + 12)
    results = []
    for op in (torch.ops.moe_ops.capture_routing_, torch.ops.moe_ops.capture_routing_reference_):
        b, w = buffer.clone(), wbuf.clone()
        counter = FaultCounter("cpu")
        target = CaptureTarget(
            b, case.layer_id, weights_buffer=w, fault_counter=counter, **_target_kw(case, counts, sizes)
        )
        op(*CAPTURE_OP.join((topk_ids, topk_weights), target.spec))
        results.append((b, w, counter.tensor.tolist()))
    (b1, w1, f1), (b2, w2, f2) = results
    assert torch.equal(b1, b2) and f1 == f2
    assert same_floats(w1, w2)


@pytest.mark.parametrize("layout", [BatchLayout.GATHERED, BatchLayout.SHARDED], ids=lambda v: v.name)
def test_large_gathers_walk_destination_rows_with_weights(layout):
    """A source above 8 tiles of 1024 ids with this rank's block not at row 0: the kernel walks
    this rank's window (the other branch of the capture kernel), weights included."""
    skip_unless_triton_runs("cpu")
    n, k = 2100, 4
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (n, k), dtype=torch.int32, generator=g)
    weights = torch.randn(n, k, generator=g)
    if layout == BatchLayout.GATHERED:
        counts, sizes, rank, start, c = torch.tensor([2000, 90], dtype=torch.int32), None, 1, 2000, 90
    else:
        counts = torch.tensor([1000, 60], dtype=torch.int32)
        sizes = torch.tensor([1000, 1000, 50, 50], dtype=torch.int32)
        rank, start, c = 1, 2000, 60
    buffer = torch.full((128, 2, k), POISON, dtype=torch.int32)
    wbuf = torch.full((128, 2, k), W_POISON, dtype=torch.bfloat16)
    capture_routing(
        buffer,
        ids,
        1,
        token_counts=counts,
        dp_rank=rank,
        layout=layout,
        shard_sizes=sizes,
        weights_buffer=wbuf,
        topk_weights=weights,
    )
    expected = torch.full_like(wbuf, W_POISON)
    expected[:c, 1] = weights[start : start + c].to(torch.bfloat16)
    assert same_floats(wbuf, expected)
    assert torch.equal(buffer[:c, 1], ids[start : start + c])


def test_nan_weights_are_stored_and_bad_ids_keep_their_weight():
    """Weights are not checked: a NaN is stored as a NaN without a fault; a row whose id is bad
    (-1, counted once) keeps its weight."""
    buffer = torch.full((4, 1, 2), POISON, dtype=torch.int16)
    wbuf = torch.full((4, 1, 2), W_POISON, dtype=torch.float16)
    ids = torch.tensor([[1, -1], [70000, 2], [3, 4]], dtype=torch.int32)
    weights = torch.tensor([[0.5, 0.25], [float("nan"), 0.125], [1.0, 2.0]])
    counter = FaultCounter("cpu")
    target = CaptureTarget(
        buffer,
        0,
        token_counts=torch.tensor([3], dtype=torch.int32),
        weights_buffer=wbuf,
        fault_counter=counter,
    )
    capture_into(target, ids, weights)
    assert buffer[:3, 0].tolist() == [[1, -1], [-1, 2], [3, 4]]
    assert same_floats(wbuf[:3, 0], weights.to(torch.float16))
    assert buffer[3].tolist() == [[POISON, POISON]] and wbuf[3].tolist() == [[W_POISON, W_POISON]]
    assert counter.check(raise_error=False) == 2  # the two bad ids, nothing for the NaN weight


def test_the_stamp_covers_ids_and_weights():
    """One stamp per layer: a capture with weights stamps its layer once, as without."""
    shape = RoutingShape(num_layers=3, num_experts=16, top_k=2)
    capturer = RoutingCapturer(shape, 4, "cpu", weights_dtype=torch.float32)
    capturer.set_step([2])
    capturer.capture(1, torch.tensor([[1, 2], [3, 4]], dtype=torch.int32), weights=torch.ones(2, 2))
    assert capturer.layer_stamps.tolist() == [-1, capturer.step, -1]


@pytest.mark.parametrize("layout", list(BatchLayout), ids=lambda v: v.name)
def test_compiled_capture_equals_eager(layout):
    """torch.compile(fullgraph=True) of a capture with weights (strided bfloat16 weights into a
    float16 buffer) writes what the eager call writes; counts change in place between calls."""
    skip_unless_triton_runs("cpu")
    n, k = 12, 3
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 32, (n, k), dtype=torch.int32, generator=g)
    wide = torch.randn(n, 2 * k, generator=g).to(torch.bfloat16)
    weights = wide[:, ::2]  # strided columns
    counts = torch.tensor([5, 4], dtype=torch.int32)
    dp_rank = 1 if layout in (BatchLayout.GATHERED, BatchLayout.SHARDED) else 0
    sizes = torch.tensor([3, 3, 3, 3], dtype=torch.int32) if layout == BatchLayout.SHARDED else None

    def step(buffer, wbuf, ids, weights, counts):
        capture_routing(
            buffer,
            ids,
            2,
            token_counts=counts,
            dp_rank=dp_rank,
            layout=layout,
            shard_sizes=sizes,
            weights_buffer=wbuf,
            topk_weights=weights,
        )

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    for live in ([5, 4], [2, 6], [0, 1]):
        counts.copy_(torch.tensor(live, dtype=torch.int32))
        got = (
            torch.full((16, 3, k), POISON, dtype=torch.int32),
            torch.full((16, 3, k), W_POISON, dtype=torch.float16),
        )
        want = tuple(t.clone() for t in got)
        compiled(*got, ids, weights, counts)
        step(*want, ids, weights, counts)
        assert torch.equal(got[0], want[0]) and same_floats(got[1], want[1]), f"{layout.name} counts {live}"
        start = {BatchLayout.GATHERED: live[0], BatchLayout.SHARDED: 6}.get(layout, 0)
        c = min(live[dp_rank], n - start)
        assert same_floats(got[1][:c, 2], weights[start : start + c].to(torch.float16))
        assert (got[1][c:] == W_POISON).all() and (got[1][:, :2] == W_POISON).all()


def _sp_worker(rank: int, world: int, init_file: str, result_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(99)  # every rank builds the same full batch
        failures = []
        for c in (0, 3, 8):
            padded = c + 3
            per = -(-padded // world)
            full_ids = torch.full((per * world, 2), -99, dtype=torch.int32)
            full_ids[:c] = torch.randint(0, 64, (c, 2), generator=g, dtype=torch.int32)
            full_w = torch.randn(per * world, 2, generator=g)
            mine_ids, mine_w = full_ids[rank * per : (rank + 1) * per], full_w[rank * per : (rank + 1) * per]
            counts = torch.tensor([c], dtype=torch.int32)

            def step(buf, wbuf, ids, w, cnt):
                capture_routing(
                    buf,
                    ids,
                    1,
                    token_counts=cnt,
                    layout=BatchLayout.SEQUENCE_PARALLEL,
                    tp_group=dist.group.WORLD,
                    weights_buffer=wbuf,
                    topk_weights=w,
                )

            expected = torch.full((16, 2, 2), W_POISON, dtype=torch.bfloat16)
            expected[:c, 1] = full_w[:c].to(torch.bfloat16)
            for mode, fn in (
                ("eager", step),
                ("compiled", torch.compile(step, fullgraph=True, dynamic=False)),
            ):
                buffer = torch.full((16, 2, 2), POISON, dtype=torch.int32)
                wbuf = torch.full((16, 2, 2), W_POISON, dtype=torch.bfloat16)
                fn(buffer, wbuf, mine_ids, mine_w, counts)
                if not torch.equal(buffer[:c, 1], full_ids[:c]) or not same_floats(wbuf, expected):
                    failures.append(f"{mode} c={c}")
        with open(os.path.join(result_dir, f"rank{rank}"), "w") as f:
            f.write(";".join(failures) if failures else "ok")
    finally:
        dist.destroy_process_group()


def test_sequence_parallel_gathers_the_weights_too():
    """SEQUENCE_PARALLEL with a real gloo TP group of 2: each rank holds a shard; the weights are
    all-gathered with the ids and the rank's rows of the full batch are recorded (eager, compiled)."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_sp_worker, args=(2, os.path.join(tmp, "init"), tmp), nprocs=2, join=True)
        for rank in range(2):
            with open(os.path.join(tmp, f"rank{rank}")) as f:
                assert f.read() == "ok", f"rank {rank}"


# ------------------------------------------------------------------------------------------------
# route(..., capture=target with weights)
# ------------------------------------------------------------------------------------------------

CPU_BACKENDS = ["torch", "triton"]


def _check_route(backend: str, device: str, case, router, wdtype, **extra) -> None:
    """``extra``: more route arguments (a hash table, fused shared experts); the buffer's width
    says which of the returned columns are recorded."""
    if backend == "triton":
        skip_unless_triton_runs(device)
    logits, bias = router.tensors(device)
    cfg = router.config
    kw = {**cfg.route_kwargs(bias), **extra}
    buffer, _, counts, sizes = case.tensors(device)
    width = buffer.shape[2]
    wbuf = torch.full(buffer.shape, W_POISON, dtype=wdtype, device=device)
    ids_before, w_before = buffer.clone(), wbuf.clone()
    target = CaptureTarget(buffer, case.layer_id, weights_buffer=wbuf, **_target_kw(case, counts, sizes))
    weights, ids = route(logits, cfg.top_k, cfg.method, capture=target, backend=backend, **kw)
    rows = slice(case.start, case.start + case.c)
    expected_ids = ids_before.clone()
    expected_ids[: case.c, case.layer_id] = ids[rows, :width].to(buffer.dtype)
    assert torch.equal(buffer, expected_ids)
    expected_w = w_before.clone()
    expected_w[: case.c, case.layer_id] = weights[rows, :width].to(wdtype)
    assert same_floats(wbuf, expected_w), f"{cfg.name} {case.layout.name}: recorded weights are not route's"
    # and capturing weights changed nothing of the routing
    kw.pop("capture_shared_experts", None)
    w2, ids2 = route(logits, cfg.top_k, cfg.method, backend=backend, **kw)
    assert torch.equal(ids, ids2) and same_floats(weights, w2)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_hash_routing_records_its_weights(backend, data):
    """A hash layer (route with a token-id table) records the table's ids and their weights."""
    case, router = data.draw(
        routed_capture_cases(configs=router_configs((RoutingMethod.SQRTSOFTPLUS, RoutingMethod.DEEPSEEK_V3)))
    )
    cfg = router.config
    # hash routing chooses nothing: no groups, no bias
    cfg = dataclasses.replace(cfg, n_group=None, topk_group=None, group_score=None, has_bias=False)
    router = dataclasses.replace(router, config=cfg)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    vocab = 13
    table = torch.stack([torch.randperm(cfg.num_experts, generator=gen)[: cfg.top_k] for _ in range(vocab)])
    tokens = torch.randint(0, vocab, (case.rows.shape[0],), generator=gen)
    wdtype = data.draw(st.sampled_from(CAPTURE_WEIGHT_DTYPES))
    _check_route(backend, "cpu", case, router, wdtype, hash_table=table, token_ids=tokens)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@settings(max_examples=20, deadline=None)
@given(data=shared_capture_cases(configs=router_configs(max_experts=64, max_top_k=6)))
def test_fused_shared_experts_record_their_weights(backend, data):
    """With fused shared experts the weights buffer holds the recorded columns' weights: the routed
    ones, and with capture_shared_experts the shared columns' 1.0."""
    case, router, n_shared, keep = data
    extra = dict(num_fused_shared_experts=n_shared, capture_shared_experts=keep)
    _check_route(backend, "cpu", case, router, torch.float32, **extra)


@pytest.mark.parametrize("method", list(RoutingMethod), ids=lambda m: m.name)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_route_records_its_own_weights_for_every_method(method, backend, data):
    """route with a weights target records exactly the weights it returns (cast to the buffer's
    dtype) for this rank's rows, in every layout (SEQUENCE_PARALLEL through its capture op)."""
    case, router = data.draw(
        routed_capture_cases(configs=router_configs((method,), max_experts=96, max_top_k=8))
    )
    _check_route(backend, "cpu", case, router, data.draw(st.sampled_from(CAPTURE_WEIGHT_DTYPES)))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
# cuda_device only names the device (no state between examples)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    cases=routed_capture_cases(configs=st.sampled_from(MODEL_ROUTERS)),
    wdtype=st.sampled_from(CAPTURE_WEIGHT_DTYPES),
)
def test_route_records_its_own_weights_gpu(cuda_device, backend, cases, wdtype):
    _check_route(backend, "cuda", *cases, wdtype)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", list(BatchLayout), ids=lambda v: v.name)
def test_cuda_graph_route_with_weights_records_the_live_rows(cuda_device, layout):
    """route + capture with a bfloat16 weights buffer, captured once in a CUDA graph, replayed with
    new logits and live counts: each replay records exactly that replay's rows and weights."""
    cfg = MODEL_ROUTERS[0]  # DeepSeek-V3
    dp, padded, rank = 3, 8, 1
    n = padded if layout in (BatchLayout.LOCAL, BatchLayout.SEQUENCE_PARALLEL) else dp * padded
    block = 0 if n == padded else padded
    counts = torch.tensor([padded] * dp, dtype=torch.int32, device=cuda_device)
    sizes = torch.full((dp,), padded, dtype=torch.int32, device=cuda_device)
    sizes = sizes if layout == BatchLayout.GATHERED else None
    if layout == BatchLayout.SHARDED:
        sizes = torch.full((2 * dp,), padded // 2, dtype=torch.int32, device=cuda_device)
    logits = torch.empty(n, cfg.num_experts, device=cuda_device)
    bias = torch.randn(cfg.num_experts, device=cuda_device) * 0.1
    buffer = torch.full((16, 4, cfg.top_k), POISON, dtype=torch.int32, device=cuda_device)
    wbuf = torch.full((16, 4, cfg.top_k), W_POISON, dtype=torch.bfloat16, device=cuda_device)
    target = CaptureTarget(
        buffer, 2, token_counts=counts, dp_rank=rank, layout=layout, shard_sizes=sizes, weights_buffer=wbuf
    )

    def step():
        return route(logits, cfg.top_k, cfg.method, capture=target, **cfg.route_kwargs(bias))

    moe_ops.check_capture_errors(cuda_device, raise_error=False)
    logits.normal_()
    step()  # warm-up: compiles, allocates the fault counter
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = step()
    rng = np.random.default_rng(0)
    for live in ([8, 8, 8], [3, 5, 1], [0, 0, 0], [1, 8, 0], [7, 2, 6]):
        counts.copy_(torch.tensor(live, dtype=torch.int32))
        logits.copy_(torch.from_numpy(rng.standard_normal((n, cfg.num_experts)).astype(np.float32)))
        buffer.fill_(POISON)
        wbuf.fill_(W_POISON)
        graph.replay()
        torch.cuda.synchronize()
        c = live[rank]
        expected_ids = torch.full_like(buffer, POISON)
        expected_ids[:c, 2] = ids[block : block + c]
        expected_w = torch.full_like(wbuf, W_POISON)
        expected_w[:c, 2] = weights[block : block + c].to(torch.bfloat16)
        assert torch.equal(buffer, expected_ids), f"replay with counts {live}: ids"
        assert same_floats(wbuf, expected_w), f"replay with counts {live}: weights"
    assert moe_ops.check_capture_errors(cuda_device) == 0


@pytest.mark.gpu
def test_flashinfer_route_records_its_weights(cuda_device):
    """route(backend="flashinfer") passes the weights it returns to a weights target."""
    pytest.importorskip("flashinfer")
    from moe_ops.flashinfer.backends import fused_topk_support

    if not fused_topk_support(torch.device(cuda_device)).ok:
        pytest.skip("FlashInfer's fused_topk_deepseek does not run on this GPU")
    cfg = MODEL_ROUTERS[0]
    logits = torch.randn(24, cfg.num_experts, device=cuda_device)
    bias = torch.randn(cfg.num_experts, device=cuda_device) * 0.1
    counts = torch.tensor([10, 14], dtype=torch.int32, device=cuda_device)
    buffer = torch.full((16, 2, cfg.top_k), POISON, dtype=torch.int32, device=cuda_device)
    wbuf = torch.full((16, 2, cfg.top_k), W_POISON, dtype=torch.float32, device=cuda_device)
    target = CaptureTarget(
        buffer, 1, token_counts=counts, dp_rank=1, layout=BatchLayout.GATHERED, weights_buffer=wbuf
    )
    weights, ids = route(
        logits, cfg.top_k, cfg.method, capture=target, backend="flashinfer", **cfg.route_kwargs(bias)
    )
    torch.cuda.synchronize()
    assert torch.equal(buffer[:14, 1], ids[10:24]) and (buffer[14:] == POISON).all()
    assert torch.equal(wbuf[:14, 1], weights[10:24]) and (wbuf[14:] == W_POISON).all()


def test_flashinfer_route_feeds_its_weights_to_the_capture_when_traced():
    """On meta tensors (no GPU): route_flashinfer with a weights target compiles fullgraph, and the
    capture op's topk_weights are the kernel's weights output (its returned weights)."""
    pytest.importorskip("flashinfer")
    from torch._dynamo.backends.common import aot_autograd

    from moe_ops.flashinfer import route_flashinfer

    torch._dynamo.reset()
    cfg = MODEL_ROUTERS[0]
    buffer = torch.full((16, 2, cfg.top_k), POISON, dtype=torch.int32, device="meta")
    wbuf = torch.full((16, 2, cfg.top_k), W_POISON, dtype=torch.bfloat16, device="meta")
    counts = torch.zeros(1, dtype=torch.int32, device="meta")
    target = CaptureTarget(buffer, 1, token_counts=counts, weights_buffer=wbuf)

    def step(logits, bias):
        return route_flashinfer(
            logits,
            cfg.top_k,
            2,
            bias=bias,
            n_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
            capture=target,
        )

    graphs: list = []

    def fw_compiler(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    logits = torch.empty(12, cfg.num_experts, device="meta")
    torch.compile(step, fullgraph=True, backend=aot_autograd(fw_compiler=fw_compiler))(
        logits, torch.empty(cfg.num_experts, device="meta")
    )
    nodes = [
        n for n in graphs[0].graph.nodes if n.op == "call_function" and "auto_functionalized" in str(n.target)
    ]
    (kernel,) = [n for n in nodes if "flashinfer_fused_topk_deepseek" in str(n.args[0])]
    (capture,) = [n for n in nodes if "capture_routing_" in str(n.args[0])]
    source = capture.kwargs["topk_weights"]
    seen = set()
    while source is not kernel and source.op == "call_function" and source not in seen:
        seen.add(source)
        source = source.args[0]
    assert source is kernel, "the capture's weights do not come from the kernel's output"
    # the weights buffer is one of the op's mutated arguments (auto_functionalized names it)
    assert any("weights_buffer" in key for key in capture.kwargs), list(capture.kwargs)


# ------------------------------------------------------------------------------------------------
# RoutingCapturer(weights_dtype=...) and its snapshots
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("wdtype", CAPTURE_WEIGHT_DTYPES)
def test_capturer_snapshot_carries_the_weights_channel(wdtype):
    """Every snapshot carries "weights" beside the ids: this step's rows of the captured layers,
    NaN for a layer not captured this step (bfloat16 as its uint16 bits, 0xFFFF a NaN)."""
    shape = RoutingShape(num_layers=3, num_experts=64, top_k=2)
    capturer = RoutingCapturer(shape, 8, "cpu", weights_dtype=wdtype, ring_depth=2)
    assert capturer.weights_buffer.dtype == wdtype and capturer.weights_buffer.isnan().all()
    g = torch.Generator().manual_seed(5)
    # step 1: layers 0 and 2; step 2: layer 0 only (layer 2 is stale)
    for layers in ((0, 2), (0,)):
        capturer.set_step([5])
        sent = {}
        for layer in layers:
            ids = torch.randint(0, 64, (5, 2), dtype=torch.int32, generator=g)
            w = torch.rand(5, 2, generator=g)
            route_target = capturer.target(layer)
            assert route_target.weights_buffer is capturer.weights_buffer
            capturer.capture(layer, ids, weights=w)
            sent[layer] = (ids, w)
        handle = capturer.snapshot()
        rows = handle.results()
        handle.release()
        assert set(rows) == {"ids", "weights"}
        got = torch.from_numpy(rows["weights"].copy())
        if wdtype == torch.bfloat16:
            assert rows["weights"].dtype == np.uint16
            got = got.view(torch.bfloat16)
        assert got.shape == (5, 3, 2) and got.dtype == wdtype
        for layer in range(3):
            if layer in sent:
                assert same_floats(got[:, layer], sent[layer][1].to(wdtype))
                assert np.array_equal(rows["ids"][:, layer], sent[layer][0].numpy())
            else:
                assert got[:, layer].isnan().all(), f"layer {layer} not captured this step must read NaN"


@pytest.mark.parametrize("wdtype", [None, *CAPTURE_WEIGHT_DTYPES])
def test_capturer_channels_are_what_a_slot_store_of_its_snapshots_takes(wdtype):
    """RoutingCapturer.channels: the snapshots' channels, ids first; a SlotStore built from them
    (no channel rebuilt by hand) stores a snapshot's rows, weights bit for bit. Read-only."""
    shape = RoutingShape(num_layers=2, num_experts=300, top_k=2)  # uint16 ids (fill 65535)
    capturer = RoutingCapturer(shape, 4, "cpu", weights_dtype=wdtype)
    ids, *extra = capturer.channels
    assert (ids.name, ids.dtype, ids.row_shape) == ("ids", np.dtype(np.uint16), (2, 2))
    if wdtype is None:
        assert extra == []
    else:
        (weights,) = extra
        assert weights == weights_channel(2, 2, wdtype).resolved((2, 2))
    with pytest.raises(AttributeError):
        capturer.channels = ()
    store = SlotStore(8, shape, ids.dtype, extra_channels=capturer.channels[1:])
    capturer.set_step([3])
    g = torch.Generator().manual_seed(3)
    for layer in range(2):
        topk = torch.randint(0, 300, (3, 2), dtype=torch.int32, generator=g)
        w = torch.rand(3, 2, generator=g) if wdtype is not None else None
        capturer.capture(layer, topk, **({} if w is None else {"weights": w}))
    with capturer.snapshot() as handle:
        rows = handle.results()
        store.write([5, 1, 6], rows)
    for channel in capturer.channels:
        got = store.read_slots([5, 1, 6], channel=channel.name)
        assert got.dtype == channel.dtype and np.array_equal(
            got.view(np.uint8), rows[channel.name].view(np.uint8)
        )


def test_state_only_capturer_with_a_weights_buffer():
    """CaptureTarget.of reads weights_buffer where a capturer has it (the Capturer protocol's
    optional member): route records its weights there."""
    buffer = torch.full((6, 2, 2), POISON, dtype=torch.int32)
    wbuf = torch.full((6, 2, 2), W_POISON, dtype=torch.float32)
    counts = torch.tensor([4], dtype=torch.int32)
    state = type(
        "State",
        (),
        dict(buffer=buffer, token_counts=counts, dp_rank=0, shard_sizes=None, weights_buffer=wbuf),
    )()
    target = CaptureTarget.of(state, 1)
    assert target.weights_buffer is wbuf
    logits = torch.randn(4, 8)
    weights, ids = route(logits, 2, RoutingMethod.RENORMALIZE, capture=target, backend="torch")
    assert torch.equal(wbuf[:4, 1], weights) and torch.equal(buffer[:4, 1], ids)
    assert (wbuf[4:] == W_POISON).all() and (wbuf[:, 0] == W_POISON).all()


# ------------------------------------------------------------------------------------------------
# bad input: refused before anything is written
# ------------------------------------------------------------------------------------------------


def _ids_target(**kw):
    buffer = torch.full((4, 2, 2), POISON, dtype=torch.int32)
    return CaptureTarget(buffer, 0, token_counts=torch.tensor([2], dtype=torch.int32), **kw), buffer


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda b: b.clone(), "weights_buffer must be float32, bfloat16 or float16"),
        (
            lambda b: torch.zeros(4, 2, 2, dtype=torch.float64),
            "weights_buffer must be float32, bfloat16 or float16",
        ),
        (lambda b: torch.zeros(4, 2, 3), r"weights_buffer must have the buffer's shape \(4, 2, 2\)"),
        (lambda b: torch.zeros(4, 2, 2, device="meta"), "weights_buffer must be on the buffer's device cpu"),
        (lambda b: torch.zeros(4, 1, 2).expand(4, 2, 2), "weights_buffer must not overlap itself"),
        (lambda b: b.view(torch.float32), "weights_buffer must not overlap buffer"),
        (lambda b: [[0.0]], "weights_buffer must be a torch.Tensor or None"),
    ],
)
def test_bad_weights_buffers_are_refused(make, match):
    buffer = torch.full((4, 2, 2), POISON, dtype=torch.int32)
    exc = TypeError if "torch.Tensor" in match else ValueError
    with pytest.raises(exc, match=match):
        CaptureTarget(
            buffer, 0, token_counts=torch.tensor([2], dtype=torch.int32), weights_buffer=make(buffer)
        )
    assert (buffer == POISON).all()


def test_weights_are_required_by_a_weights_target_and_refused_without_one():
    ids = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    wbuf = torch.full((4, 2, 2), W_POISON)
    target, buffer = _ids_target(weights_buffer=wbuf)
    with pytest.raises(ValueError, match="topk_weights is required"):
        capture_into(target, ids)
    with pytest.raises(ValueError, match=r"topk_weights must have the ids' shape \(2, 2\)"):
        capture_into(target, ids, torch.ones(2, 3))
    with pytest.raises(ValueError, match="topk_weights must be float32, bfloat16 or float16"):
        capture_into(target, ids, torch.ones(2, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="topk_weights must be float32, bfloat16 or float16"):
        capture_into(target, ids, torch.ones(2, 2, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"topk_weights must be a torch\.Tensor or None"):
        capture_into(target, ids, [[1.0, 1.0], [1.0, 1.0]])
    assert (buffer == POISON).all() and (wbuf == W_POISON).all()
    plain, buffer = _ids_target()
    with pytest.raises(ValueError, match="topk_weights given but this target has no weights_buffer"):
        capture_into(plain, ids, torch.ones(2, 2))
    with pytest.raises(ValueError, match="topk_weights given but this target has no weights_buffer"):
        capture_routing(
            buffer, ids, 0, token_counts=torch.tensor([2], dtype=torch.int32), topk_weights=torch.ones(2, 2)
        )
    assert (buffer == POISON).all()


def test_capturer_weights_errors():
    shape = RoutingShape(num_layers=2, num_experts=16, top_k=2)
    with pytest.raises(
        ValueError, match=r"weights_dtype must be None, torch\.float32, torch\.float16 or torch\.bfloat16"
    ):
        RoutingCapturer(shape, 4, "cpu", weights_dtype=torch.float64)
    ids = torch.tensor([[1, 2]], dtype=torch.int32)
    capturer = RoutingCapturer(shape, 4, "cpu", weights_dtype=torch.float16)
    capturer.set_step([1])
    with pytest.raises(ValueError, match="topk_weights is required"):
        capturer.capture(0, ids)
    plain = RoutingCapturer(shape, 4, "cpu")
    plain.set_step([1])
    with pytest.raises(ValueError, match="topk_weights given but this target has no weights_buffer"):
        plain.capture(0, ids, weights=torch.ones(1, 2))
    assert plain.weights_buffer is None and (plain.buffer == -1).all()
    assert capturer.weights_buffer.isnan().all() and (capturer.buffer == -1).all()


def test_monolithic_experts_refuse_a_weights_capturer():
    """A kernel that writes ids only into routing_replay_out cannot record weights: refused when
    bound, before any scratch is allocated; a routed variant (its router captures) accepts it."""

    class Monolithic(RoutingReplayExperts):
        kernel_name, monolithic = "ids-only", True

        def supports_routing_replay_capture(self) -> bool:
            return True

    shape = RoutingShape(num_layers=2, num_experts=16, top_k=2)
    capturer = RoutingCapturer(shape, 4, "cpu", weights_dtype=torch.bfloat16)
    experts = Monolithic(MoEDispatchConfig(max_num_tokens=4, top_k=2))
    with pytest.raises(ValueError, match=r"ids-only records expert ids only .* weights_buffer"):
        experts.set_capture_fn(LayerCapture(capturer, 0))
    assert experts.capture_fn is None and experts.replay_scratch is None
    routed = RoutingReplayExperts(MoEDispatchConfig(max_num_tokens=4, top_k=2))
    routed.set_capture_fn(LayerCapture(capturer, 0))
    assert routed.capture_fn.target(BatchLayout.LOCAL).weights_buffer is capturer.weights_buffer


@pytest.mark.parametrize("bad", [torch.float64, torch.int32, "float32", None])
def test_weights_channel_refuses_a_dtype_no_weights_buffer_has(bad):
    with pytest.raises(ValueError, match="weights_dtype must be one of"):
        weights_channel(2, 2, bad)
