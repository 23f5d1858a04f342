"""Exactly this rank's rows on every path: strided and expanded count tensors, int64 offsets, bad ids,
per-capturer fault counters under threads, set_step validation, stale layers, and one row rule that
capture_routing, route(..., capture=...), RoutingCapturer and the monolithic experts all share.

Each test that names a reproduction (an input that broke the Triton path while the PyTorch twin was
right) runs on the twin, on Triton (interpreted on CPU; compiled on the GPU) and through the op.
"""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest
import torch
from gpu_helpers import skip_unless_triton_runs
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import POISON, limit_id_cases, refused_ids, routed_capture_cases, view_base_untouched

import moe_ops
from moe_ops import (
    BatchLayout,
    CaptureTarget,
    RoutingCapturer,
    RoutingMethod,
    RoutingShape,
    capture_routing,
    route,
)
from moe_ops.capture.errors import (
    FAULT_BAD_ID,
    FAULT_BAD_OFFSET,
    FAULT_SLOTS,
    FAULT_SOURCE_SHORT,
    CaptureFaultError,
    FaultCounter,
    FaultReport,
)
from moe_ops.capture.kernels import capture_rows_torch, capture_rows_triton
from moe_ops.capture.window import plan_window
from moe_ops.transfer.narrow import narrow_rows_torch, narrow_rows_triton

IMPLS = [
    pytest.param(("torch", "cpu"), id="torch-cpu"),
    pytest.param(("triton", "cpu"), id="triton-interpret"),
    pytest.param(("triton", "cuda"), id="triton-cuda", marks=pytest.mark.gpu),
    pytest.param(("torch", "cuda"), id="torch-cuda", marks=pytest.mark.gpu),
]


def kernel_capture(impl, buffer, ids, counts, layer_id, dp_rank, layout, shard_sizes=None):
    """One call of a kernel implementation; returns the FaultReport of a fresh counter."""
    impl_name, _ = impl
    if impl_name == "triton":
        skip_unless_triton_runs(buffer.device)
    errors = torch.zeros(FAULT_SLOTS, dtype=torch.int32, device=buffer.device)
    empty = torch.empty(0, dtype=torch.int32, device=buffer.device)
    sizes, n_first = plan_window(BatchLayout(layout), counts, dp_rank, shard_sizes, buffer.device)
    fn = capture_rows_triton if impl_name == "triton" else capture_rows_torch
    no_weights = torch.empty(0, dtype=torch.float32, device=buffer.device)  # ids only (WEIGHTS off)
    no_map = torch.empty(0, dtype=torch.int32, device=buffer.device)  # ids as given (EXPERT_MAP off)
    fn(
        buffer,
        ids,
        no_weights,
        no_weights,
        counts,
        sizes,
        errors,
        empty,
        empty,
        no_map,
        layer_id,
        dp_rank,
        n_first,
        0,
    )
    return FaultReport.of(errors.tolist())


# ------------------------------------------------------------------ strided / expanded index tensors


@pytest.mark.parametrize("impl", IMPLS)
def test_strided_counts_are_read_by_stride(impl):
    device = impl[1]
    counts = torch.tensor([[2, 4], [3, 7]], dtype=torch.int32, device=device)[:, 0]  # [2, 3], stride 2
    ids = torch.arange(20, dtype=torch.int32, device=device).reshape(10, 2)
    buf = torch.full((8, 1, 2), -1, dtype=torch.int32, device=device)
    report = kernel_capture(impl, buf, ids, counts, 0, 1, BatchLayout.GATHERED)
    assert report.total == 0
    # rank 1 owns rows [2, 5): three rows, not four
    assert buf[:, 0].tolist() == [[4, 5], [6, 7], [8, 9]] + [[-1, -1]] * 5


