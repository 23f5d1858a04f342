"""DP, EP and SP capture (and replay) across real processes: moe_ops.distributed on torch.distributed.

Pools of 2 and 4 spawned ranks (tests/dist_launch.py; gloo on CPU, NCCL where GPUs exist) run every
hypothesis example as one task, so processes start once per module. Each task runs a case's steps
on every rank; the test process then checks every rank's capture buffer against the routing of
exactly that rank's real tokens, computed here from the rank-specific router inputs
(``strategies.dist_logits``), with padding rows poisoned.

``MOE_OPS_DIST_EXAMPLES`` sets the hypothesis examples per layout and world size (default 40).
"""

from __future__ import annotations

import dataclasses
import os
import re
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist_launch import RankFailure, close_pools, pool_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import (
    DIST_MAX_TOKENS,
    DIST_NUM_EXPERTS,
    DIST_TOP_K,
    POISON,
    DistCase,
    DistStep,
    dist_cases,
    dist_grids,
    dist_logits,
)

from benchmarks.cases import BENCH_CASES, BENCH_DIST_SHAPE
from moe_ops import (
    BatchLayout,
    RoutingCapturer,
    RoutingShape,
    capture_routing,
    replay_routing,
    route,
    routing_mismatch,
)
from moe_ops.distributed import (
    DistributedStep,
    ParallelLayout,
    ProcessGroups,
    StepPlan,
    gather_routing,
    scatter_routing,
)

EXAMPLES = int(os.environ.get("MOE_OPS_DIST_EXAMPLES", "40"))
# model layers 0 and 2 are MoE layers (buffer columns 0 and 1), layer 1 is dense
SHAPE = RoutingShape(2, DIST_NUM_EXPERTS, DIST_TOP_K, moe_layers=(0, 2), num_model_layers=3)
LAYOUTS = list(BatchLayout)
# a rollout's trainer sees other logits (the policy moved on): enough noise that live routing differs
TRAIN_NOISE = 0.5

needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with gloo is not available in this torch build",
)
slow_settings = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)


@pytest.fixture(scope="module", autouse=True)
def _stop_pools():
    yield
    close_pools()


def nccl_pool(world: int):
    """A pool of ``world`` NCCL ranks, one GPU each; skips with the reason when there are too few."""
    if not dist.is_nccl_available():
        pytest.skip("torch.distributed has no NCCL in this torch build")
    found = torch.cuda.device_count()
    if found < world:
        pytest.skip(f"needs {world} GPU(s) for {world} NCCL rank(s), found {found}")
    return pool_for(world, "nccl")


# ------------------------------------------------------------------ what runs on every rank

_GROUPS: dict[ParallelLayout, ProcessGroups] = {}


def _groups(parallel: ParallelLayout) -> ProcessGroups:
    """This rank's groups for ``parallel``, built once per rank process. Every rank runs the same
    tasks in the same order, so all of them build the same groups at the same point."""
    groups = _GROUPS.get(parallel)
    if groups is None:
        groups = _GROUPS[parallel] = ProcessGroups.build(parallel)
    return groups


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _capturer(parallel: ParallelLayout, groups: ProcessGroups) -> RoutingCapturer:
    return RoutingCapturer(
        SHAPE,
        DIST_MAX_TOKENS,
        _device(),
        dp_size=parallel.dp_size,
        dp_rank=groups.dp_rank,
        shards_per_rank=parallel.shards_per_rank,
    )


