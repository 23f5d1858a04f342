"""``moe-ops demo`` and ``moe-ops inspect``: routing capture end to end, verified row by row.

The demo serves synthetic requests with the reference MoE model (``moe_ops.models``) the way a
serving engine does: continuous batching of prefill and decode rows in one step, requests joining
when a slot frees up and leaving when they have generated their tokens, batches padded up to
CUDA-graph capture sizes. Per mode (eager, compiled, and on CUDA the CUDA-graph modes) it runs the
same requests twice, with and without capture, and for the captured run:

    runner.step (capturer.set_step, padded step, route(..., capture=capturer.target(layer)))
      -> capturer.snapshot()           async device-to-host copy, landed a few steps later
      -> RoutingLedger.land            into the SlotStore, rows at the requests' KV slots
      -> RoutingLedger.collect         per finished request: (num_tokens - 1, num_moe_layers, top_k)

Each request's routing is then compared with an eager, uncaptured reference run of the model on
the request's tokens (teacher-forced: the tokens that mode generated). Any mismatched row, wrong
shape or capture fault makes the demo exit non-zero.

Then, per mode, the training half (``moe_ops.demo_train``; ``--no-train`` skips it): each
request's routing through the wire format and back, replayed in one float32 training step of the
same model with perturbed router weights (mismatch without and with replay, logprobs against the
rollout's), plotted to ``replay_mismatch.png``.

Per-request shape: ``(num_tokens - 1, num_moe_layers, top_k)`` with ``num_tokens`` = prompt +
generated tokens, as vLLM (``request.num_tokens - 1``) and SGLang (``req.seqlen - 1``) return
``routed_experts``: the last generated token is sampled but never run through the model, so it has
no routing.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from moe_ops.graphs import CompileCounters, RunnerMode, StepInput, StepRunner

from .capture.capturer import RoutingCapturer
from .models.reference import ReferenceMoEModel, reference_config
from .shapes import RoutingShape
from .store import RoutingLedger, SlotStore

__all__ = [
    "DemoRequest",
    "ServeResult",
    "Verification",
    "inspect_file",
    "main_demo",
    "main_inspect",
    "reference_routing",
    "serve",
    "step_inputs",
    "synthetic_requests",
    "verify",
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


def synthetic_requests(
    num_requests: int,
    *,
    vocab_size: int,
    max_seq_len: int,
    seed: int = 0,
    prompt_lens: tuple[int, int] = (2, 20),
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


class _Progress:
    """A plain progress bar on stderr, drawn only once a run has taken ``min_seconds``."""

    def __init__(self, label: str, total: int, enabled: bool, min_seconds: float = 1.0, width: int = 30):
        # a bar redrawn with carriage returns only makes sense on a terminal
        self.label, self.total, self.enabled = label, max(total, 1), enabled and sys.stderr.isatty()
        self.min_seconds, self.width = min_seconds, width
        self.start = time.perf_counter()
        self.drawn = False

    def update(self, done: int) -> None:
        if not self.enabled or time.perf_counter() - self.start < self.min_seconds:
            return
        filled = int(self.width * min(done, self.total) / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        sys.stderr.write(f"\r  {self.label:<22} [{bar}] {done}/{self.total} tokens")
        sys.stderr.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            sys.stderr.write("\r" + " " * (self.width + 50) + "\r")
            sys.stderr.flush()


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
    progress: bool = False,
) -> ServeResult:
    """Serves ``requests`` to completion with continuous batching; captures routing when asked.

    Each step holds one decode row per running request and then the whole prompts of waiting
    requests (first come, first served) while they fit in ``max_batch_tokens`` rows and a request
    slot is free (``max_running``, at most the model's ``max_requests``). Sampling is greedy. With
    ``capture``, every step's routing goes through the async snapshot pipeline (``ring_depth``
    snapshots in flight) into a :class:`SlotStore` of KV-slot-like slots (``block_size`` tokens per
    block; blocks are freed when a request finishes and reused by later ones), bookkept by a
    :class:`RoutingLedger`.

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
    bar = _Progress(
        f"{mode.value}{' +capture' if capture else ''}", sum(r.num_tokens - 1 for r in requests), progress
    )

    def land_oldest() -> None:
        seq, handle = in_flight.popleft()
        ledger.land(seq, handle.result(copy=False))
        handle.release()

    with CompileCounters() as counters:
        t0 = time.perf_counter()
        runner.warm_up()
        result.warm_up_seconds = time.perf_counter() - t0
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
                    ledger.add_request(req.req_id)
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
            bar.update(result.tokens)
        while in_flight:
            land_oldest()
    bar.close()
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


