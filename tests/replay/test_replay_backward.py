"""The replay backward kernel (``replay_backward_triton``) against autograd through the weight rule.

Property test over methods, shapes (E not a power of two, k up to 8, n up to 12, several rows per
program or one), logit dtypes and strided layouts of the logits, the incoming gradient (expanded,
transposed, column-strided) and the gradient buffer. Buffers are poisoned with NaN: the gradient
buffer must be written everywhere in its view and nowhere in its gaps, and a read of a gap of the
logits or of the incoming gradient would carry NaN into the result.

Tolerances: the kernel computes in float32 from the float32 weights of the forward kernel; the
oracle is float64 autograd through ``replay_weights`` (the rule the forward evaluates). float32
gradients: 1e-5 relative + 1e-6 absolute (float32 rounding of sigmoid/softmax terms of size <= 4);
bf16/fp16 gradients: one rounding of the float32 value, one ulp (2**-7 / 2**-10 relative) + 1e-5.
Against the PyTorch twin (float32 too, another operation order): 1e-5 relative + 1e-6 absolute
before the final rounding, i.e. the same one-ulp bound for bf16/fp16. float64 logits: the kernel
computes in float64 from the float64 weights; 1e-12 relative + 1e-14 absolute.
"""

from __future__ import annotations

import torch
from gpu_helpers import skip_unless_triton_runs
from hypothesis import given, settings
from routing_checks import replay_backward_args, replay_forward_args
from strategies import BackwardCase, backward_cases, strided_rows

from moe_ops.replay.kernels import (
    replay_backward_torch,
    replay_backward_triton,
    replay_rows_triton,
    replay_weights,
)

# one rounding of the float32 result (relative), and the absolute floor near zero; float64 logits
# are computed in float64
ULP = {torch.float32: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float64: 0.0}
RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-5, torch.float16: 1e-5, torch.float64: 1e-12}
ATOL = {torch.float32: 1e-6, torch.bfloat16: 1e-5, torch.float16: 1e-5, torch.float64: 1e-14}


def _scale(config) -> float:
    return 1.0 if config.routed_scaling_factor is None else config.routed_scaling_factor


def _poisoned(like: torch.Tensor, layout: str) -> torch.Tensor:
    """A (n, E) view of ``layout`` in ``like``'s dtype whose whole buffer is NaN."""
    return strided_rows(torch.full(like.shape, float("nan"), dtype=like.dtype), layout)


def _check_written(out: torch.Tensor, name: str) -> None:
    """Every element of the view ``out`` is finite; every element of its buffer outside the view
    is still NaN (the NaN count of the buffer is exactly the gap's size)."""
    assert torch.isfinite(out).all(), f"{name}: elements left unwritten (still NaN) or non-finite"
    base = out if out._base is None else out._base
    gap = base.numel() - out.numel()
    assert int(torch.isnan(base).sum()) == gap, f"{name}: wrote outside its view"


def run_backward(case: BackwardCase):
    """The forward kernel on the case's record, then the backward kernel into a poisoned buffer;
    returns (logits, ids, grad, weights, grad_logits)."""
    cfg = case.router.config
    logits, recorded, grad = case.tensors()
    _, bias = case.router.tensors("cpu")
    n, k = recorded.shape
    weights = torch.full((n, k), float("nan"), dtype=grad.dtype)  # the compute dtype
    ids = torch.full((n, k), -7, dtype=torch.int32)
    errors = torch.zeros(2, dtype=torch.int32)
    n_group, topk_group = cfg.groups
    replay_rows_triton(
        **replay_forward_args(
            logits, recorded, bias, weights, ids, errors, cfg.method, n_group, topk_group, _scale(cfg)
        )
    )
    assert errors.tolist() == [0, 0] and torch.equal(ids, recorded), "the record was not replayed as is"
    out = _poisoned(logits, case.out_layout)
    replay_backward_triton(
        **replay_backward_args(grad, logits, weights, ids, out, cfg.method, _scale(cfg)), block_m=case.block_m
    )
    return logits, ids, grad, weights, out


@settings(max_examples=60)
@given(case=backward_cases())
def test_backward_kernel_matches_reference_autograd(case):
    skip_unless_triton_runs("cpu")
    cfg = case.router.config
    logits, ids, grad, weights, tri = run_backward(case)
    assert tri.dtype == logits.dtype and tri.shape == logits.shape
    _check_written(tri, "grad_logits")

    # ref: float64 autograd through the weight rule at the replayed ids
    x64 = logits.double().requires_grad_()
    ref_w = replay_weights(x64, ids.long(), cfg.method, _scale(cfg))
    rtol, atol = RTOL[logits.dtype], ATOL[logits.dtype]
    torch.testing.assert_close(weights.double(), ref_w.detach(), rtol=rtol, atol=min(atol, 1e-7))
    (ref,) = torch.autograd.grad(ref_w, x64, grad.double())
    ulp = ULP[logits.dtype]
    torch.testing.assert_close(tri.double(), ref, rtol=rtol + ulp, atol=atol)

    # the twin, same inputs, same poisoned buffer layout
    twin = _poisoned(logits, case.out_layout)
    replay_backward_torch(**replay_backward_args(grad, logits, weights, ids, twin, cfg.method, _scale(cfg)))
    _check_written(twin, "twin grad_logits")
    torch.testing.assert_close(tri.double(), twin.double(), rtol=rtol + ulp, atol=atol)
