"""The README's layout table matches the tree: every row names a path that exists, and every module
of the package is named, by its own row or by its file name in the row of its folder."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| (`[^|]+`) \| (.+) \|$")


def _table() -> dict[str, str]:
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("## Layout of the code")
    rows = {}
    for line in lines[start:]:
        if line.startswith("## ") and rows:
            break
        m = ROW.match(line)
        if m:  # a row may name several paths: `a.py`, `b.py`
            for path in re.findall(r"`([^`]+)`", m.group(1)):
                rows[path.rstrip("/")] = m.group(2)
    return rows


def _modules() -> list[Path]:
    """Every tracked-looking module: the package and graphs/ (installed as moe_ops.graphs)."""
    found = []
    for base in (ROOT / "moe_ops", ROOT / "graphs"):
        for path in sorted(base.rglob("*.py")):
            if "__pycache__" in path.parts or path.name in ("__init__.py", "__main__.py"):
                continue
            found.append(path.relative_to(ROOT))
    return found


def test_every_row_names_a_path_that_exists():
    rows = _table()
    assert len(rows) >= 15, sorted(rows)  # the table was found and read
    missing = [p for p in rows if not (ROOT / p).exists()]
    assert not missing, f"README layout rows name paths that do not exist: {missing}"


def test_every_module_is_in_the_table():
    rows = _table()
    unnamed = []
    for module in _modules():
        posix = module.as_posix()
        if posix in rows:
            continue
        # named in the row of a folder above it (`router/` names `_select.py`, `_runtime/` names
        # `faults.py`), by its file name or its path below that folder
        folders = [p for p in module.parents if p.as_posix() in rows]
        below = {module.name, *(module.relative_to(f).as_posix() for f in folders)}
        if not any(f"`{n}`" in rows[f.as_posix()] for f in folders for n in below):
            unnamed.append(posix)
    assert not unnamed, f"modules the README layout table does not name: {unnamed}"
