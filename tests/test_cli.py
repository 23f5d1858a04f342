"""The command line a newcomer meets first: --version, and usage errors (exit 2) instead of tracebacks."""

from __future__ import annotations

import pytest
import torch

import moe_ops
from moe_ops.cli import main

NO_CUDA = not torch.cuda.is_available()


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"moe-ops {moe_ops.__version__}"


BAD = [
    (["demo", "--preset", "foo"], "unknown preset 'foo'"),
    (["demo", "--capture-sizes", "abc"], "not a comma-separated list of integers"),
    (["demo", "--capture-sizes", "4,0"], "capture sizes must be >= 1"),
    (["demo", "--requests", "0"], "must be >= 1, got 0"),
    (["demo", "--max-batch-tokens", "x"], "'x' is not an integer"),
    (["demo", "--device", "tpu"], "'tpu'"),
    (["demo", "--modes", "warp"], "unknown mode(s) warp"),
    (["selftest", "--device", "cpu:x"], "'cpu:x' is not a device"),
]
if NO_CUDA:
    BAD += [
        (["demo", "--device", "cuda"], "sees no CUDA device"),
        (["selftest", "--device", "cuda"], "sees no CUDA device"),
    ]


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_values_are_one_line_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"moe-ops {argv[0]}: error: ")


@pytest.mark.parametrize("command", ["selftest", "backends", "demo", "inspect"])
def test_every_subcommand_has_a_description_and_argument_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: moe-ops " + command)
    description = out.split("\n\n")[1]
    assert not description.startswith(("options", "positional")), f"{command} has no description"
    # every option line carries a help text (argparse prints it on the same or the next line)
    options = [line for line in out.splitlines() if line.strip().startswith("--")]
    assert all(len(line.split("  ")) > 1 or line.strip().endswith("...") for line in options), options
