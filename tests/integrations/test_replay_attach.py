"""attach_replay on real transformers models and on the reference model: the experts get the
recorded ids, weighted by the architecture's own rule, and gradients reach the routers.

Every transformers model is the real ``*ForCausalLM`` built from its real config class at a tiny
size (``build_tiny_model``), float32 on the CPU. What the experts received is observed
independently of the library: a forward pre-hook on each MoE block's ``experts`` module records
the ids of every call (``top_k_index``), i.e. what the model actually computed with, including
the calls that activation checkpointing re-runs in backward.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hf_archs import ARCH_PARAMS, REPLAY_PARAMS, arch_param
from strategies import distinct_rows

from moe_ops import (
    RoutingCapturer,
    RoutingReplayer,
    RoutingShape,
    attach_capture,
    attach_replay,
    decode_routing,
    encode_routing,
    replay_batch,
    resolve_routing_shape,
)
from moe_ops.attach.replaying import ReplayRule, replay_router_output
from moe_ops.graphs import CompileCounters
from moe_ops.integrations.hf import (
    MIN_REPLAY_TRANSFORMERS_VERSION,
    REPLAY_RULES,
    SUPPORTED_ARCHITECTURES,
    build_tiny_model,
)
from moe_ops.models import ReferenceMoEModel, reference_config
from moe_ops.replay import check_replay_errors
from moe_ops.router.methods import RoutingMethod

try:
    import transformers
except ImportError:  # the hf extra is optional
    transformers = None

needs_hf = pytest.mark.skipif(
    transformers is None, reason="transformers is not installed (pip install 'moe-ops[hf]')"
)
pytestmark = pytest.mark.usefixtures("one_thread")


def _transformers_older_than(version: str) -> bool:
    from packaging.version import Version

    return Version(transformers.__version__) < Version(version)


def skip_where_replay_is_refused(arch: str) -> None:
    """attach_replay refuses ``arch`` on a transformers older than MIN_REPLAY_TRANSFORMERS_VERSION
    (test_perturbed_routers_replay_the_recorded_ids checks the refusal): the replay tests skip there."""
    if _transformers_older_than(required := MIN_REPLAY_TRANSFORMERS_VERSION.get(arch, "0")):
        pytest.skip(
            f"attach_replay refuses {arch} before transformers {required} ({transformers.__version__})"
        )


ARCHS = list(SUPPORTED_ARCHITECTURES)
VOCAB = 128  # the tiny models' vocabulary
# Rules the tiny defaults do not reach: renormalised Qwen3, DeepSeek-V3 and GLM-4.7-Flash without
# renormalisation, DeepSeek-V2 scaled and group-limited, dots1 renormalised and scaled, DeepSeek-V4
# with sigmoid scores (DEEPSEEK_V3's rule, on its hash layer too) and another scale.
RULE_CASES = [(arch, {}) for arch in ARCHS] + [
    ("qwen3_moe", {"norm_topk_prob": True}),
    ("deepseek_v3", {"norm_topk_prob": False}),
    ("glm4_moe_lite", {"norm_topk_prob": False}),
    (
        "deepseek_v2",
        {"routed_scaling_factor": 2.0, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2},
    ),
    ("dots1", {"norm_topk_prob": True, "routed_scaling_factor": 2.5}),
    ("deepseek_v4", {"scoring_func": "sigmoid", "routed_scaling_factor": 2.5}),
]
RULE_PARAMS = [arch_param(a, o, id=f"{a}{'-' if o else ''}{'-'.join(o)}", replay=True) for a, o in RULE_CASES]
# PhiMoE's sparsemixer weighs an expert by a softmax over the experts within 2 * router_jitter_noise
# (relative) of the best; at its default 0.01 the window of a tiny random model holds one expert, so
# the multiplier is 1 and the router gets no gradient, with or without replay. A wider window makes
# the gradient test meaningful.
GRAD_OVERRIDES = {"phimoe": {"router_jitter_noise": 0.5}}
# Replayed weights come from replay_routing's formula (e.g. softmax over the k recorded logits)
# where the model computes an equal one (top-k of a softmax, renormalised), in float32: a few ulp
# per weight (1e-7 relative), which three small layers carry to the logits at up to 3.7e-7 of their
# largest magnitude and to the router gradients at up to 1.0e-6 (measured over every case below
# and three seeds). 2e-5 leaves a 20x margin and is far below what one changed expert does (~1e-1).
RTOL = 2e-5


def tokens(batch: int, seq: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, seq), generator=gen)


_EXPERTS_PATH = re.compile(r"(?:^|\.)layers\.(\d+)\.[^.]+\.experts$")


class ExpertsSpy:
    """Records the ids (and weights) every ``experts`` call received, per decoder layer, in call
    order."""

    def __init__(self, model):
        self.calls: dict[int, list[torch.Tensor]] = {}
        self.weights: dict[int, list[torch.Tensor]] = {}
        self.hooks = [
            module.register_forward_pre_hook(self._recorder(int(m.group(1))), with_kwargs=True)
            for path, module in model.named_modules()
            if (m := _EXPERTS_PATH.search(path)) is not None
        ]
        assert self.hooks, "no experts module found"

    def _recorder(self, layer: int):
        def record(module, args, kwargs):
            ids = args[1] if len(args) > 1 else kwargs["top_k_index"]
            weights = args[2] if len(args) > 2 else kwargs["top_k_weights"]
            self.calls.setdefault(layer, []).append(ids.detach().clone())
            self.weights.setdefault(layer, []).append(weights.detach().clone())

        return record

    def routing(self, shape: RoutingShape, call: int = -1) -> torch.Tensor:
        """(n, num_layers, top_k) ids of call ``call`` of every MoE layer, on the MoE-only axis."""
        assert sorted(self.calls) == list(shape.moe_layers)
        return torch.stack([self.calls[layer][call] for layer in shape.moe_layers], dim=1)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()


def forward(model, x, *, grad: bool = False):
    """(logits, (n, num_layers, top_k) ids the experts received) of one forward."""
    with ExpertsSpy(model) as spy, torch.set_grad_enabled(grad):
        logits = model(x).logits
    return logits, spy.routing(resolve_routing_shape(model.config))


def routers(model) -> list[torch.nn.Module]:
    names = SUPPORTED_ARCHITECTURES[model.config.model_type].router_classes
    return [m for m in model.modules() if type(m).__name__ in names]


def perturb_routers(model, seed: int = 0) -> None:
    """What an optimizer step does to the routers: noise on the gate weights (as large as they are,
    so that the live routing changes on this few tokens)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for r in routers(model):
            r.weight.add_(torch.randn(r.weight.shape, generator=gen) * r.weight.std() * 2)


def router_grads(model, x) -> list[torch.Tensor]:
    model.zero_grad()
    logits = model(x).logits
    (logits.float() ** 2).mean().backward()
    return [r.weight.grad.clone() for r in routers(model)]


