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
before it is launched). Where the installed torch has ``torch.library.wrap_triton`` (2.6+), the op's
functionalisation runs the launcher with ``wrap=wrap_triton`` on CUDA tensors, so ``torch.compile``
records the Triton kernel itself (``triton_kernel_wrapper_functional``) and inductor launches it
from its generated code, not through the op's Python kernel and Triton's ``JITFunction.run`` -
what ``torch.library.triton_op`` does, on a ``Library`` op. On the H200 (torch 2.11) that halves
the host cost of a compiled call without CUDA graphs (``capture_into`` 50 -> 26 us per layer call
on one run's host, ``route`` 145 -> 29 us, ``benchmarks/bench_capture.py --host``), and under
``mode="reduce-overhead"`` the graph keeps its CUDA graphs: torch's mutation analysis of the
kernels reports exactly the tensors they write (``tests/runtime/test_triton_constants.py``).
:func:`trace_triton_kernels` switches it (off, or on for CPU tensors where Triton is interpreted);
on an older torch, and under ``torch.export`` with the decomposition disabled, the op stays opaque.

:func:`eager_caller`: an eager call on plain CUDA tensors runs the op's CUDA kernel without the
dispatcher's round trip, where the dispatcher would do nothing else.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable

import torch

from .triton import interpreting

__all__ = [
    "HAS_WRAP_TRITON",
    "LIB",
    "destination_op",
    "eager_caller",
    "identity",
    "reference_op",
    "trace_triton_kernels",
]

# the package's fragment of the moe_ops namespace; every op is defined through it
LIB = torch.library.Library("moe_ops", "FRAGMENT")

HAS_WRAP_TRITON = hasattr(torch.library, "wrap_triton") and hasattr(torch.library, "register_torch_dispatch")

_bump = torch.autograd.graph.increment_version


# the devices whose calls decompose into their Triton kernels when traced (see the module
# docstring and trace_triton_kernels); "cpu" applies only where Triton is interpreted
_TRACED_DEVICES = [("cuda",)]


@contextlib.contextmanager
def trace_triton_kernels(enabled: bool = True):
    """Within this block, torch.compile traces calls of the traceable ops (capture, route,
    route + capture) into their Triton kernels (``enabled=True``: on CUDA tensors, as outside the
    block, and on CPU tensors where Triton is interpreted, ``TRITON_INTERPRET=1``, for backends
    that run the graph such as ``aot_eager``: inductor cannot launch a user Triton kernel on the
    CPU), or keeps every call an opaque op (``enabled=False``).

    Only tracing reads it: a graph compiled inside the block keeps its kernels when run outside.
    Inside the block inductor's FX-graph and AOT-autograd caches are off: their keys hold the
    dynamo graph, which is the same with and without the flag (the op is decomposed below dynamo),
    so a cached artifact would hand back the other form inside the block (measured on the H200:
    the same host cost as outside), and one saved inside would hand this block's form to compiles
    outside it. A process-wide flag, not thread-safe: set it from the thread that compiles.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False, got {enabled!r}")
    previous = _TRACED_DEVICES[0]
    _TRACED_DEVICES[0] = ("cuda", "cpu") if enabled else ()
    try:
        with _caches_off():
            yield
    finally:
        _TRACED_DEVICES[0] = previous


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
        # one call for all (0.25 us each on a 2-core host); inference tensors carry no counter
        _bump([t for i in positions if isinstance(t := args[i], torch.Tensor) and not t.is_inference()])

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
    kernels: Iterable = (),
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
        kernels: the ``@triton.jit`` kernels ``traceable`` launches. Registered where
            ``torch.library.triton_op`` registers its kernels, so that the compile caches' keys
            (AOT autograd's) hash their source: without it a cached graph would hand back a traced
            kernel's old code after the kernel changed.
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
        cuda_kernel = _bumping(cuda, positions)
        LIB.impl(name, cuda_kernel, "CUDA")
        _CUDA_KERNELS[name] = cuda_kernel
    LIB.impl(name, _bumping(cpu_kernel, positions), "CPU")
    torch.library.register_fake(f"moe_ops::{name}", fake or _no_op_fake, lib=LIB)
    if kernels:
        _register_kernels(name, kernels)
    if traceable is not None and HAS_WRAP_TRITON:
        # on the CPU the launcher is traced only where it is the CPU kernel (the interpreter)
        _register_triton_decomposition(name, traceable, cpu=interpreted is not None and interpreting())
    return getattr(torch.ops.moe_ops, name)


def _register_kernels(name: str, kernels: Iterable) -> None:
    if interpreting():  # interpreted kernels have no source object to hash (and compile nothing)
        return
    try:
        from torch._library.triton import triton_ops_to_kernels
    except ImportError:  # pragma: no cover - a torch without triton_op (before 2.6)
        return
    triton_ops_to_kernels[f"moe_ops::{name}"] = list(kernels)


# op name -> its CUDA kernel as registered (version bumps included), for eager_caller
_CUDA_KERNELS: dict[str, Callable] = {}

_Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled
_profiling = torch._C._autograd._profiler_enabled
_functorch = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
_jit_tracing = torch._C._get_tracing_state


def eager_caller(name: str, checked: tuple[int, ...] | None = None) -> Callable:
    """``f(*args)`` calling ``torch.ops.moe_ops.<name>``: on plain CUDA tensors outside any
    tracing, it calls the op's CUDA kernel (the one the dispatcher would pick, version bumps
    included) itself.

    Why: the dispatcher's round trip into a Python kernel (boxing ten arguments, calling back
    into Python) cost about 16 of the capture op's 70 us per call on the H200 machine's host. The
    shortcut is taken only where the dispatcher would do nothing else: not under torch.compile
    (dynamo folds ``is_compiling()``, so traced calls always see the op), no torch-dispatch mode
    (FakeTensorMode, functionalisation, make_fx, export), no torch-function mode, no profiler
    (it records the op by name), no functorch transform, no ``torch.jit.trace``, every tensor
    argument a plain ``torch.Tensor`` on CUDA that needs no gradient (autograd would see the op).
    Anything else calls the op. The kernel is the one registered when the op was defined: a later
    ``torch.library`` override of the op's CUDA kernel is seen by the op, not by this shortcut.

    ``checked``: the positions of the tensor arguments to check (None: every tensor argument);
    a caller that built the others itself, on the checked tensors' device, passes the rest.
    """
    packet = getattr(torch.ops.moe_ops, name)
    kernel = _CUDA_KERNELS.get(name)
    if kernel is None:
        return packet
    schema = packet.default._schema
    positions = checked
    if positions is None:
        tensor_types = ("Tensor", "Optional[Tensor]", "Tensor?")
        positions = tuple(i for i, a in enumerate(schema.arguments) if str(a.type) in tensor_types)

    def call(*args):
        if _is_compiling() or _dispatch_modes() or _function_modes() or _profiling() or _functorch():
            return packet(*args)
        if _jit_tracing() is not None:  # torch.jit.trace records ops the dispatcher sees
            return packet(*args)
        grad = torch.is_grad_enabled()
        for i in positions:
            t = args[i]
            if t is None:
                continue
            if type(t) is not _Tensor or not t.is_cuda or (grad and t.requires_grad):
                return packet(*args)
        return kernel(*args)

    call.__name__ = name
    return call


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
    """Under functionalisation (torch.compile, export), CUDA calls of the op (unless
    :func:`trace_triton_kernels` turned it off) become the launcher's ``wrap_triton`` kernels:
    inductor then launches them from its own code (torch.library.triton_op's rule, on a Library
    op). ``cpu``: CPU calls too inside :func:`trace_triton_kernels` (the op's CPU kernel is the
    launcher, Triton interpreted)."""
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
        devices = _TRACED_DEVICES[0] if cpu else tuple(d for d in _TRACED_DEVICES[0] if d != "cpu")
        if not devices:
            return mode.__torch_dispatch__(op, types, args, kwargs)
        traced = all(a.device.type in devices for a in args if isinstance(a, torch.Tensor))
        if disabled or not traced:
            return mode.__torch_dispatch__(op, types, args, kwargs)
        with mode:
            launcher(*args, **kwargs, wrap=_wrap_triton)
        return None

    torch.library.register_torch_dispatch(f"moe_ops::{name}", FunctionalTensorMode, decompose, lib=LIB)
