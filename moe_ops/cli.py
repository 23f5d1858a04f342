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
import os
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


def scalar_cpu_kernels(args: argparse.Namespace) -> bool:
    """For a demo on the CPU run as the program (torch not imported yet, the environment silent),
    sets ``TORCHINDUCTOR_VEC_ISA_OK=0`` for this process: inductor then writes scalar C++ kernels.
    The tiny model gains nothing from vector code, and building it cost most of a cold run
    (measured on 2 busy cores, fresh caches: the whole demo took 42 s of CPU with it, 27 s without;
    96 s and 61 s of wall time at load 6-9). Process-wide, read once when torch's inductor config
    loads: switching it inside a running process (a ``config.patch``) left inductor's cached ISA
    choice and its precompiled headers disagreeing, and later compiles in that process failed to
    build (``at::vec`` undeclared). In-process callers (torch already imported) keep their setting.
    Returns whether it set it."""
    device = getattr(args, "device", None)
    if "torch" in sys.modules or "TORCHINDUCTOR_VEC_ISA_OK" in os.environ or (device or "cpu") != "cpu":
        return False
    if device is None and _cuda_available_without_torch():
        return False
    os.environ["TORCHINDUCTOR_VEC_ISA_OK"] = "0"
    return True


def _cuda_available_without_torch() -> bool:
    """Whether this machine may have a CUDA device, asked without importing torch: the driver's
    device files (a guess that errs towards CUDA: then the environment is left alone)."""
    return os.path.exists("/dev/nvidiactl") or bool(os.environ.get("CUDA_VISIBLE_DEVICES"))


def _run(args: argparse.Namespace) -> int:
    if args.command == "selftest":
        from .demo.progress import StatusLine  # no torch: drawn before the 2-7 s of importing it

        with StatusLine() as status:
            status.phase("moe-ops selftest: importing torch and moe_ops")
            from .selftest import run_selftest

            return run_selftest(args.device, status=status)
    if args.command == "backends":
        from .demo.progress import StatusLine

        with StatusLine() as status:
            # cold caches on 2 busy cores: 23 s before the report, most of it these two imports
            status.phase("moe-ops backends: importing torch and moe_ops")
            from .backend_report import backends

            status.phase("moe-ops backends: loading FlashInfer's op table, asking each kernel's device check")
            report = backends(args.device)
        print(report)
        return 0
    if args.command == "demo":
        check_demo_args(args)
        scalar_cpu_kernels(args)
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