def replayer_of(model, max_num_tokens: int = 16) -> RoutingReplayer:
    return RoutingReplayer(resolve_routing_shape(model.config), max_num_tokens, "cpu")


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=RTOL * scale)


# ---------------------------------------------------------------------------------------------------
# (1) the model's own ids reproduce its logits; -1 rows are the model unchanged
# ---------------------------------------------------------------------------------------------------


@needs_hf
@pytest.mark.parametrize(("arch", "overrides"), RULE_PARAMS)
def test_replaying_the_models_own_ids_reproduces_its_logits(arch, overrides):
    skip_where_replay_is_refused(arch)
    model = build_tiny_model(arch, **overrides)
    x = tokens(2, 5, seed=0)
    ref_logits, live = forward(model, x)
    assert len({tuple(r) for r in torch.sort(live[:, 0], -1).values.tolist()}) > 1, "routing must vary"
    replayer = replayer_of(model)
    with attach_replay(model, replayer) as handle:
        assert handle.arch == arch and handle.layers == replayer.shape.moe_layers
        replayer.set_batch(live.numpy())
        logits, received = forward(model, x)
        assert torch.equal(received, live), "the experts did not get the recorded ids"
        assert_close_scaled(logits, ref_logits)
        # rows of -1 keep each router's own output: the model exactly as without replay
        replayer.set_batch(np.full((10, *live.shape[1:]), -1))
        logits, received = forward(model, x)
        assert torch.equal(logits, ref_logits) and torch.equal(received, live)
    assert check_replay_errors(raise_error=False) == 0


# ---------------------------------------------------------------------------------------------------
# (2) after an optimizer step, the experts still get the recorded ids
# ---------------------------------------------------------------------------------------------------


def oracle_weights(router, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each architecture's weight rule at given ids, written from its transformers router (the
    line that computes the weights of the chosen experts), independently of the library."""
    arch = {c: a for a, spec in SUPPORTED_ARCHITECTURES.items() for c in spec.router_classes}[
        type(router).__name__
    ]
    x, ids = logits.double(), ids.long()
    if arch in ("qwen3_moe", "qwen2_moe", "olmoe", "flex_olmo", "mixtral", "qwen3_5_moe", "qwen3_5_moe_text"):
        w = x.softmax(-1).gather(1, ids)  # Mixtral and Qwen3.5 have no norm_topk_prob: always renormalised
        return w / w.sum(-1, keepdim=True) if getattr(router, "norm_topk_prob", True) else w
    if arch in ("gpt_oss", "granitemoe"):
        return x.gather(1, ids).softmax(-1)
    if arch in ("deepseek_v3", "glm4_moe", "dots1", "glm4_moe_lite"):
        w = x.sigmoid().gather(1, ids)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) if router.norm_topk_prob else w
        return w * router.routed_scaling_factor
    if arch == "deepseek_v2":
        return x.softmax(-1).gather(1, ids) * router.routed_scaling_factor
    if arch == "deepseek_v4":  # both routers: score_fn is ACT2FN[config.scoring_func]
        sqrt_softplus = type(router.score_fn).__name__ == "SqrtSoftplusActivation"
        w = (torch.nn.functional.softplus(x).sqrt() if sqrt_softplus else x.sigmoid()).gather(1, ids)
        return w / (w.sum(-1, keepdim=True) + 1e-20) * router.routed_scaling_factor
    assert arch == "phimoe"  # sparsemixer (eval) with its selected experts replaced by ids
    eps, out, masked = router.router_jitter_noise, [], x
    for k in range(2):
        if k == 1:
            masked = x.scatter(1, ids[:, :1], float("-inf"))
        top = masked.max(-1, keepdim=True).values
        outside = (top - x) / x.abs().clamp(min=top) > 2 * eps
        out.append(masked.masked_fill(outside, float("-inf")).softmax(-1).gather(1, ids[:, k : k + 1]))
    return torch.cat(out, -1)


@needs_hf
@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_perturbed_routers_replay_the_recorded_ids(arch):
    model = build_tiny_model(arch)
    required = MIN_REPLAY_TRANSFORMERS_VERSION.get(arch)
    if required is not None and _transformers_older_than(required):
        # older releases replay other ids on this architecture: attach_replay refuses them
        with pytest.raises(
            ImportError, match=rf"transformers>={re.escape(required)} \(attach_replay of {arch}"
        ):
            attach_replay(model, replayer_of(model))
        return
    x = tokens(2, 6, seed=1)
    _, recorded = forward(model, x)  # the rollout's routing, before the update
    perturb_routers(model)
    _, moved = forward(model, x)
    changed = (torch.sort(moved, -1).values != torch.sort(recorded, -1).values).any(-1)
    assert changed.any(), "the perturbation changed no routing decision: the test would prove nothing"
    replayer = replayer_of(model)
    replayer.set_batch(recorded.numpy())
    logits_of = {}
    hooks = [
        r.register_forward_hook(lambda mod, args, out, i=i: logits_of.__setitem__(i, out[0].detach()))
        for i, r in enumerate(routers(model))
    ]
    with attach_replay(model, replayer), ExpertsSpy(model) as spy, torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    received = spy.routing(replayer.shape)
    assert torch.equal(received, recorded), f"{int(changed.sum())} rows changed live; replay must undo all"
    # ... and the weights those experts got are the architecture's rule at the recorded ids
    for column, (router, layer) in enumerate(zip(routers(model), replayer.shape.moe_layers)):
        expected = oracle_weights(router, logits_of[column], recorded[:, column])
        assert_close_scaled(spy.weights[layer][0].double(), expected)
    assert check_replay_errors(raise_error=False) == 0


@needs_hf
@pytest.mark.parametrize(
    ("arch", "scoring_func"),
    [arch_param("deepseek_v4", s, id=s, replay=True) for s in ("sqrtsoftplus", "sigmoid")],
)
def test_deepseek_v4_hash_layer_forces_recorded_rows_and_takes_the_table_elsewhere(arch, scoring_func):
    """A hash layer (DeepseekV4HashRouter(hidden_states, input_ids)): recorded rows reach the experts
    although the table chooses others; a row of -1 keeps the table's ids (the router's own); a faulty
    row (an expert twice) takes tid2eid[input_ids] - the input_ids the wrapped forward passed on -
    and is counted. Weights: the scoring function's rule at the ids the experts got."""
    model = build_tiny_model(arch, scoring_func=scoring_func)
    router = model.model.layers[0].mlp.gate
    assert type(router).__name__ == "DeepseekV4HashRouter"
    x = tokens(2, 4, seed=15)
    table_ids = router.tid2eid[x.reshape(-1)]  # (8, top_k): the model's own choice
    replayer = replayer_of(model)
    recorded = distinct_rows(np.random.default_rng(14), 8, replayer.shape)
    # rows 0-3 recorded, not the table's; row 4 -1 (route live); row 5 an expert twice (faulty)
    recorded[:4, 0] = (table_ids[:4].numpy() + 1) % replayer.shape.num_experts
    recorded[4, 0] = -1
    recorded[5, 0] = recorded[5, 0, 0]
    logits_seen = []
    hook = router.register_forward_hook(lambda mod, args, out: logits_seen.append(out[0].detach()))
    check_replay_errors(raise_error=False)  # start from a zero fault count
    with attach_replay(model, replayer), ExpertsSpy(model) as spy, torch.no_grad():
        replayer.set_batch(recorded)
        model(x)
    hook.remove()
    got = spy.calls[0][0]
    assert torch.equal(got[:4], torch.from_numpy(recorded[:4, 0]).to(got.dtype))
    assert not torch.equal(got[:4], table_ids[:4]), "the recorded rows must differ from the table's"
    assert torch.equal(got[4:6], table_ids[4:6]), "a -1 row and a faulty row take the table's ids"
    assert torch.equal(got[6:], torch.from_numpy(recorded[6:, 0]).to(got.dtype))
    assert_close_scaled(spy.weights[0][0].double(), oracle_weights(router, logits_seen[0], got))
    assert check_replay_errors(raise_error=False) == 1  # the faulty row, not the -1 row


