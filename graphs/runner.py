"""``StepRunner``: run a decode-style step eagerly, compiled, or replayed from CUDA graphs, one API.

A serving engine captures its step once per *capture size* and replays the graph of the smallest
size that holds the batch, padding the rows up to it::

    capture sizes:  1   2   4   8   16   32   64
    batch of 11 rows -> graph of 16:  | r0 .. r10 | pad pad pad pad pad |
                                      |<-- n=11 ->|<-- pad_value rows ->|
    outputs: rows [0, 11) only; the capturer's live count is 11, so padding is never recorded
    batch of 70 rows -> above 64: runs eagerly, unpadded

Per step, :meth:`StepRunner.step`:

1. writes this step's real row counts into the capturer's live counts in place
   (``capturer.set_step``; the runner talks to the capturer through
   :class:`~moe_ops.capture.step.StepCapturer` only), on the step's stream, before anything runs;
2. copies the inputs into static buffers (rows ``[0, n)``) and fills rows ``[n, size)`` with each
   input's ``pad_value`` (e.g. the dummy KV slot, so padding rows never touch a request's cache);
3. runs the step in its mode and returns the outputs' rows ``[0, n)``: padding rows never reach an
   output.

Modes (:class:`RunnerMode`): ``eager`` (no padding), ``compiled`` (``torch.compile(fullgraph=True)``
with the row dimension dynamic: one graph for every size >= 2, one more for size 1), and on CUDA
``cuda-graph`` (the eager step captured once per size), ``compiled+cuda-graph`` (the compiled step
captured once per size, as vLLM does) and ``reduce-overhead`` (inductor's CUDA-graph trees). On CPU
``eager`` and ``compiled`` run with the same API.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..capture.step import StepCapturer, check_step_capturer
from .compile import compile_step, mark_rows_dynamic

__all__ = ["DEFAULT_CAPTURE_SIZES", "RunnerMode", "RunnerStats", "StepInput", "StepRunner"]

# vLLM's and SGLang's default decode capture sizes start the same way: 1, 2, 4, then multiples of 8.
DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class RunnerMode(str, enum.Enum):
    """How :class:`StepRunner` runs a step."""

    EAGER = "eager"  # the step as is, on the real rows (no padding)
    COMPILED = "compiled"  # torch.compile(fullgraph=True), rows padded, row dimension dynamic
    CUDA_GRAPH = "cuda-graph"  # the eager step captured in one CUDA graph per capture size
    COMPILED_CUDA_GRAPH = "compiled+cuda-graph"  # the compiled step captured per capture size
    REDUCE_OVERHEAD = "reduce-overhead"  # torch.compile(mode="reduce-overhead"): CUDA-graph trees

    @property
    def needs_cuda(self) -> bool:
        return self in (RunnerMode.CUDA_GRAPH, RunnerMode.COMPILED_CUDA_GRAPH, RunnerMode.REDUCE_OVERHEAD)

    @property
    def compiles(self) -> bool:
        return self in (RunnerMode.COMPILED, RunnerMode.COMPILED_CUDA_GRAPH, RunnerMode.REDUCE_OVERHEAD)

    @property
    def manual_graphs(self) -> bool:
        return self in (RunnerMode.CUDA_GRAPH, RunnerMode.COMPILED_CUDA_GRAPH)


@dataclass(frozen=True)
class StepInput:
    """One input of the step function: a tensor with one row per token."""

    # name used in error messages
    name: str
    # dtype the input must have
    dtype: torch.dtype
    # value of padding rows; the step must treat such rows as harmless (e.g. the dummy KV slot)
    pad_value: int | float = 0
    # shape of one row: the input is (n, *row_shape)
    row_shape: tuple[int, ...] = ()


@dataclass
class RunnerStats:
    """What a :class:`StepRunner` has run so far."""

    # steps run
    steps: int = 0
    # real rows over all steps
    rows: int = 0
    # padding rows added over all steps (computed, never returned or recorded)
    padded_rows: int = 0
    # steps above the largest capture size, run eagerly and unpadded
    eager_fallbacks: int = 0
    # steps per padded size (padded modes; eager steps are not counted here)
    sizes: Counter = field(default_factory=Counter)
    # CUDA graphs captured by the runner (manual graph modes)
    graphs_captured: int = 0


def _check_sizes(capture_sizes: Sequence[int]) -> tuple[int, ...]:
    try:
        sizes = sorted(set(capture_sizes))
    except TypeError:
        raise TypeError(f"capture_sizes must be a sequence of ints, got {capture_sizes!r}") from None
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"capture_sizes must be a non-empty sequence of ints >= 1, got {capture_sizes!r}")
    return tuple(sizes)


class StepRunner:
    """Runs ``fn(*inputs)`` for batches of ``n`` rows, padded to capture sizes, in one :class:`RunnerMode`.

    Args:
        fn: the step. Takes one tensor per :class:`StepInput` (each ``(rows, *row_shape)``) and
            returns a tensor or a tuple of tensors whose first dimension is the row dimension. It
            must not read device values on the host (it is compiled and captured).
        inputs: the step's inputs, in call order.
        mode: a :class:`RunnerMode` or its value.
        capture_sizes: the padded sizes; a batch runs at the smallest size that holds it and
            eagerly (unpadded) above the largest. Ignored in ``eager`` mode.
        device: where the static buffers live and the step runs.
        capturer: a :class:`~moe_ops.capture.step.StepCapturer` - the step part of a
            :class:`~moe_ops.capture.Capturer` (``moe_ops.RoutingCapturer``):
            the runner sets its live counts before each step (``set_step``), zeroes them before
            warm-up and capture runs (``clear_counts``) and reads ``dp_size`` and
            ``max_num_tokens``, nothing else. None: no capture.

    The capture sizes must fit the capturer's buffer (``max_num_tokens``), since its LOCAL capture
    sees the padded rows. Graph modes capture lazily (on first use of a size) or all at once with
    :meth:`warm_up`.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        inputs: Sequence[StepInput],
        *,
        mode: RunnerMode | str = RunnerMode.EAGER,
        capture_sizes: Sequence[int] = DEFAULT_CAPTURE_SIZES,
        device: torch.device | str = "cpu",
        capturer: StepCapturer | None = None,
    ):
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        try:
            self.mode = RunnerMode(mode)
        except ValueError:
            names = ", ".join(repr(m.value) for m in RunnerMode)
            raise ValueError(f"mode must be one of {names}, got {mode!r}") from None
        self.inputs = tuple(inputs)
        if not self.inputs or not all(isinstance(s, StepInput) for s in self.inputs):
            raise TypeError("inputs must be a non-empty sequence of StepInput")
        self.device = torch.device(device)
        if self.mode.needs_cuda and self.device.type != "cuda":
            raise ValueError(f"mode {self.mode.value!r} needs a CUDA device, got device={self.device}")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.capture_sizes = _check_sizes(capture_sizes)
        if capturer is not None:
            check_step_capturer(capturer)
        max_rows = None if capturer is None else capturer.max_num_tokens
        padded = capturer is not None and self.mode != RunnerMode.EAGER
        if padded and self.capture_sizes[-1] > max_rows:
            raise ValueError(
                f"capture_sizes go up to {self.capture_sizes[-1]} rows, but the capturer's buffer "
                f"holds max_num_tokens={max_rows}; drop the larger sizes or grow the buffer"
            )
        self.capturer = capturer
        self.fn = fn
        self.stats = RunnerStats()
        self._compiled = None
        if self.mode.compiles:
            compile_mode = "reduce-overhead" if self.mode == RunnerMode.REDUCE_OVERHEAD else "default"
            self._compiled = compile_step(fn, mode=compile_mode)
        self._buffers: list[torch.Tensor] = []
        if self.mode != RunnerMode.EAGER:
            rows = self.capture_sizes[-1]
            self._buffers = [
                torch.full((rows, *s.row_shape), s.pad_value, dtype=s.dtype, device=self.device)
                for s in self.inputs
            ]
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self._pool = None

    # ------------------------------------------------------------------------------------ public

    def padded_size(self, n: int) -> int | None:
        """Rows a batch of ``n`` runs at: ``n`` in eager mode, else the smallest capture size
        ``>= n``; None above the largest (the step runs eagerly)."""
        if self.mode == RunnerMode.EAGER:
            return n
        for size in self.capture_sizes:
            if size >= n:
                return size
        return None

    def step(self, *inputs: torch.Tensor, token_counts: Sequence[int] | None = None) -> Any:
        """Runs one step over ``n`` real rows; returns the outputs' rows ``[0, n)``.

        Args:
            inputs: one tensor per :class:`StepInput`, each ``(n, *row_shape)`` of its dtype, on any
                device (copied into the static buffers; eager steps move them to ``device``).
            token_counts: the capturer's counts for this step, ``(dp_size,)`` host ints; default
                ``[n]`` (a single DP rank whose real rows are these ``n``).

        Returns the step's outputs sliced to ``n`` rows (a tensor or a tuple, as ``fn`` returns).
        In the manual CUDA-graph modes they are views of the graph's static outputs, valid until the
        next step; copy them to keep them.
        """
        n = self._check_inputs(inputs)
        size = self.padded_size(n)
        if size is not None and self.mode.manual_graphs and size not in self._graphs:
            # Captured on padding rows with counts 0 (the warm-up runs execute); then the real step.
            self._pad_only(size)
            self._capture(size)
        self._set_counts(n, token_counts)
        self.stats.steps += 1
        self.stats.rows += n
        if size is None or self.mode == RunnerMode.EAGER:
            if size is None:
                self.stats.eager_fallbacks += 1
            return self.fn(*(x.to(self.device, non_blocking=True) for x in inputs))
        self.stats.sizes[size] += 1
        self.stats.padded_rows += size - n
        self._fill(inputs, n, size)
        return self._slice(self._run_padded(size), n)

    def warm_up(self, sizes: Sequence[int] | None = None) -> None:
        """Compiles and captures every capture size now (largest first), instead of on first use.

        Runs the step on padding rows only, with the capturer's counts at 0 (nothing is recorded);
        the steps must treat padding rows as harmless (see :class:`StepInput`). Leaves the counts at
        0: every :meth:`step` sets them again.
        """
        if self.mode == RunnerMode.EAGER:
            return
        for size in sorted(self.capture_sizes if sizes is None else _check_sizes(sizes), reverse=True):
            if size not in self.capture_sizes:
                raise ValueError(f"size {size} is not a capture size {self.capture_sizes}")
            self._pad_only(size)
            if self.mode.manual_graphs:
                if size not in self._graphs:
                    self._capture(size)
            else:
                for _ in range(3 if self.mode == RunnerMode.REDUCE_OVERHEAD else 1):
                    self._run_padded(size)  # CUDA-graph trees: warm-up run, recording, first replay

    def graph(self, size: int) -> torch.cuda.CUDAGraph:
        """The CUDA graph captured at ``size`` rows (manual graph modes; e.g. to time replays alone)."""
        if size not in self._graphs:
            raise KeyError(f"no graph captured at {size} rows; captured: {self.graph_sizes}")
        return self._graphs[size][0]

    @property
    def graph_sizes(self) -> tuple[int, ...]:
        """Sizes with a captured graph (manual graph modes)."""
        return tuple(sorted(self._graphs))

    # ---------------------------------------------------------------------------------- internals

    def _check_inputs(self, inputs: Sequence[torch.Tensor]) -> int:
        if len(inputs) != len(self.inputs):
            names = ", ".join(s.name for s in self.inputs)
            raise ValueError(f"step takes {len(self.inputs)} inputs ({names}), got {len(inputs)}")
        n = None
        for x, spec in zip(inputs, self.inputs):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{spec.name} must be a torch.Tensor, got {type(x).__name__}")
            if x.dtype != spec.dtype:
                raise ValueError(f"{spec.name} must have dtype {spec.dtype}, got {x.dtype}")
            if x.dim() != 1 + len(spec.row_shape) or tuple(x.shape[1:]) != spec.row_shape:
                raise ValueError(
                    f"{spec.name} must have shape (n, {', '.join(map(str, spec.row_shape))}) "
                    f"(rows, *row_shape), got {tuple(x.shape)}"
                    if spec.row_shape
                    else f"{spec.name} must have shape (n,), got {tuple(x.shape)}"
                )
            if n is None:
                n = x.shape[0]
            elif x.shape[0] != n:
                raise ValueError(
                    f"every input must have the same rows: {self.inputs[0].name} has {n}, "
                    f"{spec.name} has {x.shape[0]}"
                )
        if n < 1:
            raise ValueError("a step needs at least one row, got 0")
        return n

    def _set_counts(self, n: int, token_counts: Sequence[int] | None) -> None:
        if self.capturer is None:
            if token_counts is not None:
                raise ValueError("token_counts given but the runner has no capturer")
            return
        if token_counts is None:
            dp_size = self.capturer.dp_size
            if dp_size != 1:
                raise ValueError(f"token_counts is required: the capturer has dp_size={dp_size} ranks")
            token_counts = [n]
        self.capturer.set_step(token_counts)

    def _fill(self, inputs: Sequence[torch.Tensor], n: int, size: int) -> None:
        for buf, x, spec in zip(self._buffers, inputs, self.inputs):
            buf[:n].copy_(x, non_blocking=True)
            if size > n:
                buf[n:size].fill_(spec.pad_value)

    def _pad_only(self, size: int) -> None:
        for buf, spec in zip(self._buffers, self.inputs):
            buf[:size].fill_(spec.pad_value)
        if self.capturer is not None:
            # Count 0 records nothing, whatever the layout: warm-up and capture runs leave the
            # capture buffer as it was.
            self.capturer.clear_counts()

    def _views(self, size: int) -> list[torch.Tensor]:
        views = [buf[:size] for buf in self._buffers]
        if self.mode.compiles:
            mark_rows_dynamic(*views)
        return views

    def _run_padded(self, size: int) -> Any:
        if self.mode.manual_graphs:
            graph, outputs = self._graphs[size]
            graph.replay()
            return outputs
        if self.mode == RunnerMode.REDUCE_OVERHEAD:
            # The previous step's outputs were cloned; CUDA-graph trees may reuse their memory.
            torch.compiler.cudagraph_mark_step_begin()
            return _clone(self._compiled(*self._views(size)))
        return self._compiled(*self._views(size))

    def _capture(self, size: int) -> None:
        """Captures the step at ``size`` rows; call :meth:`_pad_only` first (padding, counts 0)."""
        fn = self._compiled if self.mode == RunnerMode.COMPILED_CUDA_GRAPH else self.fn
        views = self._views(size)
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles kernels, allocates lazily created state (fault counter)
                fn(*views)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = fn(*views)
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[size] = (graph, outputs)
        self.stats.graphs_captured += 1

    @staticmethod
    def _slice(outputs: Any, n: int) -> Any:
        if isinstance(outputs, torch.Tensor):
            return outputs[:n]
        if isinstance(outputs, (tuple, list)):
            return type(outputs)(o[:n] for o in outputs)
        raise TypeError(f"the step must return a tensor or a tuple of tensors, got {type(outputs).__name__}")


def _clone(outputs: Any) -> Any:
    if isinstance(outputs, torch.Tensor):
        return outputs.clone()
    return type(outputs)(o.clone() for o in outputs)
