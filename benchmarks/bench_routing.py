"""Router cost: the Triton router with and without its fused capture, against PyTorch peers.

Cases (``CASES``: ``BENCH_CASES["routing"]`` of benchmarks/cases.py, at ``BENCH_SIZES["routing"]``):
DeepSeek-V3 routing (256 experts, top_k 8, 8 groups, topk_group 4, routed scaling 2.5, bias) and
RENORMALIZE with 128 and 512 experts (top_k 8), at n in {1, 128, 4096}.
Peers (``PEERS``, one function each, building a zero-argument callable for a case or returning
None when it does not apply):

* ``triton+capture`` - ``route(..., capture=CaptureTarget(...))``: routes and records (LOCAL; and
  GATHERED, 4 DP ranks, for DeepSeek-V3 as ``triton+capture[G]``);
* ``triton+capture+w`` - the same with the weights channel on (``weights_buffer``: bfloat16, moe-ops'
  own 2-byte format, written in the same launch beside the ids);
* ``triton`` - ``route(...)`` alone (the floor of the fused capture);
* ``compiled-ref`` - ``torch.compile`` of the PyTorch reference (DeepSeek-V3 only: each size is an
  inductor compile);
* ``eager-ref`` - the PyTorch reference, eagerly.

* ``flashinfer`` / ``flashinfer+replay`` - FlashInfer's ``fused_topk_deepseek`` kernel without and
  with its int16 ``routing_replay_out`` (DeepSeek-V3, where FlashInfer runs);
* ``flashinfer-route`` - ``route(..., backend="flashinfer")``: the kernel plus the float32 cast of
  its weights (the user-facing FlashInfer path; the peer ``backend="auto"`` is decided against);
* ``flashinfer+capture`` - ``route(..., backend="flashinfer", capture=...)``: that kernel's replay
  rows plus one ``capture_routing`` into the buffer.

Three times per peer: ``eager_us`` (``do_bench`` median, Python dispatch included), ``graph_us``
(one call inside a CUDA graph of 61 calls - DeepSeek-V3's MoE layers each route once per step -
replayed, peers interleaved trial by trial) and ``device_us`` (the kernels' own GPU time from the
profiler, no launch gaps). ``graph_vs_flashinfer`` divides by the bare ``flashinfer`` kernel
measured in the same run.

Targets: ``triton+capture`` and ``triton+capture+w`` within 1.02x of ``triton`` (the capture nearly free),
and for DeepSeek-V3 within 1.2x of FlashInfer's ``fused_topk_deepseek`` - quoted there for an H200
as 5.5 us at 1 and 128 tokens and 16.6 us at 4096; the summary also divides by the FlashInfer
kernel measured in the same run, graph and device time.

Host mode (``--host``; runs on the CPU too): host us per layer call of ``route`` (RENORMALIZE, 64
tokens, 256 experts, top_k 8) beside ``torch.topk(softmax)``, eager / compiled / inside a CUDA graph.

    python benchmarks/bench_routing.py [--csv out.csv] [--sizes 1,128,4096] [--sweep [--sweep-sizes ...]]
    python benchmarks/bench_routing.py --host [--csv out.csv]
    python -m benchmarks routing [...the same flags]
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.cases import BENCH_CASES, BENCH_SIZES, BenchRouter
from benchmarks.harness import Table, device_us_per_call, do_bench_median_us, graph_calls_us, step
from benchmarks.host import host_us_per_call, target_column, target_note
from benchmarks.registry import benchmark, main, sizes_option, switch
from moe_ops import BatchLayout, CaptureTarget, RoutingMethod, route
from moe_ops._runtime.library import HAS_WRAP_TRITON, trace_triton_kernels
from moe_ops.router.args import tile_shape, validate_route_args
from moe_ops.router.reference import route_reference

LAYERS = 61  # DeepSeek-V3's MoE-bearing depth: the capture buffer's layer axis
MAX_TOKENS = 4096  # capture buffer rows (more when a benchmarked batch is larger)
# FlashInfer fused_topk_deepseek on an H200, with or without its replay output, in us.
FLASHINFER_QUOTED_US = {1: 5.5, 128: 5.5, 4096: 16.6}


# the routers measured, in table order, each naming the test that routes it
Case = BenchRouter
CASES = BENCH_CASES["routing"]


@dataclass
class Inputs:
    """The tensors of one (case, n): static addresses, as a CUDA-graphed step would hold them."""

    # (n, E) bf16 router logits
    logits: torch.Tensor
    # (E,) float32 selection bias or None
    bias: torch.Tensor | None
    # (max(MAX_TOKENS, n), LAYERS, top_k) int32 capture buffer
    buffer: torch.Tensor
    # (max(MAX_TOKENS, n), LAYERS, top_k) bf16 weights channel beside buffer
    weights_buffer: torch.Tensor
    # (1,) int32 = [n]: LOCAL counts
    counts: torch.Tensor
    # (n * 4, E) bf16 logits of a 4-rank gather and its (4,) int32 counts (rank 3 is us)
    gathered_logits: torch.Tensor
    gathered_counts: torch.Tensor

    def kwargs(self, case: Case) -> dict:
        return dict(
            bias=self.bias,
            n_group=case.n_group,
            topk_group=case.topk_group,
            routed_scaling_factor=case.routed_scaling_factor,
        )


def make_inputs(case: Case, n: int, device) -> Inputs:
    g = torch.Generator(device=device).manual_seed(n)
    logits = torch.randn(n, case.num_experts, device=device, generator=g).to(torch.bfloat16)
    bias = torch.randn(case.num_experts, device=device, generator=g) * 0.1 if case.has_bias else None
    dp = 4
    return Inputs(
        logits=logits,
        bias=bias,
        buffer=torch.zeros(max(MAX_TOKENS, n), LAYERS, case.top_k, dtype=torch.int32, device=device),
        weights_buffer=torch.zeros(
            max(MAX_TOKENS, n), LAYERS, case.top_k, dtype=torch.bfloat16, device=device
        ),
        counts=torch.tensor([n], dtype=torch.int32, device=device),
        gathered_logits=torch.randn(n * dp, case.num_experts, device=device, generator=g).to(torch.bfloat16),
        gathered_counts=torch.full((dp,), n, dtype=torch.int32, device=device),
    )


def peer_triton(case: Case, x: Inputs) -> Callable[[], object]:
    kw = x.kwargs(case)
    return lambda: route(x.logits, case.top_k, case.method, backend="triton", **kw)


def peer_triton_capture(case: Case, x: Inputs) -> Callable[[], object]:
    kw = x.kwargs(case)
    target = CaptureTarget(x.buffer, LAYERS - 1, token_counts=x.counts)
    return lambda: route(x.logits, case.top_k, case.method, capture=target, backend="triton", **kw)


def peer_triton_capture_weights(case: Case, x: Inputs) -> Callable[[], object]:
    kw = x.kwargs(case)
    target = CaptureTarget(x.buffer, LAYERS - 1, token_counts=x.counts, weights_buffer=x.weights_buffer)
    return lambda: route(x.logits, case.top_k, case.method, capture=target, backend="triton", **kw)


def peer_triton_capture_gathered(case: Case, x: Inputs) -> Callable[[], object] | None:
    if case.method != RoutingMethod.DEEPSEEK_V3:
        return None
    kw = x.kwargs(case)
    target = CaptureTarget(
        x.buffer, LAYERS - 1, token_counts=x.gathered_counts, dp_rank=3, layout=BatchLayout.GATHERED
    )
    return lambda: route(x.gathered_logits, case.top_k, case.method, capture=target, backend="triton", **kw)


def peer_triton_gathered(case: Case, x: Inputs) -> Callable[[], object] | None:
    if case.method != RoutingMethod.DEEPSEEK_V3:
        return None
    kw = x.kwargs(case)
    return lambda: route(x.gathered_logits, case.top_k, case.method, backend="triton", **kw)


def _reference(case: Case, x: Inputs) -> Callable[[], object]:
    # the validated config: groups, scale and the method's own group score (DeepSeek-V2: MAX)
    cfg = validate_route_args(
        x.logits, case.top_k, case.method, x.bias, case.n_group, case.topk_group, case.routed_scaling_factor
    )
    n_group, topk_group, scale, top = cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.group_top
    return lambda: route_reference(
        x.logits, case.top_k, case.method, x.bias, n_group, topk_group, scale, group_top=top
    )


def peer_eager_reference(case: Case, x: Inputs) -> Callable[[], object]:
    return _reference(case, x)


def peer_compiled_reference(case: Case, x: Inputs) -> Callable[[], object] | None:
    if case.method != RoutingMethod.DEEPSEEK_V3:
        return None
    return torch.compile(_reference(case, x), fullgraph=True, dynamic=False)


def _flashinfer_runs(case: Case, x: Inputs) -> bool:
    """FlashInfer's fused_topk_deepseek is a peer for DeepSeek-V3 where it runs (SM89+, installed)."""
    if case.method != RoutingMethod.DEEPSEEK_V3:
        return False
    from moe_ops.flashinfer.backends import fused_topk_support

    return fused_topk_support(x.logits.device).ok