@pytest.mark.parametrize("impl", IMPLS)
def test_expanded_counts_stay_inside_their_storage(impl):
    device = impl[1]
    counts = torch.tensor([3], dtype=torch.int32, device=device).expand(4)  # stride 0, one int32
    ids = torch.arange(40, dtype=torch.int32, device=device).reshape(20, 2)
    for layout, start in ((BatchLayout.LOCAL, 0), (BatchLayout.GATHERED, 9)):
        buf = torch.full((8, 1, 2), POISON, dtype=torch.int32, device=device)
        report = kernel_capture(impl, buf, ids, counts, 0, 3, layout)
        assert report.total == 0
        expected = torch.full((8, 2), POISON, dtype=torch.int32)
        expected[:3] = ids[start : start + 3].cpu()
        assert torch.equal(buf[:, 0].cpu(), expected), layout.name


@pytest.mark.parametrize("impl", IMPLS)
def test_sliced_ids_of_a_fused_shared_expert_tensor(impl):
    """ids[:, :top_k] of a (n, top_k + shared) tensor: row stride top_k + 1."""
    device = impl[1]
    fused = torch.arange(30, dtype=torch.int32, device=device).reshape(10, 3)
    ids = fused[:, :2]
    counts = torch.tensor([4, 5], dtype=torch.int32, device=device)
    buf = torch.full((6, 2, 2), POISON, dtype=torch.int32, device=device)
    assert kernel_capture(impl, buf, ids, counts, 1, 1, BatchLayout.GATHERED).total == 0
    assert torch.equal(buf[:5, 1], ids[4:9]) and (buf[5:, 1] == POISON).all() and (buf[:, 0] == POISON).all()


def test_overlapping_buffer_is_refused():
    ids = torch.zeros(4, 2, dtype=torch.int32)
    counts = torch.tensor([4], dtype=torch.int32)
    expanded = torch.full((1, 1, 2), POISON, dtype=torch.int32).expand(8, 1, 2)
    with pytest.raises(ValueError, match="buffer must not overlap itself"):
        capture_routing(expanded, ids, 0, token_counts=counts)
    overlapping = torch.full((16,), POISON, dtype=torch.int32).as_strided((8, 1, 2), (1, 2, 1))
    with pytest.raises(ValueError, match="buffer must not overlap itself"):
        capture_routing(overlapping, ids, 0, token_counts=counts)
    assert (expanded == POISON).all()
    # a permuted or sliced buffer does not overlap and is accepted
    wide = torch.full((8, 2, 3), POISON, dtype=torch.int32)
    capture_routing(wide[:, :, :2], ids, 1, token_counts=counts, fault_counter=FaultCounter("cpu"))
    assert torch.equal(wide[:4, 1, :2], ids) and (wide[:, :, 2] == POISON).all()


# ------------------------------------------------------------------ int64 offsets


@pytest.mark.parametrize("impl", IMPLS)
def test_offset_sums_do_not_wrap_int32(impl):
    device = impl[1]
    big = 2**31 - 1
    counts = torch.tensor([big, big, 3, 2], dtype=torch.int32, device=device)
    ids = torch.arange(10, dtype=torch.int32, device=device).reshape(5, 2)
    buf = torch.full((4, 1, 2), POISON, dtype=torch.int32, device=device)
    report = kernel_capture(impl, buf, ids, counts, 0, 3, BatchLayout.GATHERED)
    # the true start, 2**32 + 1, is past the source: nothing is written and the fault is recorded
    assert report.calls == 1 and report.flags & FAULT_BAD_OFFSET
    assert (buf == POISON).all()


# ------------------------------------------------------------------ ids the buffer cannot hold


