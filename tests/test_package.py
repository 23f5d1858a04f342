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
    return {_module_name(p): p for p in sorted((ROOT / "moe_ops").rglob("*.py"))}


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