def _route_args(case: DistCase, device: torch.device) -> tuple:
    method, kwargs = case.route_args()
    return method, {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def _plan_summary(plan: StepPlan) -> tuple:
    return plan.padded, plan.local_rows, plan.local_sizes, plan.routed_rows


def _rollout(case: DistCase, compiled: bool = False) -> list[dict]:
    """Runs ``case``'s steps on this rank: plan (one per distinct padding), begin, route and
    capture every MoE layer. Returns per step this rank's capture buffer, the routed ids per layer,
    the fault count and the plan; ``compiled`` also reports what torch.compile counted."""
    from moe_ops.graphs import CompileCounters

    parallel = case.parallel
    groups = _groups(parallel)
    device = _device()
    capturer = _capturer(parallel, groups)
    step = DistributedStep(groups, capturer)
    method, kwargs = _route_args(case, device)
    d = groups.dp_rank

    def forward(plan, batches):
        return [
            step.route(plan, layer, step.shard(plan, batch), DIST_TOP_K, method, **kwargs)[1]
            for layer, batch in zip(SHAPE.moe_layers, batches)
        ]

    exchange = step.exchange
    if compiled:
        forward = torch.compile(forward, fullgraph=True, dynamic=False)
        exchange = torch.compile(exchange, fullgraph=True, dynamic=False)
    plans: dict[tuple[int, ...], StepPlan] = {}
    out = []
    with CompileCounters() as counters:
        for s, st_ in enumerate(case.steps):
            # the key is the whole step's padding, the same on every rank: all ranks plan together
            plan = plans.get(st_.padded)
            if plan is None:
                plan = plans[st_.padded] = step.plan(st_.padded[d])
            capturer.buffer.fill_(POISON)
            num_tokens = torch.tensor([st_.counts[d]], dtype=torch.int32, device=device)
            counts, sizes = exchange(plan, num_tokens)
            capturer.set_step(counts, sizes)
            batches = [dist_logits(case, s, d, layer).to(device) for layer in SHAPE.moe_layers]
            ids = forward(plan, batches)
            out.append(
                {
                    # a copy: on CPU .cpu() is the buffer itself, which the next step overwrites
                    "buffer": capturer.buffer.cpu().numpy().copy(),
                    "routed": [i.cpu().numpy() for i in ids],
                    "counts": counts.cpu().tolist(),
                    "sizes": None if sizes is None else sizes.cpu().tolist(),
                    "faults": capturer.check_errors(raise_error=False),
                    "plan": _plan_summary(plan),
                }
            )
    if compiled:
        out.append({"graph_breaks": counters.graph_breaks, "graphs": counters.graphs})
    return out


# ------------------------------------------------------------------ what the test process checks


def expected_ids(case: DistCase, step: int, dp_rank: int, layer: int) -> np.ndarray:
    """(c, top_k) ids of DP rank ``dp_rank``'s real tokens: its own rows routed alone, here."""
    c = case.steps[step].counts[dp_rank]
    method, kwargs = case.route_args()
    logits = dist_logits(case, step, dp_rank, layer)[:c]
    return route(logits, DIST_TOP_K, method, backend="torch", **kwargs)[1].numpy()


def expected_plan(parallel: ParallelLayout, padded: tuple[int, ...], dp_rank: int) -> tuple:
    """(padded, local_rows, local_sizes, routed_rows) from the layout definitions."""
    tp = parallel.tp_size
    chunks = [-(-p // tp) for p in padded]
    if parallel.layout == BatchLayout.GATHERED:
        return padded, padded[dp_rank], padded, sum(padded)
    if parallel.layout == BatchLayout.SHARDED:
        sizes = tuple(k for k in chunks for _ in range(tp))
        return padded, chunks[dp_rank], sizes, sum(sizes)
    if parallel.layout == BatchLayout.SEQUENCE_PARALLEL:
        return padded, chunks[dp_rank], (), chunks[dp_rank]
    return padded, padded[dp_rank], (), padded[dp_rank]


def routed_blocks(parallel: ParallelLayout, step: DistStep, dp_rank: int, tp_rank: int):
    """(first row in the routed ids, DP rank, first token, tokens) of every real block the router
    of rank (dp_rank, tp_rank) saw, from the layout definitions."""
    tp = parallel.tp_size
    if parallel.layout == BatchLayout.LOCAL:
        return [(0, dp_rank, 0, step.counts[dp_rank])]
    if parallel.layout == BatchLayout.SEQUENCE_PARALLEL:
        k = -(-step.padded[dp_rank] // tp)
        first = tp_rank * k
        return [(0, dp_rank, first, max(0, min(step.counts[dp_rank] - first, k)))]
    blocks, start = [], 0
    for i, (c, p) in enumerate(zip(step.counts, step.padded)):
        blocks.append((start, i, 0, c))
        start += p if parallel.layout == BatchLayout.GATHERED else tp * -(-p // tp)
    return blocks


def check_rollout(case: DistCase, results: list[list[dict]]) -> None:
    parallel = case.parallel
    for rank, steps in enumerate(results):
        dp_rank, tp_rank = parallel.ranks_of(rank)
        for s, got in enumerate(steps[: len(case.steps)]):
            step = case.steps[s]
            where = f"rank {rank} (d{dp_rank} t{tp_rank}), step {s}, {case}"
            c = step.counts[dp_rank]
            assert got["faults"] == 0, f"capture faults on {where}"
            assert got["counts"] == list(step.counts), f"exchanged counts on {where}"
            assert got["plan"] == expected_plan(parallel, step.padded, dp_rank), f"plan on {where}"
            if parallel.layout in (BatchLayout.GATHERED, BatchLayout.SHARDED):
                assert tuple(got["sizes"]) == got["plan"][2], f"device shard sizes on {where}"
            else:
                assert got["sizes"] is None
            for col, layer in enumerate(SHAPE.moe_layers):
                want = {i: expected_ids(case, s, i, layer) for i in range(parallel.dp_size)}
                buf = got["buffer"][:, col]
                assert np.array_equal(buf[:c], want[dp_rank]), f"captured rows, layer {layer}, {where}"
                assert (buf[c:] == POISON).all(), f"rows past the count written, layer {layer}, {where}"
                ids = got["routed"][col]
                assert ids.shape[0] == got["plan"][3], f"routed rows, layer {layer}, {where}"
                for first, i, token, n in routed_blocks(parallel, step, dp_rank, tp_rank):
                    assert np.array_equal(ids[first : first + n], want[i][token : token + n]), (
                        f"routed block of DP rank {i}, layer {layer}, {where}"
                    )


# ------------------------------------------------------------------ item 2: the launcher itself


def _misbehave(kind: str, culprit: int) -> str:
    """Rank ``culprit`` raises, dies or waits in a collective nobody else enters; the others return."""
    if dist.get_rank() == culprit:
        if kind == "raise":
            raise ValueError(f"rank {culprit} raised on purpose")
        if kind == "die":
            os._exit(3)
        dist.barrier()  # hang: the other ranks never join this barrier
    return "fine"


@needs_gloo
def test_launcher_reports_errors_deaths_and_hangs():
    """A rank's exception comes back with its traceback; a dead rank and a hung rank fail the task
    at once or at its deadline (the ranks are killed), never block the test process."""
    from dist_launch import RankPool

    pool = RankPool(2, collective_timeout=5)
    try:
        results = pool.run(_misbehave, "raise", 1, allow_errors=True)
        assert results[0] == "fine"
        assert isinstance(results[1], RankFailure) and results[1].type_name == "ValueError"
        assert "raised on purpose" in results[1].message and "_misbehave" in results[1].traceback
        assert pool.run(_misbehave, "none", -1) == ["fine", "fine"], "the pool serves on after an error"
        with pytest.raises(AssertionError, match=r"1 of 2 ranks raised:\n--- rank 0: ValueError"):
            pool.run(_misbehave, "raise", 0)
        assert pool.broken, "an unexpected error leaves the ranks out of step: the pool is dropped"
    finally:
        pool.close()
    for kind, pattern in [
        ("die", r"_misbehave: ranks \[1\] of 2 died"),
        ("hang", r"_misbehave: ranks \[1\] of 2 did not answer within 3 s .*were killed"),
    ]:
        pool = RankPool(2, collective_timeout=30)
        try:
            pool.run(_misbehave, "none", -1)  # the ranks import this module: not part of the deadline
            start = time.monotonic()
            with pytest.raises(AssertionError, match=pattern):
                pool.run(_misbehave, kind, 1, timeout=3)
            # a death is seen at once (0.06 s measured), a hang killed at the 3 s deadline (3.03 s):
            # the bound is the 30 s collective timeout they must not be left to
            assert time.monotonic() - start < 30, f"{kind}: the launcher waited for the collective timeout"
            assert pool.broken and not any(p.is_alive() for p in pool._procs), f"{kind}: a rank survived"
        finally:
            pool.close()


# ------------------------------------------------------------------ item 3: every layout


def _layout_id(layout: BatchLayout) -> str:
    return layout.name


def _parallel_id(p: ParallelLayout) -> str:
    return f"{p.layout.name}-dp{p.dp_size}-tp{p.tp_size}{'-ep' if p.use_ep else ''}"


@needs_gloo
@pytest.mark.parametrize("layout", LAYOUTS, ids=_layout_id)
@pytest.mark.parametrize("world", [1, 2, 4])
@slow_settings
@given(data=st.data())
def test_each_rank_captures_exactly_its_own_tokens_gloo(world, layout, data):
    case = data.draw(dist_cases(world, layout))
    check_rollout(case, pool_for(world).run(_rollout, case))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS, ids=_layout_id)
@pytest.mark.parametrize("world", [1, 2])
@settings(max_examples=max(EXAMPLES // 2, 1), deadline=None, database=None)
@given(data=st.data())
def test_each_rank_captures_exactly_its_own_tokens_nccl(world, layout, data):
    """The same on GPUs: one rank per GPU, NCCL collectives, the Triton router and capture."""
    pool = nccl_pool(world)
    case = data.draw(dist_cases(world, layout))
    check_rollout(case, pool.run(_rollout, case))


def _fixed_steps(dp: int) -> tuple[DistStep, ...]:
    counts = (0, 5, 17, 3)[:dp]
    return (
        DistStep(counts, tuple(min(c + 3, DIST_MAX_TOKENS) for c in counts)),  # per-rank padding
        DistStep(counts[::-1], (24,) * dp),  # every rank at one CUDA-graph size
        DistStep((7, 0, 24, 1)[:dp], (24,) * dp),  # the same plan again, new counts
        DistStep((0,) * dp, (0,) * dp),  # nobody has a token: no rank enters a dispatch gather
    )


@needs_gloo
@pytest.mark.parametrize(
    "parallel", [p for layout in LAYOUTS for p in dist_grids(4, layout)], ids=_parallel_id
)
def test_uneven_zero_and_padded_steps_gloo(parallel):
    """The named edge cases in every 4-rank layout, always run: uneven counts, a rank with no
    token, padding per rank and to one CUDA-graph size, a plan reused with new counts, an empty step."""
    for router in ("renormalize", "deepseek"):
        case = DistCase(parallel, _fixed_steps(parallel.dp_size), router, 11)
        check_rollout(case, pool_for(4).run(_rollout, case))


OVER_ROWS_GRIDS = [
    ParallelLayout(4, 1, layout=BatchLayout.LOCAL),
    ParallelLayout(2, 2, layout=BatchLayout.GATHERED),
    ParallelLayout(2, 2, use_ep=True, layout=BatchLayout.SHARDED),
    ParallelLayout(2, 2, layout=BatchLayout.SEQUENCE_PARALLEL),
]


@needs_gloo
@pytest.mark.parametrize("parallel", OVER_ROWS_GRIDS, ids=_parallel_id)
def test_a_count_above_its_rows_is_clamped_and_counted_gloo(parallel):
    """DP rank 1 claims 3 tokens more than its batch has rows. Its capture takes the rows that exist
    (not the next rank's: in GATHERED and SHARDED they follow in the same batch) and its ranks'
    fault counters report one clamped call; every other rank captures as usual and reports none."""
    dp = parallel.dp_size
    padded = (6, 4, 5, 7)[:dp]
    counts = (2, 7, 5, 0)[:dp]  # DP rank 1: 7 tokens in 4 rows
    case = DistCase(parallel, (DistStep(counts, padded),), "renormalize", 2)
    results = pool_for(4).run(_rollout, case)
    for rank, steps in enumerate(results):
        d, _ = parallel.ranks_of(rank)
        got = steps[0]
        c = min(counts[d], padded[d])
        assert got["counts"] == [min(x, p) for x, p in zip(counts, padded)], f"rank {rank}"
        assert got["faults"] == (1 if d == 1 else 0), f"rank {rank}: {got['faults']} faults"
        for col, layer in enumerate(SHAPE.moe_layers):
            want = route(dist_logits(case, 0, d, layer)[:c], DIST_TOP_K, backend="torch")[1].numpy()
            assert np.array_equal(got["buffer"][:c, col], want), f"rank {rank} layer {layer}"
            assert (got["buffer"][c:, col] == POISON).all(), f"rank {rank} layer {layer}"


def test_clamped_counts_are_counted_losslessly_under_concurrent_checks():
    """The exchange's clamp op adds to the capturer's fault counter while another thread reads and
    resets it (``check_errors``): every clamped call is reported exactly once."""
    import threading

    from moe_ops.capture.errors import FaultCounter

    counter = FaultCounter("cpu")
    rows = torch.tensor([4, 6], dtype=torch.int32)
    over, fine = torch.tensor([2, 9], dtype=torch.int32), torch.tensor([3, 1], dtype=torch.int32)
    out = torch.empty(2, dtype=torch.int32)
    calls, seen, done = 400, [], threading.Event()

    def checker():
        while not done.is_set():
            seen.append(counter.check(raise_error=False))
        seen.append(counter.check(raise_error=False))

    thread = threading.Thread(target=checker)
    thread.start()
    for i in range(calls):
        # rank 1 is over its rows on odd calls only; rank 0's count is never over
        torch.ops.moe_ops.clamp_counts_(over if i % 2 else fine, rows, out, counter.tensor, 1)
    done.set()
    thread.join()
    assert sum(seen) == calls // 2, f"{sum(seen)} faults reported for {calls // 2} clamped calls"
    assert out.tolist() == [2, 6]


# ------------------------------------------------------------------ torch.compile traces the step


def _compile_case(world: int, layout: BatchLayout) -> DistCase:
    parallel = max(dist_grids(world, layout), key=lambda p: p.tp_size)
    dp = parallel.dp_size
    steps = tuple(DistStep(counts, (8,) * dp) for counts in [(3, 8)[:dp], (0, 5)[:dp], (8, 1)[:dp]])
    return DistCase(parallel, steps, "renormalize", 5)


def _check_compiled(case: DistCase, results: list[list[dict]]) -> None:
    check_rollout(case, results)
    for rank, steps_out in enumerate(results):
        counters = steps_out[-1]
        assert counters["graph_breaks"] == 0, f"rank {rank}: graph breaks"
        # one graph for exchange and one for the layer loop; the counts changed, the graphs did not
        assert counters["graphs"] == 2, f"rank {rank}: {counters['graphs']} graphs (recompiled?)"


@needs_gloo
@pytest.mark.parametrize("layout", LAYOUTS, ids=_layout_id)
def test_compiled_step_gloo(layout):
    """``exchange`` and the layer loop (dispatch, route, capture) under torch.compile(fullgraph=True):
    the same captures as eager, no graph break, and new counts under one plan compile nothing new."""
    case = _compile_case(2, layout)
    _check_compiled(case, pool_for(2).run(_rollout, case, True))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS, ids=_layout_id)
@pytest.mark.parametrize("world", [1, 2])
def test_compiled_step_nccl(world, layout):
    pool = nccl_pool(world)
    case = _compile_case(world, layout)
    _check_compiled(case, pool.run(_rollout, case, True))


# ------------------------------------------------------------------ CUDA graphs (NCCL)


def _graphed(case: DistCase) -> list[dict]:
    """``case``'s steps (one padding) replayed from two CUDA graphs per rank: the count exchange,
    then the layer loop; between them ``set_step`` hands the exchanged counts to the capturer.
    The graphs' inputs (this rank's count, its logits) are static tensors updated in place."""
    parallel = case.parallel
    groups = _groups(parallel)
    device = _device()
    capturer = _capturer(parallel, groups)
    step = DistributedStep(groups, capturer)
    method, kwargs = _route_args(case, device)
    d = groups.dp_rank
    plan = step.plan(case.steps[0].padded[d])
    num_tokens = torch.zeros(1, dtype=torch.int32, device=device)
    batches = [torch.zeros(plan.padded[d], DIST_NUM_EXPERTS, device=device) for _ in SHAPE.moe_layers]

    def forward():
        return [
            step.route(plan, layer, step.shard(plan, batch), DIST_TOP_K, method, **kwargs)[1]
            for layer, batch in zip(SHAPE.moe_layers, batches)
        ]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: Triton compiles, NCCL communicators, fault counter
        for _ in range(2):
            counts, sizes = step.exchange(plan, num_tokens)
            capturer.set_step(counts, sizes)
            forward()
    torch.cuda.current_stream().wait_stream(side)
    exchange_graph, forward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(exchange_graph):
        counts, sizes = step.exchange(plan, num_tokens)
    with torch.cuda.graph(forward_graph):
        ids = forward()
    out = []
    for s, st_ in enumerate(case.steps):
        num_tokens.fill_(st_.counts[d])
        for layer, batch in zip(SHAPE.moe_layers, batches):
            batch.copy_(dist_logits(case, s, d, layer))
        capturer.buffer.fill_(POISON)
        exchange_graph.replay()
        capturer.set_step(counts, sizes)
        forward_graph.replay()
        out.append(
            {
                "buffer": capturer.buffer.cpu().numpy().copy(),
                "routed": [i.cpu().numpy() for i in ids],
                "counts": counts.cpu().tolist(),
                "sizes": None if sizes is None else sizes.cpu().tolist(),
                "faults": capturer.check_errors(raise_error=False),
                "plan": _plan_summary(plan),
            }
        )
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS, ids=_layout_id)
@pytest.mark.parametrize("world", [1, 2])
def test_cuda_graph_step_nccl(world, layout):
    """Replayed CUDA graphs with new counts each step capture exactly each rank's own tokens."""
    pool = nccl_pool(world)
    parallel = max(dist_grids(world, layout), key=lambda p: p.tp_size)
    dp = parallel.dp_size
    steps = tuple(DistStep(c, (16,) * dp) for c in [(3, 16)[:dp], (0, 9)[:dp], (16, 0)[:dp], (5, 5)[:dp]])
    case = DistCase(parallel, steps, "deepseek", 9)
    check_rollout(case, pool.run(_graphed, case))


# ------------------------------------------------------------------ bad input: clear errors, on every rank


def _plan_on_every_rank(parallel: ParallelLayout, rows_by_rank: tuple) -> tuple:
    groups = _groups(parallel)
    step = DistributedStep(groups, _capturer(parallel, groups))
    return _plan_summary(step.plan(rows_by_rank[groups.rank]))


BAD_PLANS = {
    "not an int": (
        (3, 3, 2.5, 3),
        r"num_rows must be an int in \[0, 2\*\*31\) on every rank; rank 2 \(DP rank 1, TP rank 0\) "
        r"passed another value",
        {2: r"num_rows must be an int in \[0, 2\*\*31\) \(this batch's rows\), got 2\.5"},
    ),
    "negative": ((3, 3, 4, -1), r"rank 3 \(DP rank 1, TP rank 1\) passed another value", {3: "got -1"}),
    "beyond int64": (
        (2**70, 3, 4, 4),
        r"rank 0 \(DP rank 0, TP rank 0\) passed another value",
        {0: "got 1180"},
    ),
    "TP ranks disagree": (
        (3, 4, 5, 5),
        r"the TP ranks of DP rank 0 hold one batch but passed different num_rows \[3, 4\]",
        {},
    ),
    "over the buffer": (
        (3, 3, 30, 30),
        r"rank 2 \(DP rank 1, TP rank 0\): its batch of 30 rows exceeds its capture buffer's "
        r"max_num_tokens=24 \(raised on every rank\)",
        {},
    ),
}


@needs_gloo
@pytest.mark.parametrize("bad", list(BAD_PLANS))
def test_a_bad_plan_raises_the_same_error_on_every_rank_gloo(bad):
    """A bad ``num_rows`` on one rank: every rank raises (none is left in a collective), the
    offending rank with its own value; the next plan works on every rank."""
    parallel = ParallelLayout(2, 2, use_ep=True, layout=BatchLayout.SHARDED)
    rows, everywhere, own = BAD_PLANS[bad]
    pool = pool_for(4)
    results = pool.run(_plan_on_every_rank, parallel, rows, allow_errors=True)
    for rank, got in enumerate(results):
        assert isinstance(got, RankFailure) and got.type_name == "ValueError", f"rank {rank}: {got}"
        assert re.search(own.get(rank, everywhere), got.message), f"rank {rank}: {got.message}"
    good = pool.run(_plan_on_every_rank, parallel, (5, 5, 9, 9))
    assert good == [((5, 9), 3, (3, 3, 5, 5), 16)] * 2 + [((5, 9), 5, (3, 3, 5, 5), 16)] * 2


def _bad_arguments() -> list[str]:
    """Every local argument error of the step, as (what, message) on this rank; none collective."""
    parallel = ParallelLayout(2, 2, use_ep=True, layout=BatchLayout.SHARDED)
    groups = _groups(parallel)
    device = _device()
    good = _capturer(parallel, groups)
    errors = []

    def expect(fn):
        try:
            fn()
        except (TypeError, ValueError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        else:
            errors.append("no error")

    other_rank = RoutingCapturer(SHAPE, 24, device, dp_size=2, dp_rank=1 - groups.dp_rank, shards_per_rank=2)
    no_shards = RoutingCapturer(SHAPE, 24, device, dp_size=2, dp_rank=groups.dp_rank)
    expect(lambda: DistributedStep(groups, other_rank))
    expect(lambda: DistributedStep(groups, no_shards))
    expect(lambda: DistributedStep(groups, object()))
    if device.type == "cpu":
        expect(
            lambda: DistributedStep(
                groups,
                RoutingCapturer(SHAPE, 24, "meta", dp_size=2, dp_rank=groups.dp_rank, shards_per_rank=2),
            )
        )
    expect(
        lambda: DistributedStep(
            groups,
            good,
            dispatch=ParallelLayout(2, 2, True, BatchLayout.GATHERED).dispatch_config(8, DIST_TOP_K),
        )
    )
    step = DistributedStep(groups, good)
    plan = step.plan(6)  # every rank: the same shapes
    expect(lambda: step.exchange(plan, torch.tensor([3.0], device=device)))
    expect(lambda: step.exchange(plan, torch.tensor([3, 4], dtype=torch.int32, device=device)))
    expect(lambda: step.exchange(plan, 3))
    expect(lambda: step.dispatch(plan, torch.zeros(6, DIST_NUM_EXPERTS, device=device)))
    expect(lambda: step.shard(plan, torch.zeros(5, DIST_NUM_EXPERTS, device=device)))
    expect(lambda: step.exchange("plan", torch.tensor([3], dtype=torch.int32, device=device)))
    return errors


@needs_gloo
def test_bad_arguments_raise_clear_errors_gloo():
    results = pool_for(4).run(_bad_arguments)
    patterns = [
        r"ValueError: capturer must have dp_size=2 and dp_rank=\d \(this rank's\), got dp_size=2 "
        r"and dp_rank=\d",
        r"ValueError: capturer must have shards_per_rank=2 for SHARDED with tp_size=2, got None",
        r"TypeError: capturer must be a moe_ops.RoutingCapturer; object lacks buffer",
        r"ValueError: capturer must be on the CPU for the gloo backend of the groups, got meta",
        r"ValueError: dispatch must describe this layout .*'layout': <BatchLayout.GATHERED: 1>",
        r"ValueError: num_tokens must be a \(1,\) int32 tensor on cpu, got \(1,\) torch.float32 on cpu",
        r"ValueError: num_tokens must be a \(1,\) int32 tensor on cpu, got \(2,\) torch.int32",
        r"ValueError: num_tokens must be a \(1,\) int32 tensor on cpu, got int",
        r"ValueError: x must have this rank's 3 rows \(the plan's\), got \(6, 16\)",
        r"ValueError: batch must have this DP rank's 6 rows \(the plan's\), got \(5, 16\)",
        r"TypeError: plan must be a StepPlan from DistributedStep.plan, got str",
    ]
    for rank, messages in enumerate(results):
        assert len(messages) == len(patterns)
        for message, pattern in zip(messages, patterns):
            assert re.search(pattern, message), f"rank {rank}: {message!r} !~ {pattern!r}"


def test_parallel_layout_validation_and_sizes():
    with pytest.raises(ValueError, match=r"dp_size must be an int >= 1, got 0"):
        ParallelLayout(0)
    with pytest.raises(ValueError, match=r"tp_size must be an int >= 1, got True"):
        ParallelLayout(2, True)
    with pytest.raises(ValueError, match=r"SHARDED gathers .* set use_ep=True"):
        ParallelLayout(2, 2, layout=BatchLayout.SHARDED)
    with pytest.raises(ValueError, match=r"layout must be a BatchLayout"):
        ParallelLayout(2, 2, layout=7)
    with pytest.raises(ValueError, match=r"use_ep must be a bool"):
        ParallelLayout(2, 2, use_ep=1)
    p = ParallelLayout(2, 4, use_ep=True, layout=BatchLayout.SHARDED)
    assert (p.world_size, p.ep_size, p.dispatch_group_size, p.shards_per_rank) == (8, 8, 8, 4)
    assert p.ranks_of(5) == (1, 1) and p.rows_fed(9) == 3
    config = p.dispatch_config(8192, 8)
    assert (config.max_num_tokens, config.scratch_rows) == (2048, 2048 * 8)
    g = ParallelLayout(4, 2, layout=BatchLayout.GATHERED)
    assert (g.ep_size, g.dispatch_group_size, g.shards_per_rank, g.rows_fed(9)) == (1, 4, 1, 9)
    assert g.dispatch_config(8192, 8).scratch_rows == 8192 * 4
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 8\)"):
        g.ranks_of(8)
    with pytest.raises(ValueError, match="monolithic experts capture LOCAL, GATHERED or SHARDED"):
        ParallelLayout(1, 2, layout=BatchLayout.SEQUENCE_PARALLEL).dispatch_config(8, 8)
    assert ParallelLayout(1, 2, layout=BatchLayout.SEQUENCE_PARALLEL).shards_per_rank is None


def test_process_groups_need_an_initialised_default_group():
    if dist.is_initialized():
        pytest.skip("this process already joined a default group")
    with pytest.raises(ValueError, match=r"torch\.distributed is not initialised"):
        ProcessGroups.build(ParallelLayout(2))


# ------------------------------------------------------------------ ranks that disagree, group timeouts

# seconds a collective of the short-timeout pool waits for a peer. A rank left waiting in a group
# that has the default group's timeout raises within it; a group with torch's own default for gloo
# (30 minutes) would wait until the task's hang guard kills the ranks instead.
SHORT_TIMEOUT = 8.0
# the hang guard of those tasks: 10x the timeout, which is itself far above what they take when
# nobody waits (a layout exchange and one step: 0.01 to 0.05 s on 2 cores)
SHORT_GUARD = 10 * SHORT_TIMEOUT


def _short_pool():
    return pool_for(2, collective_timeout=SHORT_TIMEOUT)


def _step_in_own_layout(layouts: tuple[ParallelLayout, ...], relabel: bool) -> int:
    """Rank r runs one step in ``layouts[r]``: it builds its groups in that layout, or (``relabel``)
    takes the groups every rank built for LOCAL of the same dp x tp and gives them its layout, as
    an engine that creates its own groups does. Returns the rows the router saw."""
    parallel = layouts[dist.get_rank()]
    if relabel:
        agreed = _groups(ParallelLayout(parallel.dp_size, parallel.tp_size))
        groups = dataclasses.replace(agreed, layout=parallel)
    else:
        groups = ProcessGroups.build(parallel)
    step = DistributedStep(groups, _capturer(parallel, groups))
    plan = step.plan(6)
    step.begin(plan, torch.tensor([4], dtype=torch.int32))
    logits = torch.randn(6, DIST_NUM_EXPERTS, generator=torch.Generator().manual_seed(groups.dp_rank))
    _, ids = step.route(plan, SHAPE.moe_layers[0], step.shard(plan, logits), DIST_TOP_K)
    return ids.shape[0]


DISAGREEMENTS = {
    # rank 0 dispatches over the DP group, rank 1 routes its own rows: rank 0 would wait in the gather
    "layout": (
        (ParallelLayout(2, layout=BatchLayout.GATHERED), ParallelLayout(2, layout=BatchLayout.LOCAL)),
        False,
        r"ProcessGroups\.build: the ranks disagree on the ParallelLayout \(ranks \[0\] have dp_size=2 x "
        r"tp_size=1, use_ep=False, GATHERED; ranks \[1\] have dp_size=2 x tp_size=1, use_ep=False, LOCAL\)",
    ),
    # the ranks would create different groups: new_group waits for peers that create others
    "dp x tp": (
        (ParallelLayout(2, 1), ParallelLayout(1, 2)),
        False,
        r"ranks \[0\] have dp_size=2 x tp_size=1, .*; ranks \[1\] have dp_size=1 x tp_size=2,",
    ),
    "use_ep": (
        (
            ParallelLayout(2, use_ep=True, layout=BatchLayout.GATHERED),
            ParallelLayout(2, layout=BatchLayout.GATHERED),
        ),
        False,
        r"ranks \[0\] have dp_size=2 x tp_size=1, use_ep=True, GATHERED; ranks \[1\] have .*use_ep=False",
    ),
    # groups every rank built alike, given different layouts: the plan's exchange catches it
    "layout, own groups": (
        (ParallelLayout(2, layout=BatchLayout.GATHERED), ParallelLayout(2, layout=BatchLayout.LOCAL)),
        True,
        r"DistributedStep\.plan: the ranks disagree on the ParallelLayout \(ranks \[0\] have .*GATHERED; "
        r"ranks \[1\] have .*LOCAL\)",
    ),
}


@needs_gloo
@pytest.mark.parametrize("case", list(DISAGREEMENTS))
def test_ranks_that_disagree_on_the_layout_raise_on_every_rank_gloo(case):
    """Each rank has its own layout. Every rank raises the same ValueError, naming both layouts,
    before any collective that depends on the layout (no rank waits for a peer: the task ends well
    within the short pool's collective timeout); then the ranks run a step together."""
    layouts, relabel, pattern = DISAGREEMENTS[case]
    pool = _short_pool()
    start = time.monotonic()
    results = pool.run(_step_in_own_layout, layouts, relabel, timeout=SHORT_GUARD, allow_errors=True)
    elapsed = time.monotonic() - start
    for rank, got in enumerate(results):
        assert isinstance(got, RankFailure), f"rank {rank} ran the step: {got}"
        assert got.type_name == "ValueError", f"rank {rank}: {got.type_name}: {got.message}"
        assert re.search(pattern, got.message), f"rank {rank}: {got.message}"
        assert got.message.endswith("(raised on every rank)"), f"rank {rank}: {got.message}"
    assert results[0].message == results[1].message, "the ranks raised different errors"
    assert elapsed < SHORT_TIMEOUT, f"a rank waited for a peer ({elapsed:.1f} s)"
    agreed = (layouts[1], layouts[1])
    want = 12 if layouts[1].layout == BatchLayout.GATHERED else 6
    assert pool.run(_step_in_own_layout, agreed, relabel, timeout=SHORT_GUARD) == [want, want]


def _backend_timeout(group) -> float:
    """Seconds of the timeout ``group``'s backend was created with (torch keeps it in the backend's
    options; there is no public getter)."""
    device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
    return group._get_backend(device).options._timeout.total_seconds()


def _group_timeouts(parallel: ParallelLayout) -> dict[str, float]:
    groups = _groups(parallel)
    names = ("dp_group", "tp_group", "ep_group", "host_group")
    return {name: _backend_timeout(getattr(groups, name)) for name in names}


def _one_rank_fails_before_the_dispatch() -> tuple[str, str, float] | str:
    """GATHERED over 2 DP ranks: both plan and begin; rank 0 then stops (an error of its own before
    the dispatch) while rank 1 dispatches, alone in the DP group's all-gather. Rank 1 returns what
    its all-gather raised and after how many seconds."""
    parallel = ParallelLayout(2, layout=BatchLayout.GATHERED)
    groups = _groups(parallel)
    step = DistributedStep(groups, _capturer(parallel, groups))
    plan = step.plan(4)
    step.begin(plan, torch.tensor([3], dtype=torch.int32))
    if groups.rank == 0:
        return "stopped"
    start = time.monotonic()
    try:
        step.dispatch(plan, torch.zeros(4, DIST_NUM_EXPERTS))
    except Exception as exc:  # whatever gloo raises for a peer that never came
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "the all-gather completed without its peer"


@needs_gloo
def test_groups_get_the_default_groups_timeout_gloo():
    """Every group ProcessGroups.build creates has the default group's timeout (the pool's 8 s),
    not gloo's 30 minutes: a rank whose peer failed before a collective raises within about that
    timeout, and the test's hang guard (10x it) never fires."""
    pool = _short_pool()
    try:
        for parallel in (ParallelLayout(2, 1), ParallelLayout(1, 2)):
            for rank, timeouts in enumerate(pool.run(_group_timeouts, parallel, timeout=SHORT_GUARD)):
                assert timeouts == dict.fromkeys(timeouts, SHORT_TIMEOUT), f"rank {rank}, {parallel}"
        stopped, waited = pool.run(_one_rank_fails_before_the_dispatch, timeout=SHORT_GUARD)
        assert stopped == "stopped"
        assert isinstance(waited, tuple), waited
        name, message, seconds = waited
        assert re.search(r"[Tt]imed out|[Tt]imeout", message), f"{name} after {seconds:.1f} s: {message}"
    finally:
        pool.close()  # rank 1's DP group saw a timeout: the next test gets fresh ranks


@pytest.mark.gpu
def test_groups_get_the_default_groups_timeout_nccl():
    """The same with NCCL groups and the gloo host group beside them (the pool's 60 s)."""
    from dist_launch import COLLECTIVE_TIMEOUT

    pool = nccl_pool(2)
    for parallel in (ParallelLayout(2, 1), ParallelLayout(1, 2)):
        for rank, timeouts in enumerate(pool.run(_group_timeouts, parallel)):
            assert timeouts == dict.fromkeys(timeouts, COLLECTIVE_TIMEOUT), f"rank {rank}, {parallel}"


# ------------------------------------------------------------------ process-group arguments


def _bad_group_arguments() -> list[str]:
    """Every public argument that takes a process group, given an object that is not one (and a
    real group where none belongs): what each raised on this rank, before any collective."""
    parallel = ParallelLayout(2, 2, layout=BatchLayout.SEQUENCE_PARALLEL)
    groups = _groups(parallel)
    capturer = _capturer(parallel, groups)
    capturer.set_step(torch.tensor([3, 2], dtype=torch.int32))
    capturer.buffer.fill_(POISON)
    ids = torch.zeros(2, DIST_TOP_K, dtype=torch.int32)
    calls = [
        lambda: capture_routing(
            capturer.buffer,
            ids,
            0,
            token_counts=capturer.token_counts,
            dp_rank=groups.dp_rank,
            layout=BatchLayout.SEQUENCE_PARALLEL,
            tp_group=object(),
        ),
        lambda: capturer.capture(0, ids, BatchLayout.SEQUENCE_PARALLEL, tp_group="tp"),
        lambda: capturer.capture(0, ids, BatchLayout.LOCAL, tp_group=groups.tp_group),
        lambda: gather_routing(np.zeros((2, 2, DIST_TOP_K), dtype=np.int32), group=object()),
        lambda: scatter_routing(None, group=[0, 1]),
        lambda: dataclasses.replace(groups, dp_group=object()),
        lambda: dataclasses.replace(groups, host_group=None),
        lambda: dataclasses.replace(groups, dp_group=groups.ep_group),
        lambda: dataclasses.replace(groups, tp_rank=1 - groups.tp_rank),
    ]
    errors = []
    for call in calls:
        try:
            call()
        except (TypeError, ValueError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        else:
            errors.append("no error")
    errors.append(f"untouched: {bool((capturer.buffer == POISON).all())}")
    return errors


@needs_gloo
def test_bad_process_group_arguments_raise_type_errors_gloo():
    """A process-group argument that is not a ``torch.distributed.ProcessGroup`` raises a TypeError
    naming the argument, on the calling rank, before anything is written or gathered."""
    patterns = [
        r"TypeError: tp_group must be a torch\.distributed\.ProcessGroup or None, got object",
        r"TypeError: tp_group must be a torch\.distributed\.ProcessGroup or None, got str",
        r"ValueError: tp_group is only used by SEQUENCE_PARALLEL, not LOCAL",
        r"TypeError: group must be a torch\.distributed\.ProcessGroup or None, got object",
        r"TypeError: group must be a torch\.distributed\.ProcessGroup or None, got list",
        r"TypeError: dp_group must be a torch\.distributed\.ProcessGroup, got object",
        r"TypeError: host_group must be a torch\.distributed\.ProcessGroup, got NoneType",
        r"ValueError: dp_group must have 2 ranks for ParallelLayout\(dp_size=2, tp_size=2, .*\), got 4",
        r"ValueError: dp_rank and tp_rank must be \(\d, \d\) for rank \d of the layout",
        r"untouched: True",
    ]
    for rank, messages in enumerate(pool_for(4).run(_bad_group_arguments)):
        assert len(messages) == len(patterns), messages
        for message, pattern in zip(messages, patterns):
            assert re.search(pattern, message), f"rank {rank}: {message!r} !~ {pattern!r}"


# ------------------------------------------------------------------ item 4: the monolithic scratch

E_HIDDEN, E_INTER = 256, 128  # the tiny experts' sizes: their weights are never read here


def _bf16_experts(config, device):
    """FlashInfer BF16 monolithic experts (they route from logits inside the kernel)."""
    from moe_ops.flashinfer import FlashInferExperts

    return FlashInferExperts(
        "trtllm_bf16_moe",
        config,
        gemm1_weights=torch.empty(DIST_NUM_EXPERTS, E_HIDDEN // 64, 2 * E_INTER, 64, dtype=torch.bfloat16),
        gemm2_weights=torch.empty(DIST_NUM_EXPERTS, E_INTER // 64, E_HIDDEN, 64, dtype=torch.bfloat16),
        num_experts=DIST_NUM_EXPERTS,
        top_k=DIST_TOP_K,
        n_group=None,
        topk_group=None,
        intermediate_size=E_INTER,
        local_expert_offset=0,
        local_num_experts=DIST_NUM_EXPERTS,
        routing_method_type=1,
        routing_bias=None,
    )


def _monolithic(case: DistCase, max_num_tokens: int, check_at_plan: bool) -> list[dict]:
    """``case``'s steps through monolithic experts bound to the capturer: the dispatched logits
    go to the experts' routing-replay scratch and the experts' capture step records this rank's
    rows. ``check_at_plan`` gives the step the experts' dispatch config, so the plan checks the
    scratch; without it, the experts' own per-call check is the one that fires."""
    from moe_ops import LayerCapture

    parallel = case.parallel
    groups = _groups(parallel)
    device = _device()
    capturer = _capturer(parallel, groups)
    config = parallel.dispatch_config(max_num_tokens, DIST_TOP_K)
    experts = {layer: _bf16_experts(config, device) for layer in SHAPE.moe_layers}
    for layer, e in experts.items():
        e.set_capture_fn(LayerCapture(capturer, SHAPE.buffer_layer(layer)))
    step = DistributedStep(groups, capturer, dispatch=config if check_at_plan else None)
    method, kwargs = _route_args(case, device)
    d = groups.dp_rank
    out = []
    for s, st_ in enumerate(case.steps):
        plan = step.plan(st_.padded[d])
        capturer.buffer.fill_(POISON)
        num_tokens = torch.tensor([st_.counts[d]], dtype=torch.int32, device=device)
        step.begin(plan, num_tokens)
        routed = []
        for layer in SHAPE.moe_layers:
            batch = dist_logits(case, s, d, layer).to(device)
            logits = step.dispatch(plan, step.shard(plan, batch))
            replay = experts[layer].routing_replay_out(logits.shape[0], device)
            # FlashInfer's kernel routes the logits and writes every row's ids into the scratch;
            # it does not run on a CPU, so the router writes what it would (test_flashinfer_experts
            # does the same), and the experts' capture step takes it from there
            replay.copy_(route(logits, DIST_TOP_K, method, **kwargs)[1])
            experts[layer].capture_routing_replay(replay)
            routed.append(replay.cpu().numpy().astype(np.int32))
        out.append(
            {
                "buffer": capturer.buffer.cpu().numpy().copy(),
                "routed": routed,
                "counts": list(st_.counts),
                "sizes": list(plan.local_sizes) if plan.local_sizes else None,
                "faults": capturer.check_errors(raise_error=False),
                "plan": _plan_summary(plan),
                "scratch_rows": experts[SHAPE.moe_layers[0]].replay_scratch.shape[0],
            }
        )
    return out


def _scratch_case(parallel: ParallelLayout, padded: tuple[int, ...]) -> DistCase:
    counts = tuple(max(0, p - 2) for p in padded)
    return DistCase(parallel, (DistStep(counts, padded),), "renormalize", 3)


SCRATCH_LAYOUTS = [
    ParallelLayout(4, 1, use_ep=True, layout=BatchLayout.GATHERED),
    ParallelLayout(2, 2, use_ep=False, layout=BatchLayout.GATHERED),
    ParallelLayout(2, 2, use_ep=True, layout=BatchLayout.SHARDED),
]


@needs_gloo
@pytest.mark.parametrize("parallel", SCRATCH_LAYOUTS, ids=_parallel_id)
def test_monolithic_scratch_holds_the_dispatch_groups_batch_gloo(parallel):
    """The scratch is max_num_tokens x dispatch group rows (the EP group with EP, else the DP
    group), the dispatched batch fits it, and the experts' capture records each rank's own rows."""
    dp = parallel.dp_size
    case = _scratch_case(parallel, (16, 3, 0, 11)[:dp])
    results = pool_for(4).run(_monolithic, case, 16, True)
    check_rollout(case, results)
    group = parallel.world_size if parallel.use_ep else dp
    fed = -(-16 // parallel.tp_size) if parallel.layout == BatchLayout.SHARDED else 16
    for rank, steps in enumerate(results):
        got = steps[0]
        assert got["scratch_rows"] == fed * group, f"rank {rank}: scratch rows"
        assert got["plan"][3] <= got["scratch_rows"], f"rank {rank}: the dispatched batch overflows"


@needs_gloo
@pytest.mark.parametrize("parallel", SCRATCH_LAYOUTS, ids=_parallel_id)
def test_a_batch_over_the_scratch_raises_on_every_rank_gloo(parallel):
    """One DP rank's batch is larger than the experts were sized for. With the dispatch config the
    plan raises the same ValueError on every rank, before any device collective; without it every
    rank of the dispatch group raises at the experts' call, after a gather all of them finished.
    Nobody waits for a peer (the task returns well within the collective timeout), and the ranks
    run the next step together."""
    from dist_launch import COLLECTIVE_TIMEOUT

    dp = parallel.dp_size
    # DP rank 1 runs 20 rows, the experts were sized for 8 per rank; the batch overflows the scratch
    padded = (5, 20, 3, 9)[:dp]
    case = _scratch_case(parallel, padded)
    pool = pool_for(4)
    fed = -(-20 // parallel.tp_size) if parallel.layout == BatchLayout.SHARDED else 20
    limit = -(-8 // parallel.tp_size) if parallel.layout == BatchLayout.SHARDED else 8
    first_rank_of_d1 = parallel.tp_size  # rank (DP 1, TP 0)
    for check_at_plan, pattern in [
        (
            True,
            rf"rank {first_rank_of_d1} \(DP rank 1, TP rank 0\) feeds the MoE layer {fed} rows but "
            rf"its experts' dispatch config has max_num_tokens={limit}.*raised on every rank",
        ),
        (False, r"trtllm_bf16_moe: this call has \d+ tokens but the routing-replay scratch holds \d+ rows"),
    ]:
        start = time.monotonic()
        results = pool.run(_monolithic, case, 8, check_at_plan, allow_errors=True)
        elapsed = time.monotonic() - start
        for rank, got in enumerate(results):
            assert isinstance(got, RankFailure), f"rank {rank} did not raise (check_at_plan={check_at_plan})"
            assert got.type_name == "ValueError", f"rank {rank}: {got.type_name}: {got.message}"
            assert re.search(pattern, got.message), f"rank {rank}: {got.message}"
        # a rank that waited for a peer would take the whole collective timeout (60 s); every rank
        # raising at once takes 0.01-2.8 s here (the first case loads FlashInfer), so that is the bound
        assert elapsed < COLLECTIVE_TIMEOUT, f"a rank waited for a peer ({elapsed:.1f} s)"
    fits = _scratch_case(parallel, (5, 8, 3, 0)[:dp])
    check_rollout(fits, pool.run(_monolithic, fits, 8, True))


# ------------------------------------------------------------------ item 5: replay in another split


def _rollout_then_train(case: DistCase, order_seed: int, cuts: tuple[float, ...]) -> dict:
    """Rollout: one step of ``case``, every rank snapshots its captured rows. Client: rank 0
    gathers them in the wire format. Trainer: rank 0 shuffles the tokens and cuts them into
    ``world`` uneven shares (``cuts``: fractions), scatters each share with its routing, and every
    rank replays its share's recorded experts from its own (perturbed) logits."""
    parallel = case.parallel
    groups = _groups(parallel)
    device = _device()
    capturer = _capturer(parallel, groups)
    step = DistributedStep(groups, capturer)
    method, kwargs = _route_args(case, device)
    d, world, rank = groups.dp_rank, parallel.world_size, groups.rank
    st_ = case.steps[0]
    plan = step.plan(st_.padded[d])
    step.begin(plan, torch.tensor([st_.counts[d]], dtype=torch.int32, device=device))
    for layer in SHAPE.moe_layers:
        step.route(
            plan,
            layer,
            step.shard(plan, dist_logits(case, 0, d, layer).to(device)),
            DIST_TOP_K,
            method,
            **kwargs,
        )
    handle = capturer.snapshot(num_rows=st_.counts[d])
    rows = handle.result()  # (c, num_layers, top_k) uint8, this rank's real tokens
    handle.release()

    received = gather_routing(rows, dst=0)  # what a client of every rank receives
    routing_chunks = token_chunks = None
    replicas_agree = None
    if rank == 0:
        tp = parallel.tp_size
        replicas_agree = all(
            np.array_equal(received[i * tp], received[i * tp + t])
            for i in range(parallel.dp_size)
            for t in range(tp)
        )
        tokens = np.array(
            [(i, j) for i in range(parallel.dp_size) for j in range(st_.counts[i])], dtype=np.int64
        )
        tokens = tokens.reshape(-1, 2)
        routing = np.concatenate([received[i * tp] for i in range(parallel.dp_size)])
        order = np.random.default_rng(order_seed).permutation(len(tokens))
        bounds = [0, *sorted(round(f * len(tokens)) for f in cuts), len(tokens)]
        shares = [order[bounds[i] : bounds[i + 1]] for i in range(world)]
        routing_chunks = [routing[s] for s in shares]
        token_chunks = [tokens[s] for s in shares]
    my_routing = scatter_routing(routing_chunks, src=0)
    my_tokens = scatter_routing(token_chunks, src=0).reshape(-1, 2)

    # the trainer's logits: the rollout's plus noise, per token (the policy moved on)
    replayed, changed, live_changed = [], [], []
    for col, layer in enumerate(SHAPE.moe_layers):
        tables = {i: dist_logits(case, 0, i, layer) for i in range(parallel.dp_size)}
        logits = (
            torch.stack([tables[int(i)][int(j)] for i, j in my_tokens])
            if len(my_tokens)
            else (torch.empty(0, DIST_NUM_EXPERTS))
        )
        g = torch.Generator().manual_seed(case.seed * 7 + layer)
        noise = torch.randn(DIST_MAX_TOKENS * parallel.dp_size, DIST_NUM_EXPERTS, generator=g)
        logits = logits + TRAIN_NOISE * noise[: len(my_tokens)]
        logits = logits.to(device)
        recorded = torch.from_numpy(my_routing[:, col]).to(device)
        _, ids = replay_routing(logits, recorded, method, **kwargs)
        live = route(logits, DIST_TOP_K, method, **kwargs)[1]
        replayed.append(ids.cpu().numpy())
        changed.append(float(routing_mismatch(recorded, ids).changed[0]))
        # tokens whose live experts differ from the record (the fraction is 0 / 0 without tokens)
        live_changed.append(
            float(routing_mismatch(recorded, live).changed[0]) * len(my_tokens) if len(my_tokens) else 0.0
        )
    return {
        "tokens": my_tokens,
        "recorded": my_routing,
        "replayed": replayed,
        "changed": changed,
        "live_changed_tokens": live_changed,
        "replicas_agree": replicas_agree,
    }


def _replay_case(data, world: int) -> tuple[DistCase, int, tuple[float, ...]]:
    case = data.draw(dist_cases(world, data.draw(st.sampled_from(LAYOUTS)), max_steps=1))
    order_seed = data.draw(st.integers(0, 2**16))
    cuts = data.draw(st.lists(st.floats(0, 1), min_size=world - 1, max_size=world - 1))
    return case, order_seed, tuple(cuts)


@needs_gloo
@slow_settings
@given(data=st.data())
def test_replay_in_a_different_data_parallel_split_gloo(data):
    """Rollout on 4 ranks in any layout, routing gathered to rank 0 in the wire format, replayed by
    4 trainers that each get a shuffled, uneven share: every token reaches its recorded experts
    (mismatch 0), and the recorded experts are the rollout routing of exactly that token."""
    case, order_seed, cuts = _replay_case(data, 4)
    check_replay(case, pool_for(4).run(_rollout_then_train, case, order_seed, cuts))


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
@settings(max_examples=max(EXAMPLES // 4, 1), deadline=None, database=None)
@given(data=st.data())
def test_replay_in_a_different_data_parallel_split_nccl(world, data):
    pool = nccl_pool(world)
    case, order_seed, cuts = _replay_case(data, world)
    check_replay(case, pool.run(_rollout_then_train, case, order_seed, cuts))


def check_replay(case: DistCase, results: list[dict]) -> None:
    assert results[0]["replicas_agree"], "TP replicas of a DP rank captured different rows"
    counts = case.steps[0].counts
    seen = np.concatenate([r["tokens"] for r in results])
    want_tokens = sorted((i, j) for i, c in enumerate(counts) for j in range(c))
    assert sorted(map(tuple, seen.tolist())) == want_tokens, "the trainers did not get every token once"
    live_changed = 0.0
    for rank, got in enumerate(results):
        n = len(got["tokens"])
        for col, layer in enumerate(SHAPE.moe_layers):
            rollout = {i: expected_ids(case, 0, i, layer) for i in range(case.parallel.dp_size)}
            want = np.array([rollout[int(i)][int(j)] for i, j in got["tokens"]], dtype=np.int64)
            want = want.reshape(n, DIST_TOP_K)
            recorded = got["recorded"][:, col].astype(np.int64)
            assert np.array_equal(recorded, want), f"trainer {rank}: recorded experts, layer {layer}"
            assert np.array_equal(got["replayed"][col], recorded), (
                f"trainer {rank}: replayed ids, layer {layer}"
            )
            if n:
                assert got["changed"][col] == 0.0, f"trainer {rank}: mismatch {got['changed'][col]}"
            else:
                assert np.isnan(got["changed"][col]), "no token: the mismatch is 0 / 0"
            live_changed += got["live_changed_tokens"][col]
    if sum(counts) >= 8:  # the trainer's logits differ: live routing would have strayed
        assert live_changed > 0, "the trainer's live routing equals the record: the check proves nothing"


# ------------------------------------------------------------------ the benchmark's shapes

BENCH_ROUTER = {"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5}


def _benchmark_shapes(tokens: int, layers: int) -> list[str]:
    """DeepSeek-V3 routing (256 experts, top-8, 8 groups keep 4, bias) in every process grid the
    benchmark measures (benchmarks/cases.py: BENCH_CASES["distributed"], BENCH_DIST_SHAPE): each
    rank checks its own capture buffer against its own real tokens routed alone, here."""
    from moe_ops import RoutingMethod

    world, device = dist.get_world_size(), _device()
    e, k = BENCH_DIST_SHAPE.num_experts, BENCH_DIST_SHAPE.top_k
    shape = RoutingShape(layers, e, k)
    bias = (torch.randn(e, generator=torch.Generator().manual_seed(0)) * 0.1).to(device)
    failures = []
    for case in BENCH_CASES["distributed"]:
        parallel = case.parallel(world)
        if parallel is None:
            continue  # a TP group larger than the world (one NCCL rank on a one-GPU machine)
        groups = _groups(parallel)
        d = groups.dp_rank
        capturer = RoutingCapturer(
            shape,
            tokens,
            device,
            dp_size=parallel.dp_size,
            dp_rank=d,
            shards_per_rank=parallel.shards_per_rank,
        )
        step = DistributedStep(groups, capturer)
        plan = step.plan(tokens)
        count = max(0, tokens - 3 - 5 * d)  # uneven, and padding on every rank
        step.begin(plan, torch.tensor([count], dtype=torch.int32, device=device))
        for layer in range(layers):
            g = torch.Generator().manual_seed(1000 * d + layer)
            logits = torch.randn(tokens, e, generator=g).to(device)
            logits[count:] = torch.arange(e, dtype=torch.float32, device=device)  # poisoned padding
            step.route(
                plan, layer, step.shard(plan, logits), k, RoutingMethod.DEEPSEEK_V3, bias=bias, **BENCH_ROUTER
            )
            want = route(logits[:count], k, RoutingMethod.DEEPSEEK_V3, bias=bias, **BENCH_ROUTER)[1]
            if not torch.equal(capturer.buffer[:count, layer], want):
                failures.append(f"{_parallel_id(parallel)} rank {groups.rank} layer {layer}")
        if capturer.check_errors(raise_error=False):
            failures.append(f"{_parallel_id(parallel)} rank {groups.rank}: capture faults")
    return failures


@needs_gloo
@pytest.mark.parametrize("world", [1, 2, 4])
def test_benchmark_shapes_gloo(world):
    """The benchmark's experts, top-k and process grids (fewer tokens and layers on the CPU)."""
    assert pool_for(world).run(_benchmark_shapes, 64, 3) == [[]] * world


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_benchmark_shapes_nccl(world):
    """The benchmark's shapes at its size: 8192 tokens per rank, 58 layers."""
    pool = nccl_pool(world)
    assert pool.run(_benchmark_shapes, 8192, 58) == [[]] * world


def _load_bench():
    """benchmarks/bench_distributed.py as ``benchmarks.bench_distributed``: an importable name, which
    the ranks it spawns need to unpickle its worker (the repository root is on sys.path:
    tests/conftest.py, and sys.path travels to them)."""
    import importlib

    return importlib.import_module("benchmarks.bench_distributed")


def test_every_bench_case_is_a_tested_grid():
    """The benchmark measures the grids, experts and top-k that _benchmark_shapes checks."""
    bench = _load_bench()
    assert bench.CASES is BENCH_CASES["distributed"]
    for case in bench.CASES:
        assert case.test.endswith("::test_benchmark_shapes_gloo")
    assert (BENCH_DIST_SHAPE.num_experts, BENCH_DIST_SHAPE.top_k) == (bench.NUM_EXPERTS, bench.TOP_K)


@needs_gloo
def test_bench_dry_run_runs_every_case():
    """The benchmark spawns its own 2 ranks, runs and checks every case once (untimed)."""
    table = _load_bench().dry_run()
    assert [row[2] for row in table.rows] == [case.name for case in _load_bench().CASES]
