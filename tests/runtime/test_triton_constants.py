"""Every traced kernel compiles with its scalar arguments as constants (what inductor may pass), and
torch's mutation analysis sees exactly the tensors it writes.

Inductor's codegen of a ``wrap_triton`` kernel and its mutation analysis (``generate_ttir``) can
hand a scalar int argument to the kernel as a Python int constant; ``x.to(...)`` on such an
argument fails to compile (``'int' object has no attribute 'to'``). The TTIR is built for an sm_90
target in a subprocess that compiles rather than interprets (this suite interprets Triton on the
CPU, and interpreted kernels have no TTIR); no GPU is needed.

The mutation analysis (``torch._higher_order_ops.triton_kernel_wrap``) decides which tensors a
traced kernel writes: inductor clones those before the launch and copies them back, and
``mode="reduce-overhead"`` skips CUDA graphs when one is a graph input that is not static. A count
tensor reported as written (it is only read) did both on the H200.
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
import itertools, json, sys
from triton_ir import ttir, written_pointers
from moe_ops.capture.kernels import _capture_rows_kernel
from moe_ops.router.kernels import _route_kernel
from moe_ops.router.methods import RoutingMethod

results, written = {}, {}
def build(name, kernel, pointers, scalars, constexprs, as_constants):
    try:
        ir = ttir(kernel, pointers, scalars, constexprs, as_constants)
        results[name] = "tt.store" in ir and "tt.func" in ir
        written[name] = written_pointers(kernel, pointers, scalars, constexprs, as_constants)
    except Exception as exc:  # reported to the test, which names the case
        results[name] = f"{type(exc).__name__}: {exc}"[-600:]

# scalar values: typical ones, and all 1 / 0 (Triton specialises ints equal to 1 on its own)
capture_ptrs = {n: "*i32" for n in
    ("buf_ptr", "ids_ptr", "counts_ptr", "sizes_ptr", "errors_ptr", "stamps_ptr", "step_ptr")}
# the weights: float32 source rows into a bfloat16 buffer (its integer rounding path)
capture_ptrs.update(wts_ptr="*fp32", wbuf_ptr="*bf16")
# the expert map: vLLM's int64 physical_to_logical_map
capture_ptrs.update(map_ptr="*i64")
capture_scalars = [
    dict(n_src=10, n_dst=8, layer_id=2, dp_rank=1, n_first=2, stride_bm=12, stride_bl=4, stride_bk=1,
         stride_im=4, stride_ik=1, stride_wm=4, stride_wk=1, stride_vm=12, stride_vl=4, stride_vk=1,
         stride_c=1, stride_s=1, n_physical=20, n_logical=16, stride_map=1, top_k=4),
    dict(n_src=1, n_dst=1, layer_id=1, dp_rank=0, n_first=1, stride_bm=1, stride_bl=1, stride_bk=1,
         stride_im=1, stride_ik=1, stride_wm=1, stride_wk=1, stride_vm=1, stride_vl=1, stride_vk=1,
         stride_c=1, stride_s=1, n_physical=1, n_logical=1, stride_map=1, top_k=1),
]
for (i, sc), order, offset, const in itertools.product(
        enumerate(capture_scalars), (True, False), (True, False), (True, False)):
    ce = dict(ID_MAX=2**15 - 1, CHECK_HIGH=True, K_PAD=4, BLOCK_M=16, S_PAD=4, SOURCE_ORDER=order,
              HAS_OFFSET=offset, STAMP=True, WEIGHTS=True, EXPERT_MAP=True)
    build(f"capture values{i} source_order={order} offset={offset} constants={const}",
          _capture_rows_kernel, capture_ptrs, sc, ce, const)
ce = dict(ID_MAX=2**15 - 1, CHECK_HIGH=True, K_PAD=4, BLOCK_M=16, S_PAD=4, SOURCE_ORDER=True,
          HAS_OFFSET=True, STAMP=False, WEIGHTS=False, EXPERT_MAP=False)
build("capture unstamped", _capture_rows_kernel, capture_ptrs, capture_scalars[0], ce, False)
# an int32 map, ids only: the map is read, never written
for order in (True, False):
    ce = dict(ID_MAX=2**15 - 1, CHECK_HIGH=True, K_PAD=4, BLOCK_M=16, S_PAD=4, SOURCE_ORDER=order,
              HAS_OFFSET=True, STAMP=False, WEIGHTS=False, EXPERT_MAP=True)
    build(f"capture map *i32 source_order={order}", _capture_rows_kernel,
          dict(capture_ptrs, map_ptr="*i32"), capture_scalars[0], ce, False)
# the other weight dtypes: bfloat16 rows into float16 and float32 buffers (a plain cast)
for src, dst in (("*bf16", "*fp16"), ("*fp16", "*fp32")):
    ptrs = dict(capture_ptrs, wts_ptr=src, wbuf_ptr=dst)
    for order in (True, False):
        ce = dict(ID_MAX=2**15 - 1, CHECK_HIGH=True, K_PAD=4, BLOCK_M=16, S_PAD=4, SOURCE_ORDER=order,
                  HAS_OFFSET=True, STAMP=False, WEIGHTS=True, EXPERT_MAP=False)
        build(f"capture weights {src}->{dst} source_order={order}", _capture_rows_kernel, ptrs,
              capture_scalars[0], ce, True)

route_ptrs = dict(logits_ptr="*fp32", bias_ptr="*fp32", weights_ptr="*fp32", ids_ptr="*i32",
    nonfinite_ptr="*i32", buf_ptr="*i32", wbuf_ptr="*bf16", counts_ptr="*i32", sizes_ptr="*i32",
    errors_ptr="*i32", stamps_ptr="*i32", step_ptr="*i32", map_ptr="*i32")
route_scalars = dict(n_tokens=10, group_size=8, n_group=4, top_k=4, topk_group=2, scale=2.5,
    stride_lm=32, stride_le=1, stride_wm=4, stride_wk=1, stride_im=4, stride_ik=1, n_dst=8,
    layer_id=1, dp_rank=1, n_first=2, stride_bm=12, stride_bl=4, stride_bk=1, stride_vm=12,
    stride_vl=4, stride_vk=1, stride_c=1, stride_s=1, n_physical=0, n_logical=0, stride_map=1)
# (method, UNNORM, GROUP_TOP): DEEPSEEK_V3 also with renormalize=False (its s * scale rule);
# DEEPSEEK_V2 with its MAX group score (1 key), SOFTMAX_BIAS with a 3-key share sum and its softmax key
variants = ((RoutingMethod.DEEPSEEK_V3, False, 2), (RoutingMethod.DEEPSEEK_V3, True, 2),
            (RoutingMethod.RENORMALIZE, False, 2), (RoutingMethod.DEFAULT, False, 2),
            (RoutingMethod.DEEPSEEK_V2, False, 1), (RoutingMethod.SOFTMAX_BIAS, True, 3))
for (method, unnorm, top), capture, const in itertools.product(variants, (True, False), (True, False)):
    grouped = method in (RoutingMethod.DEEPSEEK_V3, RoutingMethod.DEEPSEEK_V2, RoutingMethod.SOFTMAX_BIAS)
    biased = method in (RoutingMethod.DEEPSEEK_V3, RoutingMethod.SOFTMAX_BIAS)
    sc = dict(route_scalars, **({} if grouped else dict(group_size=32, n_group=1, topk_group=1)))
    ce = dict(METHOD=int(method), UNNORM=unnorm, HAS_BIAS=biased, GROUPED=grouped, GROUP_TOP=top,
              CAPTURE=capture, BLOCK_M=2, NG_PAD=4 if grouped else 1, G_PAD=8 if grouped else 32,
              K_PAD=4, S_PAD=4, HAS_OFFSET=True, STAMP=True, WEIGHTS=capture, EXPERT_MAP=False,
              # DEFAULT with fused shared experts: their constant stores, recorded when capturing
              N_SHARED=2 if method == RoutingMethod.DEFAULT else 0,
              CAPTURE_SHARED=capture and method == RoutingMethod.DEFAULT)
    build(f"route {method.name} unnorm={unnorm} capture={capture} constants={const}", _route_kernel,
          route_ptrs, sc, ce, const)
from moe_ops.router.hash_kernels import _route_hash_kernel
hash_ptrs = dict(logits_ptr="*fp32", table_ptr="*i64", tok_ptr="*i64", weights_ptr="*fp32",
    ids_ptr="*i32", faults_ptr="*i32", nonfinite_ptr="*i32", buf_ptr="*i32", wbuf_ptr="*bf16",
    counts_ptr="*i32", sizes_ptr="*i32", errors_ptr="*i32", stamps_ptr="*i32", step_ptr="*i32",
    map_ptr="*i32")
hash_scalars = dict(n_tokens=10, num_experts=32, vocab=100, top_k=4, scale=2.5, stride_lm=32,
    stride_le=1, stride_hv=4, stride_hk=1, stride_t=1, stride_wm=4, stride_wk=1, stride_im=4,
    stride_ik=1, n_dst=8, layer_id=1, dp_rank=1, n_first=2, stride_bm=12, stride_bl=4, stride_bk=1,
    stride_vm=12, stride_vl=4, stride_vk=1, stride_c=1, stride_s=1, n_physical=0, n_logical=0,
    stride_map=1)
for method, capture, const in itertools.product(
        (RoutingMethod.DEEPSEEK_V3, RoutingMethod.DEFAULT), (True, False), (True, False)):
    ce = dict(METHOD=int(method), UNNORM=False, CAPTURE=capture, BLOCK_M=2, E_PAD=32, K_PAD=4, S_PAD=4,
              HAS_OFFSET=True, STAMP=True, WEIGHTS=capture, EXPERT_MAP=False)
    build(f"hash {method.name} capture={capture} constants={const}", _route_hash_kernel, hash_ptrs,
          hash_scalars, ce, const)
# what the compile caches' keys hash for each traced op: its kernels' source, helpers included
import moe_ops  # noqa: F401,E402 - registers the ops
from torch._library.triton import get_triton_kernels_for_op
from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code
cache_sources = {}
for op in ("capture_routing_", "route_", "route_capture_", "route_hash_", "route_hash_capture_"):
    found = get_triton_kernels_for_op(f"moe_ops::{op}")
    source = "".join(user_defined_triton_kernel_transitive_closure_source_code(k) for k in found)
    helpers = ("rows_window", "record_faults", "checked_ids", "checked_logical", "topk_rounds", "hash_ids")
    cache_sources[op] = dict(kernels=[k.fn.__name__ for k in found],
                             helpers=[h for h in helpers if f"def {h}(" in source])
print(json.dumps({"compiled": results, "written": written, "cache": cache_sources}))
"""


