"""Per-step cost of the count exchange and the capture across processes (``moe_ops.distributed``).

Spawns ``world`` ranks (gloo on CPU, for the record; NCCL with one GPU per rank) and measures, for
DeepSeek-V3 routing (58 MoE layers, top-8 of 256 experts) at ``--tokens`` rows per DP rank (every
rank padded to that one size, real counts uneven: ``tokens - 3 * dp_rank``), in each case of
``CASES`` (``BENCH_CASES["distributed"]`` of benchmarks/cases.py; each names the test that checks the
same shapes):

* ``begin``: ``DistributedStep.begin`` - the device all-gather of (count, rows) over the DP group and
  ``capturer.set_step`` with the result (``graph`` rows: the exchange alone, replayed from a graph;
  ``set_step`` runs on the host between graphs). Peers: ``host``, what an engine without it does (a host
  all-gather of the counts over a gloo group, then ``set_step`` with host ints: a host-to-device
  copy), and the floor ``gather``, the bare functional all-gather of the same 8 bytes per rank.
* ``capture``: one step of capture, 58 layers (``capture_into`` on prebuilt targets, in the
  layout: SEQUENCE_PARALLEL all-gathers the ids over TP first), against the floor ``copy``: 58 plain
  ``copy_`` of this rank's rows from host-known offsets (SEQUENCE_PARALLEL: after the same TP
  all-gather), the least a capture can do. Target: **<= 1.5x** of the floor.

Times are per step, the median over trials of the slowest rank's mean (a collective step is as slow
as its slowest rank). gloo: wall clock. NCCL: CUDA events, eagerly (``eager``) and replayed from a
CUDA graph of the step (``graph``); ``host`` cannot be graphed and is reported eager only.

    python -m benchmarks distributed [--backend gloo|nccl] [--worlds 2,4] [--tokens 8192]
        [--layers 58] [--csv out.csv] [--dry-run]
    python benchmarks/bench_distributed.py [the same flags]

``--dry-run`` runs every case once on 2 gloo ranks at 8 tokens and 2 layers, nothing timed, and
checks each rank's captured rows: a check that the benchmark runs, for machines without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pickle
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.cases import BENCH_CASES, BENCH_DIST_SHAPE, BENCH_SIZES
from benchmarks.harness import Table
from benchmarks.registry import benchmark, int_list, option
from moe_ops import BatchLayout, RoutingCapturer, RoutingShape
from moe_ops.capture.op import capture_into
from moe_ops.distributed import DistributedStep, ParallelLayout, ProcessGroups

# DeepSeek-V3: 58 MoE layers (61 layers, the first 3 dense), top-8 of 256 experts
NUM_LAYERS, NUM_EXPERTS, TOP_K = (
    BENCH_DIST_SHAPE.num_layers,
    BENCH_DIST_SHAPE.num_experts,
    BENCH_DIST_SHAPE.top_k,
)
TOKENS = BENCH_SIZES["distributed"][0]
TARGET_CAPTURE = 1.5
TRIALS = 15
QUICK_TRIALS = 5
DRY_TOKENS, DRY_LAYERS = 8, 2
# BenchGrid: name, layout, tp_size, use_ep, test, parallel(world)
CASES = BENCH_CASES["distributed"]


# ---------------------------------------------------------------------------------------------------
# Timing: the slowest rank's mean per call, median over trials
# ---------------------------------------------------------------------------------------------------


def _slowest(seconds: float, host_group) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=host_group)
    return float(t)


def time_wall_us(fn: Callable[[], object], iters: int, host_group, trials: int = TRIALS) -> float:
    """gloo / eager host timing: wall clock of ``iters`` calls between barriers."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(trials):
        dist.barrier(group=host_group)
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append(_slowest((time.perf_counter() - start) / iters, host_group))
    return statistics.median(times) * 1e6


def time_cuda_us(fn: Callable[[], object], iters: int, host_group, trials: int = TRIALS) -> float:
    """NCCL eager: CUDA events around ``iters`` calls, after a barrier."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(trials):
        torch.cuda.synchronize()
        dist.barrier(group=host_group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(_slowest(start.elapsed_time(end) * 1e-3 / iters, host_group))
    return statistics.median(times) * 1e6


def time_graph_us(fn: Callable[[], object], iters: int, host_group, trials: int = TRIALS) -> float:
    """NCCL graphed: one CUDA graph of one call (a step), replayed ``iters`` times per trial."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_cuda_us(graph.replay, iters, host_group, trials)


