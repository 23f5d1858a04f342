"""The one registration helper of the package's destination-passing ops (``torch.ops.moe_ops.*``).

Modelled on QuACK's ``cute_op``: an op is one call to :func:`destination_op` naming the kernel per
device; the schema is inferred from the kernel's annotations (or given), the fake is generated (a
destination-passing op writes its declared outputs and returns nothing, so the fake has nothing to
do), and the PyTorch twin registers as the CPU kernel of the same op.

Why ``torch.library.Library.define`` + ``impl`` per dispatch key rather than
``torch.library.custom_op``: a ``custom_op`` call walks Python layers on every call (autograd_impl
-> adinplaceorview_impl -> backend_impl, a dynamo-disable wrapper): 33 us per call on the H200's
host, 11.8 us against 1.2 us for a ``Library.impl`` kernel on this repository's 2-core CI machine
(an empty body, ``benchmarks/bench_capture.py --host`` measures both). What ``custom_op`` adds that
these ops use is kept: the mutated arguments' version counters are bumped after the kernel (what
its ADInplaceOrView layer does), and the fake. Its autograd layer is not needed: no op here has a
differentiable output (replay's gradient is an ``autograd.Function`` over two ops).

Kernels per key:

* ``cuda`` - the Triton launcher;
* ``cpu`` - the PyTorch twin, or the Triton launcher where the package interprets Triton on the
  CPU (``TRITON_INTERPRET=1``, the test suite);
* ``reference`` - the twin again, registered as its own op ``<name>reference_`` on every device,
  for callers that ask for the reference where the main op would run Triton (``backend="torch"``
  on CUDA, or on the CPU under the interpreter). It is an op, not a plain call, because the twins
  update the CPU fault counters under a ``threading.Lock``, which dynamo cannot trace.

``traceable``: a launcher that takes ``wrap=`` (a function applied to each ``@triton.jit`` kernel
before it is launched). Inside :func:`trace_triton_kernels`, where the installed torch has
``torch.library.wrap_triton`` (2.6+), the op's functionalisation runs the launcher with
``wrap=wrap_triton``, so ``torch.compile`` records the Triton kernel itself
(``triton_kernel_wrapper_functional``) and inductor launches it from its generated code, not
through the op's Python kernel and Triton's ``JITFunction.run`` - what ``torch.library.triton_op``
does, on a ``Library`` op. Outside it (the default), and on an older torch or under ``torch.export``
with the decomposition disabled, the op stays opaque. Why opt-in: on the H200 (torch 2.11) it cuts
the host cost of a compiled call without CUDA graphs (``capture_into`` 42 -> 26 us, ``route`` 145 ->
29 us per layer call, ``benchmarks/bench_capture.py --host``), but under ``mode="reduce-overhead"``
inductor then skips CUDA graphs ("mutated inputs"), which the opaque op keeps.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable

import torch

from ._triton import interpreting

__all__ = [
    "HAS_WRAP_TRITON",
    "LIB",
    "destination_op",
    "identity",
    "reference_op",
    "trace_triton_kernels",
]

# the package's fragment of the moe_ops namespace; every op is defined through it
LIB = torch.library.Library("moe_ops", "FRAGMENT")

HAS_WRAP_TRITON = hasattr(torch.library, "wrap_triton") and hasattr(torch.library, "register_torch_dispatch")

_bump = torch.autograd.graph.increment_version


# whether traced calls decompose into their Triton kernels (see trace_triton_kernels)
_TRACE_KERNELS = [False]


@contextlib.contextmanager
def trace_triton_kernels():
    """Within this block, torch.compile traces calls of the traceable ops (capture, route,
    route + capture) into their Triton kernels, which inductor then launches from its generated
    code: on CUDA tensors, and on CPU tensors where Triton is interpreted (``TRITON_INTERPRET=1``;
    for backends that run the graph, such as ``aot_eager``: inductor cannot launch a user Triton
    kernel on the CPU). Off by default: see the module docstring (host cost of compiled calls
    without CUDA graphs against CUDA graphs skipped under ``reduce-overhead``).

    Only tracing reads it: a graph compiled inside the block keeps its kernels when run outside.
    Inside the block inductor's FX-graph and AOT-autograd caches are off: their keys hold the
    dynamo graph, which is the same with and without the flag (the op is decomposed below dynamo),
    so a cached artifact would hand back the opaque op inside the block (measured on the H200: the
    same host cost as outside), and one saved inside would hand the traced kernels, which make
    ``reduce-overhead`` skip CUDA graphs, to compiles outside it.
    A process-wide flag, not thread-safe: set it from the thread that compiles.
    """
    previous = _TRACE_KERNELS[0]
    _TRACE_KERNELS[0] = True
    try:
        with _caches_off():
            yield
    finally:
        _TRACE_KERNELS[0] = previous


def _caches_off():
    """inductor's and AOT autograd's compile caches (local and remote) off, for the keys the
    installed torch has."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    stack = contextlib.ExitStack()
    for config, keys in (
        (inductor_config, ("fx_graph_cache", "fx_graph_remote_cache")),
        (functorch_config, ("enable_autograd_cache", "enable_remote_autograd_cache")),
    ):
        present = {k: False for k in keys if hasattr(config, k)}
        if present:
            stack.enter_context(config.patch(present))
    return stack


