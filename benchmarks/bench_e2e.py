"""End-to-end capture cost: steps of a small DeepSeek-V3-shaped model, capture off / on / on+snapshot.

Model: the reference model's ``deepseek_small`` preset (``moe_ops.models``): 9 layers (1 dense, 8
MoE), 256 experts, top-8, 8 groups keep 4, routed scaling 2.5, selection bias, hidden 2048, 16
heads, bf16; experts ``"auto"`` (steps of fewer than 32 rows gather their experts' weights, larger
ones run every expert). The router backend is ``"triton"`` on both sides, so the only difference is
the capture.

Modes (``--mode``), each run by ``graphs.StepRunner``:

* in CUDA graphs (``cuda-graph``, the default: the eager step captured once per batch size;
  ``compiled+cuda-graph``: the compiled step): decode steps, one row per request at position 64,
  at ``--batches``. Two times per peer: ``graph_us``, one replay of the step's graph (kernels only;
  median over trials of the mean of 50 replays), and ``step_us``, one ``StepRunner.step`` (input
  copies into the static buffers, ``set_step``, replay; plus the snapshot for ``on+snapshot``),
  timed with CUDA events around ``--steps`` consecutive steps (median over trials).
* outside CUDA graphs (``eager``; ``compiled``: ``torch.compile(fullgraph=True)``, rows dynamic, no
  graphs), where the host issues every launch and a capture's host cost per layer call
  (docs/performance.md, ``bench_capture --host``) lands in the step: decode steps at ``--batches``
  and prefill steps at ``--prefill`` tokens (whole 128-token prompts of 16 and 64 requests,
  positions 0-127, one KV slot each). One time per peer, ``step_us``: CUDA events around
  consecutive steps (as many as fill about 0.1 s, at least 2, at most ``--steps``), the peers of
  one size interleaved trial by trial (median over trials; ``off[auto]``, another router backend,
  measured alone after them).

Peers, per size (``PEERS``):

* ``off`` - ``route(...)`` without capture: the floor;
* ``on`` - ``route(..., capture=capturer.target(layer))`` in every MoE layer, and
  ``capturer.set_step`` before every step;
* ``on+snapshot`` - ``on`` plus ``capturer.snapshot()`` after every step (the async device-to-host
  copy on its own stream; each handle released two steps later, without waiting on the host);
* ``on+w`` / ``on+w+snapshot`` - ``on`` / ``on+snapshot`` with the weights channel
  (``RoutingCapturer(weights_dtype=torch.bfloat16)``: each layer's router also writes its weights,
  2 bytes an entry, and the snapshot copies them beside the ids);
* ``off[auto]`` - ``backend="auto"`` without capture: with FlashInfer installed and runnable, its
  ``fused_topk_deepseek`` routes DeepSeek-V3 (a different kernel), reported against ``off`` for
  context only (skipped where "auto" would pick the Triton router anyway).

Ratios divide by ``off`` of the same size measured in the same run; ``delta_us`` is the absolute
difference, ``delta_us/layer`` that divided by the 8 MoE layers (to set against the per-call host
costs above).

Targets: in CUDA graphs, ``on``, ``on+snapshot`` and their ``+w`` twins within **1.01x** of ``off``
(a serving engine reported about 2% throughput cost for its capture); outside them, within
**1.02x** at prefill sizes, and decode sizes reported as measured (a step of a few milliseconds
pays the per-call host cost of 8 captures).

Compiled peers: each compiled step is its own dynamo cache entry of one code object (the step
closure), so a step also evaluates the guards of the peers compiled before it (about a microsecond
each); the cache is reset between sizes.

Cases: ``BENCH_CASES["e2e"]`` (the preset; benchmarks/cases.py), decode batch sizes
``BENCH_SIZES["e2e"]``, prefill sizes ``PREFILL``.

    python -m benchmarks e2e [--csv out.csv] [--mode cuda-graph|compiled+cuda-graph|eager|compiled]
        [--batches 1,16,128] [--prefill 2048,8192] [--peers ...]
    python benchmarks/bench_e2e.py [the same flags]

``--dry-run`` steps every peer of every mode on the CPU (eager and compiled, decode and prefill
batches; the preset's routing on a narrow model: its experts, top-k, groups and bias, hidden 64,
float32, the PyTorch router) and checks that the capture buffer holds exactly the ids the model
routed: a check that the benchmark runs, without a GPU. The CUDA-graph modes need a GPU.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import statistics
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.cases import BENCH_CASES, BENCH_SIZES
from benchmarks.harness import Table
from benchmarks.registry import benchmark, option, sizes_option, table
from moe_ops import RoutingCapturer
from moe_ops.demo import greedy_step, step_inputs
from moe_ops.graphs import CompileCounters, RunnerMode, StepRunner
from moe_ops.models import ReferenceMoEModel, reference_config

POSITION = 64  # decode position of every request
TARGET = 1.01  # in CUDA graphs
TARGET_OUTSIDE_GRAPHS = 1.02  # eager and compiled, prefill sizes
PEERS = ("off", "on", "on+snapshot", "on+w", "on+w+snapshot", "off[auto]")
# the peers that capture, and those that also record the routing weights (bfloat16)
CAPTURING = ("on", "on+snapshot", "on+w", "on+w+snapshot")
WITH_WEIGHTS = ("on+w", "on+w+snapshot")
GRAPH_MODES = ("cuda-graph", "compiled+cuda-graph")
MODES = (*GRAPH_MODES, "eager", "compiled")
# prefill steps of the modes outside CUDA graphs: whole 128-token prompts of 16 and 64 requests
PREFILL = (2048, 8192)
# outside CUDA graphs a trial runs as many steps as fill about this long (at least 2)
TRIAL_SECONDS = 0.1
DRY_BATCHES = (1, 3)
DRY_PREFILL = (12,)  # two prompts of 8 and 4 tokens (the dry model's max_seq_len is 8)
DRY_MODES = ("eager", "compiled")
# the dry run's model: the case's routing (experts, top-k, groups, bias), everything else narrow
DRY_MODEL = dict(
    num_layers=3,
    hidden_size=64,
    num_heads=2,
    moe_intermediate_size=16,
    intermediate_size=64,
    vocab_size=256,
    max_requests=max(DRY_BATCHES),
    max_seq_len=8,
    dtype=torch.float32,
)


@dataclass(frozen=True)
class StepBatch:
    """The rows of one benchmarked step: ``n`` decode rows, or whole prompts (prefill)."""

    # "decode" or "prefill"
    kind: str
    # rows of the step
    n: int
    # (n,) int64 each: the step's inputs
    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_ids: torch.Tensor


def step_batch(config, kind: str, n: int, device: torch.device) -> StepBatch:
    """``decode``: one row per request (slots 0..n-1) at position 64 (the last position for a
    shorter model). ``prefill``: prompts of ``max_seq_len`` tokens (the last one shorter), one KV
    slot each, positions from 0. ValueError when the rows do not fit the model's slots."""
    g = torch.Generator().manual_seed(n)
    tokens = torch.randint(1, config.vocab_size, (n,), generator=g)
    if kind == "decode":
        if n > config.max_requests:
            raise ValueError(f"decode batch {n} > max_requests={config.max_requests} of the model")
        positions = torch.full((n,), min(POSITION, config.max_seq_len - 1), dtype=torch.int64)
        slots = torch.arange(n, dtype=torch.int64)
    elif kind == "prefill":
        length = config.max_seq_len
        if n > config.max_requests * length:
            raise ValueError(
                f"prefill of {n} tokens > max_requests * max_seq_len = {config.max_requests * length}"
            )
        positions = torch.arange(n, dtype=torch.int64) % length
        slots = torch.arange(n, dtype=torch.int64) // length
    else:
        raise ValueError(f"kind must be 'decode' or 'prefill', got {kind!r}")
    return StepBatch(kind, n, *(t.to(device) for t in (tokens, positions, slots)))


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
    """One peer, built: its runner (capture sizes ``capture_sizes``, default the batch's rows) and
    capturer, warmed up and stepped once on ``batch``; :meth:`step` runs ``inputs``."""

    def __init__(
        self,
        model,
        batch: StepBatch | int,
        peer: str,
        mode: RunnerMode,
        backend: str,
        capture_sizes: Sequence[int] | None = None,
    ):
        device = model.embed.device
        if isinstance(batch, int):  # a decode batch of that many requests
            batch = step_batch(model.config, "decode", batch, device)
        sizes = tuple(capture_sizes or (batch.n,))
        self.peer, self.batch = peer, batch.n
        self.use(batch)
        wanted = "auto" if peer == "off[auto]" else backend
        if model.config.router_backend != wanted:
            # a new config object: the steps compiled before it would recompile on their next call
            model.set_router_backend(wanted)
        capture = peer in CAPTURING
        weights = torch.bfloat16 if peer in WITH_WEIGHTS else None
        self.capturer = (
            RoutingCapturer(
                model.config.routing_shape(), max(sizes), device, ring_depth=3, weights_dtype=weights
            )
            if capture
            else None
        )
        self.runner = StepRunner(
            greedy_step(model, self.capturer),
            step_inputs(model),
            mode=mode,
            capture_sizes=sizes,
            device=device,
            capturer=self.capturer,
        )
        self.pending: deque = deque()
        self.runner.warm_up()
        self.runner.step(*self.inputs)

    def use(self, batch: StepBatch) -> None:
        """The batch :meth:`step` runs from now on (its rows <= the largest capture size)."""
        self.batch = batch.n
        self.inputs = (batch.token_ids, batch.positions, batch.slot_ids)

    def step(self) -> None:
        self.runner.step(*self.inputs)
        if self.peer.endswith("+snapshot"):
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
    """(graph_us, step_us) of one peer at one decode batch size, in a CUDA-graph mode."""
    p = Peer(model, batch, peer, mode, "triton")
    step_us = cuda_time_us(p.step, steps, trials)
    graph_us = cuda_time_us(p.runner.graph(batch).replay, 50, trials)
    p.close()
    return graph_us, step_us


