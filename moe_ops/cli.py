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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "selftest":
        from .selftest import run_selftest

        return run_selftest(args.device)
    raise AssertionError(f"unhandled command {args.command}")  # argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
