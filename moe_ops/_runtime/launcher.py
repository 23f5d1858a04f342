"""Launching the package's Triton kernels on CUDA with less host time than ``JITFunction.run``.

Outside CUDA graphs the host issues every launch, and a layer's capture or routing is one small
kernel, so the launch's host time is the op's cost. ``JITFunction.run`` binds and specialises every
argument on every call (Triton's generated binder, a ``specialize_impl`` per argument, the cache
key as a string): on the H200 machine's host (torch 2.11, Triton 3.6) 45-47 us of the capture op's
55 us, against 9.7 us for the compiled kernel's own launcher called with the same arguments.

:class:`KernelLauncher` keeps, per kernel, the ``CompiledKernel`` that ``JITFunction.run`` chose for
each specialisation, under a key it computes itself: the device, ``num_warps``, the constexpr
values, and for each runtime argument what Triton's specialisation reads from it - a tensor's dtype
and whether its address is 16-byte aligned; an int's width (i32 / i64 / u64) and, where the
parameter is specialised, whether it equals 1 and whether it is a multiple of 16; the type of
anything else. That is every property Triton 3.x specialises on, so a key is never shared by two of
Triton's specialisations. The first call of a key goes through ``JITFunction.run`` (which compiles,
launches and returns the kernel); later calls call the kernel's launcher directly, passing what
``JITFunction.run`` passes. "Every property": for NVIDIA's backend; the shortcut is used only where
Triton's active target is CUDA (AMD's backend also specialises on a tensor's storage size).

Falls back to ``JITFunction.run`` on every call where the shortcut could differ: Triton launch
hooks registered (profilers such as proton read the launch metadata that only ``run`` builds),
Triton's debug mode, an instrumentation mode, a stages-inspection hook, the kernel's pre-run hooks
(each changes what ``run`` compiles or does per launch), a Triton without ``knobs`` or
``CompiledKernel.packed_metadata``, an interpreted kernel (``TRITON_INTERPRET=1``). A kernel whose
constexpr parameters are not its last ones is refused at construction. Constexpr values are keyed
with their type (``True``, ``1`` and ``1.0`` are three keys, as they are to Triton). Thread-safe:
the cache is a dict written under a lock; a miss raced by two threads may compile twice in
Triton's own cache (harmless: both store a kernel of the same specialisation).
"""

from __future__ import annotations

import functools
import threading

import torch

__all__ = ["KernelLauncher"]


@functools.cache
def _runtime_knobs():
    """``triton.knobs.runtime`` (None: a Triton without knobs, where the shortcut is never used)."""
    try:
        from triton import knobs
    except ImportError:  # pragma: no cover - Triton before knobs: always JITFunction.run
        return None
    return knobs.runtime


@functools.cache
def _compilation_knobs():
    from triton import knobs

    return getattr(knobs, "compilation", None)


def _hooks_off() -> bool:
    """True when nothing makes ``JITFunction.run`` do more than launch the cached kernel: no launch
    hook (Triton 3.6: None; 3.9: an empty chain), no debug mode, no stages-inspection hook, no
    instrumentation mode."""
    runtime = _runtime_knobs()
    if runtime is None:  # pragma: no cover
        return False
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    if getattr(runtime, "debug", False) or getattr(runtime, "add_stages_inspection_hook", None) is not None:
        return False
    compilation = _compilation_knobs()
    return not (compilation is not None and getattr(compilation, "instrumentation_mode", ""))


@functools.cache
def _cuda_target() -> bool:
    """True where Triton's active backend is NVIDIA's (ROCm torch also calls its devices cuda)."""
    from triton.runtime import driver

    try:
        return driver.active.get_current_target().backend == "cuda"
    except Exception:  # no active driver or target: JITFunction.run says what is wrong
        return False


def _device_and_stream():
    """(current device index, raw current stream of a device): what Triton's CUDA driver reads
    (``torch.cuda.current_device``, ``torch._C._cuda_getCurrentRawStream``), without the former's
    lazy-init check, which a launch after the first (the one that compiled) does not need."""
    get_device = getattr(torch._C, "_cuda_getDevice", None)
    get_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get_device is None or get_stream is None:  # pragma: no cover - other torch builds
        from triton.runtime import driver

        return driver.active.get_current_device, driver.active.get_current_stream
    return get_device, get_stream


