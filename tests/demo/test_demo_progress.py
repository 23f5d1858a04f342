"""What `moe-ops demo` shows while it works: a status line on stderr from the first second of every
long phase (the inductor compile of a cold first run took 43 s and drew nothing), on a terminal only."""

from __future__ import annotations

import io
import sys
import time

import pytest
import torch

from moe_ops.cli import main
from moe_ops.demo import StatusLine, serve, synthetic_requests
from moe_ops.models import ReferenceMoEModel, reference_config

pytestmark = pytest.mark.usefixtures("one_thread")

# the e2e tests' model and serving shape (tests/demo/test_e2e.py): their compiled graph is in inductor's
# on-disk cache when they ran first
CONFIG = reference_config("tiny", num_layers=3, max_seq_len=32, max_requests=4)
SERVE = dict(capture_sizes=(2, 4, 8, 16), max_batch_tokens=24, max_running=3, block_size=4, ring_depth=2)


class Terminal(io.StringIO):
    """A stream that says it is a terminal (the status line draws on terminals only)."""

    def isatty(self) -> bool:
        return True


def frames(term: Terminal) -> list[str]:
    """Each drawn line, in order (the status line redraws with carriage returns)."""
    return [f.strip() for f in term.getvalue().split("\r") if f.strip()]


def first(lines: list[str], text: str) -> int:
    found = [i for i, line in enumerate(lines) if text in line]
    assert found, f"never drawn: {text!r}; drawn: {sorted(set(lines))[:40]}"
    return found[0]


def test_a_phase_is_drawn_at_once_and_its_clock_runs_while_the_caller_blocks():
    term = Terminal()
    with StatusLine(stream=term, interval=0.05) as status:
        status.phase("compiling the step")
        assert frames(term)[-1] == "0 s  compiling the step"  # before the caller does anything
        deadline = time.monotonic() + 60  # a hang guard: the clock reaches 1 s after about 1 s
        while "1 s  compiling the step" not in term.getvalue():
            assert time.monotonic() < deadline, frames(term)[-3:]
            time.sleep(0.01)  # the caller is busy elsewhere: only the status thread draws
        status.update("size 16 (1/4)")
        assert frames(term)[-1].endswith("compiling the step size 16 (1/4)")
    assert term.getvalue().endswith("\r"), "close() leaves the line cleared"
    assert frames(term)[-1].endswith("size 16 (1/4)")


def test_a_narrow_terminal_cuts_the_text_never_the_clock(monkeypatch):
    monkeypatch.setenv("COLUMNS", "24")
    term = Terminal()
    with StatusLine(stream=term) as status:
        status.phase("compiled +capture: torch.compile of the step", "size 32 (1/5): TorchDynamo traces it")
        line = term.getvalue().split("\r")[-1]
    assert line.strip().startswith("0 s  compiled") and len(line.rstrip()) <= 23, line


def test_nothing_is_drawn_off_a_terminal():
    stream = io.StringIO()  # a pipe or a log file
    status = StatusLine(stream=stream, interval=0.01)
    status.phase("compiling")
    status.update("size 2")
    time.sleep(0.05)
    status.close()
    assert stream.getvalue() == "" and status._thread is None
    term = Terminal()
    with StatusLine(enabled=False, stream=term) as off:  # --no-progress
        off.phase("compiling")
    assert term.getvalue() == ""


def test_paused_clears_the_line_and_holds_every_redraw():
    term = Terminal()
    with StatusLine(stream=term, interval=0.01) as status:
        status.phase("serving")
        with status.paused():
            held = term.getvalue()
            assert held.endswith("\r") and held.rstrip("\r").endswith(" " * len(frames(term)[-1]))
            time.sleep(0.1)  # ten intervals: the thread must not draw over a table printed here
            assert term.getvalue() == held
        assert frames(term)[-1].endswith("serving")  # drawn again at once


def test_bad_interval_is_refused():
    with pytest.raises(ValueError, match="interval must be > 0 seconds, got 0"):
        StatusLine(interval=0)


def test_serve_names_what_it_compiles_size_by_size_before_the_first_step(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # a wide terminal: the line is cut at its width
    model = ReferenceMoEModel(CONFIG)
    requests = synthetic_requests(3, vocab_size=CONFIG.vocab_size, max_seq_len=CONFIG.max_seq_len, seed=2)
    term = Terminal()
    with StatusLine(stream=term) as status:
        result = serve(model, requests, mode="compiled", progress=status, **SERVE)
    lines = frames(term)
    assert result.steps > 0
    sizes = [
        first(lines, f"size {s} ({i + 1}/4): TorchDynamo traces it") for i, s in enumerate((16, 8, 4, 2))
    ]
    assert sizes == sorted(sizes), "warm-up goes largest size first"
    assert "compiled +capture: torch.compile of the step" in lines[sizes[0]]
    assert ("Triton kernels" if torch.cuda.is_available() else "C++ kernels") in lines[sizes[0]]
    serving = first(lines, "compiled +capture: serving 3 requests")
    assert sizes[-1] < serving
    total = sum(r.num_tokens - 1 for r in requests)
    assert lines[-1].endswith(f"{total}/{total} tokens")


def test_the_demo_names_every_long_phase_on_a_terminal(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    argv = ["demo", "--modes", "eager", "--requests", "3", "--device", "cpu", "--out", str(tmp_path)]
    assert main(argv) == 0
    lines = frames(term)
    phases = [
        "moe-ops demo: importing torch",
        "building the reference model",
        "eager +capture: serving 3 requests",
        "eager: serving 3 requests",
        "eager: reference run (eager, uncaptured, one prefill per request) request 1/3",
        "training half, eager: the routing through the wire, replayed in a float32 step",
        "training half: 10 Adam steps with replay, for routing_drift.png",
        "writing the files",
    ]
    at = [first(lines, p) for p in phases]
    assert at == sorted(at), list(zip(phases, at))
    assert term.getvalue().endswith("\r"), "the line is cleared before the demo returns"


def test_the_hf_demo_clears_the_import_line_before_it_prints(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    argv = ["demo", "--hf", "qwen3_moe", "--requests", "2", "--device", "cpu", "--out", str(tmp_path)]
    assert main(argv) == 0
    drawn = term.getvalue()
    assert "moe-ops demo: importing torch" in drawn
    assert drawn.endswith("\r") and drawn.split("\r")[-2].strip() == "", "the line is left cleared"