@pytest.mark.parametrize("impl", IMPLS)
def test_ids_that_do_not_fit_are_stored_as_minus_one_and_counted(impl):
    device = impl[1]
    counts = torch.tensor([4], dtype=torch.int32, device=device)
    ids16 = torch.tensor([[40000], [32768], [70000], [7]], dtype=torch.int32, device=device)
    buf = torch.full((4, 1, 1), POISON, dtype=torch.int16, device=device)
    report = kernel_capture(impl, buf, ids16, counts, 0, 0, BatchLayout.LOCAL)
    assert buf[:, 0, 0].tolist() == [-1, -1, -1, 7]
    assert report.bad_ids == 3 and report.calls == 0 and report.flags == FAULT_BAD_ID

    ids64 = torch.tensor([[2**40, 3], [5, -2], [1, 2], [0, 0]], dtype=torch.int64, device=device)
    buf = torch.full((4, 1, 2), POISON, dtype=torch.int32, device=device)
    report = kernel_capture(impl, buf, ids64, counts, 0, 0, BatchLayout.LOCAL)
    assert buf[:, 0].tolist() == [[-1, 3], [5, -1], [1, 2], [0, 0]]
    assert report.bad_ids == 2


def test_route_refuses_a_buffer_dtype_that_cannot_hold_its_experts():
    logits = torch.randn(4, 40000)
    buf = torch.full((4, 1, 2), POISON, dtype=torch.int16)
    target = CaptureTarget(buf, 0, token_counts=torch.tensor([4], dtype=torch.int32))
    with pytest.raises(ValueError, match="cannot hold expert ids up to 39999"):
        route(logits, 2, RoutingMethod.TOPK, capture=target, backend="torch")
    assert (buf == POISON).all()


@pytest.mark.parametrize("value", [1.9, "1", True, None])
def test_layout_takes_the_enum_or_an_int_only(value):
    with pytest.raises(ValueError, match="layout must be a BatchLayout"):
        capture_routing(
            torch.zeros(4, 1, 1, dtype=torch.int32),
            torch.zeros(2, 1, dtype=torch.int32),
            0,
            token_counts=torch.tensor([2], dtype=torch.int32),
            layout=value,
        )


@pytest.mark.parametrize("value", [2.7, "2", False])
def test_method_takes_the_enum_or_an_int_only(value):
    with pytest.raises(ValueError, match="method must be a RoutingMethod"):
        route(torch.randn(2, 8), 2, value)


def _exotic_ids() -> list[tuple[str, object]]:
    """Integer-like dtypes that are not ids, each as a (2, 1) tensor where this torch makes one."""
    makers = {
        "quint8": lambda: torch.quantize_per_tensor(torch.zeros(2, 1), 1.0, 0, torch.quint8),
        "qint8": lambda: torch.quantize_per_tensor(torch.zeros(2, 1), 1.0, 0, torch.qint8),
        "qint32": lambda: torch.quantize_per_tensor(torch.zeros(2, 1), 1.0, 0, torch.qint32),
        "bits8": lambda: torch.zeros(2, 1, dtype=torch.uint8).view(torch.bits8),
        "uint1": lambda: torch.empty(2, 1, dtype=torch.uint1),
        "int4": lambda: torch.empty(2, 1, dtype=torch.int4),
        "uint4": lambda: torch.empty(2, 1, dtype=torch.uint4),
    }
    out = []
    for name, make in makers.items():
        try:
            out.append((name, make()))
        except (AttributeError, RuntimeError, NotImplementedError, TypeError):
            continue  # this torch cannot make the dtype: nothing to refuse
    return out


def test_non_id_dtypes_are_refused():
    cases = _exotic_ids()
    assert len(cases) >= 4, "the quantised and bits dtypes exist in every torch this package supports"
    buf = torch.full((4, 1, 1), POISON, dtype=torch.int32)
    for name, ids in cases:
        with pytest.raises(ValueError, match="topk_ids must have an integer dtype"):
            capture_routing(buf, ids, 0, token_counts=torch.tensor([2], dtype=torch.int32))
        assert (buf == POISON).all(), name


# ------------------------------------------------------------------ fault counters and threads


def _faulty_call(counter: FaultCounter | None = None) -> None:
    """One capture whose count exceeds the ids (SOURCE_SHORT): exactly one fault."""
    capture_routing(
        torch.full((4, 1, 1), POISON, dtype=torch.int32),
        torch.zeros(2, 1, dtype=torch.int32),
        0,
        token_counts=torch.tensor([3], dtype=torch.int32),
        fault_counter=counter,
    )