def interleaved_step_us(
    steps: dict[str, Callable[[], object]], max_steps: int, trials: int
) -> dict[str, float]:
    """Per peer, the median over ``trials`` of the mean time of one step over consecutive steps
    (CUDA events on the current stream); the peers run one after another within each trial
    (A B C, A B C, ...), so drift hits them alike. Steps per trial: as many as fill
    ``TRIAL_SECONDS`` for the slowest peer, at least 2, at most ``max_steps``."""
    for fn in steps.values():  # warm: allocator, caches, the first snapshot slots
        fn()
    torch.cuda.synchronize()
    slowest = max(cuda_time_us(fn, 1, 1) for fn in steps.values())
    repeats = max(2, min(max_steps, math.ceil(TRIAL_SECONDS * 1e6 / max(slowest, 1.0))))
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(trials):
        for name, fn in steps.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / repeats)
    return {name: statistics.median(t) for name, t in times.items()}


def measure_outside_graphs(
    model, batch: StepBatch, peers: Sequence[str], mode: RunnerMode, steps: int, trials: int
) -> dict[str, float]:
    """step_us of every peer at one step batch, eager or compiled (no CUDA graphs). The peers that
    route with the Triton kernel run interleaved; ``off[auto]`` (another router backend, read by the
    eager step at every call) is measured alone after them, for context."""
    times: dict[str, float] = {}
    for group in ([p for p in peers if p != "off[auto]"], [p for p in peers if p == "off[auto]"]):
        built = {}
        try:
            for peer in group:
                built[peer] = Peer(model, batch, peer, mode, "triton")
            if built:
                times.update(interleaved_step_us({name: p.step for name, p in built.items()}, steps, trials))
        finally:
            for p in built.values():
                p.close()
            if mode.compiles:
                torch._dynamo.reset()  # the next peers compile afresh, alone in the cache
    if model.config.router_backend != "triton":
        model.set_router_backend("triton")
    return {peer: times[peer] for peer in peers}


