"""The ``moe-ops`` command's arguments: its parser, the bounds of every value, :class:`UsageError`
and the checks the demo runs after parsing.

A leaf beside :mod:`moe_ops.cli`: it imports no torch (``--help``, ``--version`` and a usage error
answer at once) and nothing of the package at module level, so the demo reads its bounds from here
while the command imports the demo, with no import cycle.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

__all__ = [
    "MAX_DEMO_REQUESTS",
    "MAX_PROMPT_TOKENS",
    "MAX_SEED",
    "MAX_STEP_ROWS",
    "UsageError",
    "check_demo_args",
]

# The runner modes (moe_ops.graphs.RunnerMode's values) and the reference model's presets
# (moe_ops.models.reference.PRESETS), written here so that parsing imports no torch;
# tests/demo/test_cli.py checks that they are those.
_MODES = ("eager", "compiled", "cuda-graph", "compiled+cuda-graph", "reduce-overhead")
_CUDA_MODES = ("cuda-graph", "compiled+cuda-graph", "reduce-overhead")
_PRESETS = ("deepseek_small", "tiny")
# the longest prompt moe_ops.demo.serve.synthetic_requests makes by default: a step must hold one
MAX_PROMPT_TOKENS = 20
# The demo is a check, not a load generator: 4096 requests take about 2 minutes per mode on 2 CPU
# cores (measured: 120 in 3.6 s, eager, captured and plain); a count without a bound only grows the
# request list until memory runs out.
MAX_DEMO_REQUESTS = 4096
# Rows of one step (--max-batch-tokens, each --capture-sizes entry): the capture buffer and the
# runner's padded inputs are allocated at this size. A step holds at most max_requests decode rows
# plus max_requests prompts of <= 20 tokens (deepseek_small: 128 * 21 = 2688 rows).
MAX_STEP_ROWS = 4096
# --seed seeds numpy's generator (seeds >= 0) and torch's (signed 64-bit)
MAX_SEED = 2**63 - 1


class UsageError(ValueError):
    """A command-line value this run cannot use, found after parsing (e.g. by the demo): the command
    reports it as argparse does (the usage line, ``moe-ops SUBCOMMAND: error: MESSAGE``, exit 2)."""


_DEVICE = re.compile(r"(cpu|cuda)(:(\d+))?")


def _device(value: str) -> str:
    """A device this machine has: cpu, cuda or cuda:N (argparse turns the error into a usage error,
    exit 2). Only a CUDA device imports torch, to ask whether this machine has it."""
    match = _DEVICE.fullmatch(value.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"{value!r} is not a device; use cpu, cuda or cuda:N")
    if match.group(1) == "cpu":
        if match.group(2):
            raise argparse.ArgumentTypeError(f"{value!r}: the CPU device takes no index; use cpu")
        return "cpu"
    problem = _cuda_problem(int(match.group(3)) if match.group(3) else None)
    if problem:
        raise argparse.ArgumentTypeError(f"{value!r}: {problem}")
    return value.strip()


def _cuda_problem(index: int | None = None) -> str | None:
    """Why this machine cannot run on CUDA device ``index`` (None: the current one), or None.
    Imports torch (the one question parsing asks it)."""
    import torch

    if not torch.cuda.is_available():
        return f"this torch ({torch.__version__}) sees no CUDA device; use --device cpu"
    if index is not None and index >= torch.cuda.device_count():
        return f"only {torch.cuda.device_count()} CUDA device(s)"
    return None


def _int_in(low: int, high: int, why: str = "") -> Any:
    """An argparse type: an integer in [low, high] (a usage error, exit 2, naming the range)."""

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}{why}, got {n}")
        if n > high:
            raise argparse.ArgumentTypeError(f"must be <= {high}{why}, got {n}")
        return n

    return parse


def _batch_tokens(value: str) -> int:
    return _int_in(MAX_PROMPT_TOKENS, MAX_STEP_ROWS, " (the longest synthetic prompt fits in one step)")(
        value
    )


def _sizes(value: str) -> str:
    parts = [p.strip() for p in value.split(",")]
    try:
        sizes = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a comma-separated list of integers") from None
    if any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(f"capture sizes must be >= 1, got {value!r}")
    if any(n > MAX_STEP_ROWS for n in sizes):
        raise argparse.ArgumentTypeError(f"capture sizes must be <= {MAX_STEP_ROWS} rows, got {value!r}")
    return ",".join(str(n) for n in sizes)


def _modes(value: str) -> str:
    bad = [m for m in value.split(",") if m not in _MODES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {', '.join(bad)}; modes: {', '.join(_MODES)}")
    return value


def _preset(value: str) -> str:
    if value not in _PRESETS:
        raise argparse.ArgumentTypeError(f"unknown preset {value!r}; presets: {', '.join(_PRESETS)}")
    return value


def _version() -> str:
    from . import __version__

    return f"moe-ops {__version__}"


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-ops", description="Rollout routing replay for MoE models.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "selftest",
        help="check the capture op in every layout and mode on this machine",
        description="Checks the capture op in every batch layout, eagerly, compiled and (on CUDA) in "
        "CUDA graphs, against the layout definitions.",
    )
    p.add_argument("--device", type=_device, default=None, help="cpu or cuda (default: cuda when available)")
    p = sub.add_parser(
        "backends",
        help="which backend each routing method and FlashInfer kernel uses here, and why",
        description="Prints which backend (Triton, FlashInfer, PyTorch) each routing method and "
        "FlashInfer MoE kernel uses on this machine, and why the others are not used.",
    )
    p.add_argument(
        "--device",
        type=_device,
        default=None,
        help="the device to describe (default: the current CUDA device)",
    )
    p = sub.add_parser(
        "demo",
        help="serve synthetic requests with the reference MoE model, capture routing in each mode, verify it",
        description="Serves synthetic requests with the reference MoE model in each runner mode, captures "
        "their routing, verifies every row against an uncaptured reference, then replays it in a "
        "training step (see docs/demo.md).",
    )
    p.add_argument("--device", type=_device, default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument(
        "--modes",
        type=_modes,
        default=None,
        help="comma-separated runner modes: eager, compiled, cuda-graph, compiled+cuda-graph, "
        "reduce-overhead (default: eager,compiled and on CUDA cuda-graph)",
    )
    p.add_argument(
        "--preset",
        type=_preset,
        default="tiny",
        help="reference model preset: tiny (default) or deepseek_small",
    )
    p.add_argument(
        "--hf", default=None, metavar="ARCH", help="serve a tiny transformers model of ARCH instead"
    )
    p.add_argument(
        "--indexer",
        action="store_true",
        help="with --hf deepseek_v4: give the tiny model compressed sparse attention and record its "
        "indexer's top-k beside the routing (verified, written compact; see docs/indexer.md)",
    )
    p.add_argument(
        "--requests",
        type=_int_in(1, MAX_DEMO_REQUESTS),
        default=12,
        help=f"synthetic requests to serve, 1-{MAX_DEMO_REQUESTS} (default 12)",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=_batch_tokens,
        default=48,
        help=f"rows per step at most, {MAX_PROMPT_TOKENS}-{MAX_STEP_ROWS} (default 48)",
    )
    p.add_argument(
        "--capture-sizes",
        type=_sizes,
        default=None,
        help=f"comma-separated padded batch sizes, each 1-{MAX_STEP_ROWS} (default 1,2,4,8,16,32)",
    )
    p.add_argument(
        "--seed",
        type=_int_in(0, MAX_SEED),
        default=0,
        help="seed of the model weights and the requests, 0 to 2**63 - 1",
    )
    p.add_argument(
        "--out",
        default="moe-ops-demo",
        help="output folder, created before the run (default ./moe-ops-demo)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument(
        "--no-train",
        action="store_true",
        help="skip the training half (replay of the captured routing in a float32 training step)",
    )
    p = sub.add_parser(
        "inspect",
        help="summarise saved routing files (routing.npz, .npy, wire formats)",
        description="Summarises saved routing files: shapes, dtypes, expert load per layer.",
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="routing.npz, .npy or wire-format text files")
    for p in sub.choices.values():  # what reports a usage error found after parsing
        p.set_defaults(command_parser=p)
    return parser


def _output_folder_problem(path: str) -> str | None:
    """Why the demo cannot write into ``path`` (created here if missing), or None."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        return f"cannot create the output folder ({e.strerror or e})"
    if not os.access(path, os.W_OK | os.X_OK):
        return "the output folder is not writable"
    return None