def peer_flashinfer_kernel(replay: bool) -> Callable[[Case, Inputs], Callable[[], object] | None]:
    """The bare ``fused_topk_deepseek`` kernel, with or without its int16 ``routing_replay_out``."""

    def build(case: Case, x: Inputs) -> Callable[[], object] | None:
        if not _flashinfer_runs(case, x):
            return None
        from moe_ops.flashinfer import ops

        n, dev = x.logits.shape[0], x.logits.device
        values = torch.empty(n, case.top_k, dtype=x.logits.dtype, device=dev)
        indices = torch.empty(n, case.top_k, dtype=torch.int32, device=dev)
        out = torch.empty(n, case.top_k, dtype=torch.int16, device=dev) if replay else None
        return lambda: ops.call(
            "fused_topk_deepseek",
            scores=x.logits,
            bias=x.bias,
            n_group=case.n_group,
            topk_group=case.topk_group,
            topk=case.top_k,
            routed_scaling_factor=case.routed_scaling_factor,
            topk_values=values,
            topk_indices=indices,
            routing_replay_out=out,
        )

    return build


def peer_flashinfer_capture(case: Case, x: Inputs) -> Callable[[], object] | None:
    """``route(..., backend="flashinfer", capture=...)``: the kernel's replay rows + the capture op."""
    if not _flashinfer_runs(case, x):
        return None
    kw = x.kwargs(case)
    target = CaptureTarget(x.buffer, LAYERS - 1, token_counts=x.counts)
    return lambda: route(x.logits, case.top_k, case.method, capture=target, backend="flashinfer", **kw)


