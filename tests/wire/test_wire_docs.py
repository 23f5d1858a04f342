"""The ```python blocks of docs/wire.md run as written, each in a fresh interpreter on CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "wire.md"
# a block opens with a line of exactly ```python and closes at the next line of exactly ```
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)
# vLLM, SGLang int32, SGLang uint16, moe-ops, raw bytes: one block per client row at least
MIN_BLOCKS = 5


def _blocks() -> list[str]:
    return BLOCK.findall(DOC.read_text())


def test_every_client_has_a_snippet():
    blocks = _blocks()
    assert len(blocks) >= MIN_BLOCKS, f"docs/wire.md has {len(blocks)} python blocks"
    assert all("assert" in b for b in blocks), "a snippet checks nothing"


def test_the_snippets_run_in_fresh_interpreters():
    """All blocks start at once (importing moe_ops takes ~3 s per interpreter here); each must exit
    0. ``python -c`` puts the working directory (the checkout) first on sys.path, and the
    environment is the machine's, without this test run's TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for code in _blocks()
    ]
    failures = []
    for i, run in enumerate(runs):
        try:
            # a hang guard: the 5 blocks take 2.6 s each alone, ~8 s started together on 2 cores
            out, _ = run.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            run.kill()
            out, _ = run.communicate()
        if run.returncode != 0:
            failures.append(f"block {i + 1} exited {run.returncode}:\n{out[-2000:]}")
    if failures:
        pytest.fail("\n\n".join(failures))
