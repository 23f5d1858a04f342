"""The capture op against the layout definitions: every layout, padding, dtypes, poisoned buffers."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import skip_unless_triton_runs
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import GPU_CASES, POISON, capture_cases, view_base_untouched

import moe_ops
from moe_ops import BatchLayout, capture_routing
from moe_ops.capture.errors import (
    FAULT_BAD_OFFSET,
    FAULT_DEST_SHORT,
    FAULT_NEGATIVE_COUNT,
    FAULT_SLOTS,
    FAULT_SOURCE_SHORT,
    CaptureFaultError,
    FaultReport,
)
from moe_ops.capture.kernels import capture_rows_torch, capture_rows_triton
from moe_ops.capture.window import plan_window

# (implementation, device): "op" is the public capture_routing (reference on CPU, Triton on CUDA);
# "triton"/"torch" call one kernel implementation directly.
CPU_BACKENDS = [
    pytest.param(("op", "cpu"), id="op-cpu"),
    pytest.param(("triton", "cpu"), id="triton-interpret"),
]
GPU_BACKENDS = [
    pytest.param(("op", "cuda"), id="op-cuda", marks=pytest.mark.gpu),
    pytest.param(("torch", "cuda"), id="torch-cuda", marks=pytest.mark.gpu),
]
BACKENDS = CPU_BACKENDS + GPU_BACKENDS


def _skip_unavailable(impl: str, device: str) -> None:
    if impl == "triton":
        skip_unless_triton_runs(device)


def run_capture(impl: str, case, buffer, topk_ids, counts, sizes) -> torch.Tensor:
    """Runs one capture and returns the device fault counter it wrote to."""
    if impl == "op":
        capture_routing(
            buffer,
            topk_ids,
            case.layer_id,
            token_counts=counts,
            dp_rank=case.dp_rank,
            layout=case.layout,
            shard_sizes=sizes,
        )
        return moe_ops.capture_error_counter(buffer.device)
    errors = torch.zeros(FAULT_SLOTS, dtype=torch.int32, device=buffer.device)
    no_stamps = torch.empty(0, dtype=torch.int32, device=buffer.device)
    no_weights = torch.empty(0, dtype=torch.float32, device=buffer.device)
    read, n_first = plan_window(case.layout, counts, case.dp_rank, sizes, buffer.device)
    fn = capture_rows_triton if impl == "triton" else capture_rows_torch
    fn(
        buffer,
        topk_ids,
        no_weights,
        no_weights,
        counts,
        read,
        errors,
        no_stamps,
        no_stamps,
        torch.empty(0, dtype=torch.int32, device=buffer.device),  # no expert map
        case.layer_id,
        case.dp_rank,
        n_first,
        0,
    )
    return errors


def check_case(backend, case):
    impl, device = backend
    _skip_unavailable(impl, device)
    buffer, topk_ids, counts, sizes = case.tensors(device)
    expected = case.expected(buffer)
    errors = run_capture(impl, case, buffer, topk_ids, counts, sizes)
    assert torch.equal(buffer, expected), (
        f"rows written differ from the layout definition ({case.layout.name})"
    )
    assert FaultReport.of(errors.tolist()).total == 0, "a consistent call must not record a fault"
    assert view_base_untouched(buffer), "a write landed outside the buffer view"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@settings(max_examples=1500)
@given(case=capture_cases())
def test_capture_matches_layout_definition(backend, case):
    check_case(backend, case)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@settings(max_examples=300)
@given(case=capture_cases(**GPU_CASES))
def test_capture_matches_layout_definition_gpu(backend, case):
    check_case(backend, case)


@pytest.mark.parametrize("layout", list(BatchLayout))
def test_each_layout_example(layout):
    """One hand-checked example per layout (documents the diagrams in moe_ops.layout)."""
    buf = torch.full((4, 2, 1), POISON, dtype=torch.int32)
    counts = torch.tensor([2, 3], dtype=torch.int32)
    if layout == BatchLayout.SHARDED:
        ids = torch.tensor([[10], [11], [12], [-1], [20], [21], [22], [-1]], dtype=torch.int32)
        capture_routing(
            buf,
            ids,
            1,
            token_counts=counts,
            dp_rank=1,
            layout=layout,
            shard_sizes=torch.tensor([2, 2, 2, 2], dtype=torch.int32),
        )
        assert buf[:, 1, 0].tolist() == [20, 21, 22, POISON]
    elif layout == BatchLayout.GATHERED:
        ids = torch.tensor([[10], [11], [-1], [20], [21], [22]], dtype=torch.int32)
        capture_routing(
            buf,
            ids,
            1,
            token_counts=counts,
            dp_rank=1,
            layout=layout,
            shard_sizes=torch.tensor([3, 3], dtype=torch.int32),
        )
        assert buf[:, 1, 0].tolist() == [20, 21, 22, POISON]
    else:
        ids = torch.tensor([[20], [21], [22], [-1]], dtype=torch.int32)
        capture_routing(buf, ids, 1, token_counts=counts, dp_rank=1, layout=layout)
        assert buf[:, 1, 0].tolist() == [20, 21, 22, POISON]
    assert (buf[:, 0] == POISON).all(), "another layer was touched"


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=300)
@given(case=capture_cases(**GPU_CASES), extra=st.integers(1, 40), negative=st.booleans())
def test_inconsistent_counts_are_clamped_and_recorded(backend, case, extra, negative):
    """A count larger than the rows available (or negative) must not read or write out of bounds."""
    impl, device = backend
    _skip_unavailable(impl, device)
    buffer, topk_ids, counts, sizes = case.tensors(device)
    before = buffer.clone()
    bad = -extra if negative else case.c + case.max_tokens + topk_ids.shape[0] + extra
    if case.counts_view == "expanded":
        counts = counts.clone()  # one element cannot take one rank's bad count
    counts[case.dp_rank] = bad
    moe_ops.check_capture_errors(device, raise_error=False)  # start from a clean counter
    errors = run_capture(impl, case, buffer, topk_ids, counts, sizes)
    report = FaultReport.of(errors.tolist())
    calls, flags = report.calls, report.flags
    assert calls == 1
    if negative:
        assert flags & FAULT_NEGATIVE_COUNT
        assert torch.equal(buffer, before), "a negative count must write nothing"
    else:
        assert flags & (FAULT_SOURCE_SHORT | FAULT_DEST_SHORT)
        # what was written is exactly the clamped window, in place
        c_eff = min(topk_ids.shape[0] - case.start, case.max_tokens)
        c_eff = max(c_eff, 0)
        exp = before.clone()
        src = topk_ids[case.start : case.start + c_eff].to(torch.int64)
        # the overflowing window reaches padding rows (PAD_ID < 0): a negative id is stored as -1
        exp[:c_eff, case.layer_id] = torch.where(src < 0, -1, src).to(exp.dtype)
        assert torch.equal(buffer, exp)
        assert report.bad_ids == int((src < 0).sum())
    if impl == "op":
        with pytest.raises(CaptureFaultError, match="clamped"):
            moe_ops.check_capture_errors(device)
        assert moe_ops.check_capture_errors(device) == 0, "reset=True must zero the counter"


def test_negative_shard_size_is_recorded():
    buf = torch.full((4, 1, 1), POISON, dtype=torch.int32)
    ids = torch.arange(6, dtype=torch.int32)[:, None]
    counts = torch.tensor([1, 2], dtype=torch.int32)
    moe_ops.check_capture_errors("cpu", raise_error=False)
    capture_routing(
        buf,
        ids,
        0,
        token_counts=counts,
        dp_rank=1,
        layout=BatchLayout.GATHERED,
        shard_sizes=torch.tensor([-3, 2], dtype=torch.int32),
    )
    report = FaultReport.of(moe_ops.capture_error_counter("cpu").tolist())
    calls, flags = report.calls, report.flags
    assert calls == 1 and flags & FAULT_BAD_OFFSET
    assert buf[:2, 0, 0].tolist() == [0, 1]  # start clamped to 0
    moe_ops.check_capture_errors("cpu", raise_error=False)


def test_no_retrace_per_layer_or_count():
    """Layer ids, counts and ranks are runtime values: changing them compiles nothing new."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    skip_unless_triton_runs(device)
    from moe_ops.capture import kernels

    kern = kernels._capture_rows_kernel
    buf = torch.full((64, 8, 4), POISON, dtype=torch.int32, device=device)
    errors = torch.zeros(FAULT_SLOTS, dtype=torch.int32, device=device)
    stamps = torch.full((8,), -1, dtype=torch.int32, device=device)
    step = torch.ones(1, dtype=torch.int32, device=device)
    ids = torch.randint(0, 8, (48, 4), dtype=torch.int32, device=device)
    counts = torch.tensor([48, 40], dtype=torch.int32, device=device)

    def variants() -> int:
        if not hasattr(kern, "device_caches"):  # interpreted Triton compiles nothing
            return 0
        return len(kern.device_caches[device.index or 0][0])

    none = torch.empty(0, dtype=torch.float32, device=device)  # no weights
    no_map = torch.empty(0, dtype=torch.int32, device=device)  # no expert map
    capture_rows_triton(buf, ids, none, none, counts, counts, errors, stamps, step, no_map, 0, 0, 0, 0)
    before = variants()
    for layer in range(8):
        for live in ([48, 40], [3, 5], [17, 0], [0, 9]):
            counts.copy_(torch.tensor(live, dtype=torch.int32))
            capture_rows_triton(
                buf, ids, none, none, counts, counts, errors, stamps, step, no_map, layer, 0, 0, 0
            )
            assert torch.equal(buf[: live[0], layer], ids[: live[0]])
    assert variants() == before, f"{variants() - before} new compiled variants for new layers/counts"


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (lambda a: a.update(buffer=a["buffer"].float()), ValueError, "buffer must be int16, int32 or int64"),
        (lambda a: a.update(buffer=a["buffer"][0]), ValueError, "buffer must be 3-D"),
        (
            lambda a: a.update(topk_ids=a["topk_ids"].float()),
            ValueError,
            "topk_ids must have an integer dtype",
        ),
        (lambda a: a.update(topk_ids=a["topk_ids"][0]), ValueError, "topk_ids must be 2-D"),
        (lambda a: a.update(topk_ids=a["topk_ids"][:, :2]), ValueError, "top_k=2 columns"),
        (lambda a: a.update(layer_id=3), IndexError, r"layer_id must be in \[0, 3\)"),
        (lambda a: a.update(layer_id=-1), IndexError, "layer_id"),
        (lambda a: a.update(token_counts=a["token_counts"].long()), ValueError, "token_counts must be int32"),
        (lambda a: a.update(token_counts=a["token_counts"][None]), ValueError, "token_counts must be 1-D"),
        (lambda a: a.update(dp_rank=2), ValueError, r"dp_rank must be an int in \[0, 2\)"),
        (lambda a: a.update(layout=7), ValueError, "layout must be a BatchLayout"),
        (lambda a: a.update(layout=BatchLayout.SHARDED), ValueError, "SHARDED needs shard_sizes"),
        (
            lambda a: a.update(layout=BatchLayout.SHARDED, shard_sizes=torch.ones(3, dtype=torch.int32)),
            ValueError,
            "multiple of dp_size=2",
        ),
        (
            lambda a: a.update(layout=BatchLayout.GATHERED, shard_sizes=torch.ones(3, dtype=torch.int32)),
            ValueError,
            "shard_sizes must have a positive multiple of dp_size=2",
        ),
        (
            lambda a: a.update(shard_sizes=torch.ones(2, dtype=torch.int32)),
            ValueError,
            "shard_sizes is only used by GATHERED and SHARDED",
        ),
        (
            lambda a: a.update(buffer=a["buffer"][:4]),
            ValueError,
            "buffer has 4 rows but the LOCAL batch has 6",
        ),
        # not a ProcessGroup: a TypeError naming tp_group, whatever the layout (a real group given
        # to a layout that does not use it: test_bad_process_group_arguments_raise_type_errors_gloo)
        (
            lambda a: a.update(tp_group=object()),
            TypeError,
            "tp_group must be a torch.distributed.ProcessGroup or None, got object",
        ),
        (
            lambda a: a.update(layout=BatchLayout.SEQUENCE_PARALLEL, tp_group=object()),
            TypeError,
            "tp_group must be a torch.distributed.ProcessGroup or None, got object",
        ),
        (
            lambda a: a.update(layout=BatchLayout.SEQUENCE_PARALLEL, tp_group=2),
            TypeError,
            "tp_group must be a torch.distributed.ProcessGroup or None, got int",
        ),
    ],
)
def test_bad_input_raises_and_leaves_buffer_untouched(mutate, exc, match):
    buffer = torch.full((8, 3, 4), POISON, dtype=torch.int32)
    args = dict(
        buffer=buffer,
        topk_ids=torch.zeros(6, 4, dtype=torch.int32),
        layer_id=0,
        token_counts=torch.tensor([2, 3], dtype=torch.int32),
        dp_rank=1,
        layout=BatchLayout.LOCAL,
        shard_sizes=None,
        tp_group=None,
    )
    mutate(args)
    passed = args.pop("buffer")
    before = passed.clone()
    with pytest.raises(exc, match=match):
        capture_routing(passed, args.pop("topk_ids"), args.pop("layer_id"), **args)
    assert (buffer == POISON).all() and torch.equal(passed, before), "a rejected call wrote to the buffer"


