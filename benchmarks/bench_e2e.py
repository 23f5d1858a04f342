"""End-to-end capture cost: decode steps of a small DeepSeek-V3-shaped model under CUDA graphs.

Model: the reference model's ``deepseek_small`` preset (``moe_ops.models``): 9 layers (1 dense, 8
MoE), 256 experts, top-8, 8 groups keep 4, routed scaling 2.5, selection bias, hidden 2048, 16
heads, bf16; experts ``"auto"`` (batch 1 and 16 gather their experts' weights, batch 128 runs every
expert). Step: one decode row per request at position 64, greedy sampling, replayed by
``graphs.StepRunner`` in ``cuda-graph`` mode (the eager step captured once per batch size; pass
``--mode compiled+cuda-graph`` for the compiled step). The router backend is ``"triton"`` on both
sides, so the only difference is the capture.

Peers, per batch size in {1, 16, 128} (``PEERS``):

* ``off`` - ``route(...)`` without capture: the floor;
* ``on`` - ``route(..., capture=capturer.target(layer))`` in every MoE layer, and
  ``capturer.set_step`` before every step;
* ``on+snapshot`` - ``on`` plus ``capturer.snapshot()`` after every step (the async device-to-host
  copy on its own stream; each handle released two steps later, without waiting on the host);
* ``off[auto]`` - ``backend="auto"`` without capture: with FlashInfer installed and runnable, its
  ``fused_topk_deepseek`` routes DeepSeek-V3 (a different kernel), reported against ``off`` for
  context only (skipped where "auto" would pick the Triton router anyway).

Two times per peer: ``graph_us``, one replay of the step's CUDA graph (kernels only; median over
trials of the mean of 50 replays), and ``step_us``, one ``StepRunner.step`` (input copies into the
static buffers, ``set_step``, replay; plus the snapshot for ``on+snapshot``), timed with CUDA events
around 30 consecutive steps (median over trials). Ratios divide by ``off`` of the same batch size
measured in the same run; ``delta_us`` is the absolute difference.

Target: ``on`` and ``on+snapshot`` within **1.01x** of ``off`` (a serving engine reported
about 2% throughput cost for its capture).

Cases: ``BENCH_CASES["e2e"]`` (the preset; tests/strategies.py), batch sizes ``BENCH_SIZES["e2e"]``.

    python -m benchmarks e2e [--csv out.csv] [--batches 1,16,128] [--mode cuda-graph] [--peers ...]
    python benchmarks/bench_e2e.py [the same flags]

``--dry-run`` steps every peer once on the CPU (eager, the preset's routing on a narrow model: its
experts, top-k, groups and bias, hidden 64, float32, the PyTorch router) and checks that the capture
buffer holds exactly the ids the model routed: a check that the benchmark runs, without a GPU.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
from collections import deque
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import Table
from benchmarks.registry import BENCH_CASES, BENCH_SIZES, benchmark, option, sizes_option
from moe_ops import RoutingCapturer
from moe_ops.demo import greedy_step, step_inputs
from moe_ops.graphs import RunnerMode, StepRunner
from moe_ops.models import ReferenceMoEModel, reference_config

POSITION = 64  # decode position of every request
TARGET = 1.01
PEERS = ("off", "on", "on+snapshot", "off[auto]")
DRY_BATCHES = (1, 3)
# the dry run's model: the case's routing (experts, top-k, groups, bias), everything else narrow
DRY_MODEL = dict(
    num_layers=3,
    hidden_size=64,
    num_heads=2,
    moe_intermediate_size=16,
    intermediate_size=64,
    vocab_size=256,
    max_requests=max(DRY_BATCHES),
    dtype=torch.float32,
)


def cuda_time_us(fn: Callable[[], object], repeats: int, trials: int) -> float:
    """Median over ``trials`` of the mean time of ``fn`` over ``repeats`` back-to-back calls (CUDA
    events on the current stream)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / repeats)
    return statistics.median(times)


def auto_routes_with_flashinfer(device: torch.device) -> bool:
    """Whether backend="auto" sends DeepSeek-V3 routing without capture to FlashInfer here."""
    from moe_ops.router import RoutingMethod
    from moe_ops.router.policy import routing_backend

    return routing_backend(RoutingMethod.DEEPSEEK_V3, device).backend == "flashinfer"


class Peer:
    """One peer at one batch size, built: its runner (capture size ``batch``), inputs and capturer."""

    def __init__(self, model, batch: int, peer: str, mode: RunnerMode, backend: str):
        device = model.embed.device
        self.peer, self.batch = peer, batch
        model.set_router_backend("auto" if peer == "off[auto]" else backend)
        capture = peer in ("on", "on+snapshot")
        self.capturer = (
            RoutingCapturer(model.config.routing_shape(), batch, device, ring_depth=3) if capture else None
        )
        self.runner = StepRunner(
            greedy_step(model, self.capturer),
            step_inputs(model),
            mode=mode,
            capture_sizes=(batch,),
            device=device,
            capturer=self.capturer,
        )
        g = torch.Generator(device=device).manual_seed(batch)
        self.tokens = torch.randint(1, model.config.vocab_size, (batch,), device=device, generator=g)
        self.positions = torch.full((batch,), POSITION, dtype=torch.int64, device=device)
        self.slots = torch.arange(batch, dtype=torch.int64, device=device)
        self.pending: deque = deque()
        self.runner.warm_up()
        self.runner.step(self.tokens, self.positions, self.slots)

    def step(self) -> None:
        self.runner.step(self.tokens, self.positions, self.slots)
        if self.peer == "on+snapshot":
            if len(self.pending) == 2:
                self.pending.popleft().release()  # rows nobody reads: released without a host wait
            self.pending.append(self.capturer.snapshot())

    def close(self) -> None:
        while self.pending:
            self.pending.popleft().release()
        if self.capturer is not None:
            self.capturer.pipeline.synchronize()
            self.capturer.check_errors()


