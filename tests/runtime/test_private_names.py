"""Every private torch and Triton name the package uses is listed in
``moe_ops/_runtime/private_names.py``, with what it is for and the versions it was checked on.

The scan reads every module of ``moe_ops`` and ``graphs`` with ``ast`` (imports inside functions
included) and finds:

- a dotted name reached from ``torch`` or ``triton``, through an import (``import torch._x as y``,
  ``from torch._x import y``), an attribute chain (``torch._C._foo(...)``, ``y.bar`` with ``y`` so
  imported, in the scope that imported it) or ``getattr`` / ``hasattr`` with a constant name, that
  has a component starting with one underscore or lies in Triton's internal namespaces
  (``INTERNAL_NAMESPACES``). Its key is the name up to the first object that is not a module, and
  at least up to its last private component (``torch._dynamo.utils.counters["x"]`` ->
  ``torch._dynamo.utils.counters``), resolved in the installed torch and Triton;
- an attribute starting with one underscore read from an object the code holds (``op._schema``,
  ``getattr(model, "_orig_mod")``), when the package defines no attribute, function, class or
  variable of that name anywhere (its own ``self._x`` and such are not another package's). The scan
  cannot see the object's type, so ``PRIVATE_ATTRIBUTES`` is matched by the attribute's name.

A name found and not listed fails with the file and line of each use; a listed name no longer
found fails too. ``INTERNAL_ATTRIBUTES`` (undocumented attributes without an underscore, such as
``JITFunction.params``) cannot be found without types: each is checked to be still read in the
files it names, and a new one is listed by hand.
"""

from __future__ import annotations

import ast
import importlib
import types
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from moe_ops._runtime.private_names import (
    INTERNAL_ATTRIBUTES,
    INTERNAL_NAMESPACES,
    PRIVATE,
    PRIVATE_ATTRIBUTES,
)

ROOT = Path(__file__).resolve().parents[2]
ROOTS = ("torch", "triton")
TABLE = "moe_ops/_runtime/private_names.py"


class Use(NamedTuple):
    """One use of a private name in a module."""

    # the dotted name as written, aliases resolved ("torch._dynamo.utils.counters"), or for an
    # attribute of an object the code holds, the attribute ("._orig_mod" for `model._orig_mod`)
    name: str
    # "moe_ops/x.py:12"
    where: str


def _private(component: str) -> bool:
    return component.startswith("_") and not (component.startswith("__") and component.endswith("__"))


def _sources() -> list[Path]:
    return sorted((ROOT / "moe_ops").rglob("*.py")) + sorted((ROOT / "graphs").glob("*.py"))


def _defined_names(trees) -> set[str]:
    """Every name the package itself defines: functions, classes, variables, arguments, attributes
    it assigns (``self._x = ...``, ``setattr(obj, "_x", ...)``), dataclass fields and imports."""
    names: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.add((node.asname or node.name).split(".")[0])
            elif _constant_attr_call(node, ("setattr",)):
                names.add(node.args[1].value)
    return names