@pytest.mark.parametrize("own_counter", [False, True], ids=["device-wide", "own-counter"])
def test_every_fault_is_reported_exactly_once_under_threads(own_counter):
    counter = FaultCounter("cpu") if own_counter else None
    check = (
        (lambda: counter.check(raise_error=False))
        if own_counter
        else (lambda: moe_ops.check_capture_errors("cpu", raise_error=False))
    )
    check()
    workers, calls = 4, 60
    seen = []
    done = threading.Event()

    def checker():
        while not done.is_set():
            seen.append(check())

    def worker():
        for _ in range(calls):
            _faulty_call(counter)

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    watcher = threading.Thread(target=checker)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    watcher.join()
    seen.append(check())
    assert sum(seen) == workers * calls, f"reported {sum(seen)} of {workers * calls} faults"
    assert check() == 0


def test_capturers_do_not_see_each_others_faults():
    shape = RoutingShape(num_layers=1, num_experts=8, top_k=1)
    a, b = RoutingCapturer(shape, 8, "cpu"), RoutingCapturer(shape, 8, "cpu")
    moe_ops.check_capture_errors("cpu", raise_error=False)
    for cap in (a, b):
        cap.set_step([5])
    a.capture(0, torch.zeros(3, 1, dtype=torch.int32))  # 5 tokens, 3 rows: clamped
    route(torch.randn(3, 8), 1, capture=a.target(0), backend="torch")  # the target shares a's counter
    b.capture(0, torch.zeros(5, 1, dtype=torch.int32))
    assert b.check_errors() == 0
    assert moe_ops.check_capture_errors("cpu") == 0, "a capturer's fault reached the device-wide counter"
    with pytest.raises(CaptureFaultError, match="2 routing-capture call"):
        a.check_errors()
    assert a.check_errors() == 0 and b.check_errors() == 0


# ------------------------------------------------------------------ set_step validates before it writes


def test_set_step_changes_nothing_when_any_value_is_bad():
    shape = RoutingShape(num_layers=1, num_experts=8, top_k=1)
    cap = RoutingCapturer(shape, 8, "cpu", shards_per_rank=1)
    cap.set_step([3], [3])
    state = (cap.token_counts.tolist(), cap.shard_sizes.tolist(), cap.num_tokens, cap.step)
    for counts, sizes, match in (
        ([5], [2**31], r"shard_sizes must be in \[0, 2\*\*31 - 1\]"),
        ([2.7], [3], "token_counts must hold integers"),
        ([np.float64(3.0)], [3], "token_counts must hold integers"),
        (np.array([3.0]), [3], "token_counts must hold integers"),
        (torch.tensor([3.5]), [3], "token_counts must hold integers"),
        ([3], [True], "shard_sizes must hold integers"),
        ([-1], [3], "token_counts must be in"),
    ):
        with pytest.raises(ValueError, match=match):
            cap.set_step(counts, sizes)
        assert (cap.token_counts.tolist(), cap.shard_sizes.tolist(), cap.num_tokens, cap.step) == state
    handle = cap.snapshot()
    assert handle.num_rows == 3
    handle.release()


# ------------------------------------------------------------------ stale layers read as the fill value

SHAPE = RoutingShape(num_layers=3, num_experts=64, top_k=2, moe_layers=(1, 2, 4), num_model_layers=5)


def _step(cap: RoutingCapturer, n: int, seed: int, skip: set[int], capture) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = {
        layer: torch.randint(0, SHAPE.num_experts, (n, SHAPE.top_k), generator=g).to(cap.device)
        for layer in SHAPE.moe_layers
    }
    cap.set_step([n])
    capture({layer: v for layer, v in ids.items() if layer not in skip})
    return ids


def _check_snapshot(cap: RoutingCapturer, ids: dict[int, torch.Tensor], skip: set[int]) -> None:
    with cap.snapshot() as handle:
        rows = handle.result()
    fill = np.array(-1).astype(rows.dtype)
    for col, layer in enumerate(SHAPE.moe_layers):
        if layer in skip:
            assert (rows[:, col] == fill).all(), f"layer {layer} was not captured but delivered ids"
        else:
            assert np.array_equal(rows[:, col], ids[layer].cpu().numpy().astype(rows.dtype)), layer


