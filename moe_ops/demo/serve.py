"""Serving the reference model the way an engine does, with capture: :func:`serve` and its requests.

Continuous batching of prefill and decode rows in one step, requests joining when a slot frees up and
leaving when they have generated their tokens, batches padded up to CUDA-graph capture sizes by
:class:`moe_ops.graphs.StepRunner`; the captured routing goes through the snapshot pipeline, the
ledger and the slot store (see :mod:`moe_ops.demo`).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..capture.capturer import RoutingCapturer
from ..cli_args import MAX_PROMPT_TOKENS as _MAX_PROMPT_TOKENS
from ..graphs import CompileCounters, RunnerMode, StepInput, StepRunner
from ..models.reference import ReferenceMoEModel
from ..store import RoutingLedger, SlotStore
from .progress import StatusLine

__all__ = [
    "MAX_PROMPT_TOKENS",
    "DemoRequest",
    "ServeResult",
    "greedy_step",
    "serve",
    "step_inputs",
    "synthetic_requests",
]


@dataclass(frozen=True)
class DemoRequest:
    """One synthetic request."""

    # unique id
    req_id: int
    # prompt token ids; at least one
    prompt: tuple[int, ...]
    # tokens to generate, >= 1; the request finishes after sampling the last one
    max_new_tokens: int

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens once finished; ``num_tokens - 1`` of them run through the model."""
        return len(self.prompt) + self.max_new_tokens


# the longest prompt synthetic_requests makes by default: a step of the demo must hold one (written
# in the command-line module, which imports no torch, so that --max-batch-tokens is checked there)
MAX_PROMPT_TOKENS = _MAX_PROMPT_TOKENS


def synthetic_requests(
    num_requests: int,
    *,
    vocab_size: int,
    max_seq_len: int,
    seed: int = 0,
    prompt_lens: tuple[int, int] = (2, MAX_PROMPT_TOKENS),
    new_tokens: tuple[int, int] = (1, 24),
) -> list[DemoRequest]:
    """Requests with random prompts of ``prompt_lens`` (inclusive range) tokens that generate a
    random number of tokens in ``new_tokens``, so they finish at different steps."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    lo, hi = prompt_lens
    if not 1 <= lo <= hi or hi + new_tokens[0] > max_seq_len:
        raise ValueError(
            f"prompt_lens must be 1 <= lo <= hi with hi + new_tokens[0] <= max_seq_len={max_seq_len}, "
            f"got {prompt_lens} and new_tokens={new_tokens}"
        )
    if not 1 <= new_tokens[0] <= new_tokens[1]:
        raise ValueError(f"new_tokens must be 1 <= lo <= hi, got {new_tokens}")
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num_requests):
        n_prompt = int(rng.integers(lo, hi + 1))
        n_new = int(rng.integers(new_tokens[0], min(new_tokens[1], max_seq_len - n_prompt) + 1))
        prompt = tuple(int(t) for t in rng.integers(1, vocab_size, size=n_prompt))
        out.append(DemoRequest(i, prompt, n_new))
    return out


def step_inputs(model: ReferenceMoEModel) -> tuple[StepInput, ...]:
    """The reference model's step inputs; padding rows: token 0 at position 0 of the dummy slot."""
    return (
        StepInput("token_ids", torch.int64, 0),
        StepInput("positions", torch.int64, 0),
        StepInput("slot_ids", torch.int64, model.config.dummy_slot),
    )


def greedy_step(model: ReferenceMoEModel, capturer: RoutingCapturer | None) -> Callable[..., torch.Tensor]:
    """The step a runner runs: the model's forward (capturing when given a capturer), then greedy
    sampling. Returns ``(n,)`` int64 next-token ids."""

    def step(token_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
        return model(token_ids, positions, slot_ids, capturer=capturer).argmax(-1)

    return step


@dataclass
class ServeResult:
    """One serving run of :func:`serve`."""

    # the runner mode
    mode: str
    # whether routing was captured
    capture: bool
    # steps run
    steps: int = 0
    # real token rows over all steps
    tokens: int = 0
    # padding rows the runner added (never returned, never captured)
    padded_rows: int = 0
    # steps above the largest capture size, run eagerly
    eager_fallbacks: int = 0
    # wall time of each step: runner.step + snapshot enqueue + reading the sampled tokens
    step_seconds: list[float] = field(default_factory=list)
    # time of runner.warm_up (compiles, CUDA-graph captures)
    warm_up_seconds: float = 0.0
    # graphs dynamo compiled during the run (warm-up included); 0 in eager modes
    graphs_compiled: int = 0
    # dynamo's recompile reasons during the run
    recompile_reasons: list[str] = field(default_factory=list)
    # inductor CUDA-graph skips during the run (reduce-overhead falling back to no graphs); must be 0
    cudagraph_skips: int = 0
    # distinct real row counts the steps had
    distinct_batch_sizes: int = 0
    # req_id -> prompt + generated tokens
    sequences: dict[int, list[int]] = field(default_factory=dict)
    # req_id -> captured routing (num_tokens - 1, num_moe_layers, top_k), from the slot store
    routing: dict[int, np.ndarray] = field(default_factory=dict)
    # capture calls the kernels flagged as faulty (inconsistent counts); must be 0
    capture_faults: int = 0

    @property
    def mean_step_ms(self) -> float:
        return 1e3 * float(np.mean(self.step_seconds)) if self.step_seconds else float("nan")


@dataclass(eq=False)
class _Live:
    request: DemoRequest
    # request slot of the model's KV cache
    slot: int
    # prompt + generated tokens so far
    tokens: list[int]
    # tokens run through the model so far
    computed: int = 0
    # KV blocks of the routing store held by the request
    blocks: list[int] = field(default_factory=list)

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.request.prompt)


