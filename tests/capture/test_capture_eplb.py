"""EPLB: the capture target's expert map (physical slot -> logical expert), applied inside the
capture kernel, so a caller that hands physical ids (a monolithic kernel routing over replicas, an
engine's own router after its balancer's mapping) records logical ids only.

The expected buffers are computed in the strategies with numpy indexing (16 logical experts on 20
physical slots), never with the library's twin; buffers are poisoned, and the buffer and the fault
counter (which bits, how many ids) are compared exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import (
    EPLB_LOGICAL,
    EPLB_PHYSICAL,
    GPU_CASES,
    POISON,
    eplb_cases,
    map_view,
    same_floats,
)

import moe_ops
from moe_ops import BatchLayout, route
from moe_ops.capture.errors import (
    FAULT_BAD_ID,
    FAULT_BAD_MAP,
    FAULT_SLOT,
    CaptureFaultError,
    FaultCounter,
    FaultReport,
)
from moe_ops.capture.monolithic import LayerCapture, MoEDispatchConfig, RoutingReplayExperts
from moe_ops.capture.op import capture_into
from moe_ops.capture.spec import CAPTURE_OP
from moe_ops.capture.target import CaptureTarget, no_weights
from moe_ops.graphs import CompileCounters
from moe_ops.router.methods import RoutingMethod


def _target_kw(case, counts, sizes) -> dict:
    return dict(token_counts=counts, dp_rank=case.dp_rank, layout=case.layout, shard_sizes=sizes)


def _expected_report(n_bad_ids: int, n_bad_map: int) -> FaultReport:
    flags = (FAULT_BAD_ID if n_bad_ids else 0) | (FAULT_BAD_MAP if n_bad_map else 0)
    return FaultReport(calls=0, flags=flags, bad_ids=n_bad_ids, bad_mapped=n_bad_map)


@pytest.mark.parametrize("op", ["capture_routing_", "capture_routing_reference_"])
@settings(max_examples=40, deadline=None)
@given(ecase=eplb_cases(weighted=True), with_weights=st.booleans())
def test_physical_ids_are_recorded_as_logical_ids(op, ecase, with_weights):
    """Every layout, id/count/buffer view, map view (a row of a (layers, P) map, strided, sliced,
    expanded), int32/int64 map and int16/int32/int64 buffer: the buffer holds map[id], -1 where the
    id is outside the 20 slots (FAULT_BAD_ID) or its entry outside the 16 experts (FAULT_BAD_MAP),
    POISON elsewhere; weights (when recorded) are the ids' weights, untouched by the map."""
    case = ecase.case
    buffer, topk_ids, counts, sizes = case.tensors("cpu")
    expert_map = ecase.expert_map("cpu")
    map_before = expert_map.clone()
    counter = FaultCounter("cpu")
    wcase = ecase.weights
    wbuf, topk_weights = wcase.tensors("cpu") if with_weights else (None, None)
    w_before = wbuf.clone() if with_weights else None
    expected, n_bad_ids, n_bad_map = ecase.expected(buffer.clone())
    target = CaptureTarget(
        buffer,
        case.layer_id,
        fault_counter=counter,
        weights_buffer=wbuf,
        expert_map=expert_map,
        num_logical_experts=EPLB_LOGICAL,
        **_target_kw(case, counts, sizes),
    )
    weights_arg = topk_weights if with_weights else no_weights(buffer)
    getattr(torch.ops.moe_ops, op)(*CAPTURE_OP.join((topk_ids, weights_arg), target.spec))
    assert torch.equal(buffer, expected), (
        f"{case.layout.name} map {ecase.map_view} {ecase.map_dtype}: buffer is not the logical ids\n"
        f"got {buffer[:, case.layer_id].tolist()}\nwant {expected[:, case.layer_id].tolist()}"
    )
    assert counter.read_and_reset() == _expected_report(n_bad_ids, n_bad_map)
    assert torch.equal(expert_map, map_before), "the map was written"
    if with_weights:
        assert same_floats(wbuf, wcase.expected(w_before)), "the map changed the weights"