# ---------------------------------------------------------------------------------------------------
# (3) gradients reach the routers
# ---------------------------------------------------------------------------------------------------


@needs_hf
@pytest.mark.parametrize(("arch", "overrides"), RULE_PARAMS)
def test_gradients_reach_the_router_weights(arch, overrides):
    """With the model's own ids, the router gradients equal the live model's (the weight rule
    differentiates the same function); with another routing they are non-zero in every layer."""
    skip_where_replay_is_refused(arch)
    model = build_tiny_model(arch, **{**GRAD_OVERRIDES.get(arch, {}), **overrides})
    x = tokens(2, 5, seed=2)
    _, live = forward(model, x)
    live_grads = router_grads(model, x)
    replayer = replayer_of(model)
    with attach_replay(model, replayer):
        replayer.set_batch(live.numpy())
        grads = router_grads(model, x)
        for g, ref in zip(grads, live_grads):
            assert g.abs().max() > 0, "no gradient reached a router"
            assert_close_scaled(g, ref)
        replayer.set_batch(distinct_rows(np.random.default_rng(0), live.shape[0], replayer.shape))
        assert all(g.abs().max() > 0 for g in router_grads(model, x))


@needs_hf
def test_phimoe_training_mode_replays_through_its_gradient_estimator():
    """In training, sparsemixer scales each multiplier by 1 or 1/3 (Heun's estimator, its own random
    draw) and differentiates it with PhimoeMultiplier: the replay does the same at the recorded ids."""
    model = build_tiny_model("phimoe", router_jitter_noise=0.5)
    x = tokens(2, 5, seed=3)
    replayer = replayer_of(model)
    replayer.set_batch(distinct_rows(np.random.default_rng(1), 10, replayer.shape))
    with attach_replay(model, replayer):
        weights = {}
        hooks = [
            m.register_forward_pre_hook(
                lambda mod, args, i=i: weights.setdefault(i, []).append(args[2].detach().clone())
            )
            for i, m in enumerate(m for n, m in model.named_modules() if n.endswith("mlp.experts"))
        ]
        with torch.no_grad():
            _, received = forward(model, x)
        model.train()
        torch.manual_seed(0)
        _, received_train = forward(model, x)
        grads = router_grads(model, x)
        for h in hooks:
            h.remove()
    assert torch.equal(received, received_train) and torch.equal(received.int(), replayer.buffer[:10])
    # the first MoE layer sees the same hidden states in both modes (later ones see the factors)
    eval_w, train_w = weights[0][:2]  # the eval and the first training forward
    ratio = train_w[eval_w > 0] / eval_w[eval_w > 0]
    factor = torch.isclose(ratio, torch.tensor(1.0)) | torch.isclose(ratio, torch.tensor(0.3333))
    assert factor.all() and not torch.isclose(ratio, torch.tensor(1.0)).all(), (
        "training multipliers are the eval ones times 1 or 1/3 (drawn)"
    )
    assert all(g.abs().max() > 0 for g in grads)


# ---------------------------------------------------------------------------------------------------
# Activation checkpointing, micro-batches, torch.compile
# ---------------------------------------------------------------------------------------------------


@needs_hf
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_checkpointed_layers_and_repeated_forwards_read_the_same_ids(arch):
    """Gradient checkpointing re-runs every decoder layer in backward; a second forward over the
    same micro-batch runs them again: every run of a layer gets its own recorded column."""
    model = build_tiny_model(arch)
    # transformers 5.24 renamed it (5.17, on the GPU machine, has the old name only)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    model.train()
    x = tokens(2, 4, seed=4)
    replayer = replayer_of(model)
    recorded = distinct_rows(np.random.default_rng(2), 8, replayer.shape)  # not the live routing
    replayer.set_batch(recorded)
    with attach_replay(model, replayer), ExpertsSpy(model) as spy:
        for _ in range(2):
            model(x).logits.float().pow(2).mean().backward()
    for column, layer in enumerate(replayer.shape.moe_layers):
        calls = spy.calls[layer]
        assert len(calls) == 4, (
            f"layer {layer}: expected 2 forwards + 2 recomputations, got {len(calls)} calls"
        )
        for ids in calls:
            assert torch.equal(ids, torch.from_numpy(recorded[:, column]))
    assert all(r.weight.grad.abs().max() > 0 for r in routers(model))


@needs_hf
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_compiled_training_step_replays_new_batches_without_recompiling(arch):
    """fullgraph torch.compile (aot_eager: dynamo, functionalisation and AOT autograd of the replay
    op are what can break) of forward + backward: one graph, no breaks, each new batch set in place
    is replayed, and outputs and router gradients equal the eager replay's."""
    if _transformers_older_than("5.23"):
        pytest.skip(
            "transformers < 5.23: its grouped_mm backward fails under torch.compile (a data-dependent "
            "guard inside transformers, with or without replay); see docs/transformers.md"
        )
    model = build_tiny_model(arch)
    x = tokens(2, 4, seed=5)
    replayer = replayer_of(model)
    rng = np.random.default_rng(3)
    batches = [distinct_rows(rng, 8, replayer.shape, live_fraction=0.25) for _ in range(2)]
    with attach_replay(model, replayer):
        eager = []
        for batch in batches:
            replayer.set_batch(batch)
            eager.append((model(x).logits.detach(), router_grads(model, x)))
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        with CompileCounters() as counters:
            for batch, (ref_logits, ref_grads) in zip(batches, eager):
                replayer.set_batch(batch)
                model.zero_grad()
                logits = compiled(x).logits
                (logits.float() ** 2).mean().backward()
                torch.testing.assert_close(logits.detach(), ref_logits, rtol=0, atol=0)
                for r, ref in zip(routers(model), ref_grads):
                    assert_close_scaled(r.weight.grad, ref)
    torch._dynamo.reset()
    assert counters.graph_breaks == 0 and counters.graphs == 1, counters