def _stale_run(device: str, capture_fn) -> None:
    cap = RoutingCapturer(SHAPE, 16, device)
    fn = capture_fn(cap)
    for step, (n, skip) in enumerate([(6, set()), (6, {2}), (4, {1, 4}), (5, set()), (5, {4})]):
        ids = _step(cap, n, step, skip, fn)
        _check_snapshot(cap, ids, skip)


DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_a_layer_not_captured_this_step_reads_as_fill_eager(device):
    def make(cap):
        def run(ids):
            for layer, v in ids.items():
                cap.capture(layer, v)

        return run

    _stale_run(device, make)


@pytest.mark.parametrize("device", DEVICES)
def test_a_layer_not_captured_this_step_reads_as_fill_routed(device):
    """The fused router's capture stamps the layer too."""

    def make(cap):
        def run(ids):
            for layer, v in ids.items():
                # logits whose top-2 are exactly v: the routed ids equal the drawn ones
                logits = torch.zeros(v.shape[0], SHAPE.num_experts, device=v.device)
                logits.scatter_(1, v[:, :1].long(), 2.0)
                second = torch.where(v[:, 1:] == v[:, :1], (v[:, 1:] + 1) % SHAPE.num_experts, v[:, 1:])
                logits.scatter_(1, second.long(), 1.0)
                v.copy_(torch.cat([v[:, :1], second], dim=1))
                route(logits, SHAPE.top_k, RoutingMethod.TOPK, capture=cap.target(layer))

        return run

    _stale_run(device, make)


@pytest.mark.parametrize("device", DEVICES)
def test_a_layer_not_captured_this_step_reads_as_fill_compiled(device):
    def make(cap):
        def forward(a, b, c, skip_mid: bool):
            cap.capture(1, a)
            if not skip_mid:
                cap.capture(2, b)
            cap.capture(4, c)

        compiled = torch.compile(forward, fullgraph=True, dynamic=True)

        def run(ids):
            present = sorted(ids)
            if present == [1, 2, 4]:
                compiled(ids[1], ids[2], ids[4], False)
            elif present == [1, 4]:
                compiled(ids[1], ids[1], ids[4], True)
            else:  # other skips run eagerly: the compiled graph covers the two shapes above
                for layer, v in ids.items():
                    cap.capture(layer, v)

        return run

    _stale_run(device, make)


@pytest.mark.gpu
def test_a_layer_not_captured_this_step_reads_as_fill_cuda_graphs(cuda_device):
    cap = RoutingCapturer(SHAPE, 16, cuda_device)
    static = {
        layer: torch.zeros(8, SHAPE.top_k, dtype=torch.int32, device=cuda_device)
        for layer in SHAPE.moe_layers
    }
    cap.set_step([8])
    for layer, v in static.items():
        cap.capture(layer, v)  # warm-up: compiles the kernel
    torch.cuda.synchronize()
    graphs = {}
    for name, layers in (("all", (1, 2, 4)), ("no-mid", (1, 4))):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for layer in layers:
                cap.capture(layer, static[layer])
        graphs[name] = g
    for step, name in enumerate(["all", "no-mid", "all", "no-mid", "no-mid"]):
        gen = torch.Generator().manual_seed(step)
        for v in static.values():
            v.copy_(torch.randint(0, SHAPE.num_experts, v.shape, generator=gen))
        cap.set_step([5 + step % 3])
        graphs[name].replay()
        skip = set() if name == "all" else {2}
        _check_snapshot(cap, {layer: v[: 5 + step % 3] for layer, v in static.items()}, skip)


