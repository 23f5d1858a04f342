"""Fused capture: route(..., capture=CaptureTarget(...)) against route, then capture_routing.

Every layout (SEQUENCE_PARALLEL through its fallback), padding, poisoned buffers, inconsistent
counts (the fault counter must count the same calls with the same bits), and the errors of bad
capture arguments (the same as capture_routing's).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gpu_helpers import skip_unless_triton_runs
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import GPU_CAPTURE_ROUTERS, MODEL_ROUTERS, POISON, routed_capture_cases

import moe_ops
from moe_ops import BatchLayout, CaptureTarget, RoutingMethod, capture_routing, route
from moe_ops.capture.errors import FAULT_SLOTS
from moe_ops.capture.spec import CaptureSpec
from moe_ops.capture.window import plan_window
from moe_ops.router.kernels import route_rows_torch, route_rows_triton

CPU_BACKENDS = [
    pytest.param(("torch", "cpu"), id="torch-cpu"),
    pytest.param(("triton", "cpu"), id="triton-interpret"),
]
GPU_BACKENDS = [
    pytest.param(("triton", "cuda"), id="triton-cuda", marks=pytest.mark.gpu),
    pytest.param(("torch", "cuda"), id="torch-cuda", marks=pytest.mark.gpu),
]


def _skip_unavailable(backend: str, device: str) -> None:
    if backend == "triton":
        skip_unless_triton_runs(device)


def _counter_delta(device, fn):
    """Runs ``fn`` on a zeroed fault counter; returns (fn's result, the counter's values)."""
    moe_ops.check_capture_errors(device, raise_error=False)
    out = fn()
    counter = moe_ops.capture_error_counter(device).tolist()
    moe_ops.check_capture_errors(device, raise_error=False)
    return out, counter


def fused_and_separate(backend: str, device: str, case, router, counts_override=None):
    """Routes ``router``'s logits with a fused capture and separately; returns both results.

    Each result is (weights, ids, buffer, fault counter delta); both buffers start poisoned.
    """
    logits, bias = router.tensors(device)
    cfg = router.config
    kw = cfg.route_kwargs(bias)
    buffer, _, counts, sizes = case.tensors(device)
    if counts_override is not None:
        counts = counts.clone()  # an expanded view cannot take one rank's bad count
        counts[case.dp_rank] = counts_override
    capture_kw = dict(token_counts=counts, dp_rank=case.dp_rank, layout=case.layout, shard_sizes=sizes)

    fused_buf = buffer.clone()
    target = CaptureTarget(fused_buf, case.layer_id, **capture_kw)
    (w1, ids1), faults1 = _counter_delta(
        device, lambda: route(logits, cfg.top_k, cfg.method, capture=target, backend=backend, **kw)
    )

    sep_buf = buffer.clone()

    def separate():
        w, ids = route(logits, cfg.top_k, cfg.method, backend=backend, **kw)
        capture_routing(sep_buf, ids, case.layer_id, **capture_kw)
        return w, ids

    (w2, ids2), faults2 = _counter_delta(device, separate)
    return (w1, ids1, fused_buf, faults1), (w2, ids2, sep_buf, faults2), buffer


def check_fused(backend_device, case, router) -> None:
    backend, device = backend_device
    _skip_unavailable(backend, device)
    fused, separate, before = fused_and_separate(backend, device, case, router)
    w1, ids1, buf1, faults1 = fused
    w2, ids2, buf2, faults2 = separate
    # bit-identical weights: the capture adds integer stores to the same float arithmetic on the
    # same logits and shapes (a kernel that computed otherwise would show here)
    assert torch.equal(ids1, ids2) and torch.equal(w1, w2), "capturing changed the routing"
    assert torch.equal(buf1, buf2), f"fused capture differs from route + capture_routing ({case.layout.name})"
    assert faults1 == faults2 == [0] * FAULT_SLOTS
    # and both are the layout definition: this rank's rows, in place, the rest still poisoned
    expected = before.clone()
    expected[: case.c, case.layer_id] = ids1[case.start : case.start + case.c].to(expected.dtype)
    assert torch.equal(buf1, expected)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@settings(max_examples=120)
@given(cases=routed_capture_cases())
def test_fused_capture_equals_route_then_capture(backend, cases):
    check_fused(backend, *cases)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@settings(max_examples=60)
@given(cases=routed_capture_cases(**GPU_CAPTURE_ROUTERS))
def test_fused_capture_equals_route_then_capture_gpu(backend, cases):
    check_fused(backend, *cases)


@pytest.mark.parametrize("backend", CPU_BACKENDS + GPU_BACKENDS)
@settings(max_examples=40)
@given(
    cases=routed_capture_cases(**GPU_CAPTURE_ROUTERS),
    extra=st.integers(1, 40),
    negative=st.booleans(),
)
def test_inconsistent_counts_fault_the_same_way(backend, cases, extra, negative):
    """Counts that overflow (or are negative): the same clamped rows and the same fault record."""
    backend_name, device = backend
    _skip_unavailable(backend_name, device)
    case, router = cases
    bad = -extra if negative else case.c + case.max_tokens + case.rows.shape[0] + extra
    fused, separate, _ = fused_and_separate(backend_name, device, case, router, counts_override=bad)
    assert torch.equal(fused[2], separate[2]), "fused capture wrote different rows for inconsistent counts"
    assert fused[3] == separate[3], f"fault counter: fused {fused[3]} vs capture op {separate[3]}"
    assert fused[3][0] == 1, "an inconsistent count must be recorded once"


@pytest.mark.parametrize(
    "device, block_ms, extra",
    [
        pytest.param("cpu", (1, 2, 4, 8), {}, id="interpret"),
        pytest.param(
            "cuda",
            (2,),
            dict(GPU_CAPTURE_ROUTERS, capture_kw=dict(buffer_dtypes=(torch.int32,))),
            id="cuda",
            marks=pytest.mark.gpu,
        ),
    ],
)
@settings(max_examples=60)
@given(data=st.data())
def test_kernel_programs_split_the_capture_window(device, block_ms, extra, data):
    """Several rows per program and several programs: each writes only its rows of the window,
    program 0 alone records the faults; the kernel equals its PyTorch twin, counts good or bad."""
    _skip_unavailable("triton", device)
    case, router = data.draw(routed_capture_cases(**extra))
    block_m = data.draw(st.sampled_from(block_ms))
    bad = data.draw(st.sampled_from([None, None, -2, case.c + case.max_tokens + case.rows.shape[0] + 1]))
    logits, bias = router.tensors(device)
    buffer, _, counts, sizes = case.tensors(device)
    if bad is not None:
        counts = counts.clone()
        counts[case.dp_rank] = bad
    read, n_first = plan_window(case.layout, counts, case.dp_rank, sizes, counts.device)
    no_stamps = torch.empty(0, dtype=torch.int32, device=device)
    no_weights = torch.empty(0, dtype=torch.float32, device=device)
    n_group, topk_group = router.config.groups
    scale = router.config.routed_scaling_factor or 1.0
    results = []
    for impl in ("triton", "torch"):
        buf = buffer.clone()
        errors = torch.zeros(FAULT_SLOTS, dtype=torch.int32, device=device)
        w = torch.empty(logits.shape[0], router.config.top_k, dtype=torch.float32, device=device)
        ids = torch.empty(logits.shape[0], router.config.top_k, dtype=torch.int32, device=device)
        fused = CaptureSpec(
            buf,
            no_weights,
            counts,
            read,
            errors,
            no_stamps,
            no_stamps,
            torch.empty(0, dtype=torch.int32, device=device),  # no expert map
            case.layer_id,
            case.dp_rank,
            n_first,
            0,
        )
        args = (logits, bias, w, ids, int(router.config.method), n_group, topk_group, scale, fused)
        if impl == "triton":
            route_rows_triton(*args, block_m=block_m)
        else:
            route_rows_torch(*args)
        results.append((w, ids, buf, errors.tolist()))
    (w1, ids1, buf1, err1), (w2, ids2, buf2, err2) = results
    assert torch.equal(buf1, buf2) and err1 == err2
    assert err1[0] == (0 if bad is None else 1)
    assert torch.equal(ids1, ids2) or router.config.method in (
        RoutingMethod.DEEPSEEK_V3,
        RoutingMethod.MINIMAX2,
    )
    torch.testing.assert_close(w1[ids1 == ids2], w2[ids1 == ids2], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_zero_tokens_with_capture(device, backend):
    """n = 0: nothing written; a count the empty batch cannot hold is still recorded."""
    _skip_unavailable(backend, device)
    logits = torch.empty(0, 16, device=device)
    buffer = torch.full((4, 2, 1), POISON, dtype=torch.int32, device=device)
    for count, faults in ((0, 0), (3, 1)):
        counts = torch.tensor([count], dtype=torch.int32, device=device)
        target = CaptureTarget(buffer, 1, token_counts=counts)
        (w, ids), delta = _counter_delta(
            device, lambda t=target: route(logits, 1, RoutingMethod.LLAMA4, capture=t, backend=backend)
        )
        assert w.shape == (0, 1) and ids.shape == (0, 1)
        assert delta[0] == faults
        assert (buffer == POISON).all()


def _capture_args(device="cpu"):
    return dict(
        buffer=torch.full((8, 3, 4), POISON, dtype=torch.int32, device=device),
        layer_id=0,
        token_counts=torch.tensor([2, 3], dtype=torch.int32, device=device),
        dp_rank=1,
        layout=BatchLayout.LOCAL,
        shard_sizes=None,
        tp_group=None,
    )


# The same mutations as the capture op's bad-input table: CaptureTarget must raise the same errors.
CAPTURE_MUTATIONS = [
    lambda a: a.update(buffer=a["buffer"].float()),
    lambda a: a.update(buffer=a["buffer"][0]),
    lambda a: a.update(layer_id=3),
    lambda a: a.update(layer_id=-1),
    lambda a: a.update(token_counts=a["token_counts"].long()),
    lambda a: a.update(token_counts=a["token_counts"][None]),
    lambda a: a.update(dp_rank=2),
    lambda a: a.update(layout=7),
    lambda a: a.update(layout=BatchLayout.SHARDED),
    lambda a: a.update(layout=BatchLayout.SHARDED, shard_sizes=torch.ones(3, dtype=torch.int32)),
    lambda a: a.update(layout=BatchLayout.GATHERED, shard_sizes=torch.ones(3, dtype=torch.int32)),
    lambda a: a.update(shard_sizes=torch.ones(2, dtype=torch.int32)),
    lambda a: a.update(tp_group=object()),
]


@pytest.mark.parametrize("mutate", CAPTURE_MUTATIONS)
def test_capture_target_errors_match_capture_routing(mutate):
    args = _capture_args()
    mutate(args)
    buffer = args.pop("buffer")
    before = buffer.clone()
    layer_id = args.pop("layer_id")
    with pytest.raises((ValueError, IndexError, TypeError)) as from_op:
        capture_routing(buffer, torch.zeros(6, 4, dtype=torch.int32), layer_id, **args)
    with pytest.raises(from_op.type) as from_target:
        CaptureTarget(buffer, layer_id, **args)
    assert str(from_target.value) == str(from_op.value)
    assert torch.equal(buffer, before)


@pytest.mark.parametrize(
    "n_tokens, top_k, match",
    [
        (6, 8, "topk_ids has top_k=8 columns but buffer was sized for top_k=4"),
        (10, 4, "buffer has 8 rows but the LOCAL batch has 10 rows"),
    ],
)
def test_route_checks_the_capture_against_its_ids(n_tokens, top_k, match):
    """What only the routed ids reveal is checked before the kernel runs, with capture_routing's words."""
    args = _capture_args()
    buffer = args.pop("buffer")
    target = CaptureTarget(buffer, args.pop("layer_id"), **args)
    with pytest.raises(ValueError, match=match):
        route(torch.randn(n_tokens, 16), top_k, capture=target)
    with pytest.raises(ValueError, match=match):
        capture_routing(buffer, torch.zeros(n_tokens, top_k, dtype=torch.int32), 0, **args)
    assert (buffer == POISON).all()