@settings(max_examples=25, deadline=None)
@given(ecase=eplb_cases(views=False))
def test_capture_routing_takes_the_map_as_keywords(ecase):
    """The public function: expert_map / num_logical_experts as keywords, same record."""
    case = ecase.case
    buffer, topk_ids, counts, sizes = case.tensors("cpu")
    counter = FaultCounter("cpu")
    expected, n_bad_ids, n_bad_map = ecase.expected(buffer.clone())
    moe_ops.capture_routing(
        buffer,
        topk_ids,
        case.layer_id,
        fault_counter=counter,
        expert_map=ecase.expert_map("cpu"),
        num_logical_experts=EPLB_LOGICAL,
        **_target_kw(case, counts, sizes),
    )
    assert torch.equal(buffer, expected)
    assert counter.read_and_reset() == _expected_report(n_bad_ids, n_bad_map)


def test_fault_report_names_the_map():
    """FAULT_BAD_MAP has its own slot (6 of 8) and message; a check raises naming both counts."""
    assert FAULT_SLOT[FAULT_BAD_MAP] == 6 and FAULT_SLOT[FAULT_BAD_ID] == 5
    buffer = torch.full((4, 1, 2), POISON, dtype=torch.int32)
    counter = FaultCounter("cpu")
    expert_map = torch.tensor([0, 1, 16, 3], dtype=torch.int32)  # slot 2: outside 4 logical... 16
    ids = torch.tensor([[0, 2], [4, 3]], dtype=torch.int32)  # 2 -> 16 (bad map), 4 (bad id)
    moe_ops.capture_routing(
        buffer,
        ids,
        0,
        token_counts=torch.tensor([2], dtype=torch.int32),
        fault_counter=counter,
        expert_map=expert_map,
        num_logical_experts=4,
    )
    assert buffer[:2, 0].tolist() == [[0, -1], [-1, 3]] and (buffer[2:] == POISON).all()
    with pytest.raises(
        CaptureFaultError, match=r"1 expert id\(s\) on cpu mapped outside the logical experts"
    ):
        counter.check()
    assert counter.peek().total == 0


# ------------------------------------------------------------------ the map changes between steps


