"""The package a newcomer installs: `import moe_ops` stays light, the version lives in one place."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import moe_ops

ROOT = Path(__file__).resolve().parents[1]


def test_import_loads_no_optional_package_and_registers_no_flashinfer_op():
    code = (
        "import sys, torch, moe_ops\n"
        "print(sorted(m for m in sys.modules if m.startswith(('flashinfer', 'transformers', 'megatron'))))\n"
        "leaves = ('moe_ops.flashinfer', 'moe_ops.integrations')\n"
        "print(sorted(m for m in sys.modules if m.startswith(leaves)))\n"
        "ops = torch._C._dispatch_get_all_op_names()\n"
        "print(sorted(n for n in ops if n.startswith('moe_ops::flashinfer')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT, timeout=120
    ).stdout.split("\n")
    assert out[:3] == ["[]", "[]", "[]"], out


def test_the_megatron_integration_imports_megatron_on_first_use_only():
    """`moe_ops.integrations.megatron` is a leaf nothing imports; importing it imports no megatron
    (that waits for attach_*, find_routers or the first hooked call)."""
    code = (
        "import sys, moe_ops, moe_ops.integrations\n"
        "print('moe_ops.integrations.megatron' in sys.modules)\n"
        "import moe_ops.integrations.megatron as mg\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'))\n"
        "config = type('C', (), dict(num_layers=2, num_moe_experts=8, moe_router_topk=2))\n"
        "print(mg.routing_shape(config).moe_layers)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT, timeout=120
    ).stdout.split("\n")
    assert out[:3] == ["False", "[]", "(0, 1)"], out


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


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _top_level_imports(path: Path, module: str, modules) -> list[tuple[str, int]]:
    """(imported module, line) for every import that runs when ``module`` is imported (imports
    inside functions run later, on first use). ``from pkg import name`` is an import of the
    submodule ``pkg.name`` when there is one, else of ``pkg`` itself."""
    import ast

    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in modules else base, node.lineno))
    return found


def _package_modules() -> dict[str, Path]:
    """Every module of the installed package; moe_ops.graphs is built from graphs/ (the checkout's
    moe_ops/graphs/__init__.py only loads it there)."""
    modules = {_module_name(p): p for p in sorted((ROOT / "moe_ops").rglob("*.py"))}
    modules.update({"moe_ops." + _module_name(p): p for p in sorted((ROOT / "graphs").glob("*.py"))})
    return modules


def test_no_module_imports_the_package_root_and_no_import_cycle():
    modules = _package_modules()
    edges: dict[str, set[str]] = {}
    root_imports = []
    for name, path in modules.items():
        imports = _top_level_imports(path, name, modules)
        if name != "moe_ops":
            root_imports += [f"{name}:{line}" for target, line in imports if target == "moe_ops"]
        edges[name] = {target for target, _ in imports if target in modules and target != name}
    assert not root_imports, f"modules importing the package root moe_ops: {root_imports}"
    # depth-first search for a cycle through module-level imports
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        stack.append(name)
        for target in sorted(edges[name]):
            if state.get(target) == 1:
                return [*stack[stack.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[name] = 2
        return None

    for name in modules:
        if name not in state:
            cycle = visit(name)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)
    # the graph is the package's: FlashInfer's experts build on the backend-agnostic contract
    assert "moe_ops.capture.monolithic" in edges["moe_ops.flashinfer.experts"]
    assert not any(t.startswith("moe_ops.flashinfer") for t in edges["moe_ops.capture.monolithic"])
    assert "moe_ops.capture.step" in edges["moe_ops.graphs.runner"]


def test_the_wheel_installs_one_top_level_package_with_graphs_inside(tmp_path):
    """graphs/ is built as moe_ops.graphs: top_level.txt lists moe_ops alone (PyPI's "graphs" is
    someone else's), and the wheel's moe_ops/graphs/ is graphs/ itself, not the checkout's stand-in."""
    import shutil
    import zipfile

    pytest.importorskip("setuptools", minversion="77", reason="builds with the build-system's setuptools")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("moe_ops", "graphs"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            tmp_path,
            src,
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("moe_ops-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        assert z.read(top_level).decode().split() == ["moe_ops"]
        assert {"moe_ops/graphs/runner.py", "moe_ops/graphs/compile.py"} <= names
        assert z.read("moe_ops/graphs/__init__.py") == (ROOT / "graphs" / "__init__.py").read_bytes()
    assert not [n for n in names if n.startswith("graphs/")], "a top-level graphs package was built"


def test_a_graphs_folder_in_the_working_directory_does_not_shadow_moe_ops_graphs(tmp_path):
    """The checkout on PYTHONPATH, nothing installed (how the device runs), and a user's graphs/
    folder where Python looks first: moe_ops.graphs still is the repository's graphs/."""
    import os

    (tmp_path / "graphs").mkdir()
    (tmp_path / "graphs" / "__init__.py").write_text(
        "raise ImportError('the user graphs/ folder was imported')\n"
    )
    code = (
        "import sys, moe_ops.graphs, moe_ops.graphs.runner, moe_ops.demo\n"
        "print(moe_ops.graphs.__file__, moe_ops.graphs.runner.__file__, 'graphs' in sys.modules)\n"
        "from moe_ops.graphs import StepRunner\n"
        "assert StepRunner is moe_ops.graphs.runner.StepRunner\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    init, runner, shadowed = out.stdout.split()
    assert Path(init) == ROOT / "graphs" / "__init__.py" and Path(runner) == ROOT / "graphs" / "runner.py"
    assert shadowed == "False"
