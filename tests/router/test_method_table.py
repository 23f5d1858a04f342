"""The method table (``moe_ops.router.methods.METHODS``) is the one place a routing method's rules are
written: every method has a row, the public method sets and validate_route_args' messages come from
it, and no router or replay module dispatches on a method by name."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_ops.router import methods as M
from moe_ops.router.args import validate_route_args
from moe_ops.router.methods import (
    BIAS_METHODS,
    GRADIENT_OF,
    GROUP_METHODS,
    METHODS,
    N_METHOD_VALUES,
    SCALED_METHODS,
    SCALED_RULES,
    GradientRule,
    MethodSpec,
    RoutingMethod,
    SelectionKey,
    WeightRule,
    table_column,
)
from moe_ops.router.reference import rule_gradient, rule_weights

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_method_has_one_row():
    assert list(METHODS) == list(RoutingMethod)
    assert all(isinstance(spec, MethodSpec) for spec in METHODS.values())


def test_method_sets_are_what_the_table_says():
    assert {m for m, s in METHODS.items() if s.bias} == BIAS_METHODS
    assert {m for m, s in METHODS.items() if s.scaled} == SCALED_METHODS
    assert {m for m, s in METHODS.items() if s.groups} == GROUP_METHODS
    assert {m for m, s in METHODS.items() if s.unnormalized is not None} == M.UNNORMALIZED_METHODS
    assert {m for m, s in METHODS.items() if s.renormalized is not None} == M.RENORMALIZED_METHODS
    # a bias is only taken where the key is a score (sigmoid or softmax, + bias); a group score that
    # sums keys only where they are scores (MAX takes any key: the best logit is the best score)
    assert {m for m, s in METHODS.items() if s.key in M.SCORE_KEYS} >= BIAS_METHODS
    for method in GROUP_METHODS:
        spec = METHODS[method]
        assert spec.group_score is M.GroupScore.MAX or spec.key in M.SCORE_KEYS, method


def test_rows_are_consistent():
    """A row's gradient is its computed weight rule's; scaling goes with the scaled rules."""
    for method, spec in METHODS.items():
        assert spec.gradient == GRADIENT_OF[spec.weight.computed], method
        assert spec.scaled == (spec.weight in SCALED_RULES), method
    sigmoid = METHODS[RoutingMethod.SIGMOID]
    bad_rows = [
        dict(gradient=GradientRule.LOGIT),
        dict(scaled=True),
        dict(bias=True),
        dict(groups=True),
        dict(top_k=0),
        dict(weight=WeightRule.SIGMOID_SCALED, gradient=GradientRule.SIGMOID_SCALED),
        # an unnormalised rule belongs to a renormalising row, and keeps the row's scaling
        dict(unnormalized=WeightRule.SIGMOID),
        dict(renormalizes=True, unnormalized=WeightRule.SIGMOID_TIMES_SCALE),
    ]
    for change in bad_rows:
        with pytest.raises(ValueError):
            dataclasses.replace(sigmoid, **change)
    for method, spec in METHODS.items():
        if spec.unnormalized is not None:
            assert spec.renormalizes is True, method
            assert spec.unnormalized_gradient == GRADIENT_OF[spec.unnormalized.computed], method


def test_table_columns_are_indexed_by_method_value():
    """What the Triton helpers index with their constexpr METHOD."""
    column = table_column(lambda spec: spec)
    assert len(column) == N_METHOD_VALUES == max(RoutingMethod) + 1
    for method in RoutingMethod:
        assert column[int(method)] is METHODS[method]


def test_triton_helpers_read_the_table():
    pytest.importorskip("triton")
    from moe_ops.router import _select, _weights

    for method, spec in METHODS.items():
        assert _weights._WEIGHT_RULE[int(method)] == int(spec.weight.computed)
        assert _weights._GRADIENT_RULE[int(method)] == int(spec.gradient)
        assert _select._SIGMOID_BIAS_KEY[int(method)] == (spec.key == SelectionKey.SIGMOID_BIAS)
        assert _select._SQRTSOFTPLUS_BIAS_KEY[int(method)] == (spec.key == SelectionKey.SQRTSOFTPLUS_BIAS)
        assert _select._SOFTMAX_BIAS_KEY[int(method)] == (spec.key == SelectionKey.SOFTMAX_BIAS)
        # the other rule's column: the unnormalised (or renormalised) rule, or the row's own where
        # it has neither
        off = M.rule_column(method, True)
        weight = spec.unnormalized or spec.renormalized or spec.weight
        assert _weights._SOFTMAX_KEY[off] == _weights._SOFTMAX_KEY[int(method)]
        assert _weights._WEIGHT_RULE[off] == int(weight.computed)
        assert _weights._GRADIENT_RULE[off] == int(GRADIENT_OF[weight.computed])


def _named(message: str, after: str) -> set[str]:
    """The method names listed in ``message`` between ``after`` and ", not"."""
    listed = re.search(re.escape(after) + r" (.*?), not ", message).group(1)
    return set(re.split(r", | and ", listed))


def _error(method: RoutingMethod, **change) -> str:
    args = dict(top_k=1, bias=None, n_group=None, topk_group=None, routed_scaling_factor=None)
    args.update(change)
    logits = torch.randn(3, 8)
    with pytest.raises(ValueError) as info:
        validate_route_args(logits, args.pop("top_k"), method, **args)
    return str(info.value)


@pytest.mark.parametrize("method", list(RoutingMethod), ids=lambda m: m.name)
def test_messages_name_exactly_the_table_methods(method):
    spec = METHODS[method]
    names = {
        "bias": {m.name for m in BIAS_METHODS},
        "groups": {m.name for m in GROUP_METHODS},
    }
    if not spec.bias:
        message = _error(method, bias=torch.zeros(8))
        assert _named(message, "bias is only used by") == names["bias"], message
    if not spec.groups:
        message = _error(method, n_group=2, topk_group=1)
        assert _named(message, "n_group/topk_group are only used by") == names["groups"], message
    if spec.top_k is not None:
        wrong = spec.top_k % 8 + 1
        message = _error(method, top_k=wrong)
        assert message.startswith(f"{method.name} routing picks"), message
        assert f"top_k must be {spec.top_k}, got {wrong}" in message, message
    else:
        for top_k in (1, 8):
            assert (
                validate_route_args(torch.randn(3, 8), top_k, method, None, None, None, None).top_k == top_k
            )


def test_method_names_lists_in_value_order():
    assert M.method_names(frozenset({RoutingMethod.MINIMAX2, RoutingMethod.DEEPSEEK_V3})) == (
        "DEEPSEEK_V3 and MINIMAX2"
    )
    assert M.method_names(frozenset({RoutingMethod.TOPK})) == "TOPK"
    three = frozenset({RoutingMethod.SIGMOID, RoutingMethod.DEFAULT, RoutingMethod.TOPK})
    assert M.method_names(three) == "DEFAULT, TOPK and SIGMOID"


# The modules that compute routing: they read rules from the table, never a method by name.
ROUTING_MODULES = [
    "moe_ops/router/reference.py",
    "moe_ops/router/kernels.py",
    "moe_ops/router/_select.py",
    "moe_ops/router/_weights.py",
    "moe_ops/replay/kernels.py",
]


@pytest.mark.parametrize("path", ROUTING_MODULES)
def test_routing_modules_do_not_dispatch_on_a_method_name(path):
    source = (ROOT / path).read_text()
    members = "|".join(m.name for m in RoutingMethod)
    by_name = re.findall(rf"RoutingMethod\.(?:{members})\b", source)
    constants = re.findall(rf"\b_(?:{members})\b", source)
    kernel_checks = re.findall(r"\bMETHOD\s*[!=]=", source)
    assert not by_name and not constants and not kernel_checks, (by_name, constants, kernel_checks)


@settings(max_examples=60, deadline=None)
@given(
    method=st.sampled_from(list(RoutingMethod)),
    n=st.integers(1, 5),
    num_experts=st.integers(1, 12),
    data=st.data(),
)
def test_each_rows_gradient_rule_is_the_derivative_of_its_weight_rule(method, n, num_experts, data):
    """``rule_gradient`` of a row's gradient rule equals autograd through ``rule_weights`` of its
    computed weight rule, in float64: a row whose two rules disagree fails here, for any method."""
    spec = METHODS[method]
    top_k = spec.top_k or data.draw(st.integers(1, num_experts), label="top_k")
    scale = data.draw(st.sampled_from([1.0, 2.5, 0.3, -1.5, 0.0]))  # every method takes the factor
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    x = (torch.randn(n, num_experts, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    ids = torch.argsort(torch.rand(n, num_experts, generator=gen), dim=1)[:, :top_k]
    g = torch.randn(n, top_k, generator=gen, dtype=torch.float64)
    w = rule_weights(x, ids, spec.weight.computed, scale)
    (expected,) = torch.autograd.grad(w, x, g)
    got = rule_gradient(g, w.detach(), x.detach(), ids, spec.gradient, scale)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    if spec.unnormalized is not None:  # the renormalize=False rule, the same way
        w = rule_weights(x, ids, spec.unnormalized.computed, scale)
        (expected,) = torch.autograd.grad(w, x, g)
        got = rule_gradient(g, w.detach(), x.detach(), ids, spec.unnormalized_gradient, scale)
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