# The rule builders dynamo traces at every call besides those of the compiled training step above
# (Qwen3-MoE, DeepSeek-V3): a scaled DeepSeek-V2 (replay_routing's routed_scaling_factor), PhiMoE
# (its multiplier class looked up in transformers' module), Qwen3.5-MoE (the multimodal model, hybrid
# attention), DeepSeek-V4 (a hash layer: its table and the input_ids the wrapper passes on).
COMPILED_RULE_CASES = [
    ("deepseek_v2", {"routed_scaling_factor": 2.0}),
    ("phimoe", {}),
    ("qwen3_5_moe", {}),
    ("deepseek_v4", {}),
]


@needs_hf
@pytest.mark.parametrize(
    ("arch", "overrides"), [arch_param(a, o, id=a, replay=True) for a, o in COMPILED_RULE_CASES]
)
def test_each_rule_compiles_in_one_graph_without_breaks(arch, overrides):
    model = build_tiny_model(arch, **overrides)
    x = tokens(2, 4, seed=14)
    replayer = replayer_of(model)
    rng = np.random.default_rng(13)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with attach_replay(model, replayer), torch.no_grad(), CompileCounters() as counters:
        for _ in range(2):
            replayer.set_batch(distinct_rows(rng, 8, replayer.shape, live_fraction=0.25))
            torch.testing.assert_close(compiled(x).logits, model(x).logits, rtol=0, atol=0)
    torch._dynamo.reset()
    assert (counters.graphs, counters.graph_breaks) == (1, 0), counters


@needs_hf
def test_attach_and_remove_after_compile():
    """Dynamo guards on the wrapped forward: attaching or removing after compiling takes effect."""
    model = build_tiny_model("mixtral")
    x = tokens(2, 4, seed=6)
    _, live = forward(model, x)
    replayer = replayer_of(model)
    recorded = distinct_rows(np.random.default_rng(4), 8, replayer.shape)
    replayer.set_batch(recorded)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    with ExpertsSpy(model) as spy, torch.no_grad():
        compiled(x)
        with attach_replay(compiled, replayer):
            compiled(x)
        compiled(x)
    torch._dynamo.reset()
    shape = replayer.shape
    assert torch.equal(spy.routing(shape, 0), live)
    assert torch.equal(spy.routing(shape, 1), torch.from_numpy(recorded))
    assert torch.equal(spy.routing(shape, 2), live)


# ---------------------------------------------------------------------------------------------------
# From the wire to the experts
# ---------------------------------------------------------------------------------------------------


@needs_hf
@pytest.mark.parametrize("layer_axis", ["moe", "model"])
def test_captured_requests_from_the_wire_replay_in_a_padded_batch(layer_axis):
    """The rollout captures two requests (5 and 3 tokens), sends each as encode_routing text of its
    T - 1 rows (on the MoE-only axis, or widened to vLLM's model-layer axis); the trainer decodes,
    pads them into a (2, 5) batch and replays with updated routers: each real token's experts are
    the rollout's, the last tokens and the padding route live (the top-k of the logits)."""
    model = build_tiny_model("deepseek_v3")  # layer 0 dense: the two axes differ
    shape = resolve_routing_shape(model.config)
    prompts = [tokens(1, 5, seed=7), tokens(1, 3, seed=8)]
    wire = []
    for p in prompts:
        capturer = RoutingCapturer(shape, 8, "cpu")
        with attach_capture(model, capturer), torch.no_grad():
            capturer.set_step([p.shape[1] - 1])  # the last token is never run in a rollout
            model(p)
        rows = capturer.snapshot().result()
        wire.append(encode_routing(rows if layer_axis == "moe" else shape.to_model_layers(rows)))
    received = [decode_routing(s) for s in wire]
    batch = replay_batch(received, shape, layer_axis=layer_axis, pad_to=5)
    assert batch.shape == (10, shape.num_layers, shape.top_k)

    perturb_routers(model, seed=1)
    x = torch.cat([prompts[0], torch.cat([prompts[1], torch.zeros(1, 2, dtype=torch.int64)], 1)])
    replayer = RoutingReplayer(shape, 10, "cpu")
    replayer.set_batch(batch)
    logits_seen = {}
    hooks = [
        r.register_forward_hook(lambda mod, args, out, i=i: logits_seen.__setitem__(i, out[0].detach()))
        for i, r in enumerate(routers(model))
    ]
    with attach_replay(model, replayer):
        _, got = forward(model, x)
    for h in hooks:
        h.remove()
    recorded_rows = [0, 1, 2, 3, 5, 6]  # tokens 0..3 of request 0, 0..1 of request 1
    captured = np.concatenate([r.astype(np.int64) for r in received])
    if layer_axis == "model":
        captured = captured[:, list(shape.moe_layers)]
    assert torch.equal(got[recorded_rows], torch.from_numpy(captured))
    live_rows = [4, 7, 8, 9]
    for column, layer_logits in logits_seen.items():
        # DeepSeek-V3's own choice from the logits the router returned: sigmoid (+ a zero bias),
        # the 2 best of 4 groups by their top-2 sum, the top-4 inside them
        scores = layer_logits.sigmoid()
        groups = scores.view(-1, 4, 4).topk(2, -1)[0].sum(-1).topk(2, -1)[1]
        mask = torch.zeros(scores.shape[0], 4).scatter_(1, groups, 1).repeat_interleave(4, 1).bool()
        expected = scores.masked_fill(~mask, float("-inf")).topk(4, -1)[1]
        assert torch.equal(
            torch.sort(got[live_rows, column], -1).values, torch.sort(expected[live_rows], -1).values
        )


# ---------------------------------------------------------------------------------------------------
# remove(), composition with capture, bad input
# ---------------------------------------------------------------------------------------------------


@needs_hf
def test_remove_restores_the_routers_exactly():
    model = build_tiny_model("gpt_oss")
    x = tokens(2, 4, seed=9)
    ref_logits, live = forward(model, x)
    keys = {k: v.clone() for k, v in model.state_dict().items()}
    replayer = replayer_of(model)
    replayer.set_batch(distinct_rows(np.random.default_rng(5), 8, replayer.shape))
    handle = attach_replay(model, replayer)
    assert handle.attached and all("forward" in r.__dict__ for r in routers(model))
    with pytest.raises(ValueError, match="already has a routing replay"):
        attach_replay(model, replayer)
    handle.remove()
    handle.remove()  # a second remove does nothing
    assert not handle.attached and not any("forward" in r.__dict__ for r in routers(model))
    logits, received = forward(model, x)
    assert torch.equal(logits, ref_logits) and torch.equal(received, live)
    assert model.state_dict().keys() == keys.keys()
    assert all(torch.equal(v, keys[k]) for k, v in model.state_dict().items())