def check_demo_args(args: argparse.Namespace) -> None:
    """The demo's checks that parsing cannot make alone (UsageError), in order: ``--indexer`` needs
    ``--hf``, CUDA-graph modes need
    a CUDA device (torch is imported only when ``--device`` is not given and a mode needs CUDA), then
    the output folder is created and checked writable, so that a run that cannot write its files
    never starts."""
    if getattr(args, "indexer", False) and not args.hf:
        raise UsageError("--indexer records a transformers model's indexer: add --hf deepseek_v4")
    modes = args.modes.split(",") if args.modes else []
    unknown = [m for m in modes if m not in _MODES]
    if unknown:
        raise UsageError(f"--modes: unknown mode(s) {', '.join(unknown)}; modes: {', '.join(_MODES)}")
    cuda_modes = [m for m in modes if m in _CUDA_MODES]
    if cuda_modes:
        device = args.device or "the default device"
        if args.device == "cpu":
            raise UsageError(f"--modes {args.modes} include CUDA-graph modes, but the device is cpu")
        if args.device is None and (problem := _cuda_problem()):
            raise UsageError(f"--modes {args.modes} include CUDA-graph modes, but on {device}: {problem}")
    problem = _output_folder_problem(args.out)
    if problem:
        raise UsageError(f"--out {args.out!r}: {problem}")