@pytest.mark.gpu
def test_device_mismatch_raises(cuda_device):
    buffer = torch.full((8, 2, 2), POISON, dtype=torch.int32, device=cuda_device)
    ids = torch.zeros(4, 2, dtype=torch.int32)
    counts = torch.tensor([2], dtype=torch.int32, device=cuda_device)
    with pytest.raises(ValueError, match="topk_ids must be on the buffer's device"):
        capture_routing(buffer, ids, 0, token_counts=counts)
    with pytest.raises(ValueError, match="token_counts must be on the buffer's device"):
        capture_routing(buffer, ids.to(cuda_device), 0, token_counts=counts.cpu())
    assert (buffer == POISON).all()


def test_opcheck_cpu():
    buf = torch.full((8, 3, 4), POISON, dtype=torch.int32)
    ids = torch.randint(0, 64, (10, 4), dtype=torch.int32)
    counts = torch.tensor([3, 5], dtype=torch.int32)
    errors = torch.zeros(FAULT_SLOTS, dtype=torch.int32)
    stamps = torch.full((3,), -1, dtype=torch.int32)
    step = torch.ones(1, dtype=torch.int32)
    weights = torch.rand(10, 4)
    wbuf = torch.full((8, 3, 4), float("nan"), dtype=torch.bfloat16)
    expert_map = torch.arange(64, dtype=torch.int64) % 48  # 64 physical slots on 48 logical experts
    # GATHERED, rank 1 of 2: sizes = counts, one entry before this rank
    torch.library.opcheck(
        torch.ops.moe_ops.capture_routing_.default,
        (buf, ids, weights, wbuf, counts, counts, errors, stamps, step, expert_map, 1, 1, 1, 48),
    )


DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _reference_case(device, seed):
    gen = torch.Generator().manual_seed(seed)
    buf = torch.full((8, 3, 4), POISON, dtype=torch.int32)
    ids = torch.randint(-2, 70, (10, 4), dtype=torch.int32, generator=gen)  # out-of-range ids too
    counts = torch.randint(0, 9, (2,), dtype=torch.int32, generator=gen)
    sizes = torch.randint(0, 6, (4,), dtype=torch.int32, generator=gen)
    errors = torch.zeros(FAULT_SLOTS, dtype=torch.int32)
    stamps = torch.full((3,), -1, dtype=torch.int32)
    step = torch.full((1,), 7, dtype=torch.int32)
    weights = torch.randn(10, 4, generator=gen)
    wbuf = torch.full((8, 3, 4), float("nan"), dtype=torch.bfloat16)  # poison: NaN, no weight
    if seed % 2:
        # an EPLB map of 40 physical slots on 32 logical experts, two entries outside the range:
        # ids >= 40 are bad ids, ids on those two slots bad map entries
        expert_map = torch.randint(0, 32, (40,), dtype=torch.int32, generator=gen)
        expert_map[[5, 17]] = torch.tensor([-1, 32], dtype=torch.int32)
        n_logical = 32
    else:
        expert_map, n_logical = torch.empty(0, dtype=torch.int32), 0  # no map
    tensors = [
        t.to(device) for t in (buf, ids, weights, wbuf, counts, sizes, errors, stamps, step, expert_map)
    ]
    return tensors, (2, 1, 2, n_logical)  # SHARDED, rank 1 of 2 with 2 shards each: two sizes before its rows


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(6))
def test_reference_op_writes_what_the_kernel_op_writes(device, seed):
    """``capture_routing_reference_`` (the twin, on every device) and ``capture_routing_`` (the
    Triton kernel on CUDA or interpreted, the twin otherwise) write the same rows, stamps and
    faults, and bfloat16 weights (bit for bit), counts over and under the buffer included; odd
    seeds through an EPLB expert map."""
    (buf, ids, weights, wbuf, counts, sizes, errors, stamps, step, emap), ints = _reference_case(device, seed)
    ref = [t.clone() for t in (buf, wbuf, errors, stamps)]
    torch.ops.moe_ops.capture_routing_(
        buf, ids, weights, wbuf, counts, sizes, errors, stamps, step, emap, *ints
    )
    torch.ops.moe_ops.capture_routing_reference_(
        ref[0], ids, weights, ref[1], counts, sizes, ref[2], ref[3], step, emap, *ints
    )
    for got, want in zip(
        (buf, wbuf.view(torch.int16), errors, stamps), (ref[0], ref[1].view(torch.int16), *ref[2:])
    ):
        assert torch.equal(got, want)
    assert (stamps == 7).any()  # the layer was stamped: the case is not vacuous
    torch.library.opcheck(
        torch.ops.moe_ops.capture_routing_reference_.default,
        (buf, ids, weights, wbuf, counts, sizes, errors, stamps, step, emap, *ints),
    )