@pytest.fixture(scope="module")
def ttir_results() -> dict:
    # the caller's PYTHONPATH stays behind ours: a Triton put there (another release) is the one built
    path = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=path)
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def compiled(ttir_results) -> dict:
    return ttir_results["compiled"]


@pytest.fixture(scope="module")
def written(ttir_results) -> dict:
    return ttir_results["written"]


def test_capture_kernel_compiles_with_constant_scalars(compiled):
    cases = {k: v for k, v in compiled.items() if k.startswith("capture values")}
    assert len(cases) == 16
    failed = {k: v for k, v in cases.items() if v is not True}
    assert not failed, failed


def test_route_kernel_compiles_with_constant_scalars(compiled):
    cases = {k: v for k, v in compiled.items() if k.startswith("route")}
    assert len(cases) == 24  # 6 (method, renormalize, group score) variants x capture x constants
    failed = {k: v for k, v in cases.items() if v is not True}
    assert not failed, failed


def test_capture_kernel_writes_only_its_outputs(written):
    """The buffer, the fault counter and (stamped) the stamps; never the ids, the count tensors or
    the step, which it only reads."""
    stamped = {k: v for k, v in written.items() if k.startswith("capture values")}
    assert len(stamped) == 16
    wrong = {k: v for k, v in stamped.items() if v != ["buf_ptr", "errors_ptr", "stamps_ptr", "wbuf_ptr"]}
    assert not wrong, wrong
    assert written["capture unstamped"] == ["buf_ptr", "errors_ptr"]
    # the expert map is read, never written
    mapped = {k: v for k, v in written.items() if k.startswith("capture map")}
    assert len(mapped) == 2
    wrong = {k: v for k, v in mapped.items() if v != ["buf_ptr", "errors_ptr"]}
    assert not wrong, wrong
    weighted = {k: v for k, v in written.items() if k.startswith("capture weights")}
    assert len(weighted) == 4
    wrong = {k: v for k, v in weighted.items() if v != ["buf_ptr", "errors_ptr", "wbuf_ptr"]}
    assert not wrong, wrong


