"""The ``moe-ops`` command (also ``python -m moe_ops``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["main"]

_MODES = ("eager", "compiled", "cuda-graph", "compiled+cuda-graph", "reduce-overhead")
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


def _device(value: str) -> str:
    """A device this machine has: cpu, cuda or cuda:N (argparse turns the ValueError into a usage
    error, exit 2)."""
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{value!r} is not a device; use cpu or cuda") from None
    if device.type == "cpu":
        return value
    if device.type != "cuda":
        raise argparse.ArgumentTypeError(f"{value!r}: only cpu and cuda are supported")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(
            f"{value!r}: this torch ({torch.__version__}) sees no CUDA device; use --device cpu"
        )
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{value!r}: only {torch.cuda.device_count()} CUDA device(s)")
    return value


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
    from .demo.serve import MAX_PROMPT_TOKENS

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
    from .models.reference import PRESETS

    if value not in PRESETS:
        raise argparse.ArgumentTypeError(f"unknown preset {value!r}; presets: {', '.join(sorted(PRESETS))}")
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
        "--requests",
        type=_int_in(1, MAX_DEMO_REQUESTS),
        default=12,
        help=f"synthetic requests to serve, 1-{MAX_DEMO_REQUESTS} (default 12)",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=_batch_tokens,
        default=48,
        help=f"rows per step at most, 20-{MAX_STEP_ROWS} (default 48)",
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "selftest":
        from .selftest import run_selftest

        return run_selftest(args.device)
    if args.command == "backends":
        from .backend_report import backends

        print(backends(args.device))
        return 0
    if args.command == "demo":
        from .demo import main_demo

        return main_demo(args)
    if args.command == "inspect":
        from .demo.inspect import main_inspect

        return main_inspect(args)
    raise AssertionError(f"unhandled command {args.command}")  # argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
