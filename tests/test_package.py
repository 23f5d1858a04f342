"""The package a newcomer installs: `import moe_ops` stays light, the version lives in one place."""

from __future__ import annotations

import ast
import itertools
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

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
    assert moe_ops.attach_capture.__module__ == "moe_ops.integrations.hf.attach"
    assert moe_ops.attach_replay.__module__ == "moe_ops.integrations.hf.attach"
    assert moe_ops.backends.__module__ == "moe_ops.backend_report"
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


class _Import(NamedTuple):
    """One import statement's module of ``moe_ops``."""

    # the module imported: ``pkg.name`` for ``from pkg import name`` when that is a module, else ``pkg``
    target: str
    # where the statement is: "moe_ops/x.py:12"
    where: str
    # qualified name of the enclosing function or method ("" when the import runs at import time)
    function: str


def _imports(path: Path, module: str, modules) -> list[_Import]:
    """Every import statement of ``module``: at module level, in class bodies and inside functions
    and methods (those run later, on first use, but still make an arrow between the modules).
    ``import a.b`` imports ``a.b``; ``from pkg import name`` and ``from . import name`` import the
    submodule ``pkg.name`` when there is one, else ``pkg`` itself. An ``if TYPE_CHECKING:`` block
    never runs (annotations only), so its imports make no arrow."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    where = str(path.relative_to(ROOT))
    found: list[_Import] = []

    def visit(node: ast.AST, scope: str, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for rest in child.orelse:  # the else branch runs
                    visit(ast.Module(body=[rest], type_ignores=[]), scope, function)
                continue
            if isinstance(child, ast.Import):
                found.extend(_Import(a.name, f"{where}:{child.lineno}", function) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - child.level + 1] + ([base] if base else []))
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    found.append(
                        _Import(sub if sub in modules else base, f"{where}:{child.lineno}", function)
                    )
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{scope}.{child.name}" if scope else child.name
                is_def = not isinstance(child, ast.ClassDef)
                visit(child, name, name if is_def or function else function)
            else:
                visit(child, scope, function)

    visit(tree, "", "")
    return found


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _package_modules() -> dict[str, Path]:
    """Every module of the installed package; moe_ops.graphs is built from graphs/ (the checkout's
    moe_ops/graphs/__init__.py only loads it there)."""
    modules = {_module_name(p): p for p in sorted((ROOT / "moe_ops").rglob("*.py"))}
    modules.update({"moe_ops." + _module_name(p): p for p in sorted((ROOT / "graphs").glob("*.py"))})
    return modules


def _import_graph() -> dict[str, dict[str, list[_Import]]]:
    """module -> imported module of the package -> the statements that import it (self-imports out)."""
    modules = _package_modules()
    graph: dict[str, dict[str, list[_Import]]] = {}
    for name, path in modules.items():
        graph[name] = {}
        for imp in _imports(path, name, modules):
            if imp.target in modules and imp.target != name:
                graph[name].setdefault(imp.target, []).append(imp)
    return graph


def _find_cycle(graph: dict[str, dict[str, list[_Import]]]) -> list[str] | None:
    """A cycle of the graph as [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        stack.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                return [*stack[stack.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[name] = 2
        return None

    for name in graph:
        if name not in state and (cycle := visit(name)):
            return cycle
    return None


def _describe(graph, cycle: list[str]) -> str:
    lines = []
    for a, b in itertools.pairwise(cycle):
        sites = ", ".join(f"{i.where}" + (f" in {i.function}()" if i.function else "") for i in graph[a][b])
        lines.append(f"  {a} -> {b}  ({sites})")
    return "import cycle:\n" + "\n".join(lines)


def test_the_import_walk_reads_imports_inside_functions_and_submodules_of_from_imports():
    """The walk the cycle test relies on, on a module of the package with all four forms."""
    modules = _package_modules()
    found = {(i.target, i.function) for i in _imports(ROOT / "moe_ops/cli.py", "moe_ops.cli", modules)}
    # `from .demo import main_demo` inside _run: the package moe_ops.demo; `from .selftest import
    # run_selftest`: a module; `from .cli_args import (...)` at module level: a module
    assert {("moe_ops.demo", "_run"), ("moe_ops.selftest", "_run"), ("moe_ops.cli_args", "")} <= found
    # `from . import __version__` inside _version: the package itself
    args = _imports(ROOT / "moe_ops/cli_args.py", "moe_ops.cli_args", modules)
    assert ("moe_ops", "_version") in {(i.target, i.function) for i in args}
    found = {
        (i.target, i.function)
        for i in _imports(ROOT / "moe_ops/flashinfer/routing.py", "moe_ops.flashinfer.routing", modules)
    }
    assert ("moe_ops.flashinfer.ops", "") in found  # `from . import ops`: the submodule
    assert ("torch", "") in found  # a plain `import torch`


def test_no_module_imports_the_package_root_and_no_import_cycle():
    """No cycle among the package's modules, counting the imports inside functions: each arrow is
    one module needing another, whenever the import runs. Leaves (FlashInfer, the integrations)
    build on the core; the core reaches a leaf only where a caller asks for it by name. An import of
    ``pkg.mod`` also runs ``pkg/__init__.py``; that implicit arrow is not drawn (the subpackages'
    ``__init__`` re-export their modules, so it would tie such a named entry, route's
    backend="flashinfer", to all of moe_ops.router)."""
    modules = _package_modules()
    root_imports = [
        i.where
        for name, path in modules.items()
        if name != "moe_ops"
        for i in _imports(path, name, modules)
        if i.target == "moe_ops" and not i.function
    ]
    # at import time only: moe_ops.cli's _version() reads the root's version once the package is loaded
    assert not root_imports, f"modules importing the package root moe_ops: {root_imports}"
    graph = _import_graph()
    cycle = _find_cycle(graph)
    assert cycle is None, _describe(graph, cycle)
    # the graph is the package's: FlashInfer's experts build on the backend-agnostic contract
    assert "moe_ops.capture.monolithic" in graph["moe_ops.flashinfer.experts"]
    assert not any(t.startswith("moe_ops.flashinfer") for t in graph["moe_ops.capture.monolithic"])
    assert "moe_ops.capture.step" in graph["moe_ops.graphs.runner"]


def test_the_router_reaches_flashinfer_only_through_backend_flashinfer():
    """route(backend="auto") never picks FlashInfer, so the one arrow from moe_ops.router into
    moe_ops.flashinfer is the explicit backend="flashinfer" call; FlashInfer's device support
    imports nothing of its ops (the ops ask it, not the other way)."""
    graph = _import_graph()
    into_flashinfer = sorted(
        (name, imp.function, imp.target)
        for name, targets in graph.items()
        if name.startswith("moe_ops.router")
        for target, imps in targets.items()
        if target.startswith("moe_ops.flashinfer")
        for imp in imps
    )
    assert into_flashinfer == [("moe_ops.router.op", "_route_flashinfer", "moe_ops.flashinfer.routing")]
    assert not [t for t in graph["moe_ops.flashinfer.backends"] if t.startswith("moe_ops.flashinfer.")]


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
    # every subpackage, found by packages.find: each module of the checkout is in the wheel
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "moe_ops").rglob("*.py")}
    modules = {m for m in modules if "__pycache__" not in m and not m.startswith("moe_ops/graphs/")}
    assert not modules - names, f"modules the wheel lacks: {sorted(modules - names)}"


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


# ---------------------------------------------------------------------------------------------------
# The release path: `python -m build` makes the sdist, then the wheel FROM THE SDIST; the wheel goes
# into a fresh virtual environment. A wheel built from the source tree (above) cannot see a file the
# sdist leaves out.
# ---------------------------------------------------------------------------------------------------


def _manifest_sources() -> list[str]:
    """What the sdist is built from: the packages, pyproject.toml, MANIFEST.in and what its
    ``include`` and ``graft`` lines name (the checkout may hold much else: a .venv, outputs)."""
    names = ["pyproject.toml", "MANIFEST.in", "moe_ops", "graphs"]
    for line in (ROOT / "MANIFEST.in").read_text().splitlines():
        words = line.split()
        if words and words[0] in ("include", "graft"):
            names += words[1:]
    return sorted(set(names))


def _copy_sources(dest: Path) -> None:
    import shutil

    skip = shutil.ignore_patterns("__pycache__", "*.py[cod]", ".pytest_cache", ".hypothesis")
    dest.mkdir()
    for name in _manifest_sources():
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, dest / name, ignore=skip)
        elif (ROOT / name).exists():
            shutil.copy(ROOT / name, dest / name)


