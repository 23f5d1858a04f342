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

__all__ = ["ttir"]


def ttir(kernel, pointers: dict, scalars: dict, constexprs: dict, scalars_as_constants: bool) -> str:
    """The TTIR text of ``kernel``.

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
    module = ASTSource(kernel, signature, constants).make_ir(
        target, options, codegen_fns, backend.get_module_map(), context
    )
    return str(module)