def identity(kernel):
    """The eager ``wrap``: launch the ``@triton.jit`` kernel as it is."""
    return kernel


def _mutated_positions(schema: torch.FunctionSchema) -> tuple[int, ...]:
    return tuple(
        i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
    )


def _bumping(kernel: Callable, positions: tuple[int, ...]) -> Callable:
    """``kernel``, then the version counters of the mutated arguments (custom_op's ADInplaceOrView
    does the same): autograd then rejects a backward that saved a tensor this op overwrote."""

    @functools.wraps(kernel)
    def run(*args):
        kernel(*args)
        for i in positions:
            t = args[i]
            # inference tensors carry no version counter
            if isinstance(t, torch.Tensor) and not t.is_inference():
                _bump(t)

    return run


def _define(name: str, schema: str, mutates: tuple[str, ...]) -> tuple[int, ...]:
    if not schema.rstrip().endswith("-> ()"):
        raise ValueError(f"moe_ops::{name}: a destination-passing op returns nothing, got schema {schema}")
    parsed = torch._C.parse_schema(f"moe_ops::{name}{schema}")
    positions = _mutated_positions(parsed)
    declared = {parsed.arguments[i].name for i in positions}
    if declared != set(mutates):
        raise ValueError(
            f"moe_ops::{name}: schema mutates {sorted(declared)}, mutates= says {sorted(mutates)}"
        )
    LIB.define(name + schema)  # after the checks, so a bad declaration defines nothing
    return positions


def _schema_of(fn: Callable, mutates: tuple[str, ...], schema: str | None) -> str:
    return schema if schema is not None else torch.library.infer_schema(fn, mutates_args=mutates)


def _no_op_fake(*args, **kwargs) -> None:
    """Fake of a destination-passing op: the outputs are the caller's tensors, nothing to make."""
    return None


def destination_op(
    name: str,
    *,
    mutates: Iterable[str],
    cuda: Callable | None = None,
    cpu: Callable | None = None,
    interpreted: Callable | None = None,
    traceable: Callable | None = None,
    fake: Callable | None = None,
    schema: str | None = None,
):
    """Defines ``torch.ops.moe_ops.<name>`` and returns its packet.

    Args:
        name: the op's name in the ``moe_ops`` namespace (destination-passing: ends in ``_``).
        mutates: names of the arguments the kernels write (must match the schema's ``(a!)``).
        cuda: the CUDA kernel (the Triton launcher). None: no CUDA kernel (a call raises).
        cpu: the CPU kernel (the PyTorch twin). None: ``cuda`` runs on the CPU too (an op whose
            body is device-neutral torch code).
        interpreted: the CPU kernel when Triton is interpreted on the CPU (``TRITON_INTERPRET=1``);
            None: ``cpu``.
        traceable: a launcher ``f(*op_args, wrap=...)`` (see the module docstring); None: the op is
            opaque to torch.compile on every device.
        fake: the fake kernel; None: a generated no-op (the op returns nothing).
        schema: the schema, e.g. ``"(Tensor(a!) out, int n) -> ()"``; None: inferred from the
            annotations of ``cuda`` (else ``cpu``).

    The kernels receive the op's arguments positionally (defaults filled in by the dispatcher).
    """
    mutates = tuple(mutates)
    first = cuda if cuda is not None else cpu
    if first is None:
        raise ValueError(f"moe_ops::{name}: pass cuda= or cpu=")
    positions = _define(name, _schema_of(first, mutates, schema), mutates)
    cpu_kernel = interpreted if (interpreted is not None and interpreting()) else (cpu or cuda)
    if cuda is not None:
        LIB.impl(name, _bumping(cuda, positions), "CUDA")
    LIB.impl(name, _bumping(cpu_kernel, positions), "CPU")
    torch.library.register_fake(f"moe_ops::{name}", fake or _no_op_fake, lib=LIB)
    if traceable is not None and HAS_WRAP_TRITON:
        # on the CPU the launcher is traced only where it is the CPU kernel (the interpreter)
        _register_triton_decomposition(name, traceable, cpu=interpreted is not None and interpreting())
    return getattr(torch.ops.moe_ops, name)