# what warm-up does in each mode that has one, for the status line (eager has none): a short phase,
# then per size the size and what runs (a narrow terminal cuts the end of the line)
_WARM_UP = {
    RunnerMode.COMPILED: (
        "torch.compile of the step",
        "TorchDynamo traces it, inductor writes and builds {kernels} (one graph for every padded size; "
        "cached on disk after the first run)",
    ),
    RunnerMode.CUDA_GRAPH: ("CUDA-graph capture of the eager step", "one graph per size"),
    RunnerMode.COMPILED_CUDA_GRAPH: (
        "torch.compile of the step, then a CUDA graph per size",
        "inductor builds {kernels} once (cached on disk after the first run), then captures",
    ),
    RunnerMode.REDUCE_OVERHEAD: (
        "torch.compile(mode='reduce-overhead') of the step",
        "inductor builds {kernels} and records its CUDA-graph trees",
    ),
}


def _warm_up(
    runner: StepRunner, mode: RunnerMode, device: torch.device, status: StatusLine, label: str
) -> None:
    """``runner.warm_up()`` one size at a time (the same order: largest first), saying which."""
    if mode not in _WARM_UP:
        return
    what, how = _WARM_UP[mode]
    how = how.format(kernels="Triton kernels" if device.type == "cuda" else "C++ kernels")
    status.phase(f"{label}: {what}")
    sizes = sorted(runner.capture_sizes, reverse=True)
    for i, size in enumerate(sizes):
        status.update(f"size {size} ({i + 1}/{len(sizes)}): {how}")
        runner.warm_up([size])


def _bar(done: int, total: int, width: int = 30) -> str:
    filled = int(width * min(done, total) / max(total, 1))
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} tokens"