@needs_hf
def test_capture_on_top_of_replay_records_the_replayed_ids():
    """attach_capture after attach_replay wraps the replaying forward: it records what the experts
    got. Handles come off in reverse order (the outer wrapper first)."""
    model = build_tiny_model("olmoe")
    x = tokens(1, 6, seed=10)
    shape = resolve_routing_shape(model.config)
    replayer = RoutingReplayer(shape, 6, "cpu")
    recorded = distinct_rows(np.random.default_rng(6), 6, shape)
    replayer.set_batch(recorded)
    capturer = RoutingCapturer(shape, 6, "cpu")
    replay = attach_replay(model, replayer)
    capture = attach_capture(model, capturer)
    with pytest.raises(RuntimeError, match="replaced after attach_replay"):
        replay.remove()
    capturer.set_step([6])
    with torch.no_grad():
        model(x)
    capture.remove()
    replay.remove()
    assert torch.equal(capturer.buffer, torch.from_numpy(recorded).to(torch.int32))


class RouterInputs:
    """Each router's own choice, worked out from its input: a pre-hook keeps the arguments of every
    router call (the hook runs before the instance's ``forward``, wrapped or not), and the router
    class's own ``forward`` - never a wrapper - is run on them again."""

    def __init__(self, model):
        self.args: dict[torch.nn.Module, list[tuple]] = {}
        self.hooks = [r.register_forward_pre_hook(self._keep) for r in routers(model)]
        self.routers = routers(model)

    def _keep(self, module, args):
        self.args.setdefault(module, []).append(tuple(a.detach().clone() for a in args))

    def own_ids(self) -> torch.Tensor:
        """(n, num_layers, top_k) ids each router's class forward picks on its last call's input."""
        columns = []
        for router in self.routers:
            with torch.no_grad():
                output = type(router).forward(router, *self.args[router][-1])
            (ids,) = [t for t in output if not t.dtype.is_floating_point]
            columns.append(ids)
        return torch.stack(columns, dim=1)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()


@needs_hf
def test_a_capture_under_the_replay_records_the_live_ids_and_one_on_top_the_replayed_ids():
    """attach_capture, then attach_replay: the replay wraps the capture, which records each router's
    own (live) choice while the experts get the recorded ids. attach_replay, then attach_capture: the
    capture wraps the replay and records the replayed ids. The order Megatron-Core's hooks give;
    one capture and one replay per router, under or on top; handles come off in reverse order."""
    model = build_tiny_model("olmoe")
    x = tokens(1, 6, seed=10)
    shape = resolve_routing_shape(model.config)
    _, plain = forward(model, x)  # nothing attached: the router's own ids
    recorded = distinct_rows(np.random.default_rng(6), 6, shape)
    replayer = RoutingReplayer(shape, 6, "cpu", record_live=True)
    replayer.set_batch(recorded)
    capturer = RoutingCapturer(shape, 6, "cpu")
    capturer.buffer.fill_(-7)

    # capture first, replay on top of it: the capture records what each router chose itself
    capture = attach_capture(model, capturer)
    replay = attach_replay(model, replayer)
    with pytest.raises(
        ValueError, match=r"'model\.layers\.0\.mlp\.gate' already has a routing capture attached"
    ):
        attach_capture(model, RoutingCapturer(shape, 6, "cpu"))
    with pytest.raises(
        ValueError, match=r"'model\.layers\.0\.mlp\.gate' already has a routing replay attached"
    ):
        attach_replay(model, replayer)
    capturer.set_step([6])
    with RouterInputs(model) as inputs:
        _, received = forward(model, x)
    live = inputs.own_ids()
    assert torch.equal(received, torch.from_numpy(recorded)), "the experts did not get the recorded ids"
    assert torch.equal(capturer.buffer, live.to(torch.int32)), "the capture under the replay: live ids"
    assert torch.equal(live[:, 0], plain[:, 0])  # layer 0's input is the plain model's
    assert not torch.equal(live, received), "the live choice must differ from the record to tell them apart"
    # the replayer's own record of the live choice agrees
    assert torch.equal(replayer.live_buffer[:6], capturer.buffer)
    with pytest.raises(RuntimeError, match="replaced after attach_capture"):
        capture.remove()
    replay.remove()
    capture.remove()
    assert not any("forward" in r.__dict__ for r in routers(model))

    # replay first, capture on top of it: the capture records what the experts got
    capturer.buffer.fill_(-7)
    with attach_replay(model, replayer), attach_capture(model, capturer):
        capturer.set_step([6])
        _, received = forward(model, x)
    assert torch.equal(received, torch.from_numpy(recorded))
    assert torch.equal(capturer.buffer, received.to(torch.int32)), "the capture on top: replayed ids"
    assert not any("forward" in r.__dict__ for r in routers(model))