class KernelLauncher:
    """Launches one ``@triton.jit`` kernel: ``launcher(grid, args, constexprs, num_warps)`` does what
    ``kernel[grid](*args, **constexprs, num_warps=num_warps)`` does, with less host time on CUDA.

    Args:
        kernel: the ``JITFunction``. ``args`` are its runtime (non-constexpr) arguments in order,
            ``constexprs`` maps every constexpr parameter's name to its value.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        # an interpreted kernel (TRITON_INTERPRET=1) has no parameters to read and no compiled
        # kernel to reuse: every call goes through its own run
        params = list(getattr(kernel, "params", ()))
        first_constexpr = next((i for i, p in enumerate(params) if p.is_constexpr), len(params))
        runtime = params[:first_constexpr]
        if not all(p.is_constexpr for p in params[first_constexpr:]):
            # the shortcut appends the constexpr values after the runtime arguments
            names = [p.name for p in params]
            raise ValueError(f"KernelLauncher needs the constexpr parameters last, got {names}")
        self.usable = hasattr(kernel, "params")
        self.constexpr_names = tuple(p.name for p in params[first_constexpr:])
        # per runtime argument: (specialised on its value, specialised on its alignment)
        self._spec = tuple((not p.do_not_specialize, not p.do_not_specialize_on_alignment) for p in runtime)
        self._cache: dict[tuple, tuple] = {}
        # argument types -> generated key function (one per call site in practice)
        self._key_fns: dict[tuple, object] = {}
        self._lock = threading.Lock()
        self._driver = None

    def key(self, args: tuple, constexprs: dict, num_warps: int, device: int) -> tuple:
        """The specialisation key of a launch (see the module docstring)."""
        types = tuple(map(type, args))
        fn = self._key_fns.get(types)
        if fn is None:
            with self._lock:  # one token per argument types
                fn = self._key_fns.get(types)
                if fn is None:
                    fn = self._key_fns[types] = self._make_key_fn(types)
        return fn(args, constexprs, num_warps, device)

    def _make_key_fn(self, types: tuple):
        """The key as one generated expression for arguments of these types (about 3.5 us of
        Python per launch as a loop over 20 arguments, 1 us generated, on a 2-core CI host)."""
        parts = ["token", "device", "num_warps"]
        for name in self.constexpr_names:
            parts.append(f"type(constexprs[{name!r}]), constexprs[{name!r}]")
        for i, (t, (value, align)) in enumerate(zip(types, self._spec)):
            a = f"args[{i}]"
            if issubclass(t, int) and t is not bool:  # an IntEnum is specialised by its value too
                # Triton's widths: i32 (0), i64 (1), u64 (2); one comparison in the common case
                width = f"(0 if -{1 << 31} <= {a} < {1 << 31} else 1 if -{1 << 63} <= {a} < {1 << 63} else 2)"
                parts.append(f"{width}, {a} == 1, {a} % 16 == 0" if value else width)
            elif issubclass(t, torch.Tensor):
                parts.append(f"{a}.dtype, {a}.data_ptr() % 16 == 0" if align else f"{a}.dtype")
            # any other type (float, bool, None) is keyed by its type alone, through `token`
        source = f"def key(args, constexprs, num_warps, device):\n    return ({', '.join(parts)},)\n"
        # stands for the argument types in the key (hashing 20 types per launch cost 0.5 us)
        scope = {"token": len(self._key_fns)}
        exec(source, scope)
        return scope["key"]

    def __call__(self, grid: tuple, args: tuple, constexprs: dict, num_warps: int) -> None:
        if not (
            self.usable
            and _hooks_off()
            and not getattr(self.kernel, "pre_run_hooks", None)
            and _cuda_target()
        ):
            self.kernel[grid](*args, **constexprs, num_warps=num_warps)
            return
        if len(args) != len(self._spec):
            name = self.kernel.fn.__name__
            raise TypeError(f"{name} takes {len(self._spec)} runtime arguments, got {len(args)}")
        driver = self._driver
        if driver is None:
            driver = self._driver = _device_and_stream()
        device = driver[0]()
        key = self.key(args, constexprs, num_warps, device)
        hit = self._cache.get(key)
        if hit is None:
            compiled = self.kernel[grid](*args, **constexprs, num_warps=num_warps)
            packed = getattr(compiled, "packed_metadata", None)
            if packed is None:  # pragma: no cover - a Triton whose launcher takes other arguments
                self.usable = False
                return
            values = tuple(constexprs[name] for name in self.constexpr_names)
            with self._lock:
                self._cache.setdefault(key, (compiled, compiled.run, compiled.function, packed, values))
            return
        _, run, function, packed, values = hit
        n = len(grid)
        run(
            grid[0],
            grid[1] if n > 1 else 1,
            grid[2] if n > 2 else 1,
            driver[1](device),
            function,
            packed,
            None,
            None,
            None,
            *args,
            *values,
        )
