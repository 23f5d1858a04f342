"""KernelLauncher's specialisation key never puts two of Triton's specialisations under one key.

The launcher reuses the ``CompiledKernel`` Triton chose for the first launch of a key, so its key
must read at least everything Triton's own specialisation reads (``native_specialize_impl`` with
the CUDA backend, as ``JITFunction.run``'s binder calls it). Checked over every class of value
Triton distinguishes (ints around 1, 16 and the i32/i64/u64 limits, tensors of several dtypes at
several alignments), for the package's kernels' parameter flags. Runs in a subprocess with Triton
compiling, not interpreting (interpreted kernels have no parameters to read); no GPU is needed:
the key and Triton's specialisation only read host values (dtypes, addresses, ints).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SCRIPT = r"""
import itertools, json
import torch
import triton
import triton.language as tl
from triton._C.libtriton import native_specialize_impl
from moe_ops._runtime.launcher import KernelLauncher
from moe_ops.capture.kernels import _capture_rows_kernel
from moe_ops.router.kernels import _route_kernel
from moe_ops.transfer.narrow import _narrow_kernel
try:
    from triton.backends.nvidia.compiler import CUDABackend as backend
except ImportError:
    from triton.backends.compiler import BaseBackend as backend

INTS = [0, 1, 2, 15, 16, 17, 32, 48, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, 2**63 - 16,
        2**63 - 1, 2**63, 2**63 + 16, -(2**31), -(2**31) - 1, -(2**63)]
storage = torch.zeros(64, dtype=torch.float64)  # 8-byte aligned at least; offsets below
TENSORS = []
for dtype in (torch.int32, torch.int16, torch.uint8, torch.float32, torch.int64):
    base = storage.view(torch.uint8)
    for offset in (0, 1, 2, 4, 8, 16, 32):
        t = base[offset : offset + 64]
        itemsize = torch.empty(0, dtype=dtype).element_size()
        usable = (64 // itemsize) * itemsize
        if offset % itemsize == 0:
            TENSORS.append(t[:usable].view(dtype))

def triton_spec(launcher, args):
    return tuple(
        native_specialize_impl(backend, a, False, value, align)
        for a, (value, align) in zip(args, launcher._spec)
    )

report = {}
for name, kernel in (("capture", _capture_rows_kernel), ("route", _route_kernel),
                     ("narrow", _narrow_kernel)):
    launcher = KernelLauncher(kernel)
    specs = launcher._spec
    constexprs = {n: 1 for n in launcher.constexpr_names}
    # one argument varies at a time, over every class; the others keep a typical value
    typical = [7] * len(specs)
    params = list(kernel.params)
    for i, p in enumerate(params[: len(specs)]):
        pointer = p.name.endswith("_ptr") or p.name in ("src", "dst", "stamps", "step")
        typical[i] = TENSORS[0] if pointer else 7
        if p.name == "scale":
            typical[i] = 2.5
    seen, clashes, cases = {}, [], 0
    for i in range(len(specs)):
        if isinstance(typical[i], torch.Tensor):
            pool = TENSORS
        else:
            pool = INTS if isinstance(typical[i], int) else [0.5, 2.5]
        for v in pool:
            args = tuple(typical[:i] + [v] + typical[i + 1 :])
            key = launcher.key(args, constexprs, 4, 0)
            spec = triton_spec(launcher, args)
            cases += 1
            if seen.setdefault(key, spec) != spec:
                clashes.append([i, repr(v)[:60], str(seen[key])[:200], str(spec)[:200]])
    report[name] = dict(cases=cases, keys=len(seen), specs=len(set(seen.values())), clashes=clashes[:5],
                        usable=launcher.usable, n_runtime=len(specs))

@triton.jit
def _middle_constexpr(x_ptr, N: tl.constexpr, y):
    pass
try:
    KernelLauncher(_middle_constexpr)
    report["middle"] = "built"
except ValueError as exc:
    report["middle"] = str(exc)

# constexprs keyed with their type; an IntEnum argument keyed by its value, as Triton does
import enum
class Small(enum.IntEnum):
    ONE = 1
    TWO = 2
launcher = KernelLauncher(_capture_rows_kernel)
n_ptr = sum(p.name.endswith("_ptr") for p in _capture_rows_kernel.params)
args = tuple([TENSORS[0]] * n_ptr + [7] * (len(launcher._spec) - n_ptr))
cx = {n: 1 for n in launcher.constexpr_names}
report["constexpr_types"] = len({launcher.key(args, dict(cx, CHECK_HIGH=v), 4, 0) for v in (True, 1, 1.0)})
stride = [p.name for p in _capture_rows_kernel.params].index("stride_bk")
enum_args = [args[:stride] + (v,) + args[stride + 1:] for v in (Small.ONE, Small.TWO)]
report["intenum"] = [
    launcher.key(enum_args[0], cx, 4, 0) != launcher.key(enum_args[1], cx, 4, 0),
    str(triton_spec(launcher, enum_args[0])[stride]), str(triton_spec(launcher, enum_args[1])[stride]),
]
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    script = tmp_path_factory.mktemp("launcher") / "keys.py"  # @triton.jit needs a source file
    script.write_text(_SCRIPT)
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=ROOT)
    run = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kernel", ["capture", "route", "narrow"])
def test_a_key_never_holds_two_triton_specialisations(report, kernel):
    r = report[kernel]
    assert r["usable"], r
    assert r["clashes"] == [], r["clashes"]
    # the enumeration reached several of Triton's specialisations (a check that varied nothing
    # would pass the line above trivially)
    assert r["specs"] >= 6, r
    assert r["keys"] >= r["specs"]


def test_a_kernel_with_a_constexpr_before_a_runtime_argument_is_refused(report):
    assert "constexpr parameters last" in report["middle"], report["middle"]


def test_constexprs_are_keyed_with_their_type(report):
    # True, 1 and 1.0 hash equal in Python; Triton's key tells them apart, and so does ours
    assert report["constexpr_types"] == 3


def test_an_int_subclass_is_keyed_by_its_value(report):
    different, one, two = report["intenum"]
    assert one != two  # Triton specialises IntEnum(1) apart from IntEnum(2)
    assert different