# ---------------------------------------------------------------------------------------------------
# One case on one rank
# ---------------------------------------------------------------------------------------------------


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """The bare functional all-gather along dim 0 (the floor's collective)."""
    from torch.distributed import _functional_collectives as funcol

    # all_gather_single replaces all_gather_tensor in torch 2.13; 2.11 only has the latter
    all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    out = all_gather(x, gather_dim=0, group=group)
    return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out


def run_case(
    case, world: int, tokens: int, layers: int, dry: bool, trials: int = TRIALS
) -> list[list[object]]:
    parallel = case.parallel(world)
    if parallel is None:
        return []
    groups = ProcessGroups.build(parallel)
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    shape = RoutingShape(layers, NUM_EXPERTS, TOP_K)
    capturer = RoutingCapturer(
        shape,
        tokens,
        device,
        dp_size=parallel.dp_size,
        dp_rank=groups.dp_rank,
        shards_per_rank=parallel.shards_per_rank,
    )
    step = DistributedStep(groups, capturer)
    plan = step.plan(tokens)
    count = max(0, tokens - 3 * groups.dp_rank)
    num_tokens = torch.tensor([count], dtype=torch.int32, device=device)
    counts_host = [max(0, tokens - 3 * d) for d in range(parallel.dp_size)]
    step.begin(plan, num_tokens)

    g = torch.Generator(device="cpu").manual_seed(groups.rank)
    ids = torch.randint(0, NUM_EXPERTS, (plan.routed_rows, TOP_K), generator=g, dtype=torch.int32)
    ids = ids.to(device)
    tp_group = groups.tp_group if parallel.layout == BatchLayout.SEQUENCE_PARALLEL else None
    targets = [capturer.target(layer, parallel.layout, tp_group=tp_group) for layer in range(layers)]
    # where this rank's rows start in the ids, from the host counts (what the floor may use)
    if parallel.layout in (BatchLayout.GATHERED, BatchLayout.SHARDED):
        per_rank = plan.routed_rows // parallel.dp_size
        start = groups.dp_rank * per_rank
    else:
        start = 0

    def capture_step():
        for target in targets:
            capture_into(target, ids)

    def copy_step():
        src = ids
        if parallel.layout == BatchLayout.SEQUENCE_PARALLEL and parallel.tp_size > 1:
            src = _all_gather(ids, groups.tp_group)
        for layer in range(layers):
            capturer.buffer[:count, layer].copy_(src[start : start + count])

    def begin():
        step.begin(plan, num_tokens)

    def host_exchange():
        mine = torch.tensor([count], dtype=torch.int64)
        table = torch.empty(parallel.world_size, dtype=torch.int64)
        # all_gather_single replaces all_gather_into_tensor in torch 2.13; 2.11 only has the latter
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(
            table, mine, group=groups.host_group
        )
        capturer.set_step(table[:: parallel.tp_size].tolist(), _host_sizes(parallel, plan))

    pair = torch.tensor([count, tokens], dtype=torch.int32, device=device)

    def bare_gather():
        return _all_gather(pair, groups.dp_group)

    # every rank's buffer holds exactly its own rows of the ids: the benchmark measures a correct capture
    capturer.buffer.fill_(-1)
    capture_step()
    want = ids[start : start + count] if parallel.layout != BatchLayout.SEQUENCE_PARALLEL else None
    if want is None:
        want = _all_gather(ids, groups.tp_group)[:count] if parallel.tp_size > 1 else ids[:count]
    for layer in range(layers):
        assert torch.equal(capturer.buffer[:count, layer], want), (
            f"{case.name}: rank {groups.rank} layer {layer}"
        )
    assert capturer.check_errors(raise_error=False) == 0
    assert step.exchange(plan, num_tokens)[0].cpu().tolist() == counts_host

    base = [backend, world, case.name, parallel.dp_size, parallel.tp_size, tokens]
    if dry:
        for fn in (begin, host_exchange, bare_gather, capture_step, copy_step):
            fn()
        return [[*base, "dry", 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    rows = []
    modes = (
        [("eager", time_cuda_us), ("graph", time_graph_us)] if backend == "nccl" else [("wall", time_wall_us)]
    )
    for mode, timer in modes:
        iters, host = 20, groups.host_group
        begin_us = (
            timer(begin, iters, host, trials)
            if mode != "graph"
            else timer(lambda: step.exchange(plan, num_tokens), iters, host, trials)
        )
        host_us = time_wall_us(host_exchange, iters, host, trials) if mode != "graph" else float("nan")
        gather_us = timer(bare_gather, iters, host, trials)
        capture_us = timer(capture_step, 5, host, trials)
        copy_us = timer(copy_step, 5, host, trials)
        rows.append([*base, mode, begin_us, host_us, gather_us, capture_us, copy_us, capture_us / copy_us])
    return rows


def _host_sizes(parallel: ParallelLayout, plan) -> list[int] | None:
    return list(plan.local_sizes) if plan.local_sizes else None


COLUMNS = [
    "backend",
    "world",
    "case",
    "dp",
    "tp",
    "tokens",
    "mode",
    "begin_us",
    "host_us",
    "gather_us",
    "capture_us",
    "copy_us",
    "capture/copy",
]


def _worker(rank: int, world: int, backend: str, init_file: str, out_file: str, args) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        # ranks share the CPU cores: one thread each, or OpenMP workers spin against each other
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        rows = []
        for case in args.cases:
            rows += run_case(case, world, args.tokens, args.layers, args.dry_run, args.trials)
        if rank == 0:
            with open(out_file, "wb") as f:
                pickle.dump(rows, f)
    finally:
        dist.destroy_process_group()


def measure(
    backend: str,
    worlds: list[int],
    tokens: int,
    layers: int,
    dry_run: bool = False,
    cases=CASES,
    trials: int = TRIALS,
) -> Table:
    """Spawns each world of ranks and runs every case of ``cases`` on it; rank 0's rows."""
    table = Table(f"distributed step ({backend})", COLUMNS)
    args = argparse.Namespace(
        tokens=tokens, layers=layers, dry_run=dry_run, cases=tuple(cases), trials=trials
    )
    for world in worlds:
        if backend == "nccl" and torch.cuda.device_count() < world:
            print(f"skipping world {world}: needs {world} GPUs, found {torch.cuda.device_count()}")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.pkl")
            mp.spawn(_worker, args=(world, backend, os.path.join(tmp, "init"), out, args), nprocs=world)
            with open(out, "rb") as f:
                for row in pickle.load(f):
                    table.add(*row)
    return table


def dry_run(cases=CASES) -> Table:
    """Every case once on 2 gloo ranks, tiny, untimed, rows checked on every rank."""
    return measure("gloo", [2], DRY_TOKENS, DRY_LAYERS, dry_run=True, cases=cases)


OPTIONS = [
    option(
        "--backend",
        "gloo",
        choices=("gloo", "nccl"),
        help="gloo (CPU, for the record) or nccl (a GPU per rank)",
    ),
    option("--worlds", (2, 4), type=int_list, help="world sizes, comma-separated (default 2,4)"),
    option("--tokens", TOKENS, type=int, help=f"rows per DP rank (default {TOKENS})"),
    option("--layers", NUM_LAYERS, type=int, help=f"MoE layers (default {NUM_LAYERS})"),
]


@benchmark(
    "distributed", cases=CASES, needs="cpu", options=OPTIONS, dry_run=lambda cases, run: dry_run(cases)
)
def distributed(cases, run) -> Table:
    """Per-step cost of the DP count exchange and of the capture across processes (gloo or NCCL)."""
    if run.backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("--backend nccl needs CUDA GPUs (one per rank)")
    trials = QUICK_TRIALS if run.quick else TRIALS
    return measure(run.backend, list(run.worlds), run.tokens, run.layers, cases=cases, trials=trials)


if __name__ == "__main__":
    from benchmarks.registry import main

    sys.exit(main(["distributed", *sys.argv[1:]]))
