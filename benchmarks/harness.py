"""Shared benchmark harness: medians, CUDA-graph replay timing, one table printed last, CSV rows,
and the runner's status line.

Every benchmark compares against a floor or a peer measured in the same run and reports the ratio;
absolute times are context. CSV rows carry the GPU name, torch/triton versions and the git sha.

Progress: while the runner (``benchmarks/registry.py``) runs a benchmark, one status line on stderr
(``moe_ops.demo.progress.StatusLine``, a terminal only) shows the benchmark, a running clock and the
step: what the benchmark named last with :func:`step`, or the row its tables got last
(``Table.add``: "row 3 done: ..."). A CPU table can take minutes (``capture --host``: 45 s on 2
cores, most of it compiling), during which the run printed only ``NAME: running``.
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from moe_ops.demo.progress import StatusLine

__all__ = [
    "Table",
    "device_us_per_call",
    "do_bench_median_us",
    "environment",
    "graph_calls_us",
    "graph_replay_us",
    "running",
    "step",
]

# the runner's status line while a benchmark runs (``running``); None: no run, step() does nothing
_status: StatusLine | None = None


def step(text: str) -> None:
    """Names what the running benchmark measures now, on the runner's status line (a terminal
    only; elsewhere nothing): call it before a measurement that takes seconds, e.g.
    ``step(f"{name}, compiled: compiling, then timing")``."""
    if _status is not None:
        _status.update(text)


class _LineAwareStdout(io.TextIOBase):
    """stdout while the status line is drawn: the line is cleared before the first write of a
    printed line and drawn again once the line ends, so a benchmark's own prints never land on it."""

    def __init__(self, stream, status: StatusLine):
        self.stream, self.status, self._held = stream, status, None

    def write(self, s: str) -> int:
        if self._held is None:
            self._held = self.status.paused()
            self._held.__enter__()
        n = self.stream.write(s)
        if s.endswith("\n"):
            self.stream.flush()
            held, self._held = self._held, None
            held.__exit__(None, None, None)
        return n

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def release(self) -> None:
        """Lets the status line draw again after a line that never ended (the benchmark raised)."""
        if self._held is not None:
            held, self._held = self._held, None
            held.__exit__(None, None, None)


@contextlib.contextmanager
def running(status: StatusLine, name: str, what: str = "running") -> Iterator[None]:
    """The runner's block around one benchmark: ``name:`` drawn as the phase (with its clock) and
    ``what`` after it until :func:`step` or ``Table.add`` names the step; prints to stdout clear
    the line first."""
    global _status
    status.phase(f"{name}:", what)
    _status = status
    stdout = _LineAwareStdout(sys.stdout, status) if status.enabled else None
    try:
        if stdout is not None:
            with contextlib.redirect_stdout(stdout):
                yield
        else:
            yield
    finally:
        _status = None
        if stdout is not None:
            stdout.release()


def environment() -> dict[str, str]:
    """Machine and version fields stamped on every CSV row."""
    # A copy of the tree without .git (e.g. on a lent GPU machine) takes the sha from the environment.
    sha = os.environ.get("MOE_OPS_GIT_SHA", "")
    if not sha:
        try:
            out = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
            )
            sha = out.stdout.strip() or "unknown"
        except OSError:
            sha = "unknown"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton_version, "git_sha": sha}


def do_bench_median_us(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 200) -> float:
    """Median time of ``fn`` in microseconds (triton.testing.do_bench: CUDA events, L2 flushed)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e3


def graph_replay_us(fn: Callable[[], object], replays: int = 50, trials: int = 15) -> float:
    """Median over ``trials`` of the mean time of one replay of a CUDA graph of one call of ``fn``,
    in us (:func:`graph_calls_us` with one peer and ``calls=1``).

    ``fn`` is warmed up on a side stream, captured once, and replayed ``replays`` times between two
    CUDA events per trial: launch overhead is the graph's, as in a CUDA-graphed serving step.
    """
    return graph_calls_us({"fn": fn}, calls=1, replays=replays, trials=trials)["fn"]


def _capture_graph(fn: Callable[[], object], calls: int) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def graph_calls_us(
    fns: dict[str, Callable[[], object]], calls: int = 61, replays: int = 10, trials: int = 21
) -> dict[str, float]:
    """Per-call time of each ``fn`` inside a CUDA graph of ``calls`` calls (a model step that calls
    it once per layer), in us: median over ``trials`` of (one trial's replays) / (replays * calls).

    The peers' trials are interleaved (A B C, A B C, ...), so clock and thermal drift hit every peer
    alike and ratios between peers are stable to about 1%; a lone single-call graph measures mostly
    the graph launch (about 4 us on an H200) and, on a GPU that idles between replays, its clocks.
    """
    graphs = {name: _capture_graph(fn, calls) for name, fn in fns.items()}
    for graph in graphs.values():
        for _ in range(3):
            graph.replay()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(trials):
        for name, graph in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / (replays * calls))
    return {name: statistics.median(t) for name, t in times.items()}


def device_us_per_call(fn: Callable[[], object], calls: int = 200) -> float:
    """GPU time of one call of ``fn`` in us: every kernel, memcpy and memset it launches, summed
    (torch.profiler / CUPTI), divided by ``calls``. No launch gaps: the kernels' own cost."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total = sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return total / calls


@dataclass
class Table:
    """Rows of one benchmark; ``print()`` shows them as a table, ``write_csv`` appends them."""

    name: str
    columns: list[str]
    rows: list[list[object]] = field(default_factory=list)

    def add(self, *values: object) -> None:
        assert len(values) == len(self.columns), (values, self.columns)
        self.rows.append(list(values))
        step(f"row {len(self.rows)} done: {' '.join(map(self._fmt, values[:3]))}")

    def format(self) -> str:
        cells = [[self._fmt(v) for v in row] for row in self.rows]
        widths = [
            max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(self.columns)
        ]
        lines = [f"## {self.name}", "  ".join(c.rjust(w) for c, w in zip(self.columns, widths))]
        lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in cells]
        return "\n".join(lines)

    def print(self) -> None:
        print(self.format(), flush=True)

    def write_csv(self, path: str) -> None:
        env = environment()
        new = not os.path.exists(path)
        with open(path, "a", newline="") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(["benchmark", *self.columns, *env.keys()])
            for row in self.rows:
                writer.writerow([self.name, *row, *env.values()])

    @staticmethod
    def _fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
        return str(v)