def measure(model, batch: int, peer: str, mode: RunnerMode, steps: int, trials: int) -> tuple[float, float]:
    """(graph_us, step_us) of one peer at one batch size."""
    p = Peer(model, batch, peer, mode, "triton")
    step_us = cuda_time_us(p.step, steps, trials)
    graph_us = cuda_time_us(p.runner.graph(batch).replay, 50, trials)
    p.close()
    return graph_us, step_us


def _peers(requested: str) -> list[str]:
    wanted = set(requested.split(",")) | {"off"}
    unknown = wanted - set(PEERS)
    if unknown:
        raise ValueError(f"--peers: unknown {sorted(unknown)}; choose from {', '.join(PEERS)}")
    return [p for p in PEERS if p in wanted]


def dry_run(cases, run) -> list[Table]:
    """Every peer of every case stepped once on the CPU, eagerly; the capture buffer checked."""
    peers = _peers(run.peers)
    table = Table(
        "bench_e2e dry run (cpu, eager, narrow model, not timed)", ["case", "batch", "peer", "checked"]
    )
    for case in cases:
        config = reference_config(case.name, router_backend="torch", **DRY_MODEL)
        model = ReferenceMoEModel(config, torch.device("cpu"))
        for batch in DRY_BATCHES:
            for peer in peers:
                p = Peer(model, batch, peer, RunnerMode.EAGER, "torch")
                p.step()
                checked = "-"
                if p.capturer is not None:
                    p.capturer.buffer.fill_(-1)
                    p.step()
                    _, ids = model(p.tokens, p.positions, p.slots, return_router_ids=True)
                    assert torch.equal(p.capturer.buffer[:batch], ids), f"{case.name} {peer} batch {batch}"
                    checked = "capture == routed ids"
                p.close()
                table.add(case.name, batch, peer, checked)
    return [table]


@benchmark(
    "e2e",
    cases=BENCH_CASES["e2e"],
    options=[
        sizes_option("--batches", BENCH_SIZES["e2e"], "decode batch sizes"),
        option("--mode", "cuda-graph", choices=["cuda-graph", "compiled+cuda-graph"], help="runner mode"),
        option("--preset", None, choices=[c.name for c in BENCH_CASES["e2e"]], help="one case (default all)"),
        option("--steps", 30, type=int, help="steps per timed trial"),
        option("--trials", 15, type=int, help="timed trials (the median is reported)"),
        option(
            "--peers",
            ",".join(PEERS),
            help=f"comma-separated subset of {','.join(PEERS)} (off is always measured: the floor); "
            "off[auto] JIT-compiles FlashInfer's kernel on first use (about 20 s)",
        ),
    ],
    dry_run=dry_run,
)
def e2e(cases, run) -> list[Table]:
    """Decode steps of a DeepSeek-V3-shaped model under CUDA graphs, capture off / on / on+snapshot."""
    device = torch.device("cuda", torch.cuda.current_device())
    # --quick: 10 steps, 5 trials, unless given
    steps = 10 if run.quick and "steps" not in run.given else run.steps
    trials = 5 if run.quick and "trials" not in run.given else run.trials
    peers = _peers(run.peers)
    tables = []
    for case in cases:
        if run.preset is not None and case.name != run.preset:
            continue
        config = reference_config(case.name, router_backend="triton")
        batches = list(run.batches)
        if max(batches) > config.max_requests:
            raise ValueError(
                f"--batches go up to {max(batches)}, {case.name} has max_requests={config.max_requests}"
            )
        model = ReferenceMoEModel(config, device)
        print(f"bench_e2e: {case.name}: {model.extra_repr()}; mode {run.mode}", flush=True)
        case_peers = list(peers)
        if "off[auto]" in case_peers and not auto_routes_with_flashinfer(device):
            case_peers.remove("off[auto]")
            print(
                "off[auto] skipped: backend='auto' routes DeepSeek-V3 with the Triton kernel here", flush=True
            )
        table = Table(
            f"bench_e2e ({case.name}, {run.mode}, decode at position {POSITION})",
            ["batch", "peer", "graph_us", "graph_vs_off", "step_us", "step_vs_off", "delta_us", "target"],
        )
        for batch in batches:
            times = {}
            for peer in case_peers:
                times[peer] = measure(model, batch, peer, RunnerMode(run.mode), steps, trials)
                gc.collect()  # the peer's runner, graph and capturer
                torch.cuda.empty_cache()
            off_graph, off_step = times["off"]
            for peer, (graph_us, step_us) in times.items():
                target = {"off": "floor", "off[auto]": "context"}.get(peer, f"<= {TARGET}")
                table.add(
                    batch,
                    peer,
                    graph_us,
                    graph_us / off_graph,
                    step_us,
                    step_us / off_step,
                    step_us - off_step,
                    target,
                )
            print(f"  batch {batch}: done", flush=True)
        tables.append(table)
    return tables


if __name__ == "__main__":
    from benchmarks.registry import main

    sys.exit(main(["e2e", *sys.argv[1:]]))