def _path_of(model, module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


@needs_hf
@pytest.mark.parametrize("arch", REPLAY_PARAMS)
def test_a_router_top_k_other_than_the_replayers_is_a_value_error(arch):
    """Before attaching: refused, naming the router, its top_k and the replayer's. After attaching
    (the router's top_k changed): the wrapper raises the same kind of error at the next call,
    before anything reaches the experts, rather than a shape error from inside the replay."""
    model = build_tiny_model(arch)
    replayer = replayer_of(model)
    k = replayer.shape.top_k
    router = routers(model)[-1]
    path = re.escape(_path_of(model, router))
    router.top_k = k + 1
    with pytest.raises(
        ValueError, match=rf"replayer\.shape\.top_k={k} but the router at '{path}' picks top_k={k + 1}"
    ):
        attach_replay(model, replayer)
    assert not any("forward" in r.__dict__ for r in routers(model))
    router.top_k = k
    x = tokens(2, 3, seed=0)
    replayer.set_batch(distinct_rows(np.random.default_rng(10), 6, replayer.shape))
    with attach_replay(model, replayer), ExpertsSpy(model) as spy:
        router.top_k = k + 1
        if arch == "phimoe":
            # sparsemixer picks 2 experts whatever top_k says; the rule refuses any other top_k
            match = rf"sparsemixer routes top-2 only; the router has top_k={k + 1}"
        else:
            match = rf"the router at '{path}' picks top_k={k + 1} experts per token but the replayer's rows "
            match += rf"hold {k} "
        with pytest.raises(ValueError, match=match), torch.no_grad():
            model(x)
        last_layer = replayer.shape.moe_layers[-1]
        assert last_layer not in spy.calls, "the experts of the changed router were called"


@needs_hf
def test_a_changed_top_k_raises_under_torch_compile_too():
    """The check compares shapes, which dynamo knows while tracing: the recompile that the changed
    top_k causes raises the ValueError (outside fullgraph; with fullgraph=True dynamo reports an
    observed exception whose cause is this error)."""
    model = build_tiny_model("qwen3_moe", num_hidden_layers=2)
    replayer = replayer_of(model)
    replayer.set_batch(distinct_rows(np.random.default_rng(11), 4, replayer.shape))
    x = tokens(1, 4, seed=0)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    with attach_replay(model, replayer), torch.no_grad():
        compiled(x)
        model.model.layers[1].mlp.gate.top_k = 3
        with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.gate' picks top_k=3 .* hold 2"):
            compiled(x)
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------------
# Rule fields changed after attaching
# ---------------------------------------------------------------------------------------------------

# Every field of a router that its weight rule reads, each changed to a value the tiny model does not
# have. A change after attach_replay must take effect at the next call (the model's own forward with
# the new value, on its own ids, is the reference).
FIELD_CHANGES = [
    ("qwen3_moe", {"norm_topk_prob": True}),
    ("qwen2_moe", {"norm_topk_prob": True}),
    ("olmoe", {"norm_topk_prob": True}),
    ("flex_olmo", {"norm_topk_prob": True}),
    ("deepseek_v3", {"norm_topk_prob": False}),
    ("deepseek_v3", {"routed_scaling_factor": 1.0}),
    ("deepseek_v3", {"num_group": 2, "topk_group": 1}),
    ("glm4_moe", {"norm_topk_prob": False}),
    ("glm4_moe", {"routed_scaling_factor": 2.5}),
    ("glm4_moe", {"num_group": 2, "topk_group": 1}),
    ("dots1", {"norm_topk_prob": True}),
    ("dots1", {"routed_scaling_factor": 2.5}),
    ("dots1", {"num_group": 2, "topk_group": 1}),
    ("glm4_moe_lite", {"norm_topk_prob": False}),
    ("glm4_moe_lite", {"routed_scaling_factor": 1.0}),
    ("glm4_moe_lite", {"num_group": 2, "topk_group": 1}),
    ("deepseek_v2", {"routed_scaling_factor": 2.0}),
    # the best of 4 groups of 2: top-2 differs from greedy's where the second best is in another group
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "num_group": 4, "topk_group": 1}),
    ("phimoe", {"router_jitter_noise": 0.5}),
    ("deepseek_v4", {"routed_scaling_factor": 2.5}),
]
FIELD_PARAMS = [arch_param(a, f, id=f"{a}-{'-'.join(f)}", replay=True) for a, f in FIELD_CHANGES]
# Router fields no weight rule reads: the module's own (training), its size (num_experts,
# hidden_dim, in_features, out_features), top_k (its own test above) and PhiMoE's input jitter,
# which scales the hidden states before the logits in training.
NOT_RULE_FIELDS = {"training", "num_experts", "hidden_dim", "in_features", "out_features", "top_k"}
NOT_RULE_FIELDS |= {"input_jitter_noise"}


def set_router_fields(model, fields: dict) -> None:
    for r in routers(model):
        for name, value in fields.items():
            assert hasattr(r, name), f"{type(r).__name__} has no {name}"
            setattr(r, name, value)


@needs_hf
@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_field_changes_cover_every_rule_field_of_every_router(arch):
    """The table above names every scalar field of each router, except those no rule reads: a field
    transformers adds to a router shows up here."""
    model = build_tiny_model(arch, num_hidden_layers=2)
    fields = {
        name
        for name, value in vars(routers(model)[0]).items()
        if not name.startswith("_") and (value is None or isinstance(value, (bool, int, float, str)))
    }
    changed = {name for a, f in FIELD_CHANGES if a == arch for name in f}
    assert fields - NOT_RULE_FIELDS == changed


@needs_hf
@pytest.mark.parametrize(("arch", "fields"), FIELD_PARAMS)
def test_rule_fields_changed_after_attaching_take_effect(arch, fields):
    x = tokens(2, 5, seed=12)
    model = build_tiny_model(arch)
    before, routed_before = forward(model, x)
    reference = build_tiny_model(arch)  # the same weights (same seed), the new field values
    set_router_fields(reference, fields)
    ref_logits, own = forward(reference, x)
    assert not torch.equal(ref_logits, before) or not torch.equal(own, routed_before), (
        "the change does nothing to this model: the test would prove nothing"
    )
    replayer = replayer_of(model)
    with attach_replay(model, replayer):
        set_router_fields(model, fields)
        replayer.set_batch(own.numpy())
        logits, received = forward(model, x)
    assert torch.equal(received, own)
    assert_close_scaled(logits, ref_logits)
    assert check_replay_errors(raise_error=False) == 0


# routed_scaling_factor reaches the weights through a weights_fn (DeepSeek-V3) or replay_routing's
# float argument (DeepSeek-V2, DeepSeek-V4); each value other than the tiny model's
SCALE_CHANGES = [("deepseek_v3", 1.0), ("deepseek_v2", 2.0), ("deepseek_v4", 2.5)]


@needs_hf
@pytest.mark.parametrize(("arch", "scale"), [arch_param(a, c, id=a, replay=True) for a, c in SCALE_CHANGES])
def test_a_changed_rule_field_recompiles_once_and_never_per_step(arch, scale):
    """fullgraph torch.compile with replay attached: no graph break; new batches reuse the graph; a
    changed routed_scaling_factor recompiles once (dynamo guards on it) and the compiled model then
    equals an eager one built with the new value, replaying the same batches."""
    model = build_tiny_model(arch)
    reference = build_tiny_model(arch)  # the same weights, the new value from the start
    set_router_fields(reference, {"routed_scaling_factor": scale})
    x = tokens(2, 4, seed=13)
    replayer, ref_replayer = replayer_of(model), replayer_of(reference)
    rng = np.random.default_rng(12)
    batches = [distinct_rows(rng, 8, replayer.shape, live_fraction=0.25) for _ in range(4)]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with attach_replay(model, replayer), attach_replay(reference, ref_replayer), torch.no_grad():
        with CompileCounters() as first:
            for batch in batches[:2]:
                replayer.set_batch(batch)
                torch.testing.assert_close(compiled(x).logits, model(x).logits, rtol=0, atol=0)
        old_scale = model(x).logits  # the last batch at the old scale
        set_router_fields(model, {"routed_scaling_factor": scale})
        with CompileCounters() as changed:
            for batch in batches[1:]:
                replayer.set_batch(batch)
                ref_replayer.set_batch(batch)
                expected = reference(x).logits
                assert_close_scaled(compiled(x).logits, expected)
                if batch is batches[1]:
                    assert not torch.allclose(expected, old_scale), (
                        "the scale does nothing: the test proves nothing"
                    )
    torch._dynamo.reset()
    assert (first.graphs, first.graph_breaks) == (1, 0), first
    assert (changed.graphs, changed.graph_breaks) == (1, 0), changed
    assert any("routed_scaling_factor" in reason for reason in changed.recompile_reasons), changed


