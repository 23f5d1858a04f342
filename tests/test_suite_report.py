"""The test run's own output (tests/suite_report.py, loaded by conftest.py): a line when collection
starts, pytest's line per file flushed as tests end, and skips summed by reason while failures and
errors stay listed one by one. Checked on a small suite of its own, run by a real pytest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SAMPLE = """
import pytest

@pytest.mark.skip(reason="needs a CUDA GPU")
@pytest.mark.parametrize("i", range(3))
def test_on_the_gpu(i):
    pass

def test_without_network():
    pytest.skip("no network here")

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "one is not two"

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")

def test_errors(broken):
    pass
"""


def _run(tmp_path: Path, *args: str) -> list[str]:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "test_more.py").write_text(
        'import pytest\n\ndef test_gpu_too():\n    pytest.skip("needs a CUDA GPU")\n'
    )
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "suite_report", "-p", "no:cacheprovider", "-rfE", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,  # a hang guard: about a second
    )
    assert out.returncode == 1, out.stdout + out.stderr  # test_fails and test_errors
    return out.stdout.splitlines()


def test_skips_are_summed_by_reason_and_failures_listed_one_by_one(tmp_path):
    lines = _run(tmp_path)
    assert not [line for line in lines if line.startswith("SKIPPED [")], "skips listed one by one"
    start = next(i for i, line in enumerate(lines) if "5 skipped, by reason" in line)
    assert lines[start + 1 : start + 4] == [
        "4  needs a CUDA GPU  [test_more.py, test_sample.py]",
        "1  no network here  [test_sample.py]",
        "(every skip with its file and line: add -rs)",
    ]
    assert "FAILED test_sample.py::test_fails - AssertionError: one is not two" in lines
    assert "ERROR test_sample.py::test_errors - RuntimeError: fixture broke" in lines
    assert lines[-1].strip("= ").startswith("1 failed, 1 passed, 5 skipped, 1 error")


def test_collection_is_announced_and_each_file_gets_its_line(tmp_path):
    lines = _run(tmp_path)
    announced = next(i for i, line in enumerate(lines) if line.startswith("collecting the tests of 2 files"))
    collected = next(i for i, line in enumerate(lines) if line.startswith("collected 8 items"))
    assert announced < collected
    assert any(line.startswith("test_more.py s") and line.endswith("%]") for line in lines), lines
    # -q: pytest says nothing while collecting; the line still comes
    quiet = _run(tmp_path, "-q")
    assert quiet[0].startswith("collecting the tests of 2 files"), quiet[:3]
