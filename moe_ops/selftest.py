"""``moe-ops selftest``: the capture op on this machine's best device, every layout, every mode.

Each case builds a padded batch in one layout, captures it with live counts that change between
calls, and compares the buffer with the rows the layout definition selects (numpy, on the host).
Modes: eager, torch.compile(fullgraph=True), and on CUDA a manually captured CUDA graph replayed
with the counts changed in place.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from .capture import capture_routing, check_capture_errors
from .demo.progress import StatusLine
from .layout import BatchLayout

__all__ = ["run_selftest"]

POISON = -7
DP_SIZE, DP_RANK, PADDED, SPR, TOP_K, LAYERS = 3, 1, 8, 2, 4, 4


@dataclass
class Row:
    layout: str
    mode: str
    cases: int
    mismatches: int
    seconds: float


def _batch(layout: BatchLayout, device: torch.device):
    """(topk_ids, shard_sizes, first row of rank DP_RANK) for a batch padded to PADDED per rank."""
    if layout in (BatchLayout.LOCAL, BatchLayout.SEQUENCE_PARALLEL):
        n, sizes, start = PADDED, None, 0
    elif layout == BatchLayout.GATHERED:
        n, start = DP_SIZE * PADDED, DP_RANK * PADDED
        sizes = torch.full((DP_SIZE,), PADDED, dtype=torch.int32, device=device)
    else:
        n, start = DP_SIZE * PADDED, DP_RANK * PADDED
        sizes = torch.full((DP_SIZE * SPR,), PADDED // SPR, dtype=torch.int32, device=device)
    return torch.empty(n, TOP_K, dtype=torch.int32, device=device), sizes, start


def _check(layout: BatchLayout, mode: str, device: torch.device, rng: np.random.Generator) -> Row:
    ids, sizes, start = _batch(layout, device)
    counts = torch.zeros(DP_SIZE, dtype=torch.int32, device=device)
    buffer = torch.full((PADDED, LAYERS, TOP_K), POISON, dtype=torch.int32, device=device)

    def step(buf, topk_ids, token_counts, shard_sizes):
        for layer in range(LAYERS):
            capture_routing(
                buf,
                topk_ids[:, :] + layer,
                layer,
                token_counts=token_counts,
                dp_rank=DP_RANK,
                layout=layout,
                shard_sizes=shard_sizes,
            )

    run = step
    if mode == "compiled":
        run = torch.compile(step, fullgraph=True)
    elif mode == "cuda-graph":
        ids.random_(0, 256)
        step(buffer, ids, counts, sizes)  # warm-up before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(buffer, ids, counts, sizes)
        run = lambda *args: graph.replay()

    t0 = time.perf_counter()
    cases = mismatches = 0
    for _ in range(8):
        live = rng.integers(0, PADDED + 1, size=DP_SIZE).astype(np.int32)
        host_ids = rng.integers(0, 256, size=tuple(ids.shape)).astype(np.int32)
        counts.copy_(torch.from_numpy(live))
        ids.copy_(torch.from_numpy(host_ids))
        buffer.fill_(POISON)
        run(buffer, ids, counts, sizes)
        got = buffer.cpu().numpy()  # host read: the self-test checks results, it is not a hot path
        expected = np.full(got.shape, POISON, dtype=np.int32)
        c = int(live[DP_RANK])
        for layer in range(LAYERS):
            expected[:c, layer] = host_ids[start : start + c] + layer
        cases += 1
        mismatches += int((got != expected).any(axis=(1, 2)).sum())
    check_capture_errors(device)
    return Row(layout.name, mode, cases, mismatches, time.perf_counter() - t0)


# what each mode does before its cases, for the status line (the first compile: 14-15 s of the ~20 s
# a warm run takes on 2 CPU cores; the later layouts compile in 0.5-1.2 s)
_MODE_STEPS = {
    "eager": "eager",
    "compiled": "torch.compile(fullgraph=True), then the cases",
    "cuda-graph": "capturing a CUDA graph, then replaying it",
}


def run_selftest(device: str | None = None, status: StatusLine | None = None) -> int:
    """Runs every layout in every mode available here, prints a table row by row as each check
    ends, returns the exit code. ``status``: the status line to draw each check on (default: one on
    stderr, drawn on a terminal only)."""
    status = StatusLine() if status is None else status
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    modes = ["eager", "compiled"] + (["cuda-graph"] if dev.type == "cuda" else [])
    rng = np.random.default_rng(0)
    checks = [(layout, mode) for layout in BatchLayout for mode in modes]
    with status.paused():
        print(f"moe-ops selftest on {dev} (torch {torch.__version__})")
        print(f"{'layout':<18} {'mode':<11} {'cases':>5} {'bad rows':>8} {'time s':>7}  result", flush=True)
    failed = 0
    for i, (layout, mode) in enumerate(checks, 1):
        status.phase(f"check {i}/{len(checks)}: {layout.name}, {_MODE_STEPS[mode]}")
        r = _check(layout, mode, dev, rng)
        failed += r.mismatches > 0
        result = "PASS" if r.mismatches == 0 else "FAIL"
        with status.paused():
            print(
                f"{r.layout:<18} {r.mode:<11} {r.cases:>5} {r.mismatches:>8} {r.seconds:>7.2f}  {result}",
                flush=True,
            )
    status.close()
    print("all passed" if not failed else f"{failed} configuration(s) FAILED")
    return 1 if failed else 0