@needs_hf
def test_bad_replayers_raise_and_attach_nothing():
    model = build_tiny_model("deepseek_v3")
    cases = [
        (
            RoutingReplayer(RoutingShape(num_layers=3, num_experts=16, top_k=4), 4, "cpu"),
            r"replayer\.shape\.moe_layers",
        ),
        (RoutingReplayer(RoutingShape(2, 16, 2, moe_layers=(1, 2)), 4, "cpu"), r"replayer\.shape\.top_k=2"),
        (RoutingReplayer(RoutingShape(2, 32, 4, moe_layers=(1, 2)), 4, "cpu"), r"num_experts=32.*16 experts"),
    ]
    for replayer, match in cases:
        with pytest.raises(ValueError, match=match):
            attach_replay(model, replayer)
    with pytest.raises(TypeError, match="layer_ids"):
        attach_replay(model, RoutingCapturer(resolve_routing_shape(model.config), 4, "cpu"))
    with pytest.raises(ValueError, match="backend must be one of"):
        attach_replay(model, replayer_of(model), backend="cuda")
    dense = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1)
    )
    with pytest.raises(ValueError, match="attach_replay does not support model_type 'llama'"):
        attach_replay(dense, replayer_of(model))
    assert not any("forward" in m.__dict__ for m in model.modules())
    # a batch with more rows than the replayer holds fails at the router, naming both
    small = replayer_of(model, max_num_tokens=4)
    with attach_replay(model, small), pytest.raises(ValueError, match="has 6 rows, more than the replayer's"):
        model(tokens(2, 3, seed=0))


def test_a_reference_replayer_of_another_shape_raises():
    model = ReferenceMoEModel(REF)
    for shape, match in [
        (RoutingShape(2, 16, 2, moe_layers=(1, 2)), r"replayer\.shape\.top_k=2"),
        (RoutingShape(3, 16, 4), r"moe_layers=\(0, 1, 2\)"),
    ]:
        with pytest.raises(ValueError, match=match):
            attach_replay(model, RoutingReplayer(shape, 4, "cpu"))
    assert not any("router" in layer.mlp.__dict__ for layer in model.layers)


def test_replay_router_output_refuses_recorded_ids_of_another_shape():
    logits = torch.randn(4, 8)
    weights, ids = logits.softmax(-1).topk(3, -1)
    with pytest.raises(ValueError, match=r"recorded_ids must have live_ids' shape \(4, 3\).*got \(4, 2\)"):
        replay_router_output(logits, weights, ids, ids[:, :2], ReplayRule(RoutingMethod.DEFAULT))


@pytest.mark.parametrize("scale", [1e39, float("inf"), float("nan"), "2"])
def test_a_replay_rule_refuses_a_scale_the_kernels_cannot_hold(scale):
    """A routed_scaling_factor that is not finite in float32 would make every replayed weight inf,
    then zeroed and counted: ReplayRule refuses it when built, as route and replay_routing do."""
    with pytest.raises(ValueError, match="routed_scaling_factor must be"):
        ReplayRule(RoutingMethod.DEEPSEEK_V3, routed_scaling_factor=scale)
    assert ReplayRule(RoutingMethod.DEEPSEEK_V3, routed_scaling_factor=2.5).routed_scaling_factor == 2.5


def test_every_supported_architecture_has_a_replay_rule():
    assert set(REPLAY_RULES) == set(SUPPORTED_ARCHITECTURES)


# ---------------------------------------------------------------------------------------------------
# The reference model
# ---------------------------------------------------------------------------------------------------

REF = reference_config("tiny", max_requests=2, max_seq_len=16)