@pytest.mark.parametrize("impl", IMPLS)
def test_narrowing_masks_stale_layers(impl):
    impl_name, device = impl
    if impl_name == "triton":
        skip_unless_triton_runs(torch.device(device))
    src = torch.arange(7 * 3 * 4, dtype=torch.int32, device=device).reshape(7, 3, 4) % 200
    stamps = torch.tensor([5, 4, 5], dtype=torch.int32, device=device)
    step = torch.tensor([5], dtype=torch.int32, device=device)
    dst = torch.full((7, 3, 4), 77, dtype=torch.uint8, device=device)
    fn = narrow_rows_triton if impl_name == "triton" else narrow_rows_torch
    fn(dst, src, 5, stamps, step)
    expected = torch.full((7, 3, 4), 77, dtype=torch.uint8)
    expected[:5] = src[:5].cpu().to(torch.uint8)
    expected[:5, 1] = 255  # layer 1's stamp is stale
    assert torch.equal(dst.cpu(), expected)


# ------------------------------------------------------------------ every path agrees


class _Capturer:
    """The capture state a model holds (RoutingCapturerLike), with its own fault counter."""

    def __init__(self, buffer, token_counts, dp_rank, shard_sizes):
        self.buffer, self.token_counts, self.dp_rank, self.shard_sizes = (
            buffer,
            token_counts,
            dp_rank,
            shard_sizes,
        )
        self.fault_counter = FaultCounter(buffer.device)


def _experts_capture(case, cap, ids) -> None:
    """The monolithic experts' dispatch: the kernel writes routing_replay_out, the experts capture."""
    from moe_ops import LayerCapture, MoEDispatchConfig
    from moe_ops.flashinfer import FlashInferExperts

    n = ids.shape[0]
    dp = len(case.counts)
    config = MoEDispatchConfig(
        max_num_tokens=max(1, n if case.layout == BatchLayout.LOCAL else -(-n // dp)),
        top_k=case.top_k,
        dp_size=dp,
        layout=case.layout,
    )
    experts = FlashInferExperts(
        "trtllm_bf16_moe",
        config,
        gemm1_weights=torch.empty(16, 4, 256, 64, dtype=torch.bfloat16),
        gemm2_weights=torch.empty(16, 2, 256, 64, dtype=torch.bfloat16),
        num_experts=16,
        top_k=case.top_k,
        n_group=None,
        topk_group=None,
        intermediate_size=128,
        local_expert_offset=0,
        local_num_experts=16,
        routing_method_type=1,
    )
    experts.set_capture_fn(LayerCapture(cap, case.layer_id))
    replay = experts.routing_replay_out(n, ids.device)
    replay.copy_(ids)
    experts.capture_routing_replay(replay)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@settings(max_examples=40)
@given(cases=routed_capture_cases(capture_kw=dict(views=False)), bad=st.sampled_from([None, None, -3, 1000]))
def test_every_path_writes_the_same_rows_and_faults(backend, cases, bad):
    """capture_routing, route(capture=...) (fused, triton and torch), a capturer's capture and
    target, and the monolithic experts' dispatch: identical poisoned buffers, identical faults."""
    if backend == "triton":
        skip_unless_triton_runs(torch.device("cpu"))
    case, router = cases
    if case.layout == BatchLayout.SEQUENCE_PARALLEL:
        case.layout = BatchLayout.LOCAL  # tp_size 1: the same rows (the multi-process test gathers)
    cfg = router.config
    logits, bias = router.tensors("cpu")
    kw = cfg.route_kwargs(bias)
    _, ids = route(logits, cfg.top_k, cfg.method, backend="torch", **kw)
    buffer0, _, counts, sizes = case.tensors("cpu")
    if bad is not None:
        counts[case.dp_rank] = bad
    layout = case.layout
    results = {}

    def fresh():
        cap = _Capturer(buffer0.clone(), counts, case.dp_rank, sizes)
        return cap

    cap = fresh()
    capture_routing(
        cap.buffer,
        ids,
        case.layer_id,
        token_counts=counts,
        dp_rank=case.dp_rank,
        layout=layout,
        shard_sizes=sizes if layout in (BatchLayout.GATHERED, BatchLayout.SHARDED) else None,
        fault_counter=cap.fault_counter,
    )
    results["capture_routing"] = cap
    cap = fresh()
    route(
        logits,
        cfg.top_k,
        cfg.method,
        capture=CaptureTarget.of(cap, case.layer_id, layout),
        backend=backend,
        **kw,
    )
    results[f"route-{backend}"] = cap
    cap = fresh()
    moe_ops.capture.op.capture_into(CaptureTarget.of(cap, case.layer_id, layout), ids)
    results["target"] = cap
    if ids.shape[0] > 0 and (case.layout != BatchLayout.LOCAL or ids.shape[0] <= case.max_tokens):
        cap = fresh()
        _experts_capture(case, cap, ids)
        results["experts"] = cap

    ref = results.pop("capture_routing")
    ref_report = ref.fault_counter.read_and_reset()
    expected = buffer0.clone()
    if bad is None:
        assert ref_report.total == 0
        expected[: case.c, case.layer_id] = ids[case.start : case.start + case.c].to(expected.dtype)
        assert torch.equal(ref.buffer, expected), "capture_routing differs from the layout definition"
    for name, cap in results.items():
        assert torch.equal(cap.buffer, ref.buffer), f"{name} wrote other rows than capture_routing"
        assert cap.fault_counter.read_and_reset() == ref_report, f"{name} recorded other faults"


def test_a_capturer_with_shards_and_a_gathered_dispatch_takes_one_path():
    """shards_per_rank=2 and GATHERED rows: capture, target and the experts read the same sizes."""
    shape = RoutingShape(num_layers=1, num_experts=16, top_k=2)
    cap = RoutingCapturer(shape, 8, "cpu", dp_size=2, dp_rank=1, shards_per_rank=2)
    ids = torch.arange(2 * 10, dtype=torch.int32).reshape(10, 2) % 16
    cap.set_step([3, 4], [2, 2, 3, 3])  # rank 0's block: 4 rows, rank 1's: rows [4, 10)
    outs = []
    for path in ("capture", "target"):
        cap.buffer.fill_(POISON)
        if path == "capture":
            cap.capture(0, ids, BatchLayout.GATHERED)
        else:
            moe_ops.capture.op.capture_into(cap.target(0, BatchLayout.GATHERED), ids)
        outs.append(cap.buffer.clone())
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0][:4, 0], ids[4:8]) and (outs[0][4:] == POISON).all()
    assert cap.check_errors() == 0