def _stage_requirements(requirements: list[str], stage: Path) -> list[str]:
    """Links the installed distributions that ``requirements`` need (with their own requirements,
    transitively) into ``stage``, a folder a fresh environment adds to its path: the packages this
    run tests with, found without a network. Returns the names of those not installed here."""
    from importlib import metadata

    from packaging.requirements import Requirement

    stage.mkdir(parents=True)
    seen: set[str] = set()
    missing: list[str] = []
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = req.name.lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            missing.append(req.name)
            continue
        for path in dist.files or ():
            top = path.parts[0]
            if top in ("..", "__pycache__") or top.endswith(".pth") or (stage / top).exists():
                continue
            os.symlink(dist.locate_file(top), stage / top)
        for text in dist.requires or ():
            sub = Requirement(text)
            if sub.marker is None or sub.marker.evaluate({"extra": ""}):
                todo.append(sub)
    return missing


@pytest.mark.slow
def test_the_release_path_sdist_then_wheel_then_a_fresh_environment(tmp_path):
    """sdist -> wheel built from it -> a fresh venv: ``import moe_ops.graphs``, ``moe-ops demo``
    (--help and a one-request run), the sdist's own tests collect. Measured on 2 idle cores: 35 s
    (build 12 s, venv and install 8 s, collection 12 s); the timeouts are hang guards."""
    import tarfile
    import zipfile

    pytest.importorskip("build", reason="the release is built with `python -m build` (pip install build)")
    pytest.importorskip("setuptools", minversion="77", reason="builds with the build-system's setuptools")
    src = tmp_path / "src"
    _copy_sources(src)
    dist = tmp_path / "dist"
    # --no-isolation: the build-system's setuptools from this environment, no network
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, src],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (sdist,) = dist.glob("moe_ops-*.tar.gz")
    (wheel,) = dist.glob("moe_ops-*.whl")

    # the sdist holds every file of the packages (the checkout's moe_ops/graphs/__init__.py too:
    # setuptools finds the package moe_ops.graphs through it) and every test
    with tarfile.open(sdist) as tar:
        top = sdist.name.removesuffix(".tar.gz")
        members = {m.name.removeprefix(top + "/") for m in tar.getmembers() if m.isfile()}
        tar.extractall(
            tmp_path / "unpacked", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {})
        )
    unpacked = tmp_path / "unpacked" / top
    wanted = [p for folder in ("moe_ops", "graphs", "tests") for p in (ROOT / folder).rglob("*")]
    wanted = {
        str(p.relative_to(ROOT))
        for p in wanted
        if p.is_file() and "__pycache__" not in p.parts and p.suffix in (".py", ".typed", ".c")
    }
    assert not wanted - members, f"files the sdist lacks: {sorted(wanted - members)}"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert {
            "moe_ops/graphs/__init__.py",
            "moe_ops/graphs/runner.py",
            "moe_ops/graphs/compile.py",
            "moe_ops/indexer/codec.c",  # the C codec's source, built at first use
        } <= names
        assert z.read("moe_ops/graphs/__init__.py") == (ROOT / "graphs" / "__init__.py").read_bytes()

    # a fresh venv; its dependencies are this run's installed packages, linked in (no network)
    venv = tmp_path / "venv"
    # without pip: a venv's own setuptools (Python 3.11 bundles 65) would hide the one torch needs;
    # this run's pip installs into it (--python)
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", venv], check=True, capture_output=True, timeout=300
    )
    python = venv / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout.strip()
    with zipfile.ZipFile(wheel) as z:
        (meta_name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        meta = z.read(meta_name).decode()
    requires = [
        line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")
    ]
    base = [r for r in requires if "extra ==" not in r]
    tests = [r.split(";")[0] for r in requires if 'extra == "test"' in r]
    extras = [r.split(";")[0] for r in requires if 'extra == "hf"' in r or 'extra == "flashinfer"' in r]
    # "site-packages" in the path: hypothesis takes a module elsewhere for the user's own and parses
    # its source for constants (measured: 57 s of a 75 s collection for torch and transformers)
    stage = tmp_path / "deps" / "site-packages"
    missing = _stage_requirements(base + tests, stage)
    assert not missing, f"declared requirements not installed in this environment: {missing}"
    # optional: their tests skip without them
    _stage_requirements(extras, tmp_path / "extras" / "site-packages")
    Path(site, "_tested_packages.pth").write_text(f"{stage}\n{tmp_path / 'extras' / 'site-packages'}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["MOE_OPS_CACHE_DIR"] = str(tmp_path / "cache")  # the C codec built afresh from the wheel's source
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-index", "-q", f"{wheel}[test]"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert install.returncode == 0, install.stdout + install.stderr

    def run(*args, cwd=tmp_path):
        return subprocess.run(args, capture_output=True, text=True, env=env, cwd=cwd, timeout=600)

    out = run(
        python, "-c", "import moe_ops, moe_ops.graphs; print(moe_ops.__file__, moe_ops.graphs.__file__)"
    )
    assert out.returncode == 0, out.stderr
    assert all(Path(f).is_relative_to(site) for f in out.stdout.split()), out.stdout
    # the installed package builds its C codec from the source it carries (where cc exists)
    out = run(
        python, "-c", "from moe_ops.indexer import wire; print(wire.codec())",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    if shutil.which(os.environ.get("CC") or "cc"):
        assert out.stdout.strip() == "native", out.stdout
    out = run(venv / "bin" / "moe-ops", "demo", "--help")
    assert out.returncode == 0 and "--requests" in out.stdout, out.stderr
    out = run(
        venv / "bin" / "moe-ops",
        "demo",
        "--device",
        "cpu",
        "--modes",
        "eager",
        "--requests",
        "1",
        "--no-train",
        "--no-progress",
        "--out",
        str(tmp_path / "demo"),
    )
    assert out.returncode == 0 and "all verified" in out.stdout, out.stdout + out.stderr
    assert list((tmp_path / "demo").glob("request_*/routing.npz"))
    # pytest from the unpacked sdist (python -m puts it first on the path): every test collects
    out = run(python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", cwd=unpacked)
    assert out.returncode == 0 and "error" not in out.stdout.splitlines()[-1], out.stdout[-3000:] + out.stderr
