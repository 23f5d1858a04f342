"""RoutingMethod against FlashInfer's RoutingMethodType, and route()'s errors for bad arguments."""

from __future__ import annotations

import pytest
import torch
from strategies import POISON

from moe_ops import BatchLayout, CaptureTarget, RoutingMethod, route
from moe_ops.router.methods import BIAS_METHODS, OWN_METHODS_START, method_names


def test_routing_method_values_match_flashinfer():
    """Same integer for every shared name (FlashInfer spells them CamelCase: DeepSeekV3, TopKSigmoid)."""
    flashinfer = pytest.importorskip("flashinfer", reason="flashinfer-python is not installed")
    theirs = {m.name.lower(): int(m.value) for m in flashinfer.RoutingMethodType}
    ours = {m.name.replace("_", "").lower(): int(m) for m in RoutingMethod if m < OWN_METHODS_START}
    assert max(theirs.values()) < OWN_METHODS_START, "FlashInfer's values reach moe-ops' own methods'"
    assert set(ours) <= set(theirs), f"not in FlashInfer: {set(ours) - set(theirs)}"
    assert set(theirs) - set(ours) == {"unspecified"}, "FlashInfer has a routing method we lack"
    for name, value in ours.items():
        assert theirs[name] == value, f"{name}: ours {value}, FlashInfer {theirs[name]}"


def test_routing_method_values():
    assert [(m.name, m.value) for m in RoutingMethod] == [
        ("DEFAULT", 0),
        ("RENORMALIZE", 1),
        ("DEEPSEEK_V3", 2),
        ("LLAMA4", 3),
        ("RENORMALIZE_NAIVE", 4),
        ("TOPK", 5),
        ("SIGMOID_RENORM", 6),
        ("MINIMAX2", 7),
        ("SIGMOID", 8),
        ("TOPK_SIGMOID", 9),
        ("DEEPSEEK_V2", 32),
        ("SOFTMAX_BIAS", 33),
        ("SQRTSOFTPLUS", 34),
    ]


def test_method_accepts_ints():
    logits = torch.randn(5, 16)
    a = route(logits, 4, 6)
    b = route(logits, 4, RoutingMethod.SIGMOID_RENORM)
    # exact: one path on the same logits (weights are bit-identical when the same kernels run)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


DS = dict(method=RoutingMethod.DEEPSEEK_V3, n_group=4, topk_group=2, bias=torch.zeros(16))

# (route arguments changed from: 6 x 16 float32 logits, top_k 4, RENORMALIZE), exception, message
BAD = [
    (dict(router_logits=torch.randn(16)), ValueError, r"router_logits must be 2-D \(n_tokens, num_experts\)"),
    (dict(router_logits=torch.randn(2, 6, 16)), ValueError, "router_logits must be 2-D"),
    (
        dict(router_logits=torch.randn(6, 16).double()),
        ValueError,
        r"float32, bfloat16 or float16, got torch.float64 \(the router computes in float32; "
        r"replay_routing takes float64 logits\)",
    ),
    (dict(router_logits=torch.randn(6, 0)), ValueError, "at least one expert"),
    (dict(router_logits=[[1.0]]), TypeError, "router_logits must be a torch.Tensor"),
    (dict(top_k=17), ValueError, r"top_k must be an int in \[1, num_experts=16\], got 17"),
    (dict(top_k=0), ValueError, r"top_k must be an int in \[1, num_experts=16\], got 0"),
    (dict(top_k=2.0), ValueError, "top_k must be an int"),
    (dict(method=len(RoutingMethod)), ValueError, "method must be a RoutingMethod"),  # one past the last
    (dict(method="RENORMALIZE"), ValueError, "method must be a RoutingMethod"),
    (
        dict(method=RoutingMethod.LLAMA4),
        ValueError,
        "LLAMA4 routing picks one expert per token: top_k must be 1, got 4",
    ),
    (dict(DS, n_group=3), ValueError, "n_group=3 must divide num_experts=16"),
    (dict(DS, topk_group=5), ValueError, "topk_group=5 must be <= n_group=4"),
    (dict(DS, n_group=1, topk_group=2), ValueError, "topk_group=2 must be <= n_group=1"),
    (dict(DS, topk_group=None), ValueError, "n_group=4 > 1 needs topk_group"),
    (dict(DS, n_group=None), ValueError, "topk_group needs n_group"),
    (dict(DS, n_group=-1), ValueError, "n_group must be a non-negative int"),
    (dict(DS, topk_group=0), ValueError, "topk_group must be a positive int"),
    (dict(DS, top_k=9), ValueError, "top_k=9 experts cannot be chosen from topk_group=2 groups of 4 experts"),
    (
        dict(DS, bias=torch.zeros(15)),
        ValueError,
        r"bias must have shape \(num_experts,\) = \(16,\), got \(15,\)",
    ),
    (dict(DS, bias=torch.zeros(1, 16)), ValueError, r"bias must have shape \(num_experts,\)"),
    (
        dict(DS, bias=torch.zeros(16, dtype=torch.int32)),
        ValueError,
        "bias must be float32, bfloat16 or float16",
    ),
    (
        dict(DS, bias=torch.zeros(16, dtype=torch.float64)),
        ValueError,
        "bias must be float32, bfloat16 or float16, got",
    ),
    (
        dict(bias=torch.zeros(16)),
        ValueError,
        f"bias is only used by {method_names(BIAS_METHODS)}, not RENORMALIZE",
    ),
    (dict(n_group=2, topk_group=1), ValueError, "n_group/topk_group are only used by DEEPSEEK_V3"),
    (dict(routed_scaling_factor=float("inf")), ValueError, "routed_scaling_factor must be finite"),
    (dict(routed_scaling_factor=True), ValueError, "routed_scaling_factor must be a float"),
    (dict(DS, routed_scaling_factor=float("nan")), ValueError, "routed_scaling_factor must be finite"),
    # finite in float64, inf in float32, the kernels' type: every weight would be inf, zeroed, counted
    (dict(routed_scaling_factor=1e39), ValueError, "routed_scaling_factor must be finite in float32"),
    (dict(DS, routed_scaling_factor=-3.5e38), ValueError, "routed_scaling_factor must be finite in float32"),
    (dict(DS, routed_scaling_factor="2"), ValueError, "routed_scaling_factor must be a float"),
    (dict(backend="cuda"), ValueError, "backend must be one of 'auto', 'triton', 'torch', 'flashinfer'"),
    (dict(capture="buffer"), TypeError, "capture must be a CaptureTarget or None"),
]


