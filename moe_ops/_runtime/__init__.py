"""The house the kernels live in: what every op, kernel and copy of the package runs on.

- ``library`` - :func:`~moe_ops._runtime.library.destination_op`, the one registration helper of the
  ``torch.ops.moe_ops.*`` ops, ``reference_op``, ``eager_caller`` and ``trace_triton_kernels``;
- ``faults`` - :class:`~moe_ops._runtime.faults.DeviceCounter`, the one device-side fault counter
  (read-and-subtract checks, the device-wide registry, ``cpu_counter_lock``) that capture, replay
  and distributed record into;
- ``launcher`` - :class:`~moe_ops._runtime.launcher.KernelLauncher`, eager CUDA launches of a
  ``@triton.jit`` kernel without ``JITFunction.run``'s per-call binding;
- ``triton`` - whether Triton is installed and where its kernels run (``HAS_TRITON``,
  ``interpreting``, ``triton_runs_on``);
- ``cudart`` - a few CUDA runtime calls through ctypes on the libcudart torch loaded;
- ``private_names`` - every private torch / Triton name the package uses, what for and the versions
  it was checked on (``tests/runtime/test_private_names.py`` fails on one that is not listed).

Private to the package: nothing here is public API, and this ``__init__`` imports none of them
(importing one module loads only what it needs).
"""
