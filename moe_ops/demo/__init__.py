"""``moe-ops demo``: routing capture end to end, verified row by row.

The package: :mod:`.serve` (requests and the serving loop), :mod:`.verify` (the reference run and
the row-by-row check), :mod:`.files` (``routing.npz`` and the heatmap), :mod:`.train` (the training
half), :mod:`.hf` (``--hf ARCH``) and :mod:`.inspect` (``moe-ops inspect``, which says which values
it read from a file and which it guessed). This module runs the command.

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

Then, per mode, the training half (:mod:`moe_ops.demo.train`; ``--no-train`` skips it): each
request's routing through the wire format and back, replayed in one float32 training step of the
same model with perturbed router weights (mismatch without and with replay, logprobs against the
rollout's), plotted to ``replay_mismatch.png``.

Per-request shape: ``(num_tokens - 1, num_moe_layers, top_k)`` with ``num_tokens`` = prompt +
generated tokens, as vLLM (``request.num_tokens - 1``) and SGLang (``req.seqlen - 1``) return
``routed_experts``: the last generated token is sampled but never run through the model, so it has
no routing.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..graphs import RunnerMode
from ..models.reference import ReferenceMoEModel, reference_config
from .files import expert_load, plot_expert_load, write_routing
from .hf import main_demo_hf
from .inspect import inspect_file, main_inspect, read_routing_file
from .serve import DemoRequest, ServeResult, greedy_step, serve, step_inputs, synthetic_requests
from .verify import Verification, reference_routing, verify

__all__ = [
    "DemoRequest",
    "ServeResult",
    "Verification",
    "expert_load",
    "greedy_step",
    "inspect_file",
    "main_demo",
    "main_inspect",
    "plot_expert_load",
    "read_routing_file",
    "reference_routing",
    "serve",
    "step_inputs",
    "synthetic_requests",
    "verify",
    "write_routing",
]


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
    problem = _output_folder_problem(args.out)
    if problem:  # before any work: a run that cannot write its files is not started
        print(f"error: --out {args.out!r}: {problem}", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    if device.type == "cpu":
        # The tiny model's ops are too small to split across threads, and OpenMP workers spin-wait
        # when the cores are shared: measured on 2 busy cores, 5 ms/step with 1 thread, 60-250 ms
        # with 2.
        torch.set_num_threads(1)
    try:
        if args.hf:
            return main_demo_hf(args, device)
        return _run_demo(args, device, modes)
    finally:
        torch.set_num_threads(threads)


def _output_folder_problem(path: str) -> str | None:
    """Why the demo cannot write into ``path`` (created here if missing), or None."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        return f"cannot create the output folder ({e.strerror or e})"
    if not os.access(path, os.W_OK | os.X_OK):
        return "the output folder is not writable"
    return None


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
        from .train import format_checks, train_check

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
        from .train import plot_replay_mismatch

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
