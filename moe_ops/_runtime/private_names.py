"""Every private torch and Triton name the package (``moe_ops``, ``graphs``) uses: what for, and the
versions it was checked on.

Private: reached through a name that starts with one underscore (``torch._dynamo.*``, ``torch._C.*``,
``torch._subclasses.*``, ``op._schema``), or inside Triton's runtime, compiler and configuration
(``INTERNAL_NAMESPACES``), which Triton does not document as API. Such a name can change in any
release, so each is listed here with the use that would break. ``tests/runtime/test_private_names.py`` scans
every module with ``ast`` and fails on a name used and not listed here, or listed and no longer used,
naming the file and line; it also resolves every listed name in the installed torch and Triton, so
running it on a machine checks its versions.

The tested versions: torch 2.13 (CPU build) with Triton 3.9 on the CI machine ("here"), torch 2.11
with Triton 3.6 on the H200 machine. "Checked" says where the code path that uses the name ran in the
test suite: the CPU suite here, the GPU suite the H200 ran at commit c28b133 (a CUDA path runs there
only; a path of interpreted Triton kernels, ``TRITON_INTERPRET=1``, only here).

Three tables:

- ``PRIVATE``: dotted names reached from ``torch`` / ``triton`` (imports, attribute chains,
  ``getattr`` / ``hasattr``), each up to the first object that is not a module;
- ``PRIVATE_ATTRIBUTES``: private attributes of objects the code holds (a compiled module's
  ``_orig_mod``); the scan cannot see the object's type and matches them by the attribute's name;
- ``INTERNAL_ATTRIBUTES``: undocumented attributes without an underscore (``JITFunction.params``,
  ``CompiledKernel.packed_metadata``), which no scan can tell from the package's own; each names the
  files that read it, and the test checks they still do. A new one is listed by hand.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["INTERNAL_ATTRIBUTES", "INTERNAL_NAMESPACES", "PRIVATE", "PRIVATE_ATTRIBUTES", "Private"]

# Triton's namespaces that are internal though their names have no underscore
INTERNAL_NAMESPACES = ("triton.runtime", "triton.compiler", "triton.knobs", "triton.backends")

# where each name was checked (the module docstring says what "checked" means)
# the group timeouts: read by the gloo tests (CPU processes), which the GPU suite does not run; their
# NCCL twin needs two GPUs
GLOO_TIMEOUT = (
    "torch 2.13 here (tests/distributed/test_distributed.py, gloo); torch 2.11 by the same gloo tests in "
    "a CPU venv at commit c3c23c2; the NCCL groups' options not run (two GPUs)"
)
BOTH = "torch 2.13 + Triton 3.9 here; torch 2.11 + Triton 3.6 on the H200 by the GPU suite of c28b133"
CUDA_PATH = (
    "torch 2.11 + Triton 3.6 on the H200 by the GPU suite of c28b133 (a CUDA path); present in "
    "torch 2.13 + Triton 3.9 here, where the path does not run"
)
CUDA_BUILD = (
    "torch 2.11 on the H200 by the GPU suite of c28b133 (a CUDA path); CUDA builds of torch only: "
    "absent from torch 2.13+cpu here"
)
RECOMPUTE = (
    "torch 2.13 here (tests/replay/test_replay_schedules.py, tests/integrations/test_megatron.py: "
    "recomputes under torch's and transformers' checkpoints); torch 2.11 on the H200: this table's "
    "test and the GPU suite (Megatron's tensor_parallel.checkpoint)"
)
INTERPRETED = (
    "torch 2.13 + Triton 3.9 here, with TRITON_INTERPRET=1 only: the H200 compiles its kernels, so "
    "the GPU suite of c28b133 did not reach it there (torch 2.11 / Triton 3.6 presence: this table's test "
    "on the H200)"
)


class Private(NamedTuple):
    """One private name: why the package uses it and where it was checked."""

    # what the package uses it for, and what it does where the name is missing
    use: str
    # the versions it was checked on (one of the constants above, or its own sentence)
    checked: str
    # only CUDA builds of torch have it (the test looks for it only in such a build)
    cuda_build: bool = False
    # tested versions that lack it ("torch 2.11"): the code falls back there, the test expects it absent
    absent: tuple[str, ...] = ()
    # INTERNAL_ATTRIBUTES only: the files that read it
    files: tuple[str, ...] = ()


_LIBRARY = "moe_ops/_runtime/library.py"
_LAUNCHER = "moe_ops/_runtime/launcher.py"
LAUNCHER_CHECKED = (
    "Triton 3.9 here (tests/runtime/test_launcher.py); Triton 3.6 on the H200 by the GPU suite of c28b133"
)

PRIVATE: dict[str, Private] = {
    # --- torch.compile: dynamo and inductor -------------------------------------------------------
    "torch._dynamo.mark_static_address": Private(
        "persistent tensors a compiled step mutates (fault counters, capture buffers, stamps, KV "
        "caches of the reference model, replay slots) keep their address, so inductor's CUDA-graph "
        "trees accept the mutation instead of copying the tensor or skipping graphs",
        BOTH,
    ),
    "torch._dynamo.assume_constant_result": Private(
        "the device-wide fault counters (capture, replay) and the empty stamps tensor are looked "
        "up once at trace time and baked in as constants: their lock and first allocation would "
        "break the graph (public twin: torch.compiler.assume_constant_result)",
        BOTH,
    ),
    "torch._dynamo.mark_dynamic": Private(
        "graphs.compile.mark_rows_dynamic: one compiled graph for every row count", BOTH
    ),
    "torch._dynamo.reset": Private(
        "graphs.compile.count_graph_breaks starts from no compiled code (public twin: torch.compiler.reset)",
        BOTH,
    ),
    "torch._dynamo.explain": Private(
        "graphs.compile.count_graph_breaks: graph_break_count of its ExplainOutput", BOTH
    ),
    "torch._dynamo.utils.counters": Private(
        'graphs.compile.CompileCounters: counters["graph_break"], ["stats"]["unique_graphs"] and '
        '["inductor"]["cudagraph_skips"] (the numbers TORCH_LOGS prints)',
        BOTH,
    ),
    "torch._dynamo.utils.guard_failures": Private(
        "graphs.compile.CompileCounters.recompile_reasons: the failed guard of each recompile", BOTH
    ),
    "torch._inductor.config": Private(
        "trace_triton_kernels turns inductor's FX-graph caches off inside its block "
        "(fx_graph_cache, fx_graph_remote_cache; each only where the installed torch has it); the "
        "demo imports it for the patch below",
        BOTH,
    ),
    "torch._functorch.config": Private(
        "trace_triton_kernels turns AOT autograd's caches off inside its block "
        "(enable_autograd_cache, enable_remote_autograd_cache; each only where torch has it)",
        BOTH,
    ),
    # --- the op layer: registration, dispatch, tracing --------------------------------------------
    "torch._C.parse_schema": Private(
        "destination_op checks a schema's declared mutations against mutates= before defining the op",
        BOTH,
    ),
    "torch._C._len_torch_dispatch_stack": Private(
        "eager_caller: a torch-dispatch mode (FakeTensorMode, functionalisation, make_fx) is active, "
        "so the call goes through the dispatcher",
        BOTH,
    ),
    "torch._C._is_torch_function_mode_enabled": Private(
        "eager_caller: a torch-function mode is active, so the call goes through the dispatcher", BOTH
    ),
    "torch._C._autograd._profiler_enabled": Private(
        "eager_caller: the profiler records ops by name, so the call goes through the dispatcher", BOTH
    ),
    "torch._C._autograd._get_sequence_nr": Private(
        "RoutingReplayer: the next autograd node number of the selecting (forward's) thread when a "
        "slot is selected, so that a recompute in backward finds the forward it belongs to; "
        "getattr: none, a recompute reads the selected slot",
        RECOMPUTE,
    ),
    "torch._C._current_autograd_node": Private(
        "RoutingReplayer.layer_ids: the node a recomputing router call runs under (None outside a "
        "backward), whose number tells which forward it recomputes; getattr: none, a recompute "
        "reads the selected slot",
        RECOMPUTE,
    ),
    "torch._C._are_functorch_transforms_active": Private(
        "eager_caller: a functorch transform (vmap, grad) is active, so the call goes through the "
        "dispatcher; read with getattr (a torch without it: never active)",
        BOTH,
    ),
    "torch._C._get_tracing_state": Private(
        "eager_caller: torch.jit.trace records ops the dispatcher sees, so the call goes through it",
        BOTH,
    ),
    "torch._subclasses.fake_tensor.FakeTensor": Private(
        "the traced decomposition (library) accepts fake tensors; capture and replay traced outside "
        "dynamo (FakeTensorMode, make_fx) take fake stand-ins for their persistent counters",
        BOTH,
    ),
    "torch._subclasses.functional_tensor.FunctionalTensor": Private(
        "the traced decomposition accepts functional tensors beside plain and fake ones", BOTH
    ),
    "torch._subclasses.functional_tensor.FunctionalTensorMode": Private(
        "the mode the traced decomposition registers under (torch.library.register_torch_dispatch): "
        "under functionalisation a traceable op's CUDA call becomes its wrap_triton kernels",
        BOTH,
    ),
    "torch.export._trace.custom_triton_ops_decomposition_disabled": Private(
        "the traced decomposition keeps the op opaque where torch.export disabled the decomposition "
        "of custom Triton ops (ImportError: never disabled)",
        BOTH,
    ),
    "torch._library.triton.triton_ops_to_kernels": Private(
        "destination_op(kernels=) registers the @triton.jit kernels where torch.library.triton_op "
        "does, so AOT autograd's cache key hashes their source (ImportError, before 2.6: skipped; "
        "interpreted kernels are not registered)",
        CUDA_PATH,
    ),
    "torch._library.triton.is_wrap_triton_enabled": Private(
        "_wrap_triton: wrap an interpreted kernel only where torch's wrap_triton would wrap a compiled one",
        INTERPRETED,
    ),
    "torch._higher_order_ops.triton_kernel_wrap.TraceableTritonKernelWrapper": Private(
        "_wrap_triton: an interpreted kernel traced as the functional kernel node that wrap_triton "
        "makes of a compiled one (constructor: kernel, kernel index None, grid None)",
        INTERPRETED,
    ),
    "triton.runtime.jit.JITFunction": Private(
        "_traceable_interpreted subclasses it around an interpreted kernel's function: wrap_triton's "
        "tracer records JITFunctions only (overrides cache_key, __hash__, __getitem__, and run with "
        "JITFunction.run's signature: *args, grid, warmup, **kwargs)",
        INTERPRETED,
    ),
    # --- the eager launcher (KernelLauncher) ------------------------------------------------------
    "triton.knobs": Private(
        "the launcher's shortcut is used only where Triton has knobs (ImportError: always JITFunction.run)",
        CUDA_PATH,
    ),
    "triton.knobs.runtime": Private(
        "launch_enter_hook / launch_exit_hook (None in 3.6, a HookChain whose .calls is empty in "
        "3.9), debug and add_stages_inspection_hook: any set, the launcher defers to JITFunction.run",
        CUDA_PATH,
    ),
    "triton.knobs.compilation": Private(
        "instrumentation_mode set: the launcher defers to JITFunction.run (getattr: a Triton without it "
        "has no such mode)",
        CUDA_PATH,
    ),
    "triton.runtime.driver": Private(
        "active.get_current_target().backend == 'cuda' (ROCm torch also calls its devices cuda; AMD's "
        "backend specialises on more than the launcher keys); active.get_current_device / "
        "get_current_stream where torch lacks the two getters below",
        CUDA_PATH,
    ),
    "torch._C._cuda_getDevice": Private(
        "the launcher's device index without torch.cuda.current_device's lazy-init check; the "
        "snapshot pipeline's current device, read before it switches to its copy stream",
        CUDA_BUILD,
        cuda_build=True,
    ),
    "torch._C._cuda_getCurrentRawStream": Private(
        "the current cudaStream_t in one call, for the launcher and the pipeline's runtime calls "
        "(getattr: a torch without it takes Triton's driver / a Stream object)",
        CUDA_BUILD,
        cuda_build=True,
    ),
    "torch._C._cuda_getCurrentStream": Private(
        "the pipeline's current stream as (id, device, type), without torch.cuda.current_stream's "
        "device lookup (3 calls per snapshot were its largest Python cost on the H200)",
        CUDA_BUILD,
        cuda_build=True,
    ),
    "torch._C._cuda_setStream": Private(
        "the pipeline makes its copy stream current and restores the caller's (torch.cuda.stream "
        "took 10.1 us on the H200)",
        CUDA_BUILD,
        cuda_build=True,
    ),
    "torch._C._cuda_setDevice": Private(
        "the pipeline's copy stream and graph launch with another device current on the thread "
        "(2+ GPUs only: the GPU suite of c28b133 on one H200 did not reach it; the test of this table "
        "looks for it in CUDA builds)",
        "not run on a tested version (2+ GPUs only); absent from torch 2.13+cpu here; presence in "
        "torch 2.11: this table's test on the H200",
        cuda_build=True,
    ),
    # --- torch.distributed ------------------------------------------------------------------------
    "torch.distributed._functional_collectives": Private(
        "all-gathers torch.compile traces and NCCL captures in CUDA graphs: the sequence-parallel "
        "shards of topk_ids (capture.op) and moe_ops.distributed's _all_gather",
        BOTH,
    ),
    "torch.distributed._functional_collectives.all_gather_single": Private(
        "the all-gather where torch has it (2.13); getattr falls back to all_gather_tensor",
        "torch 2.13 here; absent from torch 2.11 (the H200 runs all_gather_tensor)",
        absent=("torch 2.11",),
    ),
    "torch.distributed._functional_collectives.all_gather_tensor": Private(
        "the all-gather where all_gather_single is missing (torch 2.11)",
        "torch 2.11 on the H200 by the GPU suite of c28b133; present in torch 2.13 here, not called",
    ),
    "torch.distributed._functional_collectives.AsyncCollectiveTensor": Private(
        "an eager all-gather returns one: wait() it before the values are read", BOTH
    ),
}

PRIVATE_ATTRIBUTES: dict[str, Private] = {
    "torch.autograd.graph.Node._sequence_nr": Private(
        "RoutingReplayer: the number autograd gave a node when the forward created it, matched to "
        "the selection in force then (a recompute's forward)",
        RECOMPUTE,
    ),
    "torch._ops.OpOverload._schema": Private(
        "eager_caller finds the op's tensor arguments (the positions it checks) in its schema", BOTH
    ),
    "torch._dynamo.eval_frame.OptimizedModule._orig_mod": Private(
        "models.attach: the module a torch.compile wrapper holds, to find its replay_routers()", BOTH
    ),
    "torch.distributed.ProcessGroup._device_types": Private(
        "moe_ops.distributed reads the default group's collective timeout (torch has no public "
        "getter) from each device type's backend; getattr: none, no timeout read",
        BOTH,
    ),
    "torch.distributed.ProcessGroup._get_backend": Private(
        "the backend of one device type, whose options hold the group's timeout (AttributeError / "
        "RuntimeError: no timeout read)",
        GLOO_TIMEOUT,
    ),
    "torch.distributed.ProcessGroupGloo.Options._timeout": Private(
        "the timeout the group was created with (gloo's options; NCCL's have the same field)",
        GLOO_TIMEOUT,
    ),
    "transformers.PretrainedConfig._attn_implementation": Private(
        "transformers', not torch's: integrations.hf.indexer refuses to replay indexer positions on an "
        "attention path other than eager/SDPA (the others read them as kernel indices); transformers "
        "has no public getter of the resolved implementation",
        "transformers 5.25 here (tests/integrations/test_indexer_attach.py); not run on the GPU "
        "machine's transformers 5.17 (the tests run on the CPU)",
    ),
    "ctypes.CDLL._handle": Private(
        "the standard library's, not torch's: the loader handle that tells torch's libcudart from "
        "another package's copy where two are mapped (cudart._torch_cudart)",
        "Python 3.11 here (the attribute, read by this table's test); the path runs only where two "
        "libcudart files are mapped, which no test arranges: not run on torch 2.11 or 2.13",
    ),
}

INTERNAL_ATTRIBUTES: dict[str, Private] = {
    "triton.runtime.jit.JITFunction.params": Private(
        "KernelLauncher reads the kernel's parameters (constexprs last) to build its key",
        "Triton 3.9 here (tests/runtime/test_launcher.py, kernels compiled, not interpreted); Triton 3.6 on "
        "the H200 by the GPU suite of c28b133",
        files=(_LAUNCHER,),
    ),
    "triton.runtime.jit.KernelParam.is_constexpr": Private(
        "which parameters are constexprs (passed after the runtime arguments)",
        LAUNCHER_CHECKED,
        files=(_LAUNCHER,),
    ),
    "triton.runtime.jit.KernelParam.name": Private(
        "the constexpr parameters' names, the keys of the launcher's constexprs",
        LAUNCHER_CHECKED,
        files=(_LAUNCHER,),
    ),
    "triton.runtime.jit.KernelParam.do_not_specialize": Private(
        "whether Triton specialises an int argument on == 1 and % 16 (the launcher's key does the same)",
        LAUNCHER_CHECKED,
        files=(_LAUNCHER,),
    ),
    "triton.runtime.jit.KernelParam.do_not_specialize_on_alignment": Private(
        "whether Triton specialises a pointer on 16-byte alignment (the launcher's key does the same)",
        LAUNCHER_CHECKED,
        files=(_LAUNCHER,),
    ),
    "triton.runtime.jit.JITFunction.pre_run_hooks": Private(
        "a kernel with pre-run hooks always launches through JITFunction.run",
        CUDA_PATH,
        files=(_LAUNCHER,),
    ),
    "triton.runtime.jit.JITFunction.fn": Private(
        "the kernel's Python function, whose name the launcher's argument-count error gives",
        CUDA_PATH,
        files=(_LAUNCHER,),
    ),
    "triton.runtime.interpreter.InterpretedFunction.fn": Private(
        "the interpreted kernel's Python function, which _traceable_interpreted's JITFunction wraps "
        "(and names its cache key after)",
        INTERPRETED,
        files=(_LIBRARY,),
    ),
    "triton.runtime.jit.JITFunction.cache_key": Private(
        "overridden for the JITFunction around an interpreted kernel (torch's tracer hashes it)",
        INTERPRETED,
        files=(_LIBRARY,),
    ),
    "triton.runtime.interpreter.InterpretedFunction.run": Private(
        "the interpreted kernel's launch, called with JITFunction.run's keywords (grid, warmup)",
        INTERPRETED,
        files=(_LIBRARY,),
    ),
    "triton.compiler.compiler.CompiledKernel.packed_metadata": Private(
        "KernelLauncher passes it to the compiled kernel's launcher (missing: the launcher turns "
        "itself off and launches through JITFunction.run)",
        CUDA_PATH,
        files=(_LAUNCHER,),
    ),
    "triton.compiler.compiler.CompiledKernel.function": Private(
        "the CUfunction handle passed to the compiled kernel's launcher", CUDA_PATH, files=(_LAUNCHER,)
    ),
    "triton.compiler.compiler.CompiledKernel.run": Private(
        "the compiled kernel's launcher, called positionally as JITFunction.run calls it: grid x, y, "
        "z, stream, function, packed_metadata, launch metadata (None), enter and exit hooks (None), "
        "the runtime arguments, the constexpr values",
        CUDA_PATH,
        files=(_LAUNCHER,),
    ),
    "torch.SymInt.node": Private(
        "capture.kernels.size_hint: a SymInt's example value (node.hint) picks a tile size without "
        "adding a guard",
        BOTH,
        files=("moe_ops/capture/kernels.py",),
    ),
    "torch.fx.experimental.sym_node.SymNode.hint": Private(
        "read with getattr; missing or not an int: the fallback tile size",
        BOTH,
        files=("moe_ops/capture/kernels.py",),
    ),
}
