"""``moe-ops demo``, the command: builds the reference model, serves the requests in each mode with
and without capture, verifies every request row by row, runs the training half, writes the files and
the pictures (the steps: the package docstring, :mod:`moe_ops.demo`). Importing it imports torch;
the package ``moe_ops.demo`` imports this module on first use of ``main_demo``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..cli_args import UsageError, check_demo_args
from ..graphs import RunnerMode
from ..models.reference import ReferenceMoEModel, reference_config
from .files import write_routing
from .hf import main_demo_hf
from .progress import StatusLine
from .serve import serve, synthetic_requests
from .verify import reference_routing, verify

__all__ = ["main_demo"]


def _default_modes(device: torch.device) -> list[str]:
    modes = [RunnerMode.EAGER.value, RunnerMode.COMPILED.value]
    if device.type == "cuda":
        modes.append(RunnerMode.CUDA_GRAPH.value)
    return modes


def main_demo(args: Any) -> int:
    """``moe-ops demo``: see the module docstring. Returns the exit code; a value this run cannot
    use raises :class:`moe_ops.cli_args.UsageError` before any work (the command prints it as argparse's
    usage error, exit 2)."""
    check_demo_args(args)  # the command checked already; a direct call gets the same checks
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    modes = args.modes.split(",") if args.modes else _default_modes(device)
    if device.type != "cuda" and any(RunnerMode(m).needs_cuda for m in modes):
        raise UsageError(f"--modes {','.join(modes)} include CUDA-graph modes, but the device is {device}")
    threads = torch.get_num_threads()
    if device.type == "cpu":
        # The tiny model's ops are too small to split across threads, and OpenMP workers spin-wait
        # when the cores are shared: measured on 2 busy cores, 5 ms/step with 1 thread, 60-250 ms
        # with 2.
        torch.set_num_threads(1)
    try:
        if args.hf:
            StatusLine(enabled=not args.no_progress).close()  # clears the command's "importing torch"
            return main_demo_hf(args, device)
        with StatusLine(enabled=not args.no_progress) as status:
            return _run_demo(args, device, modes, status)
    finally:
        torch.set_num_threads(threads)


def _run_demo(args: Any, device: torch.device, modes: list[str], status: StatusLine) -> int:
    status.phase("building the reference model")
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
    with status.paused():
        print(
            f"moe-ops demo: reference model '{args.preset}' ({config.num_layers} layers, "
            f"{config.num_moe_layers} MoE, {config.num_experts} experts, top-{config.top_k}, "
            f"{config.routing_method.name}, {config.dtype}) on {device}; "
            f"{len(requests)} requests of {min(len(r.prompt) for r in requests)}-"
            f"{max(len(r.prompt) for r in requests)} prompt + {min(r.max_new_tokens for r in requests)}-"
            f"{max(r.max_new_tokens for r in requests)} new tokens; torch {torch.__version__}",
            flush=True,
        )
    t_start = time.perf_counter()
    references: dict[tuple[int, ...], np.ndarray] = {}

    progress = {"done": 0, "total": 0}

    def reference(tokens: Sequence[int]) -> np.ndarray:
        progress["done"] += 1
        status.update(f"request {progress['done']}/{progress['total']}")
        key = tuple(tokens)
        if key not in references:
            references[key] = reference_routing(model, tokens)
        return references[key]

    rows = []
    last = None
    for mode in modes:
        sizes = capture_sizes or _demo_capture_sizes(RunnerMode(mode))
        kwargs = dict(mode=mode, capture_sizes=sizes, max_batch_tokens=args.max_batch_tokens, progress=status)
        captured = serve(model, requests, capture=True, **kwargs)
        plain = serve(model, requests, capture=False, **kwargs)
        status.phase(f"{mode}: reference run (eager, uncaptured, one prefill per request)")
        progress.update(done=0, total=len(captured.sequences))
        check = verify(captured, reference, shape)
        rows.append((mode, captured, plain, check))
        last = captured

    header = (
        f"{'mode':<20} {'steps':>5} {'tokens':>6} {'padded':>6} {'eager':>5} {'graphs':>6} "
        f"{'mismatched rows':>15} {'ms/step capture':>15} {'ms/step plain':>13}  result"
    )
    failed = 0
    lines = [header]
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
        lines.append(
            f"{mode:<20} {captured.steps:>5} {captured.tokens:>6} {captured.padded_rows:>6} "
            f"{captured.eager_fallbacks:>5} {captured.graphs_compiled:>6} {check.mismatched_rows:>15} "
            f"{captured.mean_step_ms:>15.2f} {plain.mean_step_ms:>13.2f}  "
            + ("PASS" if not problems else "FAIL: " + "; ".join(problems))
        )
    lines.append(
        "(padded: padding rows added to reach a capture size, never returned or captured; eager: steps "
        "above the largest capture size; graphs: graphs dynamo compiled; mismatched rows: captured "
        "routing vs an eager uncaptured reference run, per request (num_tokens - 1) rows)"
    )
    with status.paused():
        print("\n".join(lines), flush=True)

    checks, drift = [], None
    if not getattr(args, "no_train", False):
        from .train import DRIFT_STEPS, format_checks, routing_drift, train_check

        prompt_lens = {r.req_id: len(r.prompt) for r in requests}
        for mode, captured, _, _ in rows:
            status.phase(
                f"training half, {mode}: the routing through the wire, replayed in a float32 step "
                "(forwards with and without replay, one backward)"
            )
            checks.append(
                train_check(model, mode, captured.sequences, captured.routing, prompt_lens, seed=args.seed)
            )
        failed += sum(bool(c.problems) for c in checks)
        with status.paused():
            print(format_checks(checks, shape), flush=True)
        status.phase(f"training half: {DRIFT_STEPS} Adam steps with replay, for routing_drift.png")
        drift = routing_drift(model, last.mode, last.sequences, last.routing, prompt_lens)

    status.phase("writing the files")
    os.makedirs(args.out, exist_ok=True)
    written = write_routing(args.out, last, shape, requests)
    out = [f"wrote {written} x request_<id>/routing.npz ({last.mode} run) to {args.out}"]
    if drift is not None:
        from .train import plot_replay_mismatch, plot_routing_drift

        status.phase("drawing the pictures (matplotlib)")
        note = plot_replay_mismatch(checks, shape, os.path.join(args.out, "replay_mismatch.png"))
        out.append(
            note
            or f"wrote replay_mismatch.png (per MoE layer, the tokens whose experts changed after a router "
            f"update, without and with replay; {checks[-1].mode} rollout)"
        )
        note = plot_routing_drift(drift, shape, os.path.join(args.out, "routing_drift.png"))
        # the numbers are printed with or without the picture (matplotlib is an optional extra)
        numbers = (
            f"per MoE layer, the tokens whose experts differ from the rollout's over {drift.steps} "
            f"training steps: {_fractions(drift.changed[-1])} without replay after the last, "
            f"{_fractions(drift.replay_changed.max(0))} with replay"
        )
        out.append(f"{note} ({numbers})" if note else f"wrote routing_drift.png ({numbers})")
    out.append(
        f"total {time.perf_counter() - t_start:.1f} s: "
        + ("all verified" if not failed else f"{failed} mode(s) FAILED")
    )
    status.close()
    print("\n".join(out), flush=True)
    return 1 if failed else 0


def _fractions(values: np.ndarray) -> str:
    return " / ".join(f"{float(v):.2f}" for v in values)


def _demo_capture_sizes(mode: RunnerMode) -> list[int]:
    """Capture sizes of the demo: 1..32; from 2 in the compiled modes, where dynamo would
    specialise a 1-row batch into a graph of its own (a second compile, ~10 s on 2 CPU cores)."""
    return [2, 4, 8, 16, 32] if mode.compiles else [1, 2, 4, 8, 16, 32]