def _step_inputs(device):
    """A GATHERED step of 2 ranks (this one rank 1, 5 of 6 rows real) over the 20 slots."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, EPLB_PHYSICAL, (12, 4), dtype=torch.int32, generator=gen).to(device)
    counts = torch.tensor([6, 5], dtype=torch.int32, device=device)
    return ids, counts


def _maps(n: int) -> list[np.ndarray]:
    """``n`` placements a balancer moves between (valid, each logical expert placed)."""
    rng = np.random.default_rng(1)
    base = np.concatenate([np.arange(EPLB_LOGICAL), np.array([0, 5, 5, 9])])
    return [rng.permutation(base) for _ in range(n)]


def _logical(ids: torch.Tensor, placement: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(placement[ids.cpu().numpy()]).to(torch.int32)


def test_compiled_capture_reads_the_map_in_place_without_recompiling():
    """torch.compile (CPU, fullgraph): one graph; the map rewritten IN PLACE between calls (the
    balancer moved experts) is what each call records through."""
    ids, counts = _step_inputs("cpu")
    buffer = torch.full((8, 2, 4), POISON, dtype=torch.int32)
    expert_map = torch.zeros(EPLB_PHYSICAL, dtype=torch.int64)
    counter = FaultCounter("cpu")
    target = CaptureTarget(
        buffer,
        1,
        token_counts=counts,
        dp_rank=1,
        layout=BatchLayout.GATHERED,
        fault_counter=counter,
        expert_map=expert_map,
        num_logical_experts=EPLB_LOGICAL,
    )

    def step(topk_ids):
        capture_into(target, topk_ids)

    compiled = torch.compile(step, fullgraph=True)
    with CompileCounters() as cc:
        for placement in _maps(4):
            expert_map.copy_(torch.from_numpy(placement))
            buffer.fill_(POISON)
            compiled(ids)
            expected = torch.full_like(buffer, POISON)
            expected[:5, 1] = _logical(ids[6:11], placement)
            assert torch.equal(buffer, expected), "the compiled step did not record through this step's map"
    assert cc.graphs <= 1, f"recompiled {cc.graphs} times for an in-place map update"
    assert cc.graph_breaks == 0
    assert counter.check() == 0


@pytest.mark.gpu
def test_cuda_graph_replays_record_logical_ids_under_each_steps_map(cuda_device):
    """One CUDA graph captured once; between replays the balancer rewrites the map in place (and
    the live counts change): each replay records the logical ids under that step's map."""
    ids, counts = _step_inputs(cuda_device)
    buffer = torch.full((8, 2, 4), POISON, dtype=torch.int32, device=cuda_device)
    # a row of a (num_moe_layers, P) map, as vLLM keeps it
    layers = torch.zeros(3, EPLB_PHYSICAL, dtype=torch.int64, device=cuda_device)
    expert_map = layers[2]
    counter = FaultCounter(cuda_device)
    target = CaptureTarget(
        buffer,
        1,
        token_counts=counts,
        dp_rank=1,
        layout=BatchLayout.GATHERED,
        fault_counter=counter,
        expert_map=expert_map,
        num_logical_experts=EPLB_LOGICAL,
    )
    expert_map.copy_(torch.arange(EPLB_PHYSICAL) % EPLB_LOGICAL)
    capture_into(target, ids)  # warm-up: compiles the kernel
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        capture_into(target, ids)
    for placement, live in zip(_maps(5), ([6, 5], [6, 0], [0, 6], [6, 3], [6, 6])):
        expert_map.copy_(torch.from_numpy(placement))
        counts.copy_(torch.tensor(live, dtype=torch.int32))
        buffer.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        expected = torch.full_like(buffer, POISON)
        # GATHERED: rank 1's rows start after rank 0's live rows
        expected[: live[1], 1] = _logical(ids[live[0] : live[0] + live[1]], placement).to(cuda_device)
        assert torch.equal(buffer, expected), f"replay with counts {live}"
    assert counter.check() == 0


@pytest.mark.gpu
# cuda_device is a constant (the device), not state a drawn input could leak into
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ecase=eplb_cases(**GPU_CASES))
def test_kernel_records_logical_ids_on_cuda(cuda_device, ecase):
    case = ecase.case
    buffer, topk_ids, counts, sizes = case.tensors(cuda_device)
    counter = FaultCounter(cuda_device)
    expected, n_bad_ids, n_bad_map = ecase.expected(buffer.clone())
    target = CaptureTarget(
        buffer,
        case.layer_id,
        fault_counter=counter,
        expert_map=ecase.expert_map(cuda_device),
        num_logical_experts=EPLB_LOGICAL,
        **_target_kw(case, counts, sizes),
    )
    capture_into(target, topk_ids)
    assert torch.equal(buffer, expected)
    assert counter.read_and_reset() == _expected_report(n_bad_ids, n_bad_map)


# ------------------------------------------------------------------ routers and the monolithic contract


def test_route_refuses_a_target_with_a_map():
    """route records the logical ids it chooses: a map would be applied to ids that are not
    physical. Refused before anything is written."""
    buffer = torch.full((8, 2, 4), POISON, dtype=torch.int32)
    target = CaptureTarget(
        buffer,
        0,
        token_counts=torch.tensor([6], dtype=torch.int32),
        expert_map=torch.arange(EPLB_PHYSICAL, dtype=torch.int32) % EPLB_LOGICAL,
        num_logical_experts=EPLB_LOGICAL,
    )
    logits = torch.randn(6, EPLB_LOGICAL)
    with pytest.raises(
        ValueError, match="route records the logical ids it chooses; expert_map maps physical"
    ):
        route(logits, 4, RoutingMethod.RENORMALIZE, capture=target)
    assert (buffer == POISON).all()


