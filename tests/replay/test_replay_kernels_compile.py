"""The replay kernels compile for an H200 (sm_90) in float64 for every method, and the NaN-keeping
max of SIGMOID_RENORM reaches the machine code: built down to PTX and a cubin (Triton's own
``ptxas``) in a subprocess that compiles rather than interprets, without a GPU.

This suite interprets Triton on the CPU, which runs float64 kernels whatever a GPU would make of
them; compiling is what says that the float64 variants (64-bit selection keys, float64 exp and
division, a double ``scale`` argument) exist on the target. ``tl.maximum`` keeps a NaN only with
``propagate_nan=ALL``: PTX ``max.NaN.f32`` in float32; in float64, which has no such instruction,
a ``max.f64`` behind a ``setp.nan.f64`` select.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from moe_ops.router.methods import METHODS, RENORMALIZED_METHODS, UNNORMALIZED_METHODS, RoutingMethod

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SCRIPT = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from moe_ops.replay.kernels import _replay_backward_kernel, _replay_kernel
from moe_ops.router.kernels import _route_kernel
from moe_ops.router.methods import METHODS, RENORMALIZED_METHODS, UNNORMALIZED_METHODS, RoutingMethod as M

target = GPUTarget("cuda", 90, 32)
out = {}

def build(name, kernel, types, constexprs, num_warps):
    signature = {n: types.get(n, "constexpr" if n in constexprs else "i32") for n in kernel.arg_names}
    try:
        ck = triton.compile(ASTSource(kernel, signature, constexprs), target=target,
                            options=dict(num_warps=num_warps))
        ptx = ck.asm["ptx"]
        out[name] = dict(cubin=len(ck.asm["cubin"]), max_nan_f32="max.NaN.f32" in ptx,
                         nan_f64="setp.nan.f64" in ptx,
                         f64_math=bool(re.search(r"\b(add|sub|mul|fma|div|setp\.\w+)(\.rn)?\.f64\b", ptx)))
    except Exception as exc:  # reported to the test, which names the case
        out[name] = f"{type(exc).__name__}: {exc}"[-600:]

for ft in ("fp64", "fp32"):
    # every method's rule, then the other rule (renormalize=False, or True) of the methods that have one
    others = sorted(UNNORMALIZED_METHODS | RENORMALIZED_METHODS)
    for m, unnorm in [(m, False) for m in M] + [(m, True) for m in others]:
        if ft == "fp32" and m != M.SIGMOID_RENORM and not unnorm:
            continue
        name = m.name + (f" renormalize={m in RENORMALIZED_METHODS}" if unnorm else "")
        grouped = METHODS[m].groups
        biased = METHODS[m].bias
        # small tiles: this checks the lowering, not the speed (the launch tiles compile the same ops)
        k_pad = METHODS[m].top_k or 4
        fwd = dict(logits_ptr="*" + ft, rec_ptr="*i32", bias_ptr="*" + ft, weights_ptr="*" + ft,
                   ids_ptr="*i32", errors_ptr="*i32", nonfinite_ptr="*i32", row_count_ptr="*i32",
                   scale="fp64")
        # CHECK_ROWS on: the replayer's row-count check (loaded first, branched on last) compiles too
        # the group score: DEEPSEEK_V2's one key, a 3-key share sum on SOFTMAX_BIAS (the loop form)
        group_top = {M.DEEPSEEK_V2: 1, M.SOFTMAX_BIAS: 3}.get(m, 2)
        ce = dict(METHOD=int(m), UNNORM=unnorm, HAS_BIAS=biased, GROUPED=grouped, BLOCK_M=2,
                  NG_PAD=4 if grouped else 1, G_PAD=8 if grouped else 32, K_PAD=k_pad, CHECK_ROWS=True,
                  HASH=False, GROUP_TOP=group_top)
        build(f"forward {ft} {name}", _replay_kernel, fwd, ce, 4)
        if not grouped and not unnorm:
            # a hash layer's table lookup in the live rows (HASH), an int64 table and token ids
            hashed = dict(fwd, table_ptr="*i64", tok_ptr="*i64")
            build(f"hash-forward {ft}:{name}", _replay_kernel, hashed, dict(ce, HASH=True), 4)
        bwd = dict(grad_w_ptr="*" + ft, logits_ptr="*" + ft, weights_ptr="*" + ft, ids_ptr="*i32",
                   grad_ptr="*" + ft, scale="fp64")
        ce = dict(num_experts=32, top_k=k_pad, METHOD=int(m), UNNORM=unnorm, BLOCK_M=2, E_PAD=32,
                  K_PAD=k_pad)
        build(f"backward {ft} {name}", _replay_backward_kernel, bwd, ce, 4)
ptrs = dict(logits_ptr="*fp32", bias_ptr="*fp32", weights_ptr="*fp32", scale="fp32",
            **{n: "*i32" for n in ("ids_ptr", "nonfinite_ptr", "buf_ptr", "counts_ptr", "sizes_ptr",
                                   "errors_ptr", "stamps_ptr", "step_ptr", "map_ptr")})
ce = dict(METHOD=int(M.SIGMOID_RENORM), UNNORM=False, HAS_BIAS=False, GROUPED=False, CAPTURE=False,
          BLOCK_M=1, GROUP_TOP=2,
          NG_PAD=1, G_PAD=32, K_PAD=4, S_PAD=1, HAS_OFFSET=False, STAMP=False, EXPERT_MAP=False, N_SHARED=0,
          CAPTURE_SHARED=False)
build("route fp32 SIGMOID_RENORM", _route_kernel, ptrs, ce, 1)
from moe_ops.router.hash_kernels import _route_hash_kernel
hash_ptrs = dict(logits_ptr="*fp32", table_ptr="*i64", tok_ptr="*i32", weights_ptr="*fp32", scale="fp32",
                 wbuf_ptr="*fp32",
                 **{n: "*i32" for n in ("ids_ptr", "faults_ptr", "nonfinite_ptr", "buf_ptr", "counts_ptr",
                                        "sizes_ptr", "errors_ptr", "stamps_ptr", "step_ptr", "map_ptr")})
for m in M:
    ce = dict(METHOD=int(m), UNNORM=False, CAPTURE=True, BLOCK_M=2, E_PAD=32, K_PAD=METHODS[m].top_k or 4,
              S_PAD=1, HAS_OFFSET=False, STAMP=True, WEIGHTS=True, EXPERT_MAP=False)
    build(f"hash-route fp32:{m.name}", _route_hash_kernel, hash_ptrs, ce, 4)
# the launch tile (32 rows) with one or two columns and bf16 logits: triton 3.6 once failed to build
# this capturing variant ("operand #0 does not dominate this use") when the ids were stored after
# the weights' gather; the small tiles above did not show it
for k_pad in (1, 2):
    ce = dict(METHOD=int(M.LLAMA4), UNNORM=False, CAPTURE=True, BLOCK_M=32, E_PAD=16, K_PAD=k_pad,
              S_PAD=2, HAS_OFFSET=False, STAMP=False, WEIGHTS=False, EXPERT_MAP=False)
    build(f"hash-route bf16:launch tile K_PAD={k_pad}", _route_hash_kernel,
          dict(hash_ptrs, logits_ptr="*bf16", buf_ptr="*i64"), ce, 4)
# the forward as a contiguous launch specialises it (unit strides are constants; the launch tile of
# 128 experts at top_k 17..32): triton 3.6's LLVM once aborted on this variant (an SLP vectorizer
# assertion) over the non-finite rows test of the live rows; the general signatures above did not
# show it
for ft in ("fp32", "bf16"):
    fwd = dict(logits_ptr="*" + ft, bias_ptr="*fp32", weights_ptr="*fp32", scale="fp64",
               **{n: "*i32" for n in ("rec_ptr", "ids_ptr", "errors_ptr", "nonfinite_ptr", "row_count_ptr",
                                      "table_ptr", "tok_ptr")})
    ce = dict(METHOD=int(M.SOFTMAX_BIAS), UNNORM=True, HAS_BIAS=True, GROUPED=False, BLOCK_M=8, NG_PAD=1,
              G_PAD=128, K_PAD=32, CHECK_ROWS=False, HASH=False, GROUP_TOP=2, stride_le=1, stride_wk=1,
              stride_ik=1)
    build(f"forward-launch {ft}:SOFTMAX_BIAS renormalize=False K_PAD=32", _replay_kernel, fwd, ce, 4)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled() -> dict:
    # the caller's PYTHONPATH stays behind ours: a Triton put there (another release) is the one built
    path = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=path)
    # the kernels above: about 60 s uncached on a 2-core machine (Triton caches them); 600 s is a hang
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_float64_replay_kernels_compile_for_sm90_every_method(compiled):
    cases = {k: v for k, v in compiled.items() if " fp64 " in k}
    # forward and backward, every method and every other (renormalize) rule
    assert len(cases) == 2 * (len(RoutingMethod) + len(UNNORMALIZED_METHODS | RENORMALIZED_METHODS))
    failed = {k: v for k, v in cases.items() if not isinstance(v, dict) or v["cubin"] == 0}
    assert not failed, failed
    # float64 arithmetic or compares (TOPK's weights are loads: its keys' NaN test), not a float32
    # kernel fed float64 pointers (the float32 kernels have none: their double scale argument is
    # only converted)
    assert all(v["f64_math"] for v in cases.values()), {k: v for k, v in cases.items() if not v["f64_math"]}
    assert not any(compiled[f"{p} fp32 SIGMOID_RENORM"]["f64_math"] for p in ("forward", "backward"))


def test_hash_kernels_compile_for_sm90_every_method(compiled):
    """The hash router kernel (every method, fused capture) and the replay forward's HASH branch
    (float64 and float32, every method without groups) compile to a cubin."""
    route = {k: v for k, v in compiled.items() if k.startswith("hash-route")}
    assert len(route) == len(RoutingMethod) + 2  # + the two launch-tile variants
    replay = {k: v for k, v in compiled.items() if k.startswith("hash-forward")}
    assert len(replay) == sum(1 for m in RoutingMethod if not METHODS[m].groups) + 1  # + fp32 SIGMOID_RENORM
    failed = {k: v for k, v in {**route, **replay}.items() if not isinstance(v, dict) or v["cubin"] == 0}
    assert not failed, failed


def test_replay_forward_compiles_as_a_contiguous_launch_specialises_it(compiled):
    cases = {k: v for k, v in compiled.items() if k.startswith("forward-launch")}
    assert len(cases) == 2
    failed = {k: v for k, v in cases.items() if not isinstance(v, dict) or v["cubin"] == 0}
    assert not failed, failed


def test_sigmoid_renorm_max_keeps_nan_in_machine_code(compiled):
    for name in ("forward fp32", "backward fp32", "route fp32"):
        assert compiled[f"{name} SIGMOID_RENORM"]["max_nan_f32"], name
    for name in ("forward fp64", "backward fp64"):
        assert compiled[f"{name} SIGMOID_RENORM"]["nan_f64"], name