def test_capture_kernel_compiles_with_an_int32_expert_map(compiled):
    cases = {k: v for k, v in compiled.items() if k.startswith("capture map")}
    assert len(cases) == 2
    failed = {k: v for k, v in cases.items() if v is not True}
    assert not failed, failed


def test_capture_kernel_compiles_every_weights_dtype(compiled):
    cases = {k: v for k, v in compiled.items() if k.startswith("capture weights")}
    assert len(cases) == 4
    failed = {k: v for k, v in cases.items() if v is not True}
    assert not failed, failed


def test_route_kernel_writes_only_its_outputs(written):
    cases = {k: v for k, v in written.items() if k.startswith("route")}
    assert len(cases) == 24
    expected = {
        True: ["buf_ptr", "errors_ptr", "ids_ptr", "nonfinite_ptr", "stamps_ptr", "wbuf_ptr", "weights_ptr"],
        False: ["ids_ptr", "nonfinite_ptr", "weights_ptr"],
    }
    wrong = {k: v for k, v in cases.items() if v != expected["capture=True" in k]}
    assert not wrong, wrong


def test_traced_ops_register_their_kernels_for_the_compile_cache_keys(ttir_results):
    """AOT autograd's cache key hashes the source of the kernels registered for an op (what
    torch.library.triton_op registers): the kernel and every helper it calls, so an edit to the
    window rule or a fault helper cannot bring back a cached graph with the old kernel."""
    cache = ttir_results["cache"]
    assert cache["capture_routing_"] == dict(
        kernels=["_capture_rows_kernel"],
        helpers=["rows_window", "record_faults", "checked_ids", "checked_logical"],
    )
    for op in ("route_", "route_capture_"):
        assert cache[op] == dict(
            kernels=["_route_kernel"], helpers=["rows_window", "record_faults", "topk_rounds"]
        )


