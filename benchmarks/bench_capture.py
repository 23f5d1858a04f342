"""Capture op cost: eager per call, and per layer inside one CUDA graph of 61 layers.

Floor: a plain ``buffer[:n, layer] = topk_ids`` copy per layer in the same kind of graph (it knows
its row count on the host, which is exactly what a graph must not do; it is the cheapest possible
write of the same bytes). Target: capture within 1.1x of that copy inside the graph.

Host mode (``--host``; runs on the CPU too): wall clock per layer call, GATHERED 61x8, eager /
torch.compile(fullgraph=True) without CUDA graphs / inside a CUDA graph (CUDA only), each beside
its peers - a vLLM-style host-offset slice copy (the rank's offset summed on the host from host
counts, as vLLM's capturer does) and a plain slice copy (offset a Python constant; compiled, also
into a 32768-row buffer: inductor's fused copy rewrites the whole buffer), and the capture written as
PyTorch ops for inductor (compiled only) - with the targets: compiled <= 5 us, eager <= 25 us per
capture call.

Cases and default sizes: ``BENCH_CASES["capture"]`` and ``BENCH_SIZES["capture"]`` (benchmarks/cases.py).

    python benchmarks/bench_capture.py [--csv out.csv] [--sizes 1,64,512,8192] [--sweep]
    python benchmarks/bench_capture.py --host [--tokens 64] [--csv out.csv]
    python -m benchmarks capture [...the same flags]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.cases import BENCH_CASES, BENCH_SIZES
from benchmarks.harness import Table, do_bench_median_us, graph_calls_us, graph_replay_us, step
from benchmarks.host import host_us_per_call, launch_floor_us, target_column, target_note
from benchmarks.registry import benchmark, main, option, sizes_option, switch
from moe_ops import BatchLayout, capture_routing
from moe_ops._runtime.library import HAS_WRAP_TRITON, trace_triton_kernels
from moe_ops.capture.kernels import checked_ids_torch, fault_delta, id_limit
from moe_ops.capture.op import capture_into, target_tensors
from moe_ops.capture.target import CaptureTarget
from moe_ops.capture.window import rows_window_torch

LAYERS, TOP_K, MAX_TOKENS = 61, 8, 8192


def check_cases(cases) -> None:
    """The module's constants are the measured depth and width (one buffer for every case): each
    case must name them, so the case's test covers what is measured."""
    for case in cases:
        if (case.layers, case.top_k) != (LAYERS, TOP_K):
            raise ValueError(
                f"case {case.name}: {case.layers} layers x top_k {case.top_k}, "
                f"the benchmark measures {LAYERS} x {TOP_K}"
            )


# needs="cpu": --host runs on the CPU; the graph tables check for a GPU themselves
@benchmark(
    "capture",
    cases=BENCH_CASES["capture"],
    needs="cpu",
    options=[
        sizes_option("--sizes", BENCH_SIZES["capture"]),
        switch("--sweep", "also sweep launch configs at small n"),
        switch("--host", "host us per call instead: eager / compiled / graph (runs on the CPU too)"),
        # type int as distributed's --tokens (the same meaning: rows per DP rank); checked below
        option("--tokens", 64, type=int, help="--host: tokens per DP rank (default 64)"),
    ],
)
def capture(cases, run) -> list[Table]:
    """Capture op: eager per call and per layer in a 61-layer CUDA graph vs a slice copy (--host: CPU too)."""
    check_cases(cases)
    if run.tokens < 1:
        raise ValueError(f"--tokens takes a positive int (tokens per DP rank), got {run.tokens}")
    if run.host:
        gathered = [c for c in cases if c.layout == BatchLayout.GATHERED]
        if not gathered:
            raise ValueError("--host measures the GATHERED case; the cases have none")
        return [host_table(run.tokens, dp=gathered[0].dp_size)]
    if not torch.cuda.is_available():
        print("capture: the graph tables need a CUDA GPU; nothing measured (--host runs on the CPU)")
        return []
    dev = torch.device("cuda")
    table = Table(
        "capture op (61 layers, top_k 8, int32 ids and buffer)",
        ["layout", "n", "eager_us/call", "graph_us/layer", "copy_us/layer", "ratio_vs_copy"],
    )
    buffer = torch.zeros(MAX_TOKENS, LAYERS, TOP_K, dtype=torch.int32, device=dev)
    for case in cases:
        layout, dp = case.layout, case.dp_size
        for n in run.sizes:
            rows = n * dp
            ids = [torch.randint(0, 256, (rows, TOP_K), dtype=torch.int32, device=dev) for _ in range(LAYERS)]
            counts = torch.full((dp,), n, dtype=torch.int32, device=dev)
            rank = dp - 1  # last rank: the GATHERED offset is a sum over the others
            start = rank * n

            def capture_all():
                for layer in range(LAYERS):
                    capture_routing(
                        buffer, ids[layer], layer, token_counts=counts, dp_rank=rank, layout=layout
                    )

            def copy_all():
                for layer in range(LAYERS):
                    buffer[:n, layer] = ids[layer][start : start + n]

            eager = do_bench_median_us(
                lambda: capture_routing(buffer, ids[0], 0, token_counts=counts, dp_rank=rank, layout=layout)
            )
            # one graph of all 61 layers each, the two timed interleaved trial by trial
            per_call = graph_calls_us({"capture": capture_all, "copy": copy_all}, calls=1, replays=50)
            cap, floor = per_call["capture"] / LAYERS, per_call["copy"] / LAYERS
            expected = torch.stack([i[start : start + n] for i in ids], dim=1)
            capture_all()
            torch.cuda.synchronize()
            assert torch.equal(buffer[:n], expected), "benchmark capture wrote wrong rows"
            table.add(layout.name, n, eager, cap, floor, cap / floor)
    tables = [table]
    if run.sweep:
        tables.append(sweep_launch_config(buffer, cases))
    return tables