@torch.no_grad()
def reference_routing(model: ReferenceMoEModel, tokens: Sequence[int]) -> np.ndarray:
    """The routing of ``tokens[:-1]`` from one eager, uncaptured prefill of the model:
    ``(len(tokens) - 1, num_moe_layers, top_k)`` int32 (the last token is never run).

    Uses request slot 0 of the model's KV cache (call it while no request is being served).
    Host sync: the ids are copied to the host.
    """
    n = len(tokens) - 1
    device = model.embed.device
    ids = torch.tensor(list(tokens[:n]), dtype=torch.int64, device=device)
    positions = torch.arange(n, device=device)
    slots = torch.zeros(n, dtype=torch.int64, device=device)
    _, router_ids = model(ids, positions, slots, return_router_ids=True)
    return router_ids.cpu().numpy()


@dataclass
class Verification:
    """Captured routing compared with the reference, over the requests of one run."""

    # requests compared
    requests: int = 0
    # rows compared (sum of num_tokens - 1)
    rows: int = 0
    # rows whose (num_moe_layers, top_k) ids differ from the reference (or that are missing/extra)
    mismatched_rows: int = 0
    # req_id -> (got shape, expected shape) for requests whose routing has the wrong shape
    bad_shapes: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    # requests served but absent from the captured routing
    missing: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.mismatched_rows == 0 and not self.bad_shapes and not self.missing


def verify(
    result: ServeResult, reference: Callable[[Sequence[int]], np.ndarray], shape: RoutingShape
) -> Verification:
    """Compares every request's captured routing with ``reference(tokens)`` row by row (exactly)."""
    out = Verification()
    for req_id, tokens in sorted(result.sequences.items()):
        expected = reference(tokens)
        want = (len(tokens) - 1, shape.num_layers, shape.top_k)
        assert expected.shape == want, (expected.shape, want)  # the reference model's own contract
        out.requests += 1
        out.rows += want[0]
        got = result.routing.get(req_id)
        if got is None:
            out.missing.append(req_id)
            out.mismatched_rows += want[0]
            continue
        if got.shape != want:
            out.bad_shapes[req_id] = (got.shape, want)
            out.mismatched_rows += max(got.shape[0] if got.ndim else 0, want[0])
            continue
        out.mismatched_rows += int((got.astype(np.int64) != expected).any(axis=(1, 2)).sum())
    return out


# ------------------------------------------------------------------------------------- files


def write_routing(
    out_dir: str, result: ServeResult, shape: RoutingShape, requests: Sequence[DemoRequest]
) -> int:
    """Writes ``out_dir/request_<id>/routing.npz`` per request; returns how many were written.

    Arrays: ``routing`` (num_tokens - 1, num_moe_layers, top_k) narrow uint, ``tokens`` (num_tokens,)
    int64, ``prompt_len`` (), ``moe_layers`` (num_moe_layers,) model-layer index of each column,
    ``num_experts`` ().
    """
    prompt_len = {r.req_id: len(r.prompt) for r in requests}
    for req_id, routing in sorted(result.routing.items()):
        path = os.path.join(out_dir, f"request_{req_id:03d}")
        os.makedirs(path, exist_ok=True)
        np.savez(
            os.path.join(path, "routing.npz"),
            routing=routing,
            tokens=np.asarray(result.sequences[req_id], dtype=np.int64),
            prompt_len=np.int64(prompt_len[req_id]),
            moe_layers=np.asarray(shape.moe_layers, dtype=np.int64),
            num_experts=np.int64(shape.num_experts),
        )
    return len(result.routing)