def _constant_attr_call(node: ast.AST, functions=("getattr", "hasattr")) -> bool:
    """``getattr(x, "name", ...)`` / ``hasattr(x, "name")`` with a constant name."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in functions
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    )


def _bindings(body: list[ast.AST], args: ast.arguments | None = None) -> dict[str, str | None]:
    """name -> dotted torch/Triton path, for the imports of one scope (not those of nested
    functions or classes, which bind in their own scope); None for the scope's arguments and the
    names it assigns, which hide an outer scope's import of the same name."""
    bound: dict[str, str | None] = {}
    if args is not None:
        every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
        bound.update({a.arg: None for a in every if a is not None})
    imports: list[ast.AST] = []
    todo = list(body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound[node.id] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.append(node)
        todo.extend(ast.iter_child_nodes(node))
    for node in imports:
        for alias in node.names:
            if isinstance(node, ast.Import):
                local = alias.asname or alias.name.split(".")[0]
                path = alias.name if alias.asname else alias.name.split(".")[0]
            else:
                local = alias.asname or alias.name
                path = f"{node.module}.{alias.name}" if not node.level and node.module else ""
            bound[local] = path if path.split(".")[0] in ROOTS else None
    return bound


def _chain(node: ast.expr) -> tuple[ast.expr, list[str]]:
    """(root expression, attribute names) of ``root.a.b.c``."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return node, parts[::-1]


def scan(source: str, where: str, defined: set[str]) -> list[Use]:
    """The private torch/Triton names and the private attributes of held objects used in one
    module's ``source`` (see the module docstring); ``where`` names the file in each use."""
    tree = ast.parse(source)
    uses: list[Use] = []

    def candidate(name: str, line: int) -> None:
        internal = any(name == n or name.startswith(n + ".") for n in INTERNAL_NAMESPACES)
        if internal or any(_private(p) for p in name.split(".")[1:]):
            uses.append(Use(name, f"{where}:{line}"))

    def resolve(node: ast.expr, scopes: list[dict[str, str | None]]) -> str | None:
        root, parts = _chain(node)
        if not isinstance(root, ast.Name):
            return None
        for scope in reversed(scopes):
            if root.id in scope:  # None: a local variable or argument of that scope
                return None if scope[root.id] is None else ".".join([scope[root.id], *parts])
        return None

    def held(attr: str, root: ast.expr, line: int) -> None:
        if (
            _private(attr)
            and attr not in defined
            and not (isinstance(root, ast.Name) and root.id in ("self", "cls"))
        ):
            uses.append(Use("." + attr, f"{where}:{line}"))

    def visit(node: ast.AST, scopes: list[dict[str, str | None]], inner: set[int]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            body = node.body if isinstance(node.body, list) else [node.body]
            scopes = [*scopes, _bindings(body, getattr(node, "args", None))]
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ROOTS:
                    candidate(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] in ROOTS:
                for alias in node.names:
                    candidate(f"{node.module}.{alias.name}", node.lineno)
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            name = resolve(node, scopes)
            if name is not None:
                candidate(name, node.lineno)
            else:
                root, parts = _chain(node)
                for part in parts:
                    held(part, root, node.lineno)
        elif _constant_attr_call(node):
            target, attr = node.args[0], node.args[1].value
            name = resolve(target, scopes) if isinstance(target, (ast.Name, ast.Attribute)) else None
            if name is not None:
                candidate(f"{name}.{attr}", node.lineno)
                inner = inner | {id(target)}  # reported with the attribute read from it
            else:
                held(attr, _chain(target)[0], node.lineno)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            inner = inner | {id(node.value)}
        for child in ast.iter_child_nodes(node):
            visit(child, scopes, inner)

    visit(tree, [_bindings(tree.body)], set())
    return uses


def _resolve(parts: list[str]):
    """(object, how many leading parts resolved) in the installed packages."""
    try:
        obj = importlib.import_module(parts[0])
    except ImportError:
        return None, 0
    for i, part in enumerate(parts[1:], 1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif isinstance(obj, types.ModuleType):
            try:
                obj = importlib.import_module(".".join(parts[: i + 1]))
            except ImportError:
                return obj, i
        else:
            return obj, i
    return obj, len(parts)


def key(name: str) -> str:
    """The listed form of a dotted name (see the module docstring): up to the first object that is
    not a module (or the first component missing from the installed package), and at least up to
    the last private component."""
    parts = name.split(".")
    cut = len(parts)
    for i in range(1, len(parts) + 1):
        obj, found = _resolve(parts[:i])
        if found < i or not isinstance(obj, types.ModuleType):
            cut = i
            break
    last_private = max((i + 1 for i, p in enumerate(parts) if _private(p)), default=0)
    return ".".join(parts[: max(cut, last_private)])


def _package_uses() -> list[Use]:
    trees = {p: p.read_text() for p in _sources()}
    defined = _defined_names(ast.parse(s) for s in trees.values())
    uses = []
    for path, source in trees.items():
        uses.extend(scan(source, str(path.relative_to(ROOT)), defined))
    return uses


@pytest.fixture(scope="module")
def package_uses() -> list[Use]:
    return _package_uses()


def _held_key(attr: str) -> set[str]:
    """The PRIVATE_ATTRIBUTES entries of an attribute (``"._schema"``)."""
    return {k for k in PRIVATE_ATTRIBUTES if k.endswith(attr)}


def test_every_private_name_the_package_uses_is_listed(package_uses):
    unlisted = []
    for use in package_uses:
        if use.name.startswith("."):
            if not _held_key(use.name):
                unlisted.append(f"{use.where}: attribute {use.name[1:]} (add it to PRIVATE_ATTRIBUTES)")
        elif (k := key(use.name)) not in PRIVATE:
            unlisted.append(f"{use.where}: {k} (add it to PRIVATE)")
    assert not unlisted, (
        f"private torch/Triton names used but not listed in {TABLE}; list each with what it is for "
        "and the torch/Triton versions it was checked on:\n  " + "\n  ".join(unlisted)
    )


def test_every_listed_name_is_still_used(package_uses):
    used = {key(u.name) for u in package_uses if not u.name.startswith(".")}
    held = {k for u in package_uses if u.name.startswith(".") for k in _held_key(u.name)}
    stale = [f"PRIVATE[{k!r}]" for k in PRIVATE if k not in used]
    stale += [f"PRIVATE_ATTRIBUTES[{k!r}]" for k in PRIVATE_ATTRIBUTES if k not in held]
    for name, entry in INTERNAL_ATTRIBUTES.items():
        attr = name.rsplit(".", 1)[1]
        for file in entry.files:
            tree = ast.parse((ROOT / file).read_text())
            reads = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
            reads |= {n.args[1].value for n in ast.walk(tree) if _constant_attr_call(n)}
            if attr not in reads:
                stale.append(f"INTERNAL_ATTRIBUTES[{name!r}] (no {attr} in {file})")
    assert not stale, f"listed in {TABLE} but no longer used by moe_ops or graphs:\n  " + "\n  ".join(stale)


def test_every_entry_says_what_for_and_the_versions_checked():
    for table in (PRIVATE, PRIVATE_ATTRIBUTES, INTERNAL_ATTRIBUTES):
        for name, entry in table.items():
            # ctypes: the standard library's; transformers: an integration leaf's (never the core's)
            assert name.split(".")[0] in (*ROOTS, "ctypes", "transformers"), name
            assert len(entry.use) > 20, f"{name}: say what the package uses it for"
            versions = ("torch 2.11", "torch 2.13", "Triton 3.6", "Triton 3.9", "Python", "transformers 5.")
            assert any(v in entry.checked for v in versions), f"{name}: say which versions: {entry.checked}"
            assert set(entry.absent) <= {"torch 2.11", "torch 2.13", "triton 3.6", "triton 3.9"}, name
    # a listed dotted name is in its key form, so that the scan's keys can match it
    for name in PRIVATE:
        assert key(name) == name, f"PRIVATE[{name!r}] is listed as {key(name)!r} by the scan's rule"


def _compiled_module():
    return torch.compile(torch.nn.Identity())  # an OptimizedModule; compiles nothing until called


def _cdll():
    import ctypes

    return ctypes.CDLL(None)


def _installed() -> dict[str, str]:
    """{"torch": "2.13", "triton": "3.9"}: the installed versions, major.minor."""
    triton = pytest.importorskip("triton")
    return {
        "torch": ".".join(torch.__version__.split(".")[:2]),
        "triton": ".".join(triton.__version__.split(".")[:2]),
    }


def _expected_present(name: str, entry, installed: dict[str, str]) -> bool | None:
    """True: the installed versions must have it; False: must not (listed absent); None: not
    looked for (a CUDA-build name in a CPU build of torch)."""
    if entry.cuda_build and torch.version.cuda is None:
        return None
    root = name.split(".")[0]
    return f"{root} {installed.get(root)}" not in entry.absent


def _kernel_function(x_ptr, n):
    """The Python function of a JITFunction built for its attributes (never launched)."""


def _jit_function():
    from triton.runtime.jit import JITFunction

    return JITFunction(_kernel_function)


def _interpreted_function():
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(_kernel_function)


def _compiled_kernel():
    """A CompiledKernel (CUDA only: compiling needs a GPU target)."""
    import triton
    import triton.language as tl

    @triton.jit
    def store_one(x_ptr):
        tl.store(x_ptr, 1)

    x = torch.zeros(1, dtype=torch.int32, device="cuda")
    return store_one[(1,)](x)


def _symint():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return ShapeEnv().create_unbacked_symint()


# Attributes no class has as a class attribute: the object to read each from (small real ones);
# None: only where CUDA runs
INSTANCES = {
    "torch._ops.OpOverload._schema": lambda: torch.ops.aten.add.Tensor,
    "torch._dynamo.eval_frame.OptimizedModule._orig_mod": _compiled_module,
    "ctypes.CDLL._handle": _cdll,
    "triton.runtime.jit.JITFunction.params": _jit_function,
    "triton.runtime.jit.JITFunction.fn": _jit_function,
    "triton.runtime.jit.JITFunction.cache_key": _jit_function,
    "triton.runtime.jit.JITFunction.pre_run_hooks": _jit_function,
    "triton.runtime.interpreter.InterpretedFunction.fn": _interpreted_function,
    "triton.runtime.jit.KernelParam.is_constexpr": lambda: _jit_function().params[0],
    "triton.runtime.jit.KernelParam.name": lambda: _jit_function().params[0],
    "triton.runtime.jit.KernelParam.do_not_specialize": lambda: _jit_function().params[0],
    "triton.runtime.jit.KernelParam.do_not_specialize_on_alignment": lambda: _jit_function().params[0],
    "triton.compiler.compiler.CompiledKernel.packed_metadata": _compiled_kernel,
    "triton.compiler.compiler.CompiledKernel.function": _compiled_kernel,
    "torch.SymInt.node": _symint,
    "torch.autograd.graph.Node._sequence_nr": lambda: (torch.ones(1, requires_grad=True) * 2).grad_fn,
}
CUDA_INSTANCES = {_compiled_kernel}


# torch 2.13's torch.compile warns about its own use of torch.jit.script_method
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_every_listed_name_exists_in_the_installed_torch_and_triton():
    """What "checked on" means for this machine's versions: each listed name resolves in the
    installed torch and Triton, and one listed as absent from these versions does not (the GPU suite
    runs the same test on the H200's). Names only CUDA builds of torch have are looked for where
    torch is one; attributes of a compiled kernel where CUDA runs."""
    installed = _installed()
    wrong = []
    for table in (PRIVATE, PRIVATE_ATTRIBUTES, INTERNAL_ATTRIBUTES):
        for name, entry in table.items():
            want = _expected_present(name, entry, installed)
            if want is None:
                continue
            probe = INSTANCES.get(name)
            if probe is not None:
                if probe in CUDA_INSTANCES and not torch.cuda.is_available():
                    continue
                found = hasattr(probe(), name.rsplit(".", 1)[1])
            else:
                parts = name.split(".")
                found = _resolve(parts)[1] == len(parts)
                if not found and table is not PRIVATE and want:
                    wrong.append(f"{name}: no class attribute; add an object to read it from to INSTANCES")
                    continue
            if found != want:
                wrong.append(f"{name}: {'absent' if want else 'present, though listed absent'}")
    versions = f"torch {torch.__version__}, Triton {installed['triton']}"
    assert not wrong, f"{TABLE} disagrees with {versions}:\n  " + "\n  ".join(wrong)


def test_the_scan_finds_every_form_and_names_its_line():
    """The scan on a module with every form of use (its expected uses written out below)."""
    source = (
        "import torch\n"  # 1
        "import torch._inductor.config as inductor_config\n"  # 2
        "from torch._subclasses.fake_tensor import FakeTensor\n"  # 3
        "from torch.distributed import _functional_collectives as funcol\n"  # 4
        "def f(model, op):\n"  # 5
        "    from triton.runtime import driver\n"  # 6
        "    torch._dynamo.mark_static_address(model)\n"  # 7
        "    getattr(torch._C, '_cuda_getDevice', None)\n"  # 8
        "    driver.active.get_current_target()\n"  # 9
        "    funcol.all_gather_tensor(model)\n"  # 10
        "    op.default._schema\n"  # 11
        "    getattr(model, '_orig_mod', model)\n"  # 12
        "    model._mine\n"  # 13: the package defines _mine
        "    self._x\n"  # 14: self
        "    torch.library.wrap_triton\n"  # 15: public
        "def g(driver):\n"  # 16
        "    driver.active\n"  # 17: this scope's driver is an argument, not Triton's
    )
    got = scan(source, "m.py", defined={"_mine"})
    assert got == [
        Use("torch._inductor.config", "m.py:2"),
        Use("torch._subclasses.fake_tensor.FakeTensor", "m.py:3"),
        Use("torch.distributed._functional_collectives", "m.py:4"),
        Use("triton.runtime.driver", "m.py:6"),
        Use("torch._dynamo.mark_static_address", "m.py:7"),
        Use("torch._C._cuda_getDevice", "m.py:8"),  # one use: torch._C is where it is read from
        Use("triton.runtime.driver.active.get_current_target", "m.py:9"),
        Use("torch.distributed._functional_collectives.all_gather_tensor", "m.py:10"),
        Use("._schema", "m.py:11"),
        Use("._orig_mod", "m.py:12"),
    ]
    # keys: up to the first object that is not a module, at least up to the last private part
    assert key("torch._dynamo.utils.counters.get") == "torch._dynamo.utils.counters"
    assert key("torch._C._cuda_no_such_function") == "torch._C._cuda_no_such_function"
    assert key("torch.Tensor._version.real") == "torch.Tensor._version"
    assert key("torch._inductor.config") == "torch._inductor.config"