def test_fault_bits_of_a_clamped_window_are_counted_per_bit():
    counter = FaultCounter("cpu")
    for _ in range(3):
        _faulty_call(counter)
    report = counter.peek()
    assert report == FaultReport(calls=3, flags=FAULT_SOURCE_SHORT, bad_ids=0)
    assert counter.check(raise_error=False) == 3 and counter.check() == 0


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=150)
@given(case=limit_id_cases())
def test_ids_at_the_dtype_limits(impl, case):
    """Every id the buffer dtype holds is stored as is, every other one as -1 and counted."""
    device = impl[1]
    buffer, ids, counts, sizes = case.tensors(device)
    expected, n_bad = refused_ids(case, buffer)
    report = kernel_capture(impl, buffer, ids, counts, case.layer_id, case.dp_rank, case.layout, sizes)
    assert torch.equal(buffer, expected)
    assert report.bad_ids == n_bad and report.calls == 0
    assert view_base_untouched(buffer)


def test_a_snapshot_without_set_step_warns_once():
    from moe_ops.capture.capturer import MissingSetStepWarning

    cap = RoutingCapturer(SHAPE, 8, "cpu")
    with pytest.warns(MissingSetStepWarning, match="without a set_step"):
        cap.snapshot(0).release()
    cap.set_step([2])
    with warnings.catch_warnings():
        warnings.simplefilter("error", MissingSetStepWarning)
        cap.snapshot().release()  # a step: no warning
        cap.snapshot(0).release()  # none again, but the warning was given once already