def expert_load(routing: Sequence[np.ndarray], shape: RoutingShape) -> np.ndarray:
    """(num_moe_layers, num_experts) int64: tokens routed to each expert in each MoE layer."""
    load = np.zeros((shape.num_layers, shape.num_experts), dtype=np.int64)
    for r in routing:
        for layer in range(shape.num_layers):
            load[layer] += np.bincount(r[:, layer].reshape(-1).astype(np.int64), minlength=shape.num_experts)
    return load


def plot_expert_load(load: np.ndarray, shape: RoutingShape, path: str, title: str) -> str | None:
    """Heatmap of ``load`` to ``path``; returns None, or a note when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'moe-ops[plot]'): skipped expert_load.png"
    fig, ax = plt.subplots(figsize=(max(6.0, 0.18 * shape.num_experts + 2), 0.45 * shape.num_layers + 1.8))
    image = ax.imshow(load, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("model layer")
    ax.set_yticks(range(shape.num_layers))
    ax.set_yticklabels([str(layer) for layer in shape.moe_layers])
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="tokens routed")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def inspect_file(path: str) -> str:
    """A text summary of a saved routing file: the demo's ``routing.npz``, a ``.npy`` array, or the
    wire formats of ``moe_ops.wire`` (base64 ``.npy`` text, or raw ``MOER`` bytes)."""
    from .wire import RAW_MAGIC, decode_routing, decode_routing_bytes

    extra: dict[str, Any] = {}
    with open(path, "rb") as f:
        head = f.read(4)
    if head == b"PK\x03\x04":  # a zip: .npz
        with np.load(path, allow_pickle=False) as data:
            if "routing" not in data:
                raise ValueError(f"{path}: an .npz without a 'routing' array (arrays: {sorted(data.files)})")
            routing = data["routing"]
            extra = {k: data[k] for k in data.files if k != "routing"}
    elif head == RAW_MAGIC:
        with open(path, "rb") as f:
            routing = decode_routing_bytes(f.read())
    elif head == b"\x93NUM":
        routing = np.load(path, allow_pickle=False)
    else:
        with open(path) as f:
            routing = decode_routing(f.read().strip())
    if routing.ndim != 3:
        raise ValueError(f"{path}: routing must be (tokens, num_layers, top_k), got shape {routing.shape}")
    tokens, layers, top_k = routing.shape
    moe_layers = [int(v) for v in extra.get("moe_layers", range(layers))]
    if "num_experts" in extra:
        num_experts = int(extra["num_experts"])
    else:  # a bare array: the largest id seen + 1
        num_experts = int(routing.max()) + 1 if routing.size else 0
    lines = [
        f"{path}",
        f"  routing: {tokens} tokens x {layers} MoE layers x top-{top_k}, dtype {routing.dtype}",
    ]
    if "tokens" in extra:
        prompt_len = int(extra.get("prompt_len", -1))
        n = len(extra["tokens"])
        lines.append(
            f"  request: {n} tokens ({prompt_len} prompt + {n - prompt_len} generated); "
            f"routing rows = num_tokens - 1 = {n - 1}"
        )
    lines.append(f"  experts: {num_experts}, MoE layers (model index): {moe_layers}")
    if tokens:
        dup = sum(len(set(row)) != top_k for row in routing.reshape(-1, top_k).tolist())
        lines.append(f"  ids in [{int(routing.min())}, {int(routing.max())}]; rows with repeated ids: {dup}")
        for col, layer in enumerate(moe_layers):
            counts = np.bincount(routing[:, col].reshape(-1).astype(np.int64), minlength=num_experts)
            top = np.argsort(-counts, kind="stable")[:3]
            busiest = ", ".join(f"{int(e)} ({int(counts[e])})" for e in top)
            lines.append(
                f"  layer {layer:>3}: {int((counts > 0).sum())}/{num_experts} experts used; busiest {busiest}"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- the command


def _default_modes(device: torch.device) -> list[str]:
    modes = [RunnerMode.EAGER.value, RunnerMode.COMPILED.value]
    if device.type == "cuda":
        modes.append(RunnerMode.CUDA_GRAPH.value)
    return modes


def main_demo(args: Any) -> int:
    """``moe-ops demo``: see the module docstring. Returns the exit code."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    modes = args.modes.split(",") if args.modes else _default_modes(device)
    valid = {m.value for m in RunnerMode}
    bad = [m for m in modes if m not in valid]
    if bad:
        print(f"error: --modes: unknown {bad}; choose from {sorted(valid)}", file=sys.stderr)
        return 2
    if device.type != "cuda" and any(RunnerMode(m).needs_cuda for m in modes):
        print(f"error: --modes {modes} include CUDA-graph modes, but the device is {device}", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    if device.type == "cpu":
        # The tiny model's ops are too small to split across threads, and OpenMP workers spin-wait
        # when the cores are shared: measured on 2 busy cores, 5 ms/step with 1 thread, 60-250 ms
        # with 2.
        torch.set_num_threads(1)
    try:
        if args.hf:
            return _main_demo_hf(args, device)
        return _run_demo(args, device, modes)
    finally:
        torch.set_num_threads(threads)


def _run_demo(args: Any, device: torch.device, modes: list[str]) -> int:

    overrides = {"seed": args.seed}
    if device.type == "cuda":
        # One router kernel on both sides (with "auto", DeepSeek-V3 without capture may use FlashInfer).
        overrides["router_backend"] = "triton"
    config = reference_config(args.preset, **overrides)
    model = ReferenceMoEModel(config, device=device)
    shape = config.routing_shape()
    requests = synthetic_requests(
        args.requests, vocab_size=config.vocab_size, max_seq_len=config.max_seq_len, seed=args.seed
    )
    capture_sizes = [int(s) for s in args.capture_sizes.split(",")] if args.capture_sizes else None
    print(
        f"moe-ops demo: reference model '{args.preset}' ({config.num_layers} layers, "
        f"{config.num_moe_layers} MoE, {config.num_experts} experts, top-{config.top_k}, "
        f"{config.routing_method.name}, {config.dtype}) on {device}; "
        f"{len(requests)} requests of {min(len(r.prompt) for r in requests)}-"
        f"{max(len(r.prompt) for r in requests)} prompt + {min(r.max_new_tokens for r in requests)}-"
        f"{max(r.max_new_tokens for r in requests)} new tokens; torch {torch.__version__}"
    )
    t_start = time.perf_counter()
    references: dict[tuple[int, ...], np.ndarray] = {}

    def reference(tokens: Sequence[int]) -> np.ndarray:
        key = tuple(tokens)
        if key not in references:
            references[key] = reference_routing(model, tokens)
        return references[key]

    rows = []
    last = None
    progress = not args.no_progress
    for mode in modes:
        sizes = capture_sizes or _demo_capture_sizes(RunnerMode(mode))
        kwargs = dict(
            mode=mode, capture_sizes=sizes, max_batch_tokens=args.max_batch_tokens, progress=progress
        )
        captured = serve(model, requests, capture=True, **kwargs)
        plain = serve(model, requests, capture=False, **kwargs)
        check = verify(captured, reference, shape)
        rows.append((mode, captured, plain, check))
        last = captured

    header = (
        f"{'mode':<20} {'steps':>5} {'tokens':>6} {'padded':>6} {'eager':>5} {'graphs':>6} "
        f"{'mismatched rows':>15} {'ms/step capture':>15} {'ms/step plain':>13}  result"
    )
    print(header)
    failed = 0
    for mode, captured, plain, check in rows:
        problems = []
        if not check.ok:
            problems.append(f"{check.mismatched_rows} mismatched rows")
        if check.bad_shapes:
            problems.append(f"wrong shapes {check.bad_shapes}")
        if check.missing:
            problems.append(f"missing requests {check.missing}")
        if captured.capture_faults:
            problems.append(f"{captured.capture_faults} capture faults")
        failed += bool(problems)
        print(
            f"{mode:<20} {captured.steps:>5} {captured.tokens:>6} {captured.padded_rows:>6} "
            f"{captured.eager_fallbacks:>5} {captured.graphs_compiled:>6} {check.mismatched_rows:>15} "
            f"{captured.mean_step_ms:>15.2f} {plain.mean_step_ms:>13.2f}  "
            + ("PASS" if not problems else "FAIL: " + "; ".join(problems))
        )
    print(
        "(padded: padding rows added to reach a capture size, never returned or captured; eager: steps "
        "above the largest capture size; graphs: graphs dynamo compiled; mismatched rows: captured "
        "routing vs an eager uncaptured reference run, per request (num_tokens - 1) rows)"
    )

    checks = []
    if not getattr(args, "no_train", False):
        from .demo_train import format_checks, train_check

        prompt_lens = {r.req_id: len(r.prompt) for r in requests}
        for mode, captured, _, _ in rows:
            checks.append(
                train_check(model, mode, captured.sequences, captured.routing, prompt_lens, seed=args.seed)
            )
        failed_train = sum(bool(c.problems) for c in checks)
        print(format_checks(checks, shape))
        failed += failed_train

    os.makedirs(args.out, exist_ok=True)
    written = write_routing(args.out, last, shape, requests)
    load = expert_load(list(last.routing.values()), shape)
    note = plot_expert_load(
        load,
        shape,
        os.path.join(args.out, "expert_load.png"),
        f"tokens per expert ({args.preset}, {last.mode})",
    )
    print(
        f"wrote {written} x request_<id>/routing.npz ({last.mode} run) to {args.out}"
        + ("" if note else " and expert_load.png")
    )
    if note:
        print(note)
    if checks:
        from .demo_train import plot_replay_mismatch

        note = plot_replay_mismatch(checks, shape, os.path.join(args.out, "replay_mismatch.png"))
        print(note or f"wrote replay_mismatch.png (mismatch per layer with and without replay) to {args.out}")
    print(
        f"total {time.perf_counter() - t_start:.1f} s: "
        + ("all verified" if not failed else f"{failed} mode(s) FAILED")
    )
    return 1 if failed else 0


def _demo_capture_sizes(mode: RunnerMode) -> list[int]:
    """Capture sizes of the demo: 1..32; from 2 in the compiled modes, where dynamo would
    specialise a 1-row batch into a graph of its own (a second compile, ~10 s on 2 CPU cores)."""
    return [2, 4, 8, 16, 32] if mode.compiles else [1, 2, 4, 8, 16, 32]


def _main_demo_hf(args: Any, device: torch.device) -> int:
    """``moe-ops demo --hf ARCH``: a tiny transformers model, eager, captured with attach_capture."""
    try:
        from .integrations import hf
    except ImportError as exc:
        print(
            f"error: --hf needs the transformers integration (moe_ops.integrations.hf) and transformers "
            f"(pip install 'moe-ops[hf]'): {exc}",
            file=sys.stderr,
        )
        return 2
    arch = args.hf.strip().lower().replace("-", "_")  # transformers' model_type: "Qwen3-MoE" -> qwen3_moe
    if arch not in hf.SUPPORTED_ARCHITECTURES:
        print(
            f"error: --hf {args.hf!r} is not supported; supported: "
            + ", ".join(sorted(hf.SUPPORTED_ARCHITECTURES)),
            file=sys.stderr,
        )
        return 2
    return _serve_hf(hf, arch, args, device)


def _serve_hf(hf: Any, arch: str, args: Any, device: torch.device) -> int:
    """Eager serving of a tiny transformers model, one request per forward (prefill, then one decode
    row per forward, with the model's own KV cache), interleaved round-robin so that requests start
    and finish at different steps, through the snapshot pipeline, ledger and slot store.

    Reference: each request's same forwards re-run alone, the ids read straight from the capture
    buffer after each forward (no interleaving, pipeline, ledger or store). The forwards have the
    same shapes as in the served run, so the model computes the same values bit for bit (a
    one-prefill reference would not: float32 sums in another order can flip a near-tie). That
    ``attach_capture`` records what the unmodified router picks is the integration's own test.
    """
    from .shapes import resolve_routing_shape

    # transformers' grouped expert GEMM (torch._grouped_mm) takes float32/bf16/fp16, not float64
    model = hf.build_tiny_model(arch, seed=args.seed, dtype=torch.float32).to(device).eval()
    shape = resolve_routing_shape(model.config)
    requests = synthetic_requests(
        args.requests,
        vocab_size=int(model.config.vocab_size),
        max_seq_len=64,
        seed=args.seed,
        new_tokens=(1, 12),
    )
    print(
        f"moe-ops demo --hf {arch}: {shape.num_layers} MoE layers, {shape.num_experts} experts, "
        f"top-{shape.top_k} on {device} (eager, float32); {len(requests)} requests"
    )
    capturer = RoutingCapturer(shape, 64, device, ring_depth=2)

    def forward(tokens: Sequence[int], cache: Any, start: int) -> tuple[int, Any]:
        ids = torch.tensor([list(tokens)], dtype=torch.int64, device=device)
        positions = torch.arange(start, start + len(tokens), device=device)[None]
        capturer.set_step([len(tokens)])
        out = model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True)
        return int(out.logits[0, -1].argmax()), out.past_key_values

    ledger = RoutingLedger(SlotStore(len(requests) * 64, shape), 64)
    sequences: dict[int, list[int]] = {}
    mismatched = 0
    with torch.no_grad(), hf.attach_capture(model, capturer):
        live = [[r, list(r.prompt), None, 0] for r in requests]  # request, tokens, cache, computed
        for block, (req, *_rest) in enumerate(live):
            ledger.add_request(req.req_id)
            ledger.append_blocks(req.req_id, [block])
        while live:
            for entry in list(live):
                req, tokens, cache, computed = entry
                new = tokens[computed:]
                seq = ledger.schedule([(req.req_id, len(new))]).seq
                nxt, entry[2] = forward(new, cache, computed)
                with capturer.snapshot() as snap:
                    ledger.land(seq, snap.result(copy=False))
                entry[3] = len(tokens)
                tokens.append(nxt)
                if len(tokens) - len(req.prompt) == req.max_new_tokens:
                    ledger.finish(req.req_id)
                    sequences[req.req_id] = tokens
                    live.remove(entry)
        captured = {done.req_id: done.routing for done in ledger.collect()}
        prompt_len = {r.req_id: len(r.prompt) for r in requests}
        for req_id, tokens in sorted(sequences.items()):
            cache, start, rows = None, 0, []
            for stop in range(prompt_len[req_id], len(tokens)):
                _, cache = forward(tokens[start:stop], cache, start)
                # host read (reference only); a copy: on CPU .numpy() would view the live buffer
                rows.append(capturer.buffer[: stop - start].cpu().numpy().copy())
                start = stop
            expected = np.concatenate(rows)
            got = captured.get(req_id)
            if got is None or got.shape != expected.shape:
                mismatched += len(tokens) - 1
                continue
            mismatched += int((got.astype(np.int64) != expected).any(axis=(1, 2)).sum())
    print(f"{'mode':<8} {'requests':>8} {'mismatched rows':>15}  result")
    print(f"{'eager':<8} {len(sequences):>8} {mismatched:>15}  {'PASS' if not mismatched else 'FAIL'}")
    os.makedirs(args.out, exist_ok=True)
    result = ServeResult("eager", True, sequences=sequences, routing=captured)
    written = write_routing(args.out, result, shape, requests)
    print(f"wrote {written} x request_<id>/routing.npz to {args.out}")
    return 1 if mismatched else 0


def main_inspect(args: Any) -> int:
    """``moe-ops inspect FILE``: prints a summary of each file; exit 1 if one cannot be read."""
    status = 0
    for path in args.files:
        try:
            print(inspect_file(path))
        except (OSError, ValueError) as exc:
            print(f"{path}: cannot read routing: {exc}", file=sys.stderr)
            status = 1
    return status