def _peers(requested: str) -> list[str]:
    wanted = set(requested.split(",")) | {"off"}
    unknown = wanted - set(PEERS)
    if unknown:
        raise ValueError(f"--peers: unknown {sorted(unknown)}; choose from {', '.join(PEERS)}")
    return [p for p in PEERS if p in wanted]


def _cpu_inductor() -> contextlib.AbstractContextManager:
    """The dry run compiles without SIMD code on the CPU (as ``moe-ops demo`` does): nothing is timed,
    and the vectorised kernels cost a 2-core machine most of a cold compile."""
    if "TORCHINDUCTOR_VEC_ISA_OK" in os.environ:
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config

    return inductor_config.patch({"cpp.vec_isa_ok": False})


def dry_run(cases, run) -> list[Table]:
    """Every peer of every case stepped on the CPU, eager and compiled, at decode and prefill batches;
    the capture buffer checked against the ids the model routed. One runner per peer and mode serves
    every batch (compiled: one graph for the sizes >= 2, one for size 1), and each compiled peer
    must have compiled (a peer over dynamo's recompile limit would run eagerly without a word)."""
    peers = _peers(run.peers)
    device = torch.device("cpu")
    table = Table(
        "bench_e2e dry run (cpu, eager and compiled, narrow model, not timed)",
        ["case", "mode", "kind", "tokens", "peer", "checked"],
    )
    sizes = (*DRY_BATCHES, *DRY_PREFILL)
    for case in cases:
        config = reference_config(case.name, router_backend="torch", **DRY_MODEL)
        model = ReferenceMoEModel(config, device)
        batches = [step_batch(config, "decode", n, device) for n in DRY_BATCHES]
        batches += [step_batch(config, "prefill", n, device) for n in DRY_PREFILL]
        for mode in map(RunnerMode, DRY_MODES):
            for peer in peers:
                with _cpu_inductor() if mode.compiles else contextlib.nullcontext(), CompileCounters() as cc:
                    p = Peer(model, batches[0], peer, mode, "torch", capture_sizes=sizes)
                    for batch in batches:
                        p.use(batch)
                        p.step()
                        checked = "-"
                        if p.capturer is not None:
                            p.capturer.buffer.fill_(-1)
                            wbuf = p.capturer.weights_buffer
                            if wbuf is not None:
                                wbuf.fill_(float("nan"))
                            p.step()
                            _, ids = model(*p.inputs, return_router_ids=True)
                            where = f"{case.name} {mode.value} {batch.kind} {batch.n} {peer}"
                            assert torch.equal(p.capturer.buffer[: batch.n], ids), where
                            checked = "capture == routed ids"
                            if wbuf is not None:
                                # every routed row's weights written (finite), nothing past them
                                assert not wbuf[: batch.n].isnan().any() and wbuf[batch.n :].isnan().all(), (
                                    where
                                )
                                checked += ", weights written"
                        table.add(case.name, mode.value, batch.kind, batch.n, peer, checked)
                    p.close()
                if mode.compiles:
                    assert cc.graphs >= 1 and cc.graph_breaks == 0, f"{case.name} {peer}: {cc.graphs} graphs"
                    torch._dynamo.reset()  # every peer compiles in a cache of its own
    return [table]