class _State:
    """A capture state as a serving engine holds it (moe_ops.capture.protocol's state members)."""

    def __init__(self, buffer: torch.Tensor, counts: torch.Tensor):
        self.buffer, self.token_counts, self.dp_rank, self.shard_sizes = buffer, counts, 1, None
        if counts.shape[0] == 1:
            self.dp_rank = 0
        self.fault_counter = FaultCounter("cpu")


class _ReplicaKernelExperts(RoutingReplayExperts):
    """A monolithic kernel that routes over the 20 physical slots and writes them into
    routing_replay_out (what a kernel without an EPLB map inside it does when its logits are over
    replicas)."""

    kernel_name = "replica_kernel"
    monolithic = True

    def supports_routing_replay_capture(self) -> bool:
        return True

    def forward(self, physical_ids: torch.Tensor) -> None:
        replay = self.routing_replay_out(physical_ids.shape[0], physical_ids.device)
        if replay is not None:
            replay.copy_(physical_ids)  # the kernel's write
        self.capture_routing_replay(replay)


@pytest.mark.parametrize("layout", [BatchLayout.LOCAL, BatchLayout.GATHERED], ids=lambda v: v.name)
def test_monolithic_contract_records_logical_ids(layout):
    """MoEDispatchConfig's expert_map (a row of a (layers, P) map) reaches the target the experts
    build: capture_routing_replay records logical ids, through the map as it is at each call."""
    dp, rows = 2, 6
    counts = torch.tensor([rows, 5], dtype=torch.int32)
    # a serving engine's capture state: the four state members, its own fault counter
    capturer = _State(torch.full((rows * dp, 2, 4), POISON, dtype=torch.int32), counts)
    layers = torch.zeros(2, EPLB_PHYSICAL, dtype=torch.int32)
    config = MoEDispatchConfig(
        max_num_tokens=rows,
        top_k=4,
        dp_size=dp,
        layout=layout,
        expert_map=layers[1],
        num_logical_experts=EPLB_LOGICAL,
    )
    experts = _ReplicaKernelExperts(config)
    experts.set_capture_fn(LayerCapture(capturer=capturer, layer_id=1))
    n = rows if layout == BatchLayout.LOCAL else rows * dp
    start = 0 if layout == BatchLayout.LOCAL else rows
    physical = torch.randint(0, EPLB_PHYSICAL, (n, 4), dtype=torch.int16)
    for placement in _maps(3):
        layers[1].copy_(torch.from_numpy(placement))
        capturer.buffer.fill_(POISON)
        experts.forward(physical)
        expected = torch.full_like(capturer.buffer, POISON)
        expected[:5, 1] = _logical(physical[start : start + 5].to(torch.int64), placement).to(
            capturer.buffer.dtype
        )
        assert torch.equal(capturer.buffer, expected)
    assert capturer.fault_counter.check() == 0


def test_monolithic_config_map_is_checked_when_capture_is_bound():
    config = MoEDispatchConfig(max_num_tokens=4, top_k=2, expert_map=torch.zeros(20, dtype=torch.int32))
    capturer = _State(torch.full((4, 1, 2), POISON, dtype=torch.int32), torch.tensor([4], dtype=torch.int32))
    experts = _ReplicaKernelExperts(config)
    with pytest.raises(ValueError, match="num_logical_experts is required with expert_map"):
        experts.set_capture_fn(LayerCapture(capturer=capturer, layer_id=0))
    assert experts.capture_fn is None and experts.replay_scratch is None


