"""The ``moe-ops`` command (also ``python -m moe_ops``)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-ops", description="Rollout routing replay for MoE models.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("selftest", help="check the capture op in every layout and mode on this machine")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p = sub.add_parser(
        "backends", help="which backend each routing method and FlashInfer kernel uses here, and why"
    )
    p.add_argument("--device", default=None, help="the device to describe (default: the current CUDA device)")
    p = sub.add_parser(
        "demo",
        help="serve synthetic requests with the reference MoE model, capture routing in each mode, verify it",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument(
        "--modes",
        default=None,
        help="comma-separated runner modes: eager, compiled, cuda-graph, compiled+cuda-graph, "
        "reduce-overhead (default: eager,compiled and on CUDA cuda-graph)",
    )
    p.add_argument(
        "--preset", default="tiny", help="reference model preset: tiny (default) or deepseek_small"
    )
    p.add_argument(
        "--hf", default=None, metavar="ARCH", help="serve a tiny transformers model of ARCH instead"
    )
    p.add_argument("--requests", type=int, default=12, help="synthetic requests to serve (default 12)")
    p.add_argument("--max-batch-tokens", type=int, default=48, help="rows per step at most (default 48)")
    p.add_argument(
        "--capture-sizes", default=None, help="comma-separated padded batch sizes (default 1,2,4,8,16,32)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the model weights and the requests")
    p.add_argument("--out", default="moe-ops-demo", help="output folder (default ./moe-ops-demo)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument(
        "--no-train",
        action="store_true",
        help="skip the training half (replay of the captured routing in a float32 training step)",
    )
    p = sub.add_parser("inspect", help="summarise saved routing files (routing.npz, .npy, wire formats)")
    p.add_argument("files", nargs="+", metavar="FILE")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "selftest":
        from .selftest import run_selftest

        return run_selftest(args.device)
    if args.command == "backends":
        from .flashinfer.backends import backends

        print(backends(args.device))
        return 0
    if args.command == "demo":
        from .demo import main_demo

        return main_demo(args)
    if args.command == "inspect":
        from .demo import main_inspect

        return main_inspect(args)
    raise AssertionError(f"unhandled command {args.command}")  # argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
