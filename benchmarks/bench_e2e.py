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

    python benchmarks/bench_e2e.py [--csv out.csv] [--batches 1,16,128] [--mode cuda-graph] [--peers ...]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
from collections import deque
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import Table
from moe_ops import RoutingCapturer
from moe_ops.demo import greedy_step, step_inputs
from moe_ops.graphs import RunnerMode, StepRunner
from moe_ops.models import ReferenceMoEModel, reference_config

POSITION = 64  # decode position of every request
TARGET = 1.01
PEERS = ("off", "on", "on+snapshot", "off[auto]")


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
    from moe_ops.route import RoutingMethod
    from moe_ops.route.policy import routing_backend

    return routing_backend(RoutingMethod.DEEPSEEK_V3, device).backend == "flashinfer"


def measure(model, batch: int, peer: str, mode: RunnerMode, steps: int, trials: int) -> tuple[float, float]:
    """(graph_us, step_us) of one peer at one batch size."""
    device = model.embed.device
    capture = peer in ("on", "on+snapshot")
    model.set_router_backend("auto" if peer == "off[auto]" else "triton")
    capturer = RoutingCapturer(model.config.routing_shape(), batch, device, ring_depth=3) if capture else None
    runner = StepRunner(
        greedy_step(model, capturer),
        step_inputs(model),
        mode=mode,
        capture_sizes=(batch,),
        device=device,
        capturer=capturer,
    )
    g = torch.Generator(device=device).manual_seed(batch)
    tokens = torch.randint(1, model.config.vocab_size, (batch,), device=device, generator=g)
    positions = torch.full((batch,), POSITION, dtype=torch.int64, device=device)
    slots = torch.arange(batch, dtype=torch.int64, device=device)
    runner.warm_up()
    runner.step(tokens, positions, slots)
    pending: deque = deque()

    def step() -> None:
        runner.step(tokens, positions, slots)
        if peer == "on+snapshot":
            if len(pending) == 2:
                pending.popleft().release()  # rows nobody reads: released without a host wait
            pending.append(capturer.snapshot())

    step_us = cuda_time_us(step, steps, trials)
    graph = runner.graph(batch)
    graph_us = cuda_time_us(graph.replay, 50, trials)
    while pending:
        pending.popleft().release()
    if capturer is not None:
        capturer.pipeline.synchronize()
        capturer.check_errors()
    return graph_us, step_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--csv", default=None, help="append the rows to this CSV file")
    parser.add_argument("--batches", default="1,16,128", help="decode batch sizes (default 1,16,128)")
    parser.add_argument("--mode", default="cuda-graph", choices=["cuda-graph", "compiled+cuda-graph"])
    parser.add_argument("--preset", default="deepseek_small", help="reference model preset")
    parser.add_argument("--steps", type=int, default=30, help="steps per timed trial")
    parser.add_argument("--trials", type=int, default=15, help="timed trials (the median is reported)")
    parser.add_argument(
        "--peers",
        default=",".join(PEERS),
        help=f"comma-separated subset of {','.join(PEERS)} (off is always measured: the floor); "
        "off[auto] JIT-compiles FlashInfer's kernel on first use (about 20 s)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_e2e needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    config = reference_config(args.preset, router_backend="triton")
    batches = [int(b) for b in args.batches.split(",")]
    if max(batches) > config.max_requests:
        sys.exit(f"--batches go up to {max(batches)}, the preset has max_requests={config.max_requests}")
    model = ReferenceMoEModel(config, device)
    print(f"bench_e2e: {args.preset}: {model.extra_repr()}; mode {args.mode}", flush=True)
    wanted = set(args.peers.split(",")) | {"off"}
    unknown = wanted - set(PEERS)
    if unknown:
        sys.exit(f"--peers: unknown {sorted(unknown)}; choose from {', '.join(PEERS)}")
    peers = [p for p in PEERS if p in wanted]
    if "off[auto]" in peers and not auto_routes_with_flashinfer(device):
        peers.remove("off[auto]")
        print("off[auto] skipped: backend='auto' routes DeepSeek-V3 with the Triton kernel here", flush=True)

    table = Table(
        f"bench_e2e ({args.preset}, {args.mode}, decode at position {POSITION})",
        ["batch", "peer", "graph_us", "graph_vs_off", "step_us", "step_vs_off", "delta_us", "target"],
    )
    for batch in batches:
        times = {}
        for peer in peers:
            times[peer] = measure(model, batch, peer, RunnerMode(args.mode), args.steps, args.trials)
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
    table.print()
    if args.csv:
        table.write_csv(args.csv)


if __name__ == "__main__":
    main()