@pytest.mark.gpu
def test_capture_on_another_device_raises(cuda_device):
    args = _capture_args(cuda_device)
    buffer = args.pop("buffer")
    target = CaptureTarget(buffer, args.pop("layer_id"), **args)
    with pytest.raises(ValueError, match="router_logits must be on the capture buffer's device"):
        route(torch.randn(4, 16), 4, capture=target)
    assert (buffer == POISON).all()


def _sp_worker(rank: int, world: int, init_file: str, result_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cfg = MODEL_ROUTERS[0]
        g = torch.Generator().manual_seed(99)  # every rank builds the same full batch
        failures = []
        for c in (0, 3, 8):
            padded = c + 2
            per = -(-padded // world)
            full = torch.randn(per * world, cfg.num_experts, generator=g)
            bias = torch.randn(cfg.num_experts, generator=g) * 0.1
            mine = full[rank * per : (rank + 1) * per]
            counts = torch.tensor([c], dtype=torch.int32)
            fused = torch.full((16, 2, cfg.top_k), POISON, dtype=torch.int32)
            target = CaptureTarget(
                fused, 1, token_counts=counts, layout=BatchLayout.SEQUENCE_PARALLEL, tp_group=dist.group.WORLD
            )
            _, my_ids = route(mine, cfg.top_k, cfg.method, capture=target, **cfg.route_kwargs(bias))
            _, all_ids = route(full, cfg.top_k, cfg.method, **cfg.route_kwargs(bias))
            expected = torch.full_like(fused, POISON)
            expected[:c, 1] = all_ids[:c]
            if not torch.equal(fused, expected) or not torch.equal(
                my_ids, all_ids[rank * per : (rank + 1) * per]
            ):
                failures.append(f"c={c}")
        with open(os.path.join(result_dir, f"rank{rank}"), "w") as f:
            f.write(";".join(failures) if failures else "ok")
    finally:
        dist.destroy_process_group()


def test_sequence_parallel_falls_back_to_the_capture_op_gloo():
    """SEQUENCE_PARALLEL with a real TP group of 2: route locally, all-gather, record every row."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_sp_worker, args=(2, os.path.join(tmp, "init"), tmp), nprocs=2, join=True)
        for rank in range(2):
            with open(os.path.join(tmp, f"rank{rank}")) as f:
                assert f.read() == "ok", f"rank {rank}"