def reference_step(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randint(1, REF.vocab_size, (n,), generator=gen),
        torch.arange(n),
        torch.zeros(n, dtype=torch.int64),
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_reference_model_replays_recorded_ids(dtype):
    """Own ids: the same logits (float64: bit for bit, the weights are recomputed from the float64
    logits at the same ids; float32: replay_routing's weights equal route's to 1e-6). Moved gate:
    the experts get the recorded ids; a capture in the same forward records the replayed ids;
    gradients reach every gate."""
    model = ReferenceMoEModel(reference_config("tiny", max_requests=2, max_seq_len=16, dtype=dtype))
    shape = model.config.routing_shape()
    step = reference_step(6, seed=0)
    ref_logits, live = model(*step, return_router_ids=True)
    replayer = RoutingReplayer(shape, 8, "cpu")
    replayer.set_batch(live.numpy())
    with attach_replay(model, replayer) as handle:
        assert handle.arch == "reference" and handle.paths == ("layers.1.mlp", "layers.2.mlp")
        logits, ids = model(*step, return_router_ids=True)
        assert torch.equal(ids, live)
        if dtype == torch.float64:
            assert torch.equal(logits, ref_logits)
        else:
            assert_close_scaled(logits, ref_logits)
        gates = [layer.mlp.gate for layer in model.layers[1:]]
        with torch.no_grad():
            for g in gates:
                g.add_(
                    torch.randn(g.shape, generator=torch.Generator().manual_seed(1), dtype=g.dtype) * g.std()
                )
        replayer.set_batch(np.full((6, *live.shape[1:]), -1))
        _, moved = model(*step, return_router_ids=True)  # -1 rows: the moved gates' own routing
        assert not torch.equal(moved, live), "the perturbation changed no routing decision"
        recorded = distinct_rows(np.random.default_rng(7), 6, shape)
        replayer.set_batch(recorded)
        capturer = RoutingCapturer(shape, 8, "cpu")
        capturer.set_step([6])
        for g in gates:
            g.requires_grad_(True)
        logits, ids = model(*step, capturer=capturer, return_router_ids=True)
        logits.pow(2).mean().backward()
    assert torch.equal(ids, torch.from_numpy(recorded).to(torch.int32))
    assert torch.equal(capturer.buffer[:6], ids)
    assert all(g.grad.abs().max() > 0 for g in gates)
    assert not any("router" in layer.mlp.__dict__ for layer in model.layers)
    _, after = model(*step, return_router_ids=True)
    assert torch.equal(after, moved), "remove() must give the live routing back"


def test_the_reference_model_has_its_own_attach_path():
    """moe_ops.models.attach_replay attaches the reference model (and its torch.compile wrapper);
    moe_ops.attach_replay hands the reference model to it (one dispatch) and gives the same handle;
    it refuses a model that does not list its routers, before touching anything."""
    import moe_ops.models
    from moe_ops.attach.replaying import ReplayHandle
    from moe_ops.attach.sites import AttachHandle

    model = ReferenceMoEModel(REF)
    shape = model.config.routing_shape()
    replayer = RoutingReplayer(shape, 8, "cpu")
    step = reference_step(6, seed=3)
    recorded = distinct_rows(np.random.default_rng(4), 6, shape)
    replayer.set_batch(recorded)
    outputs = []
    for attach, target in [
        (moe_ops.models.attach_replay, model),
        (attach_replay, model),
        (moe_ops.models.attach_replay, torch.compile(model, backend="eager")),
    ]:
        with attach(target, replayer) as handle:
            assert type(handle) is ReplayHandle and isinstance(handle, AttachHandle)
            assert (handle.what, handle.arch, handle.layers) == ("replay", "reference", (1, 2))
            assert handle.paths == ("layers.1.mlp", "layers.2.mlp") and len(handle.rules) == 2
            assert all("router" in block.__dict__ for _, block in model.moe_blocks())
            outputs.append(model(*step, return_router_ids=True)[1])
        assert not any("router" in block.__dict__ for _, block in model.moe_blocks())
    expected = torch.from_numpy(recorded).to(torch.int32)
    assert all(torch.equal(ids, expected) for ids in outputs)
    with pytest.raises(TypeError, match=r"replay_routers\(\).*got Linear"):
        moe_ops.models.attach_replay(torch.nn.Linear(2, 2), replayer)
    with pytest.raises(TypeError, match="layer_ids"):
        moe_ops.models.attach_replay(model, object())
    assert not any("router" in block.__dict__ for _, block in model.moe_blocks())


# ---------------------------------------------------------------------------------------------------
# GPU: CUDA graphs
# ---------------------------------------------------------------------------------------------------


@needs_hf
@pytest.mark.gpu
@pytest.mark.parametrize(
    "arch",
    [arch_param(a, id=a, replay=True) for a in ("qwen3_moe", "deepseek_v3")]
    + [
        # transformers' DeepSeek-V4 forward builds its sliding-window mask with
        # torch.tensor(0.0, device=...) (masking_utils.eager_mask): a host-to-device copy that CUDA
        # graph capture refuses (H200, transformers 5.17) before any router runs - the model is
        # not capturable, whatever replays it
        pytest.param(
            "deepseek_v4",
            id="deepseek_v4",
            marks=pytest.mark.skip(reason="transformers' DeepSeek-V4 forward is not CUDA-graph capturable"),
        )
    ],
)
def test_gpu_cuda_graph_replays_each_batch_set_in_place(arch):
    """torch.cuda.graph around the eager model with replay attached: set_batch between replays is
    all it takes for the graph to replay the next batch (batched_mm experts: transformers' default
    grouped_mm reads expert offsets on the host for fp32 weights, which no graph can hold)."""
    model = build_tiny_model(arch, device="cuda", experts_implementation="batched_mm")
    shape = resolve_routing_shape(model.config)
    replayer = RoutingReplayer(shape, 8, "cuda")
    static_x = tokens(2, 4, seed=11).cuda()
    rng = np.random.default_rng(8)
    batches = [distinct_rows(rng, 8, shape, live_fraction=0.25) for _ in range(3)]
    with attach_replay(model, replayer), torch.no_grad():
        replayer.set_batch(batches[0])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: Triton compile, the fault counter, cuBLAS workspaces
                model(static_x, use_cache=False)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_logits = model(static_x, use_cache=False).logits
        outputs = []
        for batch in batches:
            replayer.set_batch(batch)
            graph.replay()
            eager, received = forward(model, static_x)
            torch.testing.assert_close(static_logits, eager)
            live_rows = (torch.from_numpy(batch) == -1).all(-1).cuda()
            assert torch.equal(received[~live_rows], torch.from_numpy(batch).cuda()[~live_rows])
            outputs.append(static_logits.clone())
    assert not torch.allclose(outputs[0], outputs[1]), "the graph replayed the first batch again"
    assert check_replay_errors(raise_error=False) == 0


# ---------------------------------------------------------------------------------------------------
# Recorded weights: attach_replay(..., weights="recorded")
# ---------------------------------------------------------------------------------------------------


@needs_hf
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_recorded_weights_reach_the_experts(arch):
    """The experts receive the rollout's weights on every recorded row, the router's own on a row
    of -1 and the computed ones where the record has no weights (NaN); the ids are the record's."""
    model = build_tiny_model(arch)
    shape = resolve_routing_shape(model.config)
    x = tokens(1, 6, seed=4)
    rng = np.random.default_rng(3)
    ids = distinct_rows(rng, 6, shape)
    weights = rng.integers(1, 128, size=ids.shape).astype(np.float32) / 128
    ids[5] = -1  # the last token: no record
    weights[5] = np.nan
    weights[2, 0] = np.nan  # a layer's record without weights
    replayer = RoutingReplayer(shape, 8, "cpu", weights_dtype=torch.float32)
    replayer.set_batch(ids, weights=weights)
    with attach_replay(model, replayer), ExpertsSpy(model) as computed_spy:
        model(x)
    with attach_replay(model, replayer, weights="recorded"), ExpertsSpy(model) as spy:
        model(x)
    for column, layer in enumerate(shape.moe_layers):
        got, expected_ids = spy.weights[layer][-1], spy.calls[layer][-1]
        assert torch.equal(expected_ids[:5], torch.from_numpy(ids[:5, column]).to(expected_ids.dtype))
        recorded = torch.from_numpy(weights[:5, column]).to(got.dtype)
        rows = [r for r in range(5) if not (r == 2 and column == 0)]
        assert torch.equal(got[rows], recorded[rows]), f"layer {layer}: not the recorded weights"
        if column == 0:  # the first MoE layer sees the same input in both runs (later ones do not)
            assert torch.equal(got[5:], computed_spy.weights[layer][-1][5:])  # -1 row: the router's own
            assert torch.equal(got[2], computed_spy.weights[layer][-1][2])  # NaN record: computed


def test_recorded_weights_need_a_replayer_that_keeps_them():
    model = ReferenceMoEModel(reference_config("tiny", num_layers=2))
    replayer = RoutingReplayer(model.config.routing_shape(), 8, "cpu")
    with pytest.raises(
        ValueError, match='weights="recorded" needs a replayer that keeps the recorded weights'
    ):
        attach_replay(model, replayer, weights="recorded")
    with pytest.raises(ValueError, match="weights must be one of 'computed', 'recorded'"):
        attach_replay(model, replayer, weights="rollout")
    assert not any("router" in vars(m) for m in model.modules()), "a refused attach left a wrapper"


@needs_hf
def test_a_replayer_whose_rows_return_a_pair_still_replays():
    """A replayer of one's own with ``rows(layer, n) -> (ids, row_count)`` (the pair RoutingReplayer
    returned before ``ReplayRows``) is read as before; only weights="recorded" asks for a third."""
    model = build_tiny_model("qwen3_moe")
    shape = resolve_routing_shape(model.config)
    inner = RoutingReplayer(shape, 8, "cpu")
    ids = distinct_rows(np.random.default_rng(1), 5, shape)
    inner.set_batch(ids)

    class PairReplayer:
        def __init__(self):
            self.shape, self.device = inner.shape, inner.device

        def layer_ids(self, layer, n, **kwargs):
            return inner.layer_ids(layer, n, **kwargs)

        def rows(self, layer, n, **kwargs):
            assert not kwargs, "asked for more than the pair"
            got, row_count, _ = inner.rows(layer, n)
            return got, row_count

    with attach_replay(model, PairReplayer()):
        _, routing = forward(model, tokens(1, 5, seed=1))
    assert torch.equal(routing, torch.from_numpy(ids).to(routing.dtype))
