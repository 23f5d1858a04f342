"""The ``moe-ops`` command (also ``python -m moe_ops``).

Parsing imports no torch: ``--help``, ``--version`` and a usage error answer at once (importing
torch and ``torch._dynamo`` took 6-7 s of CPU on a 2-core machine). The only checks that import it
ask whether this machine has the CUDA device a ``--device`` or ``--modes`` value needs. Every usage
error, found while parsing or later (a CUDA mode without a CUDA device, an ``--out`` folder that
cannot be written, an ``--hf`` architecture the integration does not know), is argparse's: the
subcommand's usage line, ``moe-ops SUBCOMMAND: error: ...`` and exit 2.
"""

from __future__ import annotations

import argparse
import sys

from .cli_args import (
    MAX_DEMO_REQUESTS,
    MAX_PROMPT_TOKENS,
    MAX_STEP_ROWS,
    UsageError,
    _build_parser,
    check_demo_args,
)

__all__ = ["MAX_DEMO_REQUESTS", "MAX_PROMPT_TOKENS", "MAX_STEP_ROWS", "UsageError", "main"]


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        return _run(args)
    except UsageError as exc:
        args.command_parser.error(str(exc))  # argparse's format: usage line, error line, exit 2


def _run(args: argparse.Namespace) -> int:
    if args.command == "selftest":
        from .selftest import run_selftest

        return run_selftest(args.device)
    if args.command == "backends":
        from .backend_report import backends

        print(backends(args.device))
        return 0
    if args.command == "demo":
        check_demo_args(args)
        if not args.no_progress and sys.stderr.isatty():
            # the first second: importing torch takes 3-7 s before the demo can say anything else
            sys.stderr.write("\r  moe-ops demo: importing torch and moe_ops ...")
            sys.stderr.flush()
        from .demo import main_demo

        return main_demo(args)
    if args.command == "inspect":
        from .demo.inspect import main_inspect

        return main_inspect(args)
    raise AssertionError(f"unhandled command {args.command}")  # argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
