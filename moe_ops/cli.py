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
    raise AssertionError(f"unhandled command {args.command}")  # argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