def peer_flashinfer_route(case: Case, x: Inputs) -> Callable[[], object] | None:
    """``route(..., backend="flashinfer")`` without capture: the kernel plus the cast of its weights
    to float32 - what ``backend="auto"`` would cost if it chose FlashInfer."""
    if not _flashinfer_runs(case, x):
        return None
    kw = x.kwargs(case)
    return lambda: route(x.logits, case.top_k, case.method, backend="flashinfer", **kw)


# name -> builder(case, inputs) -> zero-argument callable (or None: not measured for this case)
PEERS: dict[str, Callable[[Case, Inputs], Callable[[], object] | None]] = {
    "triton+capture": peer_triton_capture,
    "triton+capture+w": peer_triton_capture_weights,
    "triton": peer_triton,
    "flashinfer": peer_flashinfer_kernel(replay=False),
    "flashinfer+replay": peer_flashinfer_kernel(replay=True),
    "flashinfer-route": peer_flashinfer_route,
    "flashinfer+capture": peer_flashinfer_capture,
    "triton+capture[G]": peer_triton_capture_gathered,
    "triton[G]": peer_triton_gathered,
    "compiled-ref": peer_compiled_reference,
    "eager-ref": peer_eager_reference,
}


def check_capture(case: Case, x: Inputs, n: int) -> None:
    """The benchmarked fused call records exactly what route + capture_routing would."""
    x.buffer.fill_(-1)
    _, ids = peer_triton_capture(case, x)()
    torch.cuda.synchronize()
    assert torch.equal(x.buffer[:n, LAYERS - 1], ids), "benchmark capture wrote wrong rows"
    assert (x.buffer[n:] == -1).all() and (x.buffer[:, : LAYERS - 1] == -1).all()
    # with the weights channel: the same ids, and the weights route returned, rounded to bf16
    x.buffer.fill_(-1)
    x.weights_buffer.fill_(float("nan"))
    weights, ids = peer_triton_capture_weights(case, x)()
    torch.cuda.synchronize()
    assert torch.equal(x.buffer[:n, LAYERS - 1], ids), "benchmark capture (+weights) wrote wrong ids"
    assert torch.equal(x.weights_buffer[:n, LAYERS - 1], weights.to(torch.bfloat16)), "wrong weights"
    assert x.weights_buffer[n:].isnan().all() and x.weights_buffer[:, : LAYERS - 1].isnan().all()


