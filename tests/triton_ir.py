"""Builds a ``@triton.jit`` kernel's TTIR for a CUDA target without a GPU (run with Triton compiling,
not interpreting: ``TRITON_INTERPRET=0``).

Inductor's user-defined-kernel codegen, and its mutation analysis (``generate_ttir``), may pass a
kernel's scalar int arguments as constants, so every scalar argument of a traced kernel must
compile both as a runtime value and as a constexpr. :func:`ttir` builds either; it reads no device
(``GPUTarget("cuda", 90, 32)``: an H200's sm_90).
"""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource, make_backend

__all__ = ["ttir", "ttir_module", "written_pointers"]


def ttir(kernel, pointers: dict, scalars: dict, constexprs: dict, scalars_as_constants: bool) -> str:
    """The TTIR text of ``kernel`` (arguments as :func:`ttir_module`)."""
    return str(ttir_module(kernel, pointers, scalars, constexprs, scalars_as_constants))


def ttir_module(kernel, pointers: dict, scalars: dict, constexprs: dict, scalars_as_constants: bool):
    """The TTIR module of ``kernel``.

    pointers: name -> Triton pointer type ("*i32", "*fp32", ...)
    scalars: name -> Python int/float value of each runtime scalar argument
    constexprs: name -> value of each ``tl.constexpr`` parameter
    scalars_as_constants: pass the scalars as constexprs (what inductor may do), else as i32/fp32
    """
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({})
    signature, constants = {}, dict(constexprs)
    missing = set(kernel.arg_names) - set(pointers) - set(scalars) - set(constexprs)
    if missing:
        raise ValueError(f"no value for the kernel arguments {sorted(missing)}")
    for name in kernel.arg_names:
        if name in pointers:
            signature[name] = pointers[name]
        elif name in scalars and not scalars_as_constants:
            signature[name] = "fp32" if isinstance(scalars[name], float) else "i32"
        else:
            signature[name] = "constexpr"
            constants[name] = scalars[name] if name in scalars else constexprs[name]
    context = triton._C.libtriton.ir.context()
    triton._C.libtriton.ir.load_dialects(context)
    backend.load_dialects(context)
    codegen_fns = backend.get_codegen_implementation(options)
    return ASTSource(kernel, signature, constants).make_ir(
        target, options, codegen_fns, backend.get_module_map(), context
    )


def written_pointers(kernel, pointers: dict, scalars: dict, constexprs: dict, scalars_as_constants: bool):
    """Names of the pointer arguments torch's mutation analysis of traced Triton kernels
    (``torch._higher_order_ops.triton_kernel_wrap``: what decides which tensors inductor treats as
    mutated, clones and copies back) reports as written, on ``kernel``'s TTIR. The pointer
    arguments must come first in the kernel's signature (they do in this package's kernels)."""
    from torch._higher_order_ops import triton_kernel_wrap as tkw

    names = list(kernel.arg_names)
    n_pointers = len(pointers)
    if set(names[:n_pointers]) != set(pointers):
        raise ValueError(f"the pointer arguments must come first, got {names}")
    module = ttir_module(kernel, pointers, scalars, constexprs, scalars_as_constants)
    functions = tkw.ttir_to_functions(module)
    fn_name = next(name for name in functions if kernel.fn.__name__ in name)
    if hasattr(tkw, "analyze_kernel_access"):  # torch >= 2.12
        tkw.analyze_kernel_access.reset()
        tkw.get_tma_stores.reset()
        accesses = tkw.analyze_kernel_access(
            functions, fn_name, len(names), tuple(names), frozenset(range(n_pointers))
        )
        return sorted(dep.name for dep in accesses.read_writes.writes)
    for memo in (tkw.analyze_kernel_mutations, tkw.get_tma_stores):
        getattr(memo, "reset", lambda: None)()
    mutated = tkw.analyze_kernel_mutations(functions, fn_name, n_pointers)
    return sorted(name for name, hit in zip(names, mutated) if hit)
