"""The indexer kernels compile for an sm_90 target with their scalars as runtime values and as
constants (what inductor may pass), and torch's mutation analysis sees exactly what they write
(the machinery and the reasons: tests/runtime/test_triton_constants.py). No GPU needed."""

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
from triton_ir import ttir, written_pointers
from moe_ops.indexer.kernels import _capture_positions_kernel
from moe_ops.indexer.select import _select_count_kernel, _select_hist_kernel, _select_kernel

results, written = {}, {}
def build(name, kernel, pointers, scalars, constexprs, as_constants):
    try:
        ir = ttir(kernel, pointers, scalars, constexprs, as_constants)
        results[name] = ("tt.store" in ir or "tt.atomic_rmw" in ir) and "tt.func" in ir
        written[name] = written_pointers(kernel, pointers, scalars, constexprs, as_constants)
    except Exception as exc:
        results[name] = f"{type(exc).__name__}: {exc}"[-600:]

capture = dict(buf_ptr="*i32", wbuf_ptr="*fp32", counts_ptr="*i32", sizes_ptr="*i32", errors_ptr="*i32",
               stamps_ptr="*i32", step_ptr="*i32", map_ptr="*i32")
cap_scalars = dict(n_dst=8, layer_id=1, dp_rank=1, n_first=2, stride_bm=12, stride_bl=4, stride_bk=1,
                   stride_vm=0, stride_vl=0, stride_vk=0, stride_c=1, stride_s=1, n_physical=0,
                   n_logical=0, stride_map=1)
for unique, lens, const, k_pad in itertools.product((True, False), (True, False), (True, False), (8, 2048)):
    ce = dict(K_PAD=k_pad, BLOCK_M=max(1, 4096 // k_pad), HAS_LENS=lens, UNIQUE=unique, S_PAD=4,
              HAS_OFFSET=True, STAMP=True, WEIGHTS=False, EXPERT_MAP=False)
    sc = dict(cap_scalars, n_src=10, stride_pm=k_pad, stride_pk=1, stride_len=1, top_k=k_pad - 1)
    build(f"capture unique={unique} lens={lens} constants={const} k={k_pad}", _capture_positions_kernel,
          dict(capture, pos_ptr="*i64", lens_ptr="*i32"), sc, ce, const)
flags = (True, False)
row = dict(n_rows=4, n_keys=8192, top_k=2048, stride_sm=8192, stride_st=1, stride_len=1)
for cap, lens, const, src, split in itertools.product(flags, flags, flags, ("*fp32", "*bf16"), flags):
    ce = dict(BLOCK_T=1024, K_PAD=2048, HAS_LENS=lens, SPLIT=split, CAPTURE=cap, S_PAD=4, HAS_OFFSET=cap,
              STAMP=cap, WEIGHTS=False, EXPERT_MAP=False)
    sc = dict(cap_scalars, **row, stride_om=2048, stride_ok=1, chunk=4096)
    build(f"select capture={cap} lens={lens} constants={const} {src} split={split}", _select_kernel,
          dict(capture, scores_ptr=src, lens_ptr="*i32", hist_ptr="*i32", tally_ptr="*i32", out_ptr="*i32"),
          sc, ce, const)
for lens, const, src, atomic in itertools.product(flags, flags, ("*fp32", "*bf16"), flags):
    build(f"hist lens={lens} constants={const} {src} atomic={atomic}", _select_hist_kernel,
          dict(scores_ptr=src, lens_ptr="*i32", hist_ptr="*i32"), dict(row, chunk=4096, pass_idx=2),
          dict(BLOCK_T=1024, HAS_LENS=lens, ATOMIC=atomic), const)
    build(f"count lens={lens} constants={const} {src} atomic={atomic}", _select_count_kernel,
          dict(scores_ptr=src, lens_ptr="*i32", hist_ptr="*i32", tally_ptr="*i32"), dict(row, chunk=4096),
          dict(BLOCK_T=1024, HAS_LENS=lens), const)
print(json.dumps({"compiled": results, "written": written}))
"""


@pytest.fixture(scope="module")
def ttir_results() -> dict:
    path = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=path)
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_capture_kernel_compiles_and_writes_only_its_outputs(ttir_results):
    compiled = {k: v for k, v in ttir_results["compiled"].items() if k.startswith("capture")}
    assert len(compiled) == 16
    assert all(v is True for v in compiled.values()), {k: v for k, v in compiled.items() if v is not True}
    written = {k: v for k, v in ttir_results["written"].items() if k.startswith("capture")}
    wrong = {k: v for k, v in written.items() if v != ["buf_ptr", "errors_ptr", "stamps_ptr"]}
    assert not wrong, wrong


def test_select_kernel_compiles_and_writes_only_its_outputs(ttir_results):
    compiled = {k: v for k, v in ttir_results["compiled"].items() if k.startswith("select")}
    assert len(compiled) == 32
    assert all(v is True for v in compiled.values()), {k: v for k, v in compiled.items() if v is not True}
    expected = {True: ["buf_ptr", "errors_ptr", "out_ptr", "stamps_ptr"], False: ["out_ptr"]}
    written = {k: v for k, v in ttir_results["written"].items() if k.startswith("select")}
    wrong = {k: v for k, v in written.items() if v != expected["capture=True" in k]}
    assert not wrong, wrong


def test_selection_passes_compile_and_write_only_their_workspace(ttir_results):
    """The histogram passes write (or atomically add to) the histograms only, the count pass its
    tallies only."""
    for name, want in (("hist", ["hist_ptr"]), ("count", ["tally_ptr"])):
        compiled = {k: v for k, v in ttir_results["compiled"].items() if k.startswith(name)}
        assert len(compiled) == 16
        assert all(v is True for v in compiled.values()), {k: v for k, v in compiled.items() if v is not True}
        written = {k: v for k, v in ttir_results["written"].items() if k.startswith(name)}
        assert all(v == want for v in written.values()), written