EAGER_TARGET_US, COMPILED_TARGET_US = 25.0, 5.0

# rows of the buffer in the "full-size buffer" rows: a serving engine's capacity, not the step's
FULL_BUFFER_ROWS = 32768


def decomposed_capture(target: CaptureTarget, topk_ids: torch.Tensor) -> None:
    """The capture written as PyTorch ops that inductor can fuse (a what-if peer, not a shipped
    path): the row rule's twin, then an ``index_put_`` into the buffer itself (inductor writes it
    in place; a ``copy_`` into a slice view made it rewrite the whole buffer), the fault delta and
    the stamp. Same writes as the op for valid ids; here to show how many kernels inductor makes of
    it (one per layer: it does not fuse scatters whose rows come from device values)."""
    buffer = target.buffer
    errors, stamps, step = target_tensors(target)
    n_src, n_dst = topk_ids.shape[0], buffer.shape[0]
    start, c_eff, flags = rows_window_torch(
        target.token_counts, target.sizes, target.dp_rank, target.n_first, n_src, n_dst
    )
    window = min(n_src, n_dst)
    rows = torch.arange(window, device=buffer.device)
    valid = rows < c_eff
    ids, bad = checked_ids_torch(topk_ids[(start + rows).clamp(max=n_src - 1)], id_limit(buffer.dtype))
    layer = torch.tensor(target.layer_id, device=buffer.device)
    cols = torch.arange(topk_ids.shape[1], device=buffer.device)
    values = torch.where(valid[:, None], ids.to(buffer.dtype), buffer[:window, target.layer_id])
    buffer.index_put_((rows[:, None], layer, cols[None, :]), values)
    errors.add_(fault_delta(flags, (bad & valid[:, None]).sum()))
    if stamps.numel():
        stamps.index_put_((layer,), step[0])


# layers of the compiled function: inductor compiles each launch apart, and 61 layers x 4 paths
# took too long on the H200; per-layer host cost does not depend on the depth
COMPILED_LAYERS = 16


