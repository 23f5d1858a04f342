"""The package a newcomer installs: `import moe_ops` stays light, the version lives in one place."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import moe_ops

ROOT = Path(__file__).resolve().parents[1]


def test_import_loads_no_optional_package_and_registers_no_flashinfer_op():
    code = (
        "import sys, torch, moe_ops\n"
        "print(sorted(m for m in sys.modules if m.startswith(('flashinfer', 'transformers'))))\n"
        "leaves = ('moe_ops.flashinfer', 'moe_ops.integrations')\n"
        "print(sorted(m for m in sys.modules if m.startswith(leaves)))\n"
        "ops = torch._C._dispatch_get_all_op_names()\n"
        "print(sorted(n for n in ops if n.startswith('moe_ops::flashinfer')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT, timeout=120
    ).stdout.split("\n")
    assert out[:3] == ["[]", "[]", "[]"], out


def test_optional_names_resolve_on_first_use():
    assert moe_ops.attach_capture.__module__ == "moe_ops.integrations.hf"
    assert moe_ops.attach_replay.__module__ == "moe_ops.integrations.hf"
    assert moe_ops.backends.__module__ == "moe_ops.flashinfer.backends"
    assert {"attach_capture", "attach_replay", "backends"} <= set(dir(moe_ops))
    try:
        moe_ops.no_such_name  # noqa: B018 - the attribute access is the test
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("an unknown attribute must raise AttributeError")


def test_the_version_lives_in_the_package_only():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'attr = "moe_ops.__version__"' in pyproject
    assert "\nversion =" not in pyproject.split("[project]")[1].split("\n[")[0]
    assert moe_ops.__version__.count(".") == 2