@pytest.mark.gpu
def test_opcheck_cuda(cuda_device):
    buf = torch.full((8, 3, 4), POISON, dtype=torch.int32, device=cuda_device)
    ids = torch.randint(0, 64, (10, 4), dtype=torch.int32, device=cuda_device)
    counts = torch.tensor([3, 5], dtype=torch.int32, device=cuda_device)
    sizes = torch.tensor([2, 3, 2, 3], dtype=torch.int32, device=cuda_device)
    errors = torch.zeros(FAULT_SLOTS, dtype=torch.int32, device=cuda_device)
    stamps = torch.full((3,), -1, dtype=torch.int32, device=cuda_device)
    step = torch.ones(1, dtype=torch.int32, device=cuda_device)
    weights = torch.rand(10, 4, device=cuda_device)
    wbuf = torch.full((8, 3, 4), float("nan"), dtype=torch.float16, device=cuda_device)
    expert_map = torch.arange(64, dtype=torch.int32, device=cuda_device) % 48
    # SHARDED, rank 1 of 2 with 2 shards each: two entries before this rank
    torch.library.opcheck(
        torch.ops.moe_ops.capture_routing_.default,
        (buf, ids, weights, wbuf, counts, sizes, errors, stamps, step, expert_map, 2, 1, 2, 48),
    )