# peers timed inside graphs of GRAPH_CALLS calls, and the slow references in graphs of REF_CALLS
GRAPH_CALLS = LAYERS
REF_CALLS = 8
REFERENCES = ("compiled-ref", "eager-ref")


def measure(sizes: list[int], cases=CASES) -> tuple[Table, Table]:
    dev = torch.device("cuda")
    table = Table(
        f"routing (bf16 logits; us per call: graph = one call of a {GRAPH_CALLS}-call CUDA graph, "
        "device = kernel time from the profiler)",
        ["case", "n", "peer", "eager_us", "graph_us", "device_us", "graph_vs_triton", "graph_vs_flashinfer"],
    )
    summary = Table(
        "targets (graph = per call in the graph; device = kernel time)",
        [
            "case",
            "n",
            "capture/route graph",
            "capture/route device",
            "capture+w/route graph",
            "capture+w/route device",
            "capture/FI graph",
            "capture/FI device",
            "capture/FI quoted",
        ],
    )
    for case in cases:
        for n in sizes:
            x = make_inputs(case, n, dev)
            check_capture(case, x, n)
            fns = {name: build(case, x) for name, build in PEERS.items()}
            fns = {name: fn for name, fn in fns.items() if fn is not None}
            fast = {name: fn for name, fn in fns.items() if name not in REFERENCES}
            refs = {name: fn for name, fn in fns.items() if name in REFERENCES}
            eager = {name: do_bench_median_us(fn) for name, fn in fns.items()}
            graph = graph_calls_us(fast, calls=GRAPH_CALLS)
            graph.update(graph_calls_us(refs, calls=REF_CALLS, trials=7))
            device = {name: device_us_per_call(fn) for name, fn in fast.items()}
            fi = graph.get("flashinfer")
            for name in fns:
                floor = graph["triton[G]"] if name.endswith("[G]") else graph["triton"]
                table.add(
                    case.name,
                    n,
                    name,
                    eager[name],
                    graph[name],
                    device.get(name, ""),
                    graph[name] / floor,
                    graph[name] / fi if fi else "",
                )
            quoted = FLASHINFER_QUOTED_US.get(n) if case.method == RoutingMethod.DEEPSEEK_V3 else None
            summary.add(
                case.name,
                n,
                graph["triton+capture"] / graph["triton"],
                device["triton+capture"] / device["triton"],
                graph["triton+capture+w"] / graph["triton"],
                device["triton+capture+w"] / device["triton"],
                graph["triton+capture"] / fi if fi else "",
                device["triton+capture"] / device["flashinfer"] if fi else "",
                graph["triton+capture"] / quoted if quoted else "",
            )
    return table, summary


SWEEP_CONFIGS = ((1, 1), (1, 2), (1, 4), (2, 1), (4, 1), (2, 2))


def sweep_launch_config(sizes: list[int], cases=CASES) -> Table:
    """Per-call graph time and kernel time of the fused call for fixed (rows per program, warps)."""
    from moe_ops.router import kernels

    dev = torch.device("cuda")
    table = Table(
        "launch-config sweep (+ capture; us per call)",
        ["case", "n", "block_m", "warps", "graph_us", "device_us", "default"],
    )
    default = kernels.launch_config

    def fixed(block_m: int, warps: int, fn: Callable[[], object]) -> Callable[[], object]:
        def call():
            kernels.launch_config = lambda n_tokens, ng_pad, g_pad: (block_m, warps)
            try:
                return fn()
            finally:
                kernels.launch_config = default

        return call

    for case in cases:
        tile = tile_shape(case.num_experts, case.n_group or 1)
        for n in sizes:
            x = make_inputs(case, n, dev)
            base = peer_triton_capture(case, x)
            fns = {cfg: fixed(*cfg, base) for cfg in SWEEP_CONFIGS if cfg[0] <= max(1, n)}
            graph = graph_calls_us(fns, calls=GRAPH_CALLS, trials=11)
            for (block_m, warps), fn in fns.items():
                chosen = default(n, *tile) == (block_m, warps)
                table.add(
                    case.name, n, block_m, warps, graph[(block_m, warps)], device_us_per_call(fn), chosen
                )
    return table


HOST_LAYERS, EAGER_TARGET_US, COMPILED_TARGET_US = 61, 25.0, 5.0
# layers of the compiled function: inductor compiles each launch of a 61-layer function apart (more
# than 60 s on the H200); per-layer host cost does not depend on the depth
COMPILED_LAYERS = 16