def test_routing_capturer_takes_a_layers_map_row():
    """RoutingCapturer.capture(..., expert_map=row of a (num_moe_layers, P) map): logical ids in
    the layer's buffer column, the map's faults in the capturer's own counter."""
    shape = moe_ops.RoutingShape(num_layers=2, num_experts=EPLB_LOGICAL, top_k=2, moe_layers=(1, 2))
    capturer = moe_ops.RoutingCapturer(shape, max_num_tokens=4, device="cpu")
    capturer.set_step([3])
    layers = torch.from_numpy(np.stack(_maps(2)))  # (num_moe_layers, P) int64
    layers[1, 7] = EPLB_LOGICAL  # a bad entry
    physical = torch.tensor([[0, 19], [7, 3], [1, 1]], dtype=torch.int32)
    capturer.buffer.fill_(POISON)
    capturer.capture(2, physical, expert_map=layers[1], num_logical_experts=EPLB_LOGICAL)
    want = torch.from_numpy(layers[1].numpy()[physical.numpy()]).to(torch.int32)
    want[1, 0] = -1
    column = capturer.buffer[:3, 1]  # model layer 2 is MoE layer 1
    assert torch.equal(column, want) and (capturer.buffer[:, 0] == POISON).all()
    assert (capturer.buffer[3:] == POISON).all()
    with pytest.raises(CaptureFaultError, match="1 expert id"):
        capturer.check_errors()


# ------------------------------------------------------------------ bad arguments


def _build(**kw):
    buffer = torch.full((4, 2, 2), POISON, dtype=kw.pop("dtype", torch.int32))
    return CaptureTarget(buffer, 0, token_counts=torch.tensor([2], dtype=torch.int32), **kw)


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        (
            dict(expert_map=torch.zeros(20), num_logical_experts=16),
            ValueError,
            "expert_map must be int32 or int64",
        ),
        (
            dict(expert_map=torch.zeros(2, 20, dtype=torch.int32), num_logical_experts=16),
            ValueError,
            r"expert_map must be 1-D \(P,\)",
        ),
        (
            dict(expert_map=torch.zeros(0, dtype=torch.int32), num_logical_experts=16),
            ValueError,
            "P >= 1",
        ),
        (
            dict(expert_map=torch.zeros(20, dtype=torch.int32, device="meta"), num_logical_experts=16),
            ValueError,
            "expert_map must be on the buffer's device cpu",
        ),
        (dict(expert_map=[0, 1], num_logical_experts=16), TypeError, "expert_map must be a torch.Tensor"),
        (dict(expert_map=torch.zeros(20, dtype=torch.int32)), ValueError, "num_logical_experts is required"),
        (
            dict(expert_map=torch.zeros(20, dtype=torch.int32), num_logical_experts=0),
            ValueError,
            "num_logical_experts must be >= 1, got 0",
        ),
        (
            dict(expert_map=torch.zeros(20, dtype=torch.int32), num_logical_experts=True),
            TypeError,
            "num_logical_experts must be an int",
        ),
        (
            dict(expert_map=torch.zeros(20, dtype=torch.int32), num_logical_experts=40000, dtype=torch.int16),
            ValueError,
            "num_logical_experts=40000 does not fit the buffer dtype torch.int16",
        ),
        (dict(num_logical_experts=16), ValueError, "num_logical_experts=16 given without expert_map"),
    ],
)
def test_bad_maps_are_refused_naming_the_argument(kw, error, match):
    with pytest.raises(error, match=match):
        _build(**kw)


def test_map_views_keep_their_values():
    """The strategies' map views (what the property test draws) carry the placement's values."""
    values = torch.from_numpy(_maps(1)[0])
    for kind in ("contiguous", "layer_row", "strided", "sliced"):
        view = map_view(values, kind)
        assert torch.equal(view, values), kind
        assert kind == "contiguous" or view.is_contiguous() is (kind != "strided")
    assert map_view(torch.full((20,), 7), "expanded").stride() == (0,)