@pytest.mark.parametrize("layer_id", [3, -1])
def test_one_layer_check_for_the_target_and_the_monolithic_experts(layer_id):
    """A layer outside the buffer raises one error wherever it is checked: the target's, and the
    monolithic experts' check before any target is built (which raised a plain ValueError where the
    target raised IndexError). It is both an IndexError and a ValueError."""
    from moe_ops import LayerCapture, MoEDispatchConfig, RoutingReplayExperts
    from moe_ops.capture import CaptureTarget, LayerIndexError

    buffer = torch.full((8, 3, 2), POISON, dtype=torch.int32)
    counts = torch.tensor([4], dtype=torch.int32)
    with pytest.raises(LayerIndexError, match=r"layer_id must be in \[0, 3\) for this buffer") as from_target:
        CaptureTarget(buffer, layer_id, token_counts=counts)
    experts = RoutingReplayExperts(MoEDispatchConfig(max_num_tokens=8, top_k=2))
    state = type("State", (), dict(buffer=buffer, token_counts=counts, dp_rank=0, shard_sizes=None))()
    with pytest.raises(LayerIndexError) as from_experts:
        experts.set_capture_fn(LayerCapture(state, layer_id))
    assert str(from_experts.value) == str(from_target.value)
    assert isinstance(from_target.value, IndexError) and isinstance(from_target.value, ValueError)
    assert experts.capture_fn is None and (buffer == POISON).all()


def test_monolithic_experts_validate_their_target_once_when_bound():
    """set_capture_fn builds and validates the experts' target (here: a dp_rank outside the counts,
    which used to pass the binding and fail at the first capture); each capture then checks only
    the ids and writes this rank's rows."""
    from moe_ops import LayerCapture, MoEDispatchConfig, RoutingReplayExperts

    buffer = torch.full((8, 2, 2), POISON, dtype=torch.int32)
    experts = RoutingReplayExperts(
        MoEDispatchConfig(max_num_tokens=4, top_k=2, dp_size=2, layout=BatchLayout.GATHERED)
    )
    make = type("State", (), {})

    def state(counts, dp_rank):
        s = make()
        s.buffer, s.token_counts, s.dp_rank, s.shard_sizes = buffer, counts, dp_rank, None
        return s

    with pytest.raises(ValueError, match=r"dp_rank must be an int in \[0, 1\)"):
        experts.set_capture_fn(LayerCapture(state(torch.tensor([3], dtype=torch.int32), 1), 1))
    assert experts.capture_fn is None
    counts = torch.tensor([3, 2], dtype=torch.int32)
    experts.set_capture_fn(LayerCapture(state(counts, 1), 1))
    ids = torch.arange(10, dtype=torch.int16).reshape(5, 2)  # rank 0's 3 rows, then rank 1's 2
    experts.capture_routing_replay(ids)
    assert torch.equal(buffer[:2, 1], ids[3:5].to(torch.int32)) and (buffer[2:, 1] == POISON).all()
    assert (buffer[:, 0] == POISON).all()
    counts[0], counts[1] = 1, 3  # live counts: the same target reads them at the next call
    experts.capture_routing_replay(ids[:4])
    assert torch.equal(buffer[:3, 1], ids[1:4].to(torch.int32))
    with pytest.raises(ValueError, match="top_k=1 columns"):
        experts.capture_routing_replay(ids[:, :1])