def host_table(n: int = 64, num_experts: int = 256, top_k: int = 8) -> Table:
    """Host us per layer call of ``route`` (RENORMALIZE, ``n`` tokens, ``num_experts``) beside its
    peer ``torch.topk(softmax)``: eager, compiled (fullgraph, no CUDA graphs; 61 layers in one
    graph), and inside a CUDA graph (CUDA only). The ids of every path are checked against the
    peer's."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    table = Table(
        f"route host cost per layer call (RENORMALIZE, n {n}, E {num_experts}, top_k {top_k}, {dev.type}; "
        f"eager {HOST_LAYERS} layers, compiled and graph {COMPILED_LAYERS}){target_note(dev)}",
        ["path", "mode", "host_us/call", target_column(dev)],
    )
    logits = [torch.randn(n, num_experts, device=dev) for _ in range(HOST_LAYERS)]

    def route_all(*logits):
        return [route(x, top_k, RoutingMethod.RENORMALIZE)[1] for x in logits]

    def topk_all(*logits):
        return [torch.topk(torch.softmax(x, dim=-1), top_k, dim=-1)[1].int() for x in logits]

    want = topk_all(*logits)
    for name, fn, ours in (("route", route_all, True), ("torch.topk(softmax)", topk_all, False)):
        compiled = torch.compile(fn, fullgraph=True)
        for mode, f, layers in (
            ("eager", fn, HOST_LAYERS),
            ("compiled (no graphs)", compiled, COMPILED_LAYERS),
        ):
            step(f"{name}, {mode}: {'compiling, then ' if f is compiled else ''}timing {layers} layers")
            xs = logits[:layers]
            got = f(*xs)
            # the sets agree (random logits: no ties); column order is each path's own
            for g, w in zip(got, want):
                if not torch.equal(g.sort(dim=-1).values, w.sort(dim=-1).values):
                    raise AssertionError(f"{name} ({mode}) chose other experts than torch.topk")
            us = host_us_per_call(lambda f=f, xs=xs: f(*xs), dev, calls_per_fn=layers)
            target = (EAGER_TARGET_US if mode == "eager" else COMPILED_TARGET_US) if ours else ""
            table.add(name, mode, us, target)
        if dev.type == "cuda":
            xs = logits[:COMPILED_LAYERS]
            per_call = graph_calls_us({name: lambda: compiled(*xs)}, calls=1, replays=20)
            table.add(name, "in CUDA graph (device)", per_call[name] / COMPILED_LAYERS, "")
        if ours and dev.type == "cuda" and HAS_WRAP_TRITON:
            # for comparison, the opaque op: inductor calls the op's Python kernel (moe_ops._runtime.library;
            # the default above has inductor launch the Triton kernel itself)
            torch._dynamo.reset()
            xs = logits[:COMPILED_LAYERS]
            with trace_triton_kernels(False):
                traced = torch.compile(fn, fullgraph=True)
                got = traced(*xs)  # compiles inside the block
            for g, w in zip(got, want):
                if not torch.equal(g.sort(dim=-1).values, w.sort(dim=-1).values):
                    raise AssertionError(f"{name} (opaque op) chose other experts than torch.topk")
            us = host_us_per_call(lambda: traced(*xs), dev, calls_per_fn=COMPILED_LAYERS)
            table.add(name, "compiled, opaque op", us, "")
    return table


# needs="cpu": --host runs on the CPU; the router tables check for a GPU themselves
@benchmark(
    "routing",
    cases=CASES,
    needs="cpu",
    options=[
        sizes_option("--sizes", BENCH_SIZES["routing"]),
        sizes_option("--sweep-sizes", (1, 128, 1024, 4096, 16384)),
        switch("--sweep", "also sweep launch configs (tuning aid)"),
        switch("--host", "host us per call instead: eager / compiled / graph (runs on the CPU too)"),
    ],
)
def routing(cases, run) -> list[Table]:
    """Triton router with and without fused capture vs FlashInfer and PyTorch (--host: CPU too)."""
    if run.host:
        return [host_table()]
    if not torch.cuda.is_available():
        print("routing: the router tables need a CUDA GPU; nothing measured (--host runs on the CPU)")
        return []
    tables = list(measure(list(run.sizes), cases))
    if run.sweep:
        tables.append(sweep_launch_config(list(run.sweep_sizes), cases))
    return tables


if __name__ == "__main__":
    sys.exit(main(["routing", *sys.argv[1:]]))