def reference_op(name: str, twin: Callable, *, mutates: Iterable[str], schema: str | None = None):
    """Defines ``torch.ops.moe_ops.<name>reference_`` (``route_`` -> ``route_reference_``): ``twin``
    on every device (see the module docstring for why the reference is an op of its own)."""
    mutates = tuple(mutates)
    op_name = f"{name.rstrip('_')}_reference_"
    positions = _define(op_name, _schema_of(twin, mutates, schema), mutates)
    kernel = _bumping(twin, positions)
    LIB.impl(op_name, kernel, "CPU")
    LIB.impl(op_name, kernel, "CUDA")
    torch.library.register_fake(f"moe_ops::{op_name}", _no_op_fake, lib=LIB)
    return getattr(torch.ops.moe_ops, op_name)


@functools.cache
def _traceable_interpreted(kernel):
    """A ``JITFunction`` over an interpreted kernel's Python function that launches the interpreted
    kernel: what ``wrap_triton``'s tracer takes (it records JITFunctions only), running the same
    code when the traced graph runs. Triton has no TTIR for it here (no GPU target), so torch's
    mutation analysis assumes every tensor argument is written (it logs a warning saying so)."""
    from triton.runtime.jit import JITFunction

    class InterpretedJIT(JITFunction):
        # JITFunction hashes its source and every jit function it calls; the interpreted ones
        # have no such key, and one wrapper per kernel needs none
        cache_key = f"moe_ops-interpreted-{kernel.fn.__module__}.{kernel.fn.__qualname__}"

        def __hash__(self):
            return hash(self.cache_key)

        def __getitem__(self, grid):
            return kernel[grid]

        def run(self, *args, grid, warmup, **kwargs):
            return kernel.run(*args, grid=grid, warmup=warmup, **kwargs)

    return InterpretedJIT(kernel.fn)


def _wrap_triton(kernel):
    """``torch.library.wrap_triton``, also for a kernel Triton interprets (``TRITON_INTERPRET=1``),
    which wrap_triton hands back unwrapped: traced, it becomes the same functional kernel node
    (``triton_kernel_wrapper_functional``), and running that node launches the interpreted kernel."""
    if interpreting():
        from torch._library.triton import is_wrap_triton_enabled

        if is_wrap_triton_enabled():
            from torch._higher_order_ops.triton_kernel_wrap import TraceableTritonKernelWrapper

            return TraceableTritonKernelWrapper(_traceable_interpreted(kernel), None, None)
        return kernel
    return torch.library.wrap_triton(kernel)


def _register_triton_decomposition(name: str, launcher: Callable, *, cpu: bool) -> None:
    """Under functionalisation (torch.compile, export) inside :func:`trace_triton_kernels`, CUDA
    calls of the op become the launcher's ``wrap_triton`` kernels: inductor then launches them from
    its own code (torch.library.triton_op's rule, on a Library op). ``cpu``: CPU calls too (the
    op's CPU kernel is the launcher, Triton interpreted)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    known = (torch.Tensor, FunctionalTensor)

    def decompose(mode, op, types, args, kwargs):
        try:
            from torch.export._trace import custom_triton_ops_decomposition_disabled

            disabled = custom_triton_ops_decomposition_disabled()
        except ImportError:  # pragma: no cover - torch builds without export
            disabled = False
        if any(not (issubclass(t, FakeTensor) or t in known) for t in types):
            return NotImplemented  # a tensor subclass: let it handle the op
        if not _TRACE_KERNELS[0]:
            return mode.__torch_dispatch__(op, types, args, kwargs)
        devices = ("cuda", "cpu") if cpu else ("cuda",)
        traced = all(a.device.type in devices for a in args if isinstance(a, torch.Tensor))
        if disabled or not traced:
            return mode.__torch_dispatch__(op, types, args, kwargs)
        with mode:
            launcher(*args, **kwargs, wrap=_wrap_triton)
        return None

    torch.library.register_torch_dispatch(f"moe_ops::{name}", FunctionalTensorMode, decompose, lib=LIB)