@pytest.mark.parametrize("change, exc, match", BAD, ids=[m for _, _, m in BAD])
def test_bad_arguments_raise_before_anything_is_written(change, exc, match):
    buffer = torch.full((8, 2, 4), POISON, dtype=torch.int32)
    counts = torch.tensor([6], dtype=torch.int32)
    args = dict(
        router_logits=torch.randn(6, 16),
        top_k=4,
        method=RoutingMethod.RENORMALIZE,
        capture=CaptureTarget(buffer, 1, token_counts=counts),
    )
    args.update(change)
    with pytest.raises(exc, match=match):
        route(args.pop("router_logits"), args.pop("top_k"), args.pop("method"), **args)
    assert (buffer == POISON).all(), "a rejected call wrote to the capture buffer"


def test_valid_grouping_edge_cases():
    """n_group 0/1 means no grouping (Kimi-K2 passes n_group=1, topk_group=1); 1-expert groups work."""
    logits = torch.randn(7, 16)
    bias = torch.randn(16) * 0.1
    flat = route(logits, 4, RoutingMethod.DEEPSEEK_V3, bias=bias)
    for n_group, topk_group in ((0, None), (1, None), (1, 1)):
        got = route(logits, 4, RoutingMethod.DEEPSEEK_V3, bias=bias, n_group=n_group, topk_group=topk_group)
        # exact: these spell "no grouping", so the same kernels run on the same logits
        assert torch.equal(got[1], flat[1]) and torch.equal(got[0], flat[0])
    # 16 groups of one expert, keep all 16: the same choice as no grouping
    same = route(logits, 4, RoutingMethod.DEEPSEEK_V3, bias=bias, n_group=16, topk_group=16)
    assert torch.equal(same[1], flat[1])


def test_flashinfer_backend_reports_why_it_is_unavailable():
    try:
        import moe_ops.flashinfer.routing  # noqa: F401 - only probing whether the adapter exists
    except ImportError as exc:
        reason = str(exc)
    else:
        pytest.skip("moe_ops.flashinfer.routing exists: the FlashInfer backend is tested with its adapter")
    with pytest.raises(ValueError, match="backend='flashinfer' is not available") as info:
        route(torch.randn(4, 16), 2, backend="flashinfer")
    assert reason in str(info.value)


def test_sequence_parallel_target_without_group_is_local():
    """CaptureTarget(layout=SEQUENCE_PARALLEL, tp_group=None) records like LOCAL (tp_size 1)."""
    logits = torch.randn(6, 16)
    counts = torch.tensor([4], dtype=torch.int32)
    buffers = [torch.full((8, 2, 4), POISON, dtype=torch.int32) for _ in range(2)]
    for buf, layout in zip(buffers, (BatchLayout.SEQUENCE_PARALLEL, BatchLayout.LOCAL)):
        _, ids = route(logits, 4, capture=CaptureTarget(buf, 0, token_counts=counts, layout=layout))
    assert torch.equal(buffers[0], buffers[1])
    assert torch.equal(buffers[0][:4, 0], ids[:4])