@benchmark(
    "e2e",
    cases=BENCH_CASES["e2e"],
    options=[
        sizes_option("--batches", BENCH_SIZES["e2e"], "decode batch sizes"),
        sizes_option("--prefill", PREFILL, "prefill step sizes in tokens (--mode eager and compiled)"),
        option(
            "--mode",
            "cuda-graph",
            choices=MODES,
            help="runner mode: in CUDA graphs (cuda-graph, compiled+cuda-graph) or outside them (eager, "
            "compiled; these also measure --prefill)",
        ),
        option("--preset", None, choices=[c.name for c in BENCH_CASES["e2e"]], help="one case (default all)"),
        option("--steps", 30, type=int, help="steps per timed trial (at most, outside CUDA graphs)"),
        option("--trials", 15, type=int, help="timed trials (the median is reported)"),
        option(
            "--peers",
            ",".join(PEERS),
            help=f"comma-separated subset of {','.join(PEERS)} (off is always measured: the floor); "
            "off[auto] JIT-compiles FlashInfer's kernel on first use (about 20 s)",
        ),
    ],
    dry_run=dry_run,
    tables=[
        table("decode steps in CUDA graphs", flags="--mode cuda-graph|compiled+cuda-graph"),
        table("decode and prefill steps outside CUDA graphs", flags="--mode eager|compiled"),
    ],
)
def e2e(cases, run) -> list[Table]:
    """Steps of a DeepSeek-V3-shaped model, capture off / on / on+snapshot, in CUDA graphs or outside them."""
    device = torch.device("cuda", torch.cuda.current_device())
    # --quick: 10 steps, 5 trials, unless given
    steps = 10 if run.quick and "steps" not in run.given else run.steps
    trials = 5 if run.quick and "trials" not in run.given else run.trials
    if steps < 1 or trials < 1:
        raise ValueError(f"--steps and --trials take ints >= 1, got {steps} and {trials}")
    peers = _peers(run.peers)
    mode = RunnerMode(run.mode)
    tables = []
    for case in cases:
        if run.preset is not None and case.name != run.preset:
            continue
        config = reference_config(case.name, router_backend="triton")
        batches = [("decode", n) for n in run.batches]
        if run.mode not in GRAPH_MODES:
            batches += [("prefill", n) for n in run.prefill]
        for kind, n in batches:  # every size checked before the model is built
            step_batch(config, kind, n, torch.device("cpu"))
        model = ReferenceMoEModel(config, device)
        print(f"bench_e2e: {case.name}: {model.extra_repr()}; mode {run.mode}", flush=True)
        case_peers = list(peers)
        if "off[auto]" in case_peers and not auto_routes_with_flashinfer(device):
            case_peers.remove("off[auto]")
            print(
                "off[auto] skipped: backend='auto' routes DeepSeek-V3 with the Triton kernel here", flush=True
            )
        if run.mode in GRAPH_MODES:
            tables.append(_graph_table(model, case, run, mode, case_peers, steps, trials))
        else:
            tables.append(_outside_graphs_table(model, case, mode, batches, case_peers, steps, trials))
    return tables