def test_hash_kernel_compiles_with_constant_scalars_and_writes_only_its_outputs(compiled, written):
    """The hash router kernel: with and without capture, scalars as constants or not; it writes
    the weights, the ids and the hash fault counter (and, capturing, the capture's buffer, counter
    and stamps), never the table, the token ids or the logits."""
    cases = {k: v for k, v in compiled.items() if k.startswith("hash ")}
    assert len(cases) == 8
    failed = {k: v for k, v in cases.items() if v is not True}
    assert not failed, failed
    expected = {
        True: [
            "buf_ptr",
            "errors_ptr",
            "faults_ptr",
            "ids_ptr",
            "nonfinite_ptr",
            "stamps_ptr",
            "wbuf_ptr",
            "weights_ptr",
        ],
        False: ["faults_ptr", "ids_ptr", "nonfinite_ptr", "weights_ptr"],
    }
    wrong = {k: v for k, v in written.items() if k.startswith("hash ") and v != expected["capture=True" in k]}
    assert not wrong, wrong


def test_hash_ops_register_their_kernel_for_the_compile_cache_keys(ttir_results):
    cache = ttir_results["cache"]
    for op in ("route_hash_", "route_hash_capture_"):
        assert cache[op] == dict(
            kernels=["_route_hash_kernel"], helpers=["rows_window", "record_faults", "hash_ids"]
        )