def serve(
    model: ReferenceMoEModel,
    requests: Sequence[DemoRequest],
    *,
    mode: RunnerMode | str = RunnerMode.EAGER,
    capture: bool = True,
    capture_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32),
    max_batch_tokens: int = 48,
    max_running: int | None = None,
    block_size: int = 4,
    ring_depth: int = 3,
    progress: bool | StatusLine = False,
) -> ServeResult:
    """Serves ``requests`` to completion with continuous batching; captures routing when asked.

    Each step holds one decode row per running request and then the whole prompts of waiting
    requests (first come, first served) while they fit in ``max_batch_tokens`` rows and a request
    slot is free (``max_running``, at most the model's ``max_requests``). Sampling is greedy. With
    ``capture``, every step's routing goes through the async snapshot pipeline (``ring_depth``
    snapshots in flight) into a :class:`SlotStore` of KV-slot-like slots (``block_size`` tokens per
    block; blocks are freed when a request finishes and reused by later ones), bookkept by a
    :class:`RoutingLedger`.

    ``progress``: a :class:`~moe_ops.demo.progress.StatusLine` to report on (the warm-up: what
    compiles or is captured, size by size; then the served tokens), or True for one of its own
    (stderr, a terminal only).

    Host syncs: reading the sampled tokens after each step (an engine's sampling sync) and the
    landed snapshots (``handle.result()``); none inside the step.
    """
    cfg = model.config
    mode = RunnerMode(mode)
    device = model.embed.device
    max_running = cfg.max_requests if max_running is None else min(max_running, cfg.max_requests)
    too_long = [
        r.req_id for r in requests if len(r.prompt) > max_batch_tokens or r.num_tokens > cfg.max_seq_len
    ]
    if too_long:
        raise ValueError(
            f"requests {too_long[:8]} do not fit: prompts must be <= max_batch_tokens={max_batch_tokens} "
            f"and prompt + new tokens <= max_seq_len={cfg.max_seq_len}"
        )
    shape = cfg.routing_shape()
    capturer = None
    if capture:
        capturer = RoutingCapturer(
            shape, max(max_batch_tokens, max(capture_sizes)), device, ring_depth=ring_depth
        )
    runner = StepRunner(
        greedy_step(model, capturer),
        step_inputs(model),
        mode=mode,
        capture_sizes=capture_sizes,
        device=device,
        capturer=capturer,
    )
    result = ServeResult(mode.value, capture)
    blocks_per_request = math.ceil(cfg.max_seq_len / block_size)
    ledger = None
    if capture:
        ledger = RoutingLedger(SlotStore(max_running * blocks_per_request * block_size, shape), block_size)
    free_blocks = deque(range(max_running * blocks_per_request))
    free_slots = deque(range(max_running))
    waiting = deque(requests)
    running: list[_Live] = []
    in_flight: deque = deque()
    batch_sizes = set()
    label = f"{mode.value}{' +capture' if capture else ''}"
    status = progress if isinstance(progress, StatusLine) else StatusLine(enabled=bool(progress))
    total_tokens = sum(r.num_tokens - 1 for r in requests)

    def land_oldest() -> None:
        seq, handle = in_flight.popleft()
        ledger.land(seq, handle.result(copy=False))
        handle.release()

    with CompileCounters() as counters:
        t0 = time.perf_counter()
        _warm_up(runner, mode, device, status, label)
        result.warm_up_seconds = time.perf_counter() - t0
        status.phase(f"{label}: serving {len(requests)} requests", _bar(0, total_tokens))
        while waiting or running:
            batch: list[tuple[_Live, int]] = [(live, 1) for live in running]
            budget = max_batch_tokens - len(running)
            while waiting and free_slots and len(waiting[0].prompt) <= budget:
                req = waiting.popleft()
                live = _Live(req, free_slots.popleft(), list(req.prompt))
                running.append(live)
                batch.append((live, len(req.prompt)))
                budget -= len(req.prompt)
                if ledger is not None:
                    ledger.add_request(req.req_id, prompt_len=len(req.prompt))
            token_ids, positions, slot_ids = [], [], []
            for live, n_new in batch:
                start = live.computed
                token_ids += live.tokens[start : start + n_new]
                positions += range(start, start + n_new)
                slot_ids += [live.slot] * n_new
            n = len(token_ids)
            batch_sizes.add(n)
            seq = None
            if ledger is not None:
                for live, n_new in batch:
                    while len(live.blocks) * block_size < live.computed + n_new:
                        block = free_blocks.popleft()
                        live.blocks.append(block)
                        ledger.append_blocks(live.request.req_id, [block])
                seq = ledger.schedule([(live.request.req_id, n_new) for live, n_new in batch]).seq
                while len(in_flight) >= ring_depth:
                    land_oldest()
            t_step = time.perf_counter()
            next_tokens = runner.step(
                torch.tensor(token_ids, dtype=torch.int64),
                torch.tensor(positions, dtype=torch.int64),
                torch.tensor(slot_ids, dtype=torch.int64),
            )
            if capturer is not None:
                in_flight.append((seq, capturer.snapshot()))
            sampled = next_tokens.cpu().tolist()  # the engine's sampling sync
            result.step_seconds.append(time.perf_counter() - t_step)
            result.steps += 1
            result.tokens += n
            row = 0
            for live, n_new in batch:
                row += n_new
                live.computed += n_new
                live.tokens.append(int(sampled[row - 1]))
                if live.generated == live.request.max_new_tokens:
                    running.remove(live)
                    free_slots.append(live.slot)
                    free_blocks.extend(live.blocks)
                    result.sequences[live.request.req_id] = live.tokens
                    if ledger is not None:
                        ledger.finish(live.request.req_id)
            status.update(_bar(result.tokens, total_tokens))
        while in_flight:
            land_oldest()
    if status is not progress:
        status.close()
    if ledger is not None:
        for done in ledger.collect():
            result.routing[done.req_id] = done.routing
        result.capture_faults = capturer.check_errors(raise_error=False)
    result.padded_rows = runner.stats.padded_rows
    result.eager_fallbacks = runner.stats.eager_fallbacks
    result.graphs_compiled = counters.graphs
    result.recompile_reasons = counters.recompile_reasons
    result.cudagraph_skips = counters.cudagraph_skips
    result.distinct_batch_sizes = len(batch_sizes)
    return result