def _graph_table(model, case, run, mode, case_peers, steps, trials) -> Table:
    table = Table(
        f"bench_e2e ({case.name}, {run.mode}, decode at position {POSITION})",
        ["batch", "peer", "graph_us", "graph_vs_off", "step_us", "step_vs_off", "delta_us", "target"],
    )
    for batch in run.batches:
        times = {}
        for peer in case_peers:
            times[peer] = measure(model, batch, peer, mode, steps, trials)
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
        print(f"  batch {batch}: done", file=sys.stderr, flush=True)
    return table


def _outside_graphs_table(model, case, mode, batches, case_peers, steps, trials) -> Table:
    layers = model.config.num_moe_layers
    position, prompt = min(POSITION, model.config.max_seq_len - 1), model.config.max_seq_len
    table = Table(
        f"bench_e2e ({case.name}, {mode.value}, no CUDA graphs; decode at position {position}, prefill of "
        f"{prompt}-token prompts)",
        ["kind", "tokens", "peer", "step_us", "step_vs_off", "delta_us", "delta_us/layer", "target"],
    )
    for kind, n in batches:
        batch = step_batch(model.config, kind, n, model.embed.device)
        times = measure_outside_graphs(model, batch, case_peers, mode, steps, trials)
        gc.collect()  # the peers' runners and capturers
        torch.cuda.empty_cache()
        off = times["off"]
        for peer, step_us in times.items():
            if peer == "off":
                target = "floor"
            elif peer == "off[auto]":
                target = "context"
            else:
                target = f"<= {TARGET_OUTSIDE_GRAPHS}" if kind == "prefill" else "report"
            delta = step_us - off
            table.add(kind, n, peer, step_us, step_us / off, delta, delta / layers, target)
        print(f"  {kind} {n}: done", file=sys.stderr, flush=True)
    return table


if __name__ == "__main__":
    from benchmarks.registry import main

    sys.exit(main(["e2e", *sys.argv[1:]]))