def host_table(n: int, dp: int = 4) -> Table:
    """Host us per layer call of the capture paths and their peers (GATHERED, last of ``dp``
    ranks, ``n`` tokens each, 61 layers). Every path's rows are checked against the copy's."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    table = Table(
        f"capture host cost per layer call (GATHERED {LAYERS}x{TOP_K}, {n} tokens/rank, dp {dp}, {dev.type}; "
        f"eager {LAYERS} layers, compiled and graph {COMPILED_LAYERS}){target_note(dev)}",
        ["path", "mode", "host_us/call", target_column(dev)],
    )
    rows, rank = n * dp, dp - 1
    buffer = torch.zeros(max(rows, 1), LAYERS, TOP_K, dtype=torch.int32, device=dev)
    ids = [torch.randint(0, 256, (rows, TOP_K), dtype=torch.int32, device=dev) for _ in range(LAYERS)]
    counts = torch.full((dp,), n, dtype=torch.int32, device=dev)
    host_counts = [n] * dp  # vLLM keeps the counts on the host too
    start = rank * n
    targets = [
        CaptureTarget(buffer, layer, token_counts=counts, dp_rank=rank, layout=BatchLayout.GATHERED)
        for layer in range(LAYERS)
    ]

    def capture_routing_all(buffer, *ids):
        for layer in range(len(ids)):
            capture_routing(
                buffer, ids[layer], layer, token_counts=counts, dp_rank=rank, layout=BatchLayout.GATHERED
            )

    def capture_into_all(buffer, *ids):
        for layer in range(len(ids)):
            capture_into(targets[layer], ids[layer])

    def vllm_copy_all(buffer, *ids):
        for layer in range(len(ids)):
            off = sum(host_counts[:rank])
            c = host_counts[rank]
            buffer[:c, layer].copy_(ids[layer][off : off + c])

    def plain_copy_all(buffer, *ids):
        for layer in range(len(ids)):
            buffer[:n, layer] = ids[layer][start : start + n]

    def decomposed_all(buffer, *ids):
        for layer in range(len(ids)):
            decomposed_capture(targets[layer], ids[layer])

    full = torch.zeros(max(rows, FULL_BUFFER_ROWS), LAYERS, TOP_K, dtype=torch.int32, device=dev)
    expected = torch.stack([i[start : start + n] for i in ids], dim=1)
    # name -> (function, ours, eager too, buffer)
    paths = {
        "capture_routing": (capture_routing_all, True, True, buffer),
        "capture_into(prebuilt target)": (capture_into_all, True, True, buffer),
        "vllm host-offset slice copy": (vllm_copy_all, False, True, buffer),
        "plain slice copy": (plain_copy_all, False, True, buffer),
        # inductor fuses the layers' slice copies into one kernel that rewrites the whole buffer:
        # cheap on the host, and on the device it grows with the buffer, not the step
        f"plain slice copy, {full.shape[0]}-row buffer": (plain_copy_all, False, False, full),
        "PyTorch decomposition (inductor's kernels)": (decomposed_all, False, False, buffer),
    }
    for name, (fn, ours, with_eager, buf) in paths.items():
        compiled = torch.compile(fn, fullgraph=True)
        modes = {"eager": (fn, LAYERS)} if with_eager else {}
        modes["compiled (no graphs)"] = (compiled, COMPILED_LAYERS)
        for mode, (f, layers) in modes.items():
            step(f"{name}, {mode}: {'compiling, then ' if f is compiled else ''}timing {layers} layers")
            buf.zero_()
            xs = ids[:layers]
            us = host_us_per_call(lambda f=f, xs=xs, buf=buf: f(buf, *xs), dev, calls_per_fn=layers)
            if not torch.equal(buf[:n, :layers], expected[:, :layers]):
                raise AssertionError(f"{name} ({mode}) wrote wrong rows")
            target = (EAGER_TARGET_US if mode == "eager" else COMPILED_TARGET_US) if ours else ""
            table.add(name, mode, us, target)
        if dev.type == "cuda":
            xs = ids[:COMPILED_LAYERS]
            per_call = graph_calls_us({name: lambda buf=buf: compiled(buf, *xs)}, calls=1, replays=20)
            table.add(name, "in CUDA graph (device)", per_call[name] / COMPILED_LAYERS, "")
        if ours and dev.type == "cuda" and HAS_WRAP_TRITON:
            # for comparison, the opaque op: inductor calls the op's Python kernel (moe_ops._runtime.library;
            # the default above has inductor launch the Triton kernel itself)
            torch._dynamo.reset()
            xs = ids[:COMPILED_LAYERS]
            with trace_triton_kernels(False):
                traced = torch.compile(fn, fullgraph=True)
                buffer.zero_()
                traced(buffer, *xs)  # compiles inside the block
            us = host_us_per_call(lambda: traced(buffer, *xs), dev, calls_per_fn=COMPILED_LAYERS)
            if not torch.equal(buffer[:n, :COMPILED_LAYERS], expected[:, :COMPILED_LAYERS]):
                raise AssertionError(f"{name} (opaque op) wrote wrong rows")
            table.add(name, "compiled, opaque op", us, "")
    for mode, us in launch_floor_us(dev, LAYERS, COMPILED_LAYERS).items():
        table.add("one-store Triton kernel, same arguments (floor)", mode, us, "")
    return table


def sweep_launch_config(buffer: torch.Tensor, cases=BENCH_CASES["capture"]) -> Table:
    """Graph time per layer for fixed (rows per program, warps) choices at small n (tuning aid)."""
    from moe_ops.capture import kernels

    dev = buffer.device
    table = Table(
        "launch-config sweep (graph us/layer)", ["layout", "n", "block_m", "warps", "graph_us/layer"]
    )
    default = kernels.launch_config
    try:
        for case in cases:
            layout, dp = case.layout, case.dp_size
            for n in (1, 64):
                ids = [
                    torch.randint(0, 256, (n * dp, TOP_K), dtype=torch.int32, device=dev)
                    for _ in range(LAYERS)
                ]
                counts = torch.full((dp,), n, dtype=torch.int32, device=dev)
                for block_m, warps in ((1, 1), (n, 1), (n, 4), (128, 1), (128, 4)):
                    kernels.launch_config = lambda window, k_pad, b=block_m, w=warps: (max(1, b), w)

                    def capture_all():
                        for layer in range(LAYERS):
                            capture_routing(
                                buffer, ids[layer], layer, token_counts=counts, dp_rank=dp - 1, layout=layout
                            )

                    table.add(layout.name, n, block_m, warps, graph_replay_us(capture_all) / LAYERS)
    finally:
        kernels.launch_config = default
    return table


if __name__ == "__main__":
    sys.exit(main(["capture", *sys.argv[1:]]))
