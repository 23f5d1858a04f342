"""The replay forward kernel (``replay_rows_triton``) against its PyTorch twin and the float64 rule.

Property test over methods, shapes, logit dtypes, values (ties, +-inf, NaN, -0.0), every kind of
recorded row (replayed, live, out of range, repeated, partly -1), id dtypes, launch configurations
(several rows per program or one) and strided layouts of the logits, the record and both outputs.
The output buffers are poisoned (weights NaN, ids POISON): every element of each view must be
written and nothing in its gaps; a read of a gap of the logits would carry NaN into a weight.

Ids and the fault counter are compared exactly. Weights: against the twin (float32 too, another
operation order) 1e-5 relative + 1e-7 absolute on rows of finite logits; recorded rows of finite
logits against the float64 rule to 1e-5 relative (the tolerance of tests/replay/test_replay.py). float64
logits: float64 weights, to 1e-12 relative of the twin and of the rule.
"""

from __future__ import annotations

import torch
from gpu_helpers import skip_unless_triton_runs
from hypothesis import given, settings
from routing_checks import replay_forward_args
from strategies import POISON, ForwardCase, forward_cases, strided_rows

from moe_ops import route
from moe_ops.replay.kernels import replay_rows_torch, replay_rows_triton, replay_weights
from moe_ops.router.methods import BIAS_METHODS


def _scale(config) -> float:
    return 1.0 if config.routed_scaling_factor is None else config.routed_scaling_factor


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _poisoned(shape, dtype: torch.dtype, layout: str) -> torch.Tensor:
    """A view of ``layout`` whose whole buffer holds the poison (NaN, or POISON for integers)."""
    fill = float("nan") if dtype.is_floating_point else POISON
    if layout == "contiguous":
        return torch.full(shape, fill, dtype=dtype)
    n, m = shape
    if layout == "row_padded":
        return torch.full((n, m + 3), fill, dtype=dtype)[:, :m]
    return torch.full((n, 2 * m), fill, dtype=dtype)[:, ::2]  # column_strided


def _strided_ids(ids: torch.Tensor, layout: str) -> torch.Tensor:
    """The record in a view of ``layout`` (its gaps hold ids that are out of range for any row)."""
    if layout == "contiguous":
        return ids.clone()
    n, m = ids.shape
    gap = 127 if ids.dtype in (torch.int8, torch.uint8) else 30000
    base = torch.full((n, m + 3) if layout == "row_padded" else (n, 2 * m), gap, dtype=ids.dtype)
    view = base[:, :m] if layout == "row_padded" else base[:, ::2]
    view.copy_(ids)
    return view


def _written(out: torch.Tensor) -> tuple[bool, bool]:
    """(every element of the view is written, nothing outside it is), for a poisoned view."""
    base = out if out._base is None else out._base
    if out.dtype.is_floating_point:
        poisoned_base, poisoned_view = torch.isnan(base), torch.isnan(out)
    else:
        poisoned_base, poisoned_view = base == POISON, out == POISON
    gap = int(poisoned_base.sum()) - int(poisoned_view.sum())  # the poison left outside the view
    return not bool(poisoned_view.any()), gap == base.numel() - out.numel()


def run(case: ForwardCase, kernel, **launch):
    """The kernel (or its twin) on the case into poisoned outputs: (logits, weights, ids, errors)."""
    rc = case.recorded
    cfg = rc.router.config
    logits, bias = rc.router.tensors("cpu")
    kw = cfg.route_kwargs(bias)
    # the record's "route" rows: the router's choice (route takes float32 of float64 logits)
    routed = logits.float() if logits.dtype == torch.float64 else logits
    recorded = rc.recorded(route(routed, cfg.top_k, cfg.method, backend="torch", **kw)[1])
    x = strided_rows(logits, case.logits_layout)
    rec = _strided_ids(recorded, case.ids_layout)
    n, k = recorded.shape
    weights = _poisoned((n, k), _compute_dtype(logits), case.out_layout)
    ids = _poisoned((n, k), torch.int32, case.out_layout)
    errors = torch.zeros(2, dtype=torch.int32)
    n_group, topk_group = cfg.groups
    args = replay_forward_args(
        x, rec, bias, weights, ids, errors, cfg.method, n_group, topk_group, _scale(cfg)
    )
    kernel(**args, **launch)
    return logits, weights, ids, errors


@settings(max_examples=60, deadline=None)
@given(case=forward_cases())
def test_forward_kernel_matches_twin_and_reference(case):
    skip_unless_triton_runs("cpu")
    rc = case.recorded
    cfg = rc.router.config
    logits, tri_w, tri_ids, tri_err = run(
        case, replay_rows_triton, block_m=case.block_m, num_warps=case.num_warps
    )
    _, ref_w, ref_ids, ref_err = run(case, replay_rows_torch)
    for name, out in (("weights", tri_w), ("ids", tri_ids)):
        all_written, only_view = _written(out)
        assert only_view, f"{name}: written outside its view"
        if name == "ids":
            assert all_written, "ids: elements left unwritten"
    assert tri_err.tolist() == ref_err.tolist(), "fault counter differs from the twin"
    assert tri_err[0] == rc.faulty_rows

    live = rc.routed_live()
    recorded_rows = ~live
    # live rows of the biased methods may round sigmoid + bias differently near a tie
    # (tests/replay/test_replay.py::test_triton_equals_twin_on_edge_values)
    compare = recorded_rows if cfg.method in BIAS_METHODS else torch.ones_like(live)
    assert torch.equal(tri_ids[compare], ref_ids[compare]), "ids differ from the twin"
    finite = torch.isfinite(logits.double()).all(1) & compare
    assert not torch.isnan(tri_w[finite]).any(), "weights left unwritten on rows of finite logits"
    rtol, atol = (1e-12, 1e-15) if logits.dtype == torch.float64 else (1e-5, 1e-7)
    torch.testing.assert_close(tri_w[finite], ref_w[finite], rtol=rtol, atol=atol)
    rows = finite & recorded_rows
    want = replay_weights(logits.double(), tri_ids.long().clamp(min=0), cfg.method, _scale(cfg))
    err = (tri_w.double() - want).abs()[rows]
    bound = 1e-12 if logits.dtype == torch.float64 else 1e-5
    assert not (err > bound * want.abs()[rows] + 1e-30).any(), "recorded rows: weights off the float64 rule"
