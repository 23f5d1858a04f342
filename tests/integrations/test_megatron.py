"""moe_ops.integrations.megatron against the real megatron-core (the `megatron` extra).

On CPU every check goes through ``TopKRouter.routing`` as Megatron's own unit tests do (its
``forward`` moves the gate to CUDA), with Megatron's gate op (``router_gating_linear``) in front of
it so that the router weight's gradient is Megatron's own; the GPU tests run the whole router, an
``MoELayer``, a ``GPTModel`` with MTP layers and Megatron's schedule. Megatron's process groups are
real: a gloo (NCCL on a GPU) group of world size 1 and ``parallel_state.initialize_model_parallel``.
"""

from __future__ import annotations

import inspect
import traceback
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed (pip install 'moe-ops[megatron]')"
)

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.pipeline_parallel.schedules import (
    custom_backward,
    deallocate_output_tensor,
    set_current_microbatch,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe import router as megatron_router
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import router_gating_linear
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from megatron.core.transformer.transformer_config import TransformerConfig
from strategies import MegatronRouterCase, distinct_rows, megatron_router_cases

from benchmarks.cases import BENCH_CASES
from moe_ops import GroupScore, RoutingCapturer, RoutingMethod, RoutingReplayer, RoutingShape
from moe_ops.attach.replaying import replay_routing_rule
from moe_ops.integrations import megatron as mg
from moe_ops.replay import check_replay_errors
from moe_ops.router.methods import BIAS_METHODS

HIDDEN = 16
HAVE_TE_ROUTER_FUSION = (
    getattr(moe_utils, "HAVE_TE", False) and moe_utils.fused_topk_with_score_function is not None
)
ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64, None: torch.bfloat16}
# Megatron's score functions run in float32 whatever the router dtype (softmax(..., dtype=float32),
# sigmoid(x.float())): weights and the logits' gradient agree to float32 rounding (a few ulps:
# replay_routing's kernels vs Megatron's ops, and the order of the top-k columns) for float32 and
# float64 routers, to two bf16 ulps for bf16 routers (one rounding of float32 values that differ in
# their last bits). The gate's gradient sums over tokens; in bf16 Megatron's gate backward
# accumulates in bf16.
PROB_TOL = {torch.float64: dict(rtol=1e-5, atol=1e-6), torch.float32: dict(rtol=1e-5, atol=1e-6)}
PROB_TOL[torch.bfloat16] = dict(rtol=1.6e-2, atol=1.6e-2)
GRAD_TOL = {torch.float64: dict(rtol=1e-4, atol=1e-5), torch.float32: dict(rtol=1e-4, atol=1e-5)}
GRAD_TOL[torch.bfloat16] = dict(rtol=5e-2, atol=5e-2)

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


@pytest.fixture(scope="module", autouse=True)
def model_parallel(tmp_path_factory):
    """A real process group of world size 1 and Megatron's model-parallel state over it."""
    import torch.distributed as dist

    created = False
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        store = tmp_path_factory.mktemp("megatron") / "store"
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
        created = True
    elif dist.get_world_size() != 1:
        pytest.skip("these tests need a process group of world size 1")
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    parallel_state.initialize_model_parallel(1, 1)
    # megatron-core 0.16.1 without Transformer Engine: router_gating_linear (every TopKRouter's
    # gate) reads the name te_general_gemm, which moe_utils defines only when TE imports, so the
    # gate raises NameError before its own `te_general_gemm is not None` check can pick the torch.mm
    # branch. Binding the name to None is that branch, as Megatron intends it (RL frameworks on
    # 0.16 do the same); with TE installed nothing is changed.
    unbound = not hasattr(moe_utils, "te_general_gemm")
    if unbound:
        moe_utils.te_general_gemm = None
    # Megatron compiles TopKRouter._apply_expert_bias (jit_fuser = torch.compile) and guards on the
    # router instance: one ~3 s CPU compile per router built here. Dynamo off runs it eagerly (the
    # same two ops); nothing of moe-ops is compiled in this module.
    with torch._dynamo.config.patch(disable=True):
        yield
    if unbound:
        del moe_utils.te_general_gemm
    parallel_state.destroy_model_parallel()
    if created:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def clean_state():
    """No fault count, no RouterReplay instance and no moe-ops dispatcher carried between tests."""
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        check_replay_errors(device, raise_error=False)
    RouterReplay.global_router_replay_instances.clear()
    yield
    RouterReplay.global_router_replay_instances.clear()
    original = mg.routers._megatron().original
    assert megatron_router.topk_routing_with_score_function is original, "a handle leaked"


# ---------------------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------------------


def make_config(num_layers: int = 1, **fields) -> TransformerConfig:
    base = dict(
        num_layers=num_layers,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_aux_loss_coeff=0.0,
        add_bias_linear=False,
        use_cpu_initialization=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformerConfig(**{**base, **fields})


def build_router(
    fields: dict, *, layer_number: int = 1, seed: int = 0, device: str = "cpu", num_layers: int | None = None
) -> TopKRouter:
    """A real TopKRouter, its gate (and expert bias) drawn from ``seed``.

    On a CPU-only torch ``TopKRouter.__init__`` cannot create the expert-bias buffers (it allocates
    them on ``torch.cuda.current_device()``): the router is built without them and they are
    registered exactly as ``__init__`` registers them, on the CPU.
    """
    bias = bool(fields.get("moe_router_enable_expert_bias"))
    on_cpu = device == "cpu" and not torch.cuda.is_available()
    config = make_config(
        num_layers or layer_number, **{**fields, "moe_router_enable_expert_bias": bias and not on_cpu}
    )
    pg = ProcessGroupCollection.use_mpu_process_groups()
    router = TopKRouter(config, pg_collection=pg)
    router.set_layer_number(layer_number)
    num_experts = config.num_moe_experts
    gen = torch.Generator().manual_seed(seed % 2**31)
    with torch.no_grad():
        router.weight.copy_(torch.randn(num_experts, HIDDEN, generator=gen))
    if bias:
        values = 0.3 * torch.randn(num_experts, generator=gen)
        if on_cpu:
            config.moe_router_enable_expert_bias = True
            router.enable_expert_bias = True
            del router.local_tokens_per_expert, router.expert_bias  # None attributes of the CPU build
            router.register_buffer("local_tokens_per_expert", torch.zeros(num_experts), persistent=False)
            router.register_buffer("expert_bias", values)
        else:
            with torch.no_grad():
                router.expert_bias.copy_(values)
    return router.to(device)


def case_router(case: MegatronRouterCase, device: str = "cpu") -> TopKRouter:
    return build_router(case.config_kwargs(), seed=case.seed, device=device)


def replayer_for(router_or_config, rows: np.ndarray, *, device="cpu", mtp_rows=None, num_mtp_layers=0):
    """A RoutingReplayer of a one-layer (or the model's) shape holding ``rows`` ((n, layers, k))."""
    config = getattr(router_or_config, "config", router_or_config)
    replayer = RoutingReplayer(mg.routing_shape(config), rows.shape[0], device, num_mtp_layers=num_mtp_layers)
    replayer.set_batch(rows, mtp_routing=mtp_rows)
    return replayer


def map_ids(routing_map: torch.Tensor, top_k: int) -> torch.Tensor:
    """(n, top_k) ascending expert ids of a routing map with top_k True per row (from nonzero, not
    from the code under test)."""
    rows, experts = routing_map.nonzero(as_tuple=True)
    assert torch.equal(rows, torch.arange(routing_map.shape[0]).repeat_interleave(top_k).to(rows.device))
    return experts.view(-1, top_k)


def run_router(router: TopKRouter, x: torch.Tensor, grad_out: torch.Tensor, *, forward: bool = False):
    """Megatron's gate and routing of ``x`` ([s, b, hidden]); backward of ``sum(probs * grad_out)``.

    Returns probs, routing map, the logits' gradient, the gate's gradient and the expert-bias token
    counts this call added (None without expert bias). ``forward``: the router's whole forward
    (CUDA only: it moves a CPU gate to the current device).
    """
    router.zero_grad(set_to_none=True)
    counts = None if router.local_tokens_per_expert is None else router.local_tokens_per_expert.clone()
    if forward:
        seen: list[torch.Tensor] = []
        routing = router.routing

        def keep_logits(logits, padding_mask=None):  # the gate's output, to read its gradient
            logits.retain_grad()
            seen.append(logits)
            return routing(logits, padding_mask=padding_mask)

        router.routing = keep_logits
        try:
            probs, routing_map = router(x)
        finally:
            del router.routing
        logits = seen[0]
    else:
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(router.config.moe_router_dtype, x.dtype)
        logits = router_gating_linear(x, router.weight, None, dtype)
        logits.retain_grad()
        probs, routing_map = router.routing(logits)
    (probs.float() * grad_out).sum().backward()
    logits_grad = logits.grad.reshape(-1, logits.shape[-1])
    if counts is not None:
        counts = router.local_tokens_per_expert - counts
    return SimpleNamespace(
        probs=probs.detach(),
        map=routing_map,
        logits_grad=logits_grad,
        weight_grad=router.weight.grad.clone(),
        counts=counts,
    )


def case_inputs(case: MegatronRouterCase, device: str = "cpu"):
    gen = torch.Generator().manual_seed(case.seed % 2**31 + 1)
    act = torch.bfloat16 if case.router_dtype is None else torch.float32
    x = torch.randn(case.seq_len, case.batch, HIDDEN, generator=gen).to(device, act)
    grad_out = torch.randn(case.n, case.num_experts, generator=gen).to(device)
    return x, grad_out


def megatron_replay(router: TopKRouter, target: torch.Tensor) -> RouterReplay:
    """Megatron's own RouterReplay on ``router``, replaying ``target`` ((n, top_k) int64)."""
    replay = RouterReplay()
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    replay.set_target_indices(target)
    router.router_replay = replay
    return replay


def rule_live_ids(router: TopKRouter, logits: torch.Tensor) -> torch.Tensor:
    """(n, top_k) int64 - what the hook's rule routes a row of -1 to (``live_rows="rule"``):
    ``replay_routing`` of rows of -1 under the router's rule, ascending (a map has no order)."""
    rule = mg.replay_rule(router.config, logits.dtype)
    bias = router.expert_bias if rule.method in BIAS_METHODS else None
    no_record = torch.full((logits.shape[0], router.topk), -1, dtype=torch.int32, device=logits.device)
    return replay_routing_rule(logits.detach(), no_record, rule, bias=bias)[1].sort(1).values


def router_logits(router: TopKRouter, x: torch.Tensor) -> torch.Tensor:
    """The gate's logits of ``x``, (n, num_experts), as ``run_router`` computes them."""
    dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(router.config.moe_router_dtype, x.dtype)
    return router_gating_linear(x, router.weight, None, dtype).reshape(-1, router.config.num_moe_experts)


def compare_with_megatron_replay(
    case: MegatronRouterCase, device: str = "cpu", forward: bool = False, live_rows: str = "router"
):
    """The check of the issue: on the rows moe-ops replays, its ids, weights and router gradients
    equal Megatron's RouterReplay's. The other rows (-1, faulty): with ``live_rows="router"`` the
    router's own output, bit for bit; with "rule" the rule's live routing (``rule_live_ids``),
    weights and gradients equal to Megatron's RouterReplay of the ids the hook returned - except
    groups no moe-ops rule routes (softmax, sigmoid top-1 without a bias), routed as "router" does."""
    router = case_router(case, device)
    x, grad_out = case_inputs(case, device)
    k = case.top_k
    live = run_router(router, x, grad_out, forward=forward)
    recorded = case.recorded()
    replayed = case.replayed_rows().to(device)
    target = torch.where(
        replayed[:, None], torch.from_numpy(recorded).long().to(device), map_ids(live.map, k)
    )
    replay = megatron_replay(router, target)
    ref = run_router(router, x, grad_out, forward=forward)
    assert torch.equal(map_ids(ref.map, k)[replayed], target[replayed].sort(1).values)  # Megatron replayed
    replay.clear_router_replay_action()  # the router's own routing again, under moe-ops' hook
    replayer = replayer_for(router, recorded[:, None, :], device=device)
    with mg.attach_replay(router, replayer, live_rows=live_rows):
        ours = run_router(router, x, grad_out, forward=forward)
    assert check_replay_errors(device, raise_error=False) == case.faulty_rows
    assert router.router_replay is replay
    dtype = ROUTER_DTYPES[case.router_dtype]
    assert ours.probs.dtype == ref.probs.dtype == dtype
    assert torch.equal(ours.map[replayed], ref.map[replayed])
    torch.testing.assert_close(ours.probs[replayed], ref.probs[replayed], **PROB_TOL[dtype])
    # groups no moe-ops rule routes (softmax with groups; sigmoid top-1 without a bias, with groups):
    # the hook takes the router's own output for every row, as live_rows="router" does
    grouped_without_rule = bool(case.group_topk) and mg.replay_rule(router.config).n_group is None
    as_router = live_rows == "router" or grouped_without_rule
    if not as_router:
        # the -1 and faulty rows: the rule's live routing; every row's weights and the gradients
        # are Megatron's RouterReplay's of the ids the hook returned
        expected = rule_live_ids(router, router_logits(router, x))
        assert torch.equal(map_ids(ours.map, k)[~replayed], expected[~replayed])
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        replay.set_target_indices(map_ids(ours.map, k))
        ref = run_router(router, x, grad_out, forward=forward)
        replay.clear_router_replay_action()
        assert torch.equal(ours.map, ref.map)
        torch.testing.assert_close(ours.probs, ref.probs, **PROB_TOL[dtype])
    else:
        assert torch.equal(ours.map[~replayed], live.map[~replayed])
        assert torch.equal(ours.probs[~replayed], live.probs[~replayed])  # bit for bit
    torch.testing.assert_close(ours.logits_grad, ref.logits_grad, **GRAD_TOL[dtype])
    torch.testing.assert_close(ours.weight_grad, ref.weight_grad, **GRAD_TOL[dtype])
    if case.expert_bias:  # Megatron counts the tokens each expert got, replayed ones included
        assert torch.equal(ours.counts, ref.counts)
    return router, ours, ref, live


# ---------------------------------------------------------------------------------------------------
# Replay against Megatron's RouterReplay
# ---------------------------------------------------------------------------------------------------


@settings(max_examples=60)
@given(case=megatron_router_cases(), live_rows=st.sampled_from(mg.attach.LIVE_ROWS))
def test_replay_matches_megatron_router_replay(case, live_rows):
    compare_with_megatron_replay(case, live_rows=live_rows)


@pytest.mark.parametrize("router_dtype", ["fp32", "fp64", None])
def test_every_score_function_replays_each_configuration(router_dtype):
    """One fixed case per branch of Megatron's routing (the property test draws them at random)."""
    branches = [
        dict(score_function="softmax", pre_softmax=False, top_k=2),
        dict(score_function="softmax", pre_softmax=True, top_k=2, scaling=2.5),
        dict(score_function="softmax", pre_softmax=True, top_k=1),
        dict(score_function="softmax", pre_softmax=False, top_k=4, num_groups=4, group_topk=2),
        dict(score_function="sigmoid", top_k=1),
        dict(score_function="sigmoid", top_k=3, scaling=2.5),
        dict(score_function="sigmoid", top_k=4, expert_bias=True, num_groups=4, group_topk=2, scaling=2.5),
        dict(score_function="sigmoid", top_k=1, expert_bias=True, scaling=2.5),
        # a share of 3 keys per group score (top_k // group_topk): not DeepSeek-V3's two
        dict(score_function="sigmoid", top_k=6, expert_bias=True, num_groups=4, group_topk=2),
        # groups no moe-ops method routes: the -1 rows take the router's own output under "rule" too
        dict(score_function="sigmoid", top_k=1, num_groups=4, group_topk=2),
    ]
    for i, branch in enumerate(branches):
        fields = dict(pre_softmax=False, scaling=None, expert_bias=False, num_groups=None, group_topk=None)
        fields.update(branch)
        kinds = ["recorded", "live", "recorded", "recorded", "live", "recorded"]
        if branch["top_k"] >= 2:
            kinds += ["repeated", "partial"]
        case = MegatronRouterCase(
            num_experts=16,
            router_dtype=router_dtype,
            seq_len=len(kinds) // 2,
            batch=2,
            kinds=kinds,
            seed=i,
            **fields,
        )
        for live_rows in mg.attach.LIVE_ROWS:
            compare_with_megatron_replay(case, live_rows=live_rows)


@pytest.mark.parametrize("router_dtype", ["fp32", None])
def test_rule_routes_rows_without_a_record_as_megatron_does(router_dtype):
    """``live_rows="rule"``: a row of -1 gets Megatron's own experts (every branch the rule routes),
    compared on the rows where Megatron's selection keys - rounded as Megatron rounds them (bf16
    routers: the scores in bf16) - and group scores are pairwise distinct: a tie is broken by
    index in moe-ops and by ``torch.topk`` in Megatron, and a bf16 router's keys tie often.
    Groups the rule does not route (sigmoid top-1 without bias) take the router's own output."""
    branches = [
        dict(moe_router_score_function="softmax", moe_router_topk=2),
        dict(moe_router_score_function="softmax", moe_router_pre_softmax=True, moe_router_topk=3),
        dict(moe_router_score_function="sigmoid", moe_router_topk=1),
        dict(moe_router_score_function="sigmoid", moe_router_topk=4, moe_router_topk_scaling_factor=2.5),
        dict(
            moe_router_score_function="sigmoid", moe_router_topk=4, moe_router_enable_expert_bias=True,
            moe_router_num_groups=4, moe_router_group_topk=2,
        ),
        dict(moe_router_score_function="sigmoid", moe_router_topk=1, moe_router_enable_expert_bias=True),
        dict(
            moe_router_score_function="sigmoid", moe_router_topk=1, moe_router_num_groups=4,
            moe_router_group_topk=2,
        ),
    ]  # fmt: skip
    dtype = ROUTER_DTYPES[router_dtype]
    for seed, fields in enumerate(branches):
        router = build_router({**fields, "num_moe_experts": 16, "moe_router_dtype": router_dtype}, seed=seed)
        k = router.topk
        logits = (torch.randn(64, 16, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)
        live_probs, live_map = router.routing(logits)
        replayer = replayer_for(router, np.full((64, 1, k), -1, dtype=np.int32))
        with mg.attach_replay(router, replayer):
            probs, routing_map = router.routing(logits)
        assert check_replay_errors("cpu", raise_error=False) == 0
        if (
            fields.get("moe_router_group_topk")
            and fields.get("moe_router_score_function") == "sigmoid"
            and k == 1
        ):
            assert torch.equal(routing_map, live_map) and torch.equal(probs, live_probs)  # the router's own
            continue
        if fields["moe_router_score_function"] == "softmax":
            keys = (
                logits.float()
                if not fields.get("moe_router_pre_softmax")
                else torch.softmax(logits.float(), -1).to(dtype).float()
            )
        else:
            keys = torch.sigmoid(logits.float()).to(dtype).float()
        if router.expert_bias is not None:
            keys = keys + router.expert_bias
        distinct = keys.sort(1).values.diff(dim=1).ne(0).all(1)
        if router.config.moe_router_group_topk:
            share = k // router.config.moe_router_group_topk
            groups = keys.view(64, 4, -1).topk(share, dim=-1).values.sum(-1)
            distinct &= groups.sort(1).values.diff(dim=1).ne(0).all(1)
        assert distinct.sum() >= (60 if router_dtype else 16), fields  # the comparison covers rows
        assert torch.equal(routing_map[distinct], live_map[distinct]), fields
        torch.testing.assert_close(probs[distinct], live_probs[distinct], **PROB_TOL[dtype])


@pytest.mark.parametrize("live_rows", ["rule", "router"])
@pytest.mark.parametrize("router_dtype", ["fp32", None])
def test_recorded_weights_are_the_probs_and_the_rules_gradient(live_rows, router_dtype):
    """weights="recorded": each recorded row's probs are the rollout's weights (in the router's
    dtype), a row without recorded weights (NaN) or without a record (-1) keeps the computed probs,
    and the logits' gradient is the computed mode's (straight-through), for a method rule (fp32)
    and Megatron's own ops (bf16)."""
    (case,) = [c for c in BENCH_CASES["train"] if c.framework == "megatron"]
    fields = dict(
        moe_router_score_function="sigmoid", moe_router_topk=case.top_k, num_moe_experts=case.num_experts,
        moe_router_topk_scaling_factor=case.scale, moe_router_enable_expert_bias=case.expert_bias,
        moe_router_num_groups=case.num_groups, moe_router_group_topk=case.group_topk,
        moe_router_dtype=router_dtype,
    )  # fmt: skip
    router = build_router(fields, seed=5)
    rng = np.random.default_rng(5)
    n = 8
    ids = distinct_rows(rng, n, mg.routing_shape(router.config))
    weights = rng.integers(1, 128, size=ids.shape).astype(np.float32) / 128  # exact in bf16
    ids[7], weights[7] = -1, np.nan
    weights[3] = np.nan
    dtype = ROUTER_DTYPES[router_dtype]
    x = torch.randn(4, 2, HIDDEN, generator=torch.Generator().manual_seed(6)).to(
        torch.float32 if router_dtype else torch.bfloat16
    )
    grad_out = torch.randn(n, case.num_experts, generator=torch.Generator().manual_seed(7))
    replayer = RoutingReplayer(mg.routing_shape(router.config), n, "cpu", weights_dtype=torch.float32)
    replayer.set_batch(ids, weights=weights)
    with mg.attach_replay(router, replayer, live_rows=live_rows):
        computed = run_router(router, x, grad_out)
    with mg.attach_replay(router, replayer, live_rows=live_rows, weights="recorded"):
        ours = run_router(router, x, grad_out)
    assert torch.equal(ours.map, computed.map)
    k_ids = torch.from_numpy(ids[:, 0]).long()
    recorded = torch.from_numpy(weights[:, 0]).to(dtype)
    rows = [0, 1, 2, 4, 5, 6]
    assert torch.equal(ours.probs[rows].gather(1, k_ids[rows]), recorded[rows])
    assert torch.equal(ours.probs[[3, 7]], computed.probs[[3, 7]])
    torch.testing.assert_close(ours.logits_grad, computed.logits_grad, rtol=0, atol=1e-6)
    assert check_replay_errors("cpu", raise_error=False) == 0


def test_recorded_weights_need_a_replayer_that_keeps_them_megatron():
    router = build_router({})
    replayer = RoutingReplayer(mg.routing_shape(router.config), 4, "cpu")
    with pytest.raises(
        ValueError, match='weights="recorded" needs a replayer that keeps the recorded weights'
    ):
        mg.attach_replay(router, replayer, weights="recorded")
    with pytest.raises(ValueError, match="live_rows must be one of"):
        mg.attach_replay(router, replayer, live_rows="live")
    assert router.router_replay is None


@pytest.mark.parametrize("live_rows", ["rule", "router"])
def test_bench_train_router_replays_like_megatron(live_rows):
    """The train benchmark's Megatron router (DeepSeek-V3-like: sigmoid, expert bias, 8 groups keep
    4, scale 2.5, 64 experts, top-8, fp32 router) replays as Megatron's RouterReplay does."""
    (case,) = [c for c in BENCH_CASES["train"] if c.framework == "megatron"]
    kinds = ["recorded"] * 9 + ["live", "repeated", "partial"]
    bench = MegatronRouterCase(
        score_function="sigmoid", pre_softmax=False, top_k=case.top_k, num_experts=case.num_experts,
        scaling=case.scale, expert_bias=case.expert_bias, num_groups=case.num_groups,
        group_topk=case.group_topk, router_dtype="fp32", seq_len=6, batch=2, kinds=kinds, seed=3,
    )  # fmt: skip
    compare_with_megatron_replay(bench, live_rows=live_rows)


def test_rule_table():
    """Each Megatron configuration maps to the moe-ops method of docs/megatron.md's table, with
    Megatron's own operations (weights_fn) exactly where no method computes its rule."""
    f32, f64, bf16 = torch.float32, torch.float64, torch.bfloat16
    M = RoutingMethod
    table = [
        # (config fields, logits dtype) -> (method, weights_fn used, n_group, routed_scaling_factor)
        (dict(moe_router_score_function="softmax"), f32, (M.RENORMALIZE, False, None, None)),
        (dict(moe_router_score_function="softmax"), bf16, (M.RENORMALIZE, False, None, None)),
        (dict(moe_router_score_function="softmax"), f64, (M.RENORMALIZE, False, None, None)),
        (dict(moe_router_score_function="sigmoid"), f64, (M.DEEPSEEK_V3, True, None, None)),
        (
            dict(moe_router_score_function="softmax", moe_router_pre_softmax=True),
            f32,
            (M.DEFAULT, False, None, None),
        ),
        (
            dict(
                moe_router_score_function="softmax",
                moe_router_pre_softmax=True,
                moe_router_topk_scaling_factor=2.0,
            ),
            f32,
            (M.DEFAULT, True, None, None),
        ),
        (dict(moe_router_score_function="sigmoid"), f32, (M.DEEPSEEK_V3, False, None, None)),
        (dict(moe_router_score_function="sigmoid"), bf16, (M.DEEPSEEK_V3, True, None, None)),
        (
            dict(moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5),
            f32,
            (M.DEEPSEEK_V3, False, None, 2.5),
        ),
        (dict(moe_router_score_function="sigmoid", moe_router_topk=1), f32, (M.SIGMOID, False, None, None)),
        (
            dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_topk=1),
            f32,
            (M.DEEPSEEK_V3, True, None, None),
        ),
        (
            dict(
                moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True,
                moe_router_num_groups=4,
                moe_router_group_topk=2,
            ),
            f32,
            (M.DEEPSEEK_V3, False, 4, None),
        ),
        (
            dict(moe_router_score_function="softmax", moe_router_num_groups=4, moe_router_group_topk=2),
            f32,
            (M.RENORMALIZE, False, None, None),
        ),
    ]
    for fields, dtype, (method, uses_fn, n_group, scale) in table:
        rule = mg.replay_rule(make_config(**fields), dtype)
        got = (rule.method, rule.weights_fn is not None, rule.n_group, rule.routed_scaling_factor)
        assert got == (method, uses_fn, n_group, scale), (fields, dtype)
    # groups are scored by Megatron's share rule (group_limited_topk), live rows too
    grouped = dict(moe_router_num_groups=4, moe_router_group_topk=2, moe_router_enable_expert_bias=True)
    rule = mg.replay_rule(make_config(moe_router_score_function="sigmoid", **grouped), f32)
    assert rule.group_score == GroupScore.TOPK_SHARE_SUM
    # the logits' dtype defaults to moe_router_dtype, else the parameters'
    config = make_config(moe_router_score_function="sigmoid", moe_router_dtype="fp64")
    assert mg.replay_rule(config).weights_fn is not None
    config = make_config(moe_router_score_function="sigmoid", params_dtype=torch.bfloat16, bf16=True)
    assert mg.replay_rule(config).weights_fn is not None


def test_row_count_must_match_the_batch():
    router = build_router({})
    replayer = replayer_for(router, np.tile(np.array([[[0, 1]]], dtype=np.int32), (6, 1, 1)))
    with mg.attach_replay(router, replayer), pytest.raises(ValueError, match="has 4 rows but the batch set"):
        router.routing(torch.randn(2, 2, 8))


def test_no_batch_set_is_refused_and_an_empty_batch_routes_live():
    router = build_router({})
    shape = mg.routing_shape(router.config)
    replayer = RoutingReplayer(shape, 8, "cpu")
    logits = torch.randn(3, 1, 8)
    live = router.routing(logits)
    with mg.attach_replay(router, replayer):
        with pytest.raises(ValueError, match="no batch was set"):
            router.routing(logits)
        replayer.set_batch(np.full((3, 1, 2), -1, dtype=np.int32))
        probs, routing_map = router.routing(logits)
    assert torch.equal(probs, live[0]) and torch.equal(routing_map, live[1])


# ---------------------------------------------------------------------------------------------------
# Fusion: the hook sits above the fused return
# ---------------------------------------------------------------------------------------------------


@pytest.mark.skipif(HAVE_TE_ROUTER_FUSION, reason="with Transformer Engine the GPU test runs the fused path")
def test_fused_routing_reaches_the_hook_where_megatrons_router_replay_is_bypassed():
    """Without Transformer Engine the fused kernel cannot run (it is CUDA-only; there is no CPU
    fused path at all), so this shows the placement: Megatron's router passes fused= and its
    RouterReplay to the one function moe-ops hooks, whose fused branch returns before RouterReplay
    acts; a fused call of an attached router runs through the moe-ops hook before that branch. With
    ``live_rows="rule"`` the hook never calls the router's own routing, so a fused router replays
    here too (no Transformer Engine needed)."""
    routing_source = inspect.getsource(TopKRouter.routing)
    assert "topk_routing_with_score_function(" in routing_source
    assert "fused=self.config.moe_router_fusion" in routing_source
    assert "router_replay=self.router_replay" in routing_source
    topk_source = inspect.getsource(moe_utils.topk_routing_with_score_function)
    assert topk_source.index("if fused:") < topk_source.index("router_replay.get_replay_topk")

    router = build_router(dict(moe_router_fusion=True))
    logits = torch.randn(3, 2, 8)
    megatron_replay(router, torch.tensor([[0, 1]] * 6))
    with pytest.raises(ValueError, match="fused_topk_with_score_function is not available") as megatron_only:
        router.routing(logits)
    frames = [f.name for f in traceback.extract_tb(megatron_only.tb)]
    assert "get_replay_topk" not in frames and frames[-1] == "topk_routing_with_score_function"

    router.router_replay.clear_router_replay_action()
    replayer = replayer_for(router, np.tile(np.array([[[0, 1]]], dtype=np.int32), (6, 1, 1)))
    with (
        mg.attach_replay(router, replayer, live_rows="router"),
        pytest.raises(ValueError, match="not available") as attached,
    ):
        router.routing(logits)
    ours = [(f.name, f.filename) for f in traceback.extract_tb(attached.tb)]
    names = [name for name, _ in ours]
    assert (
        names.index("_dispatch") < names.index("__call__") < names.index("topk_routing_with_score_function")
    )
    hooks = mg.attach.__file__  # the dispatcher and the hooks' module
    assert all(file == hooks for name, file in ours if name in ("_dispatch", "__call__", "routed"))
    with mg.attach_replay(router, replayer):  # live_rows="rule": the fused branch is never reached
        _, routing_map = router.routing(logits)
    assert torch.equal(map_ids(routing_map, 2), torch.tensor([[0, 1]] * 6))


# ---------------------------------------------------------------------------------------------------
# Models: layer numbering, dense and MTP layers, pipeline stages
# ---------------------------------------------------------------------------------------------------


def build_gpt(moe_layer_freq=(0, 1, 1), mtp_num_layers: int = 2, device: str = "cpu", **fields) -> GPTModel:
    config = make_config(
        num_layers=len(moe_layer_freq),
        moe_layer_freq=list(moe_layer_freq),
        mtp_num_layers=mtp_num_layers or None,
        moe_router_dtype="fp32",
        **fields,
    )
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if mtp_num_layers else None
    return GPTModel(config, spec, vocab_size=64, max_sequence_length=32, mtp_block_spec=mtp).to(device)


def record(rng, n: int, layers: int, num_experts: int, top_k: int) -> np.ndarray:
    """(n, layers, top_k) int32 rows of distinct experts."""
    shape = RoutingShape(num_layers=layers, num_experts=num_experts, top_k=top_k)
    return distinct_rows(rng, n, shape).astype(np.int32)


def test_mtp_layers_read_their_own_rows_and_route_live_without_them():
    """Megatron numbers an MTP layer's transformer layer after the decoder's (0.16: num_layers + i
    + 1; other releases restart at 1, aliasing decoder layer i): keyed by layer number alone MTP
    layer i reads another layer's rows, or none. Each router here reads its own (kind, index)."""
    model = build_gpt()
    routers = mg.find_routers(model)
    assert [(r.kind, r.index) for r in routers] == [("decoder", 1), ("decoder", 2), ("mtp", 0), ("mtp", 1)]
    assert [r.module.layer_number for r in routers] == [2, 3, 4, 5]  # what Megatron 0.16.1 numbers them
    assert routers[2].path == "mtp.layers.0.transformer_layer.mlp.router"
    shape = mg.routing_shape(model.config)
    assert shape.moe_layers == (1, 2) and shape.num_model_layers == 3
    rng = np.random.default_rng(0)
    n, k = 6, 2
    decoder_rows = record(rng, n, 2, 8, k)
    mtp_rows = record(rng, n, 2, 8, k)
    mtp_rows[:, 0] = (decoder_rows[:, 0] + 4) % 8  # MTP layer 0 differs from decoder layer 0 ...
    mtp_rows[:, 1] = (decoder_rows[:, 1] + 4) % 8  # ... and 1 in every row
    logits = {r.path: torch.randn(3, 2, 8) for r in routers}
    live = {r.path: r.module.routing(logits[r.path]) for r in routers}
    replayer = RoutingReplayer(shape, n, "cpu", num_mtp_layers=2)
    with mg.attach_replay(model, replayer) as handle:
        assert handle.layers == (("decoder", 1), ("decoder", 2), ("mtp", 0), ("mtp", 1))
        replayer.set_batch(decoder_rows, mtp_routing=mtp_rows)
        for r, expected in zip(routers, [*decoder_rows.transpose(1, 0, 2), *mtp_rows.transpose(1, 0, 2)]):
            _, routing_map = r.module.routing(logits[r.path])
            assert torch.equal(map_ids(routing_map, k), torch.from_numpy(np.sort(expected, axis=1)).long()), r
        replayer.set_batch(decoder_rows)  # no MTP rows: the MTP layers route live
        for r in routers[2:]:
            probs, routing_map = r.module.routing(logits[r.path])
            assert torch.equal(probs, live[r.path][0]) and torch.equal(routing_map, live[r.path][1])
    assert check_replay_errors("cpu", raise_error=False) == 0


def test_pipeline_stage_routers_read_their_global_layers():
    """A pipeline stage holds layers with global layer numbers: a stage of decoder layers 3 and 4
    (1-based 4, 5) reads columns 3 and 4 of the model's shape. MoE layers built as Megatron's tests
    build them, numbered by set_layer_number as their TransformerLayer numbers them."""
    config = make_config(num_layers=6, moe_router_dtype="fp32")
    spec = get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False)
    stage = nn.ModuleList([MoELayer(config, spec.submodules.mlp.submodules) for _ in range(2)])
    for i, layer in enumerate(stage):
        layer.set_layer_number(4 + i)
    routers = mg.find_routers(stage)
    assert [(r.kind, r.index, r.path) for r in routers] == [
        ("decoder", 3, "0.router"),
        ("decoder", 4, "1.router"),
    ]
    rows = record(np.random.default_rng(1), 4, 6, 8, 2)
    replayer = replayer_for(config, rows)
    with mg.attach_replay(stage, replayer):
        for layer, column in zip(stage, (3, 4)):
            _, routing_map = layer.router.routing(torch.randn(4, 1, 8))
            assert torch.equal(map_ids(routing_map, 2), torch.from_numpy(np.sort(rows[:, column], 1)).long())
    # virtual-pipeline chunks: a list of modules, each router's path names its chunk
    chunks = mg.find_routers([stage[0], stage[1]])
    assert [(r.index, r.path) for r in chunks] == [(3, "chunk0.router"), (4, "chunk1.router")]


def test_routing_shape_is_the_models_routers():
    for freq in ([1, 0, 1, 1], 2, 1, [0, 0, 1, 0]):
        num_layers = len(freq) if isinstance(freq, list) else 4
        flags = freq if isinstance(freq, list) else [1 if i % freq == 0 else 0 for i in range(num_layers)]
        model = build_gpt(moe_layer_freq=flags, mtp_num_layers=0)
        model.config.moe_layer_freq = freq  # the int form Megatron's spec builder also reads
        shape = mg.routing_shape(model.config)
        assert shape.moe_layers == tuple(r.index for r in mg.find_routers(model)), freq
        assert (shape.num_model_layers, shape.num_experts, shape.top_k) == (num_layers, 8, 2)
    with pytest.raises(ValueError, match="num_moe_experts must be a positive int"):
        mg.routing_shape(make_config(num_moe_experts=None))
    with pytest.raises(ValueError, match="moe_layer_freq must be a positive int or num_layers=2 flags"):
        mg.routing_shape(
            SimpleNamespace(num_layers=2, num_moe_experts=8, moe_router_topk=2, moe_layer_freq=[1])
        )
    with pytest.raises(ValueError, match="every layer dense"):
        mg.routing_shape(
            SimpleNamespace(num_layers=2, num_moe_experts=8, moe_router_topk=2, moe_layer_freq=[0, 0])
        )


@settings(max_examples=30)
@given(
    batch=st.integers(1, 4),
    seq=st.integers(1, 5),
    tail=st.sampled_from([(), (3,), (2, 2)]),
    numpy=st.booleans(),
)
def test_megatron_token_order(batch, seq, tail, numpy):
    """Row b * seq + i (batch-major) is row i * batch + b in Megatron's [s, b] order."""
    rows = np.arange(batch * seq * int(np.prod(tail, dtype=int))).reshape(batch * seq, *tail)
    data = rows if numpy else torch.from_numpy(rows)
    megatron = mg.to_megatron_order(data, batch)
    assert type(megatron) is type(data) and tuple(megatron.shape) == rows.shape
    for b in range(batch):
        for i in range(seq):
            assert np.array_equal(np.asarray(megatron[i * batch + b]), rows[b * seq + i])
    assert np.array_equal(np.asarray(mg.from_megatron_order(megatron, batch)), rows)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        mg.to_megatron_order(data, 0)


def test_megatron_token_order_bad_input():
    with pytest.raises(ValueError, match="batch_size \\* seq_len rows"):
        mg.to_megatron_order(np.zeros((5, 2)), 2)
    with pytest.raises(TypeError, match=r"numpy array or a torch\.Tensor"):
        mg.to_megatron_order([[0, 1]], 1)


# ---------------------------------------------------------------------------------------------------
# Capture
# ---------------------------------------------------------------------------------------------------


def test_capture_records_each_decoder_routers_logical_ids():
    """Each decoder router's ids (the experts of the map Megatron returned: global ids, before the
    dispatcher maps them to expert-parallel ranks) land in its MoE-only column; MTP routers are not
    captured. On top of a replay the replayed ids are recorded; under it, the router's own."""
    model = build_gpt()
    routers = mg.find_routers(model)
    shape = mg.routing_shape(model.config)
    n, k = 6, 2
    capturer = RoutingCapturer(shape, 8, "cpu")
    capturer.buffer.fill_(-7)
    logits = {r.path: torch.randn(3, 2, 8) for r in routers}
    with mg.attach_capture(model, capturer) as handle:
        assert handle.layers == (("decoder", 1), ("decoder", 2)) and handle.rules == ()
        capturer.set_step([n])
        maps = [r.module.routing(logits[r.path])[1] for r in routers]
        with capturer.snapshot() as snap:
            captured = snap.result()
    assert captured.shape == (n, 2, k)
    for column in range(2):
        assert np.array_equal(captured[:, column], map_ids(maps[column], k).numpy())
    assert (capturer.buffer[n:] == -7).all()  # rows past this step untouched

    rows = record(np.random.default_rng(2), n, 2, 8, k)
    rows[1] = -1  # a live row: the router's own ids are recorded
    replayer = replayer_for(model.config, rows, num_mtp_layers=2)
    with mg.attach_replay(model, replayer), mg.attach_capture(model, capturer):
        capturer.set_step([n])
        maps = [r.module.routing(logits[r.path])[1] for r in routers[:2]]
        with capturer.snapshot() as snap:
            captured = snap.result()
    expected = np.sort(rows, axis=-1)
    expected[1] = np.stack([map_ids(m, k)[1].numpy() for m in maps])
    assert np.array_equal(captured, expected)

    # attached before the replay, the capture sits under it: the router's own ids, every row
    with mg.attach_capture(model, capturer), mg.attach_replay(model, replayer):
        capturer.set_step([n])
        replayed = [r.module.routing(logits[r.path])[1] for r in routers[:2]]
        with capturer.snapshot() as snap:
            captured = snap.result()
    own = [r.module.routing(logits[r.path])[1] for r in routers[:2]]  # nothing attached
    assert np.array_equal(captured, np.stack([map_ids(m, k).numpy() for m in own], axis=1))
    assert not np.array_equal(captured, np.stack([map_ids(m, k).numpy() for m in replayed], axis=1))


# ---------------------------------------------------------------------------------------------------
# Attaching, removing, errors
# ---------------------------------------------------------------------------------------------------


def test_remove_restores_megatron_and_nesting_is_ordered():
    router = build_router({})
    original_replay = RouterReplay()
    router.router_replay = original_replay
    logits = torch.randn(4, 1, 8)
    before = router.routing(logits)
    rows = record(np.random.default_rng(3), 4, 1, 8, 2)
    replayer = replayer_for(router, rows)
    capturer = RoutingCapturer(mg.routing_shape(router.config), 4, "cpu")
    replay = mg.attach_replay(router, replayer)
    assert megatron_router.topk_routing_with_score_function is not mg.routers._megatron().original
    capture = mg.attach_capture(router, capturer)
    with pytest.raises(RuntimeError, match="remove that handle first"):
        replay.remove()
    assert replay.attached and router.router_replay.inner is replay._hooks[0][1]
    capture.remove()
    capture.remove()  # a second call does nothing
    replay.remove()
    assert not replay.attached and router.router_replay is original_replay
    assert megatron_router.topk_routing_with_score_function is mg.routers._megatron().original
    after = router.routing(logits)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    # an unattached router in the same process never reaches the hooks
    other = build_router({}, seed=5)
    with mg.attach_replay(router, replayer):
        live = other.routing(logits)
    assert torch.equal(live[1], build_router({}, seed=5).routing(logits)[1])


def test_megatron_handles_are_the_shared_attach_handle():
    """MegatronHandle is the AttachHandle every attach_* returns: what, arch, layers, paths, rules;
    removing the last one restores Megatron's routing function."""
    from moe_ops.attach.sites import AttachHandle

    router = build_router({})
    replayer = replayer_for(router, record(np.random.default_rng(6), 4, 1, 8, 2))
    capturer = RoutingCapturer(mg.routing_shape(router.config), 4, "cpu")
    with mg.attach_replay(router, replayer) as replay, mg.attach_capture(router, capturer) as capture:
        for handle, what in ((replay, "replay"), (capture, "capture")):
            assert type(handle) is mg.MegatronHandle and isinstance(handle, AttachHandle)
            assert (handle.what, handle.arch, handle.layers) == (what, "megatron", (("decoder", 0),))
        assert len(replay.rules) == 1 and capture.rules == () and replay.paths == capture.paths
        assert (
            router.router_replay is capture._hooks[0][1] and router.router_replay.inner is replay._hooks[0][1]
        )
    assert router.router_replay is None and not replay.attached and not capture.attached
    assert megatron_router.topk_routing_with_score_function is mg.routers._megatron().original


def test_attach_errors_leave_the_model_untouched():
    router = build_router({})
    rows = np.zeros((4, 1, 2), dtype=np.int32)
    rows[:, :, 1] = 1

    def untouched():
        assert router.router_replay is None
        assert megatron_router.topk_routing_with_score_function is mg.routers._megatron().original

    with pytest.raises(TypeError, match="layer_ids"):
        mg.attach_replay(router, object())
    with pytest.raises(ValueError, match="backend must be one of"):
        mg.attach_replay(router, replayer_for(router, rows), backend="cuda")
    with pytest.raises(ValueError, match="found no TopKRouter"):
        mg.attach_replay(nn.Linear(2, 2), replayer_for(router, rows))
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        mg.attach_replay("model", replayer_for(router, rows))
    other_k = RoutingReplayer(mg.routing_shape(make_config(moe_router_topk=3)), 4, "cpu")
    with pytest.raises(ValueError, match=r"shape\.top_k=3 but the router"):
        mg.attach_replay(router, other_k)
    dense_first = build_router({}, layer_number=2)
    with pytest.raises(ValueError, match=r"decoder layer 1 .* does not hold"):
        mg.attach_replay(dense_first, replayer_for(router, rows))
    unnumbered = TopKRouter(make_config(), pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    with pytest.raises(ValueError, match="layer_number=None"):
        mg.attach_replay(unnumbered, replayer_for(router, rows))
    sinkhorn = build_router(dict(moe_router_load_balancing_type="sinkhorn"))
    with pytest.raises(ValueError, match="sinkhorn"):
        mg.attach_replay(sinkhorn, replayer_for(router, rows))
    model = build_gpt()
    with pytest.raises(ValueError, match=r"MTP layer 0 but replayer\.num_mtp_layers=0"):
        mg.attach_replay(model, RoutingReplayer(mg.routing_shape(model.config), 4, "cpu"))
    with pytest.raises(TypeError, match="capture"):
        mg.attach_capture(router, object())
    untouched()
    with mg.attach_replay(router, replayer_for(router, rows)):
        with pytest.raises(ValueError, match="already replays"):
            mg.attach_replay(router, replayer_for(router, rows))
        capturer = RoutingCapturer(mg.routing_shape(router.config), 4, "cpu")
        with mg.attach_capture(router, capturer), pytest.raises(ValueError, match="already captures"):
            mg.attach_capture(router, capturer)
    untouched()


# ---------------------------------------------------------------------------------------------------
# Pipeline schedules: a slot per micro-batch, reselected in backward
# ---------------------------------------------------------------------------------------------------


class RoutedLayer(nn.Module):
    """A decoder layer of a test stack: Megatron's gate and TopKRouter.routing, then a mix of the
    input weighted by the routing probabilities; logs the routing map of every call."""

    def __init__(self, router: TopKRouter, log: list):
        super().__init__()
        self.router = router
        self.mix = nn.Linear(8, HIDDEN, bias=False)
        self.log = log

    def forward(self, x):
        logits = router_gating_linear(x, self.router.weight, None, torch.float32)
        probs, routing_map = self.router.routing(logits)
        self.log.append((self.router.layer_number - 1, routing_map))
        return x + self.mix(probs).view_as(x)


class RoutedStack(nn.Module):
    """``decoder.layers`` as Megatron's models hold them (what ``set_current_microbatch`` sets);
    each layer checkpointed, so its backward recomputes the routing: torch's checkpoint (reentrant
    or not), or Megatron's own ``tensor_parallel.checkpoint`` (CheckpointFunction, CUDA only: it
    saves the CUDA RNG state)."""

    def __init__(self, routers, log, checkpoint: str = "non-reentrant"):
        super().__init__()
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList([RoutedLayer(r, log) for r in routers])
        self.checkpoint = checkpoint

    def forward(self, x):
        for layer in self.decoder.layers:
            if self.checkpoint == "megatron":
                from megatron.core import tensor_parallel

                x = tensor_parallel.checkpoint(layer, False, x)
            else:
                reentrant = self.checkpoint == "reentrant"
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=reentrant)
        return x


def test_replaying_forward_step_reselects_each_microbatchs_slot_in_backward():
    """1F1B order: the forwards of micro-batches 0 and 1, then 0's backward (through Megatron's
    deallocate_output_tensor and custom_backward, as a non-last stage runs it), then 1's. Each
    checkpointed layer's recompute reads its own micro-batch's rows."""
    log: list[tuple[int, torch.Tensor]] = []
    routers = [build_router({}, layer_number=i + 1, num_layers=2, seed=i) for i in range(2)]
    model = RoutedStack(routers, log)
    shape = mg.routing_shape(routers[0].config)
    replayer = RoutingReplayer(shape, 6, "cpu", num_slots=2)
    rng = np.random.default_rng(4)
    batches = [record(rng, 6, 2, 8, 2) for _ in range(2)]
    for slot, rows in enumerate(batches):
        replayer.set_batch(rows, slot=slot)
    inputs = iter([torch.randn(3, 2, HIDDEN, requires_grad=True) for _ in range(2)])

    def forward_step_func(data_iterator, model):
        return model(next(data_iterator)), None

    step = mg.replaying_forward_step(forward_step_func, replayer)
    assert inspect.signature(step) == inspect.signature(forward_step_func)

    def read(mb):
        """Whether every routing logged since the last check read micro-batch mb's rows, and two
        were logged (the two layers; in backward their recomputes, the last layer first)."""
        rows = [
            torch.equal(map_ids(m, 2), torch.from_numpy(np.sort(batches[mb][:, i], 1)).long()) for i, m in log
        ]
        ok = len(log) == 2 and all(rows)
        log.clear()
        return ok

    outputs = []
    with mg.attach_replay(model, replayer):
        for mb in range(2):
            set_current_microbatch(model, mb)
            outputs.append(step(inputs, model)[0])
            assert read(mb)
        assert replayer.slot == 1
        deallocate_output_tensor(outputs[0], deallocate_pipeline_outputs=True)
        custom_backward(outputs[0], torch.ones(3, 2, HIDDEN))
        assert read(0)
        outputs[1].sum().backward()
        assert read(1)
    assert routers[0].weight.grad is not None and routers[0].weight.grad.abs().sum() > 0


def _one_f_one_b_without_reselecting(checkpoint: str, device: str = "cpu") -> None:
    """1F1B on a non-last stage with two micro-batches of EQUAL size (where a wrong batch gives no
    row-count error): each forward selects its slot, nothing selects in backward, and each
    checkpointed layer's recompute still reads its own micro-batch's rows - the replayer finds the
    forward a recompute belongs to."""
    log: list[tuple[int, torch.Tensor]] = []
    routers = [build_router({}, layer_number=i + 1, num_layers=2, seed=i, device=device) for i in range(2)]
    model = RoutedStack(routers, log, checkpoint).to(device)
    replayer = RoutingReplayer(mg.routing_shape(routers[0].config), 6, device, num_slots=2)
    rng = np.random.default_rng(5)
    batches = [record(rng, 6, 2, 8, 2) for _ in range(2)]
    assert not np.array_equal(batches[0], batches[1])
    for slot, rows in enumerate(batches):
        replayer.set_batch(rows, slot=slot)

    def read(mb) -> bool:
        rows = [
            torch.equal(map_ids(m, 2).cpu(), torch.from_numpy(np.sort(batches[mb][:, i], 1)).long())
            for i, m in log
        ]
        ok = len(log) == 2 and all(rows)
        log.clear()
        return ok

    outputs = []
    with mg.attach_replay(model, replayer):
        for mb in range(2):
            replayer.select(mb)
            outputs.append(model(torch.randn(3, 2, HIDDEN, device=device, requires_grad=True)))
            assert read(mb)
        assert replayer.slot == 1
        deallocate_output_tensor(outputs[0], deallocate_pipeline_outputs=True)
        custom_backward(outputs[0], torch.ones(3, 2, HIDDEN, device=device))
        assert read(0), "micro-batch 0's recompute read another micro-batch's rows"
        outputs[1].sum().backward()
        assert read(1)
    check_replay_errors(device)


@pytest.mark.parametrize("checkpoint", ["non-reentrant", "reentrant"])
def test_equal_micro_batches_recompute_their_own_rows_without_reselecting(checkpoint):
    _one_f_one_b_without_reselecting(checkpoint)


@pytest.mark.gpu
def test_gpu_megatron_checkpoint_recomputes_its_own_micro_batch(cuda_device):
    """The same with Megatron's own activation checkpoint (tensor_parallel.checkpoint, the reentrant
    CheckpointFunction its recompute_granularity uses), which runs on CUDA only."""
    _one_f_one_b_without_reselecting("megatron", "cuda")


def test_replaying_forward_step_needs_a_schedules_microbatch():
    router = build_router({})
    replayer = RoutingReplayer(mg.routing_shape(router.config), 4, "cpu")
    step = mg.replaying_forward_step(lambda data_iterator, model: (torch.zeros(1), None), replayer)
    with pytest.raises(ValueError, match="current_microbatch"):
        step(None, RoutedStack([router], []))
    with pytest.raises(TypeError, match="callable"):
        mg.replaying_forward_step(None, replayer)
    with pytest.raises(TypeError, match="RoutingReplayer"):
        mg.replaying_forward_step(lambda d, m: None, object())


# ---------------------------------------------------------------------------------------------------
# GPU: the whole router, an MoE layer, a GPT model with MTP layers, Megatron's schedule
# ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("forward", [False, True], ids=["routing", "forward"])
@settings(max_examples=20)
@given(case=megatron_router_cases(), live_rows=st.sampled_from(mg.attach.LIVE_ROWS))
def test_gpu_router_matches_megatron_router_replay(forward, case, live_rows):
    """On CUDA, moe-ops' Triton replay against Megatron's RouterReplay: TopKRouter.routing after
    Megatron's gate, and the whole TopKRouter.forward (gate, routing; expert bias built by Megatron
    on the device), both ``live_rows``."""
    compare_with_megatron_replay(case, device="cuda", forward=forward, live_rows=live_rows)


def moe_layer(fields: dict, seed: int = 0) -> MoELayer:
    config = make_config(moe_router_dtype="fp32", moe_token_dispatcher_type="allgather", **fields)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    layer = MoELayer(config, spec.submodules.mlp.submodules).cuda()
    layer.set_layer_number(1)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return layer


def run_moe_layer(layer: MoELayer, x: torch.Tensor, grad: torch.Tensor) -> SimpleNamespace:
    """Output, the router's routing map, the tokens each local expert received (a pre-hook on the
    experts), and the input's and parameters' gradients of one forward + backward."""
    maps: list[torch.Tensor] = []
    received: list[torch.Tensor] = []
    hooks = [
        layer.router.register_forward_hook(lambda m, args, out: maps.append(out[1])),
        layer.experts.register_forward_pre_hook(
            lambda m, args: received.append(torch.as_tensor(args[1]).cpu())
        ),
    ]
    try:
        layer.zero_grad(set_to_none=True)
        x = x.detach().requires_grad_()
        output, _ = layer(x)
        (output * grad).sum().backward()
    finally:
        for hook in hooks:
            hook.remove()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
    return SimpleNamespace(
        output=output.detach(), map=maps[0], received=received[0], x_grad=x.grad, grads=grads
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "fields",
    [
        dict(moe_router_score_function="softmax"),
        dict(
            moe_router_score_function="softmax",
            moe_router_pre_softmax=True,
            moe_router_topk_scaling_factor=2.0,
        ),
        dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_topk=4),
        dict(
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_topk=4,
            moe_router_num_groups=4,
            moe_router_group_topk=2,
            moe_router_topk_scaling_factor=2.5,
        ),
    ],
)
@pytest.mark.parametrize("fusion", [False, True])
def test_gpu_moe_layer_replays_forward_and_backward(fields, fusion):
    """An MoELayer (local spec: SequentialMLP experts, all-gather dispatcher) forward + backward:
    the experts receive the recorded tokens; output and every gradient equal the unfused run with
    Megatron's RouterReplay. With moe_router_fusion=True Megatron's RouterReplay is bypassed (the
    experts get the live routing) while moe-ops still replays."""
    if fusion and not HAVE_TE_ROUTER_FUSION:
        pytest.skip("moe_router_fusion needs Transformer Engine >= 2.6 (fused_topk_with_score_function)")
    layer = moe_layer(fields)
    num_experts, k = layer.config.num_moe_experts, layer.config.moe_router_topk
    gen = torch.Generator().manual_seed(1)
    seq, batch = 5, 2
    x = torch.randn(seq, batch, HIDDEN, generator=gen).cuda()
    grad = torch.randn(seq, batch, HIDDEN, generator=gen).cuda()
    rows = record(np.random.default_rng(5), seq * batch, 1, num_experts, k)
    target = torch.from_numpy(rows[:, 0]).long().cuda()

    def expected_counts(ids):
        return torch.bincount(ids.flatten().cpu(), minlength=num_experts)

    layer.config.moe_router_fusion = False
    live = run_moe_layer(layer, x, grad)
    replay = megatron_replay(layer.router, target)
    ref = run_moe_layer(layer, x, grad)
    assert torch.equal(map_ids(ref.map, k), target.sort(1).values)
    assert torch.equal(ref.received, expected_counts(target))
    layer.config.moe_router_fusion = fusion
    if fusion:  # Megatron's own replay never runs on the fused path: the experts get the live routing
        bypassed = run_moe_layer(layer, x, grad)
        assert torch.equal(bypassed.map, live.map) and not torch.equal(bypassed.map, ref.map)
    replay.clear_router_replay_action()
    replayer = replayer_for(layer.config, rows, device="cuda")
    with mg.attach_replay(layer, replayer):
        ours = run_moe_layer(layer, x, grad)
    assert check_replay_errors("cuda", raise_error=False) == 0
    assert torch.equal(ours.map, ref.map) and torch.equal(ours.received, expected_counts(target))
    torch.testing.assert_close(ours.output, ref.output, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.x_grad, ref.x_grad, rtol=1e-5, atol=1e-6)
    assert ours.grads.keys() == ref.grads.keys() and "router.weight" in ours.grads
    for name in ref.grads:
        torch.testing.assert_close(ours.grads[name], ref.grads[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("fusion", [False, True])
def test_gpu_router_fusion_bypasses_router_replay_but_not_moe_ops(fusion):
    """moe_router_fusion=True: Megatron's RouterReplay in REPLAY_FORWARD returns the live routing
    (its hook sits after the fused return); moe-ops returns the recorded ids with the same weights
    as the unfused replay."""
    if fusion and not HAVE_TE_ROUTER_FUSION:
        pytest.skip("moe_router_fusion needs Transformer Engine >= 2.6 (fused_topk_with_score_function)")
    fields = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_topk=4)
    router = build_router({**fields, "moe_router_dtype": "fp32"}, device="cuda", seed=3)
    x = torch.randn(4, 2, HIDDEN, device="cuda")
    rows = record(np.random.default_rng(6), 8, 1, 8, 4)
    target = torch.from_numpy(rows[:, 0]).long().cuda()
    with torch.no_grad():
        live = router(x)
        replay = megatron_replay(router, target)
        unfused = router(x)
        router.config.moe_router_fusion = fusion
        megatron_fused = router(x)
        replay.clear_router_replay_action()
        with mg.attach_replay(router, replayer_for(router, rows, device="cuda")):
            ours = router(x)
    assert torch.equal(map_ids(unfused[1], 4), target.sort(1).values)
    if fusion:
        assert torch.equal(megatron_fused[1], live[1])  # bypassed
    assert torch.equal(ours[1], unfused[1])
    torch.testing.assert_close(ours[0], unfused[0], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_gpu_gpt_model_with_mtp_under_megatrons_schedule():
    """A GPTModel (dense layer 0, MoE layers 1-2, two MTP layers) trained one step through
    Megatron's forward_backward_no_pipelining with full activation recompute and three
    micro-batches in three slots: every router call (forwards and recomputes) gets its micro-batch's
    rows, decoder and MTP layers each their own."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(0)
    model = build_gpt(
        device="cuda",
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    routers = mg.find_routers(model)
    shape = mg.routing_shape(model.config)
    seq, batch, micro = 6, 2, 3
    rng = np.random.default_rng(7)
    decoder_rows = [record(rng, seq * batch, 2, 8, 2) for _ in range(micro)]
    mtp_rows = [record(rng, seq * batch, 2, 8, 2) for _ in range(micro)]
    replayer = RoutingReplayer(shape, seq * batch, "cuda", num_slots=micro, num_mtp_layers=2)
    for mb in range(micro):
        replayer.set_batch(decoder_rows[mb], slot=mb, mtp_routing=mtp_rows[mb])
    seen: list[tuple[int, str, torch.Tensor]] = []
    hooks = [
        r.module.register_forward_hook(
            lambda m, a, out, path=r.path: seen.append((replayer.slot, path, out[1]))
        )
        for r in routers
    ]
    tokens = torch.randint(0, 64, (micro, batch, seq), device="cuda")

    def forward_step_func(data_iterator, model):
        mb = next(data_iterator)
        ids = tokens[mb]
        position_ids = torch.arange(seq, device="cuda").expand(batch, seq)
        output = model(ids, position_ids, None, labels=ids)

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    model.config.finalize_model_grads_func = None
    with mg.attach_replay(model, replayer):
        forward_backward_no_pipelining(
            forward_step_func=mg.replaying_forward_step(forward_step_func, replayer),
            data_iterator=iter(range(micro)),
            model=[model],
            num_microbatches=micro,
            seq_length=seq,
            micro_batch_size=batch,
            forward_only=False,
        )
    for h in hooks:
        h.remove()
    assert check_replay_errors("cuda", raise_error=False) == 0
    columns = {r.path: (r.kind, r.index) for r in routers}
    calls_per_path: dict[str, int] = {}
    for slot, path, routing_map in seen:
        kind, index = columns[path]
        rows = (
            decoder_rows[slot][:, shape.buffer_layer(index)]
            if kind == "decoder"
            else mtp_rows[slot][:, index]
        )
        assert torch.equal(map_ids(routing_map, 2).cpu(), torch.from_numpy(np.sort(rows, 1)).long()), (
            slot,
            path,
        )
        calls_per_path[path] = calls_per_path.get(path, 0) + 1
    # each decoder router routes every micro-batch in its forward and again in its recompute
    assert all(calls_per_path[r.path] >= 2 * micro for r in routers if r.kind == "decoder"), calls_per_path
    assert all(r.module.weight.grad is not None for r in routers)


def test_a_replayed_router_call_stays_in_few_files():
    """Megatron's hook rides the same corridor as every replayed router (tests/test_corridor.py):
    from the dispatcher in router.py down to the replay kernel in at most 8 package files, coming
    back into one it left at most 4 times (Megatron's own routing, which the hook runs first, is no
    package file)."""
    from corridor import KERNEL_ROOMS, walk

    router = build_router({})
    replayer = replayer_for(router, record(np.random.default_rng(0), 6, 1, 8, 2))
    logits = torch.randn(6, 8, requires_grad=True)
    with mg.attach_replay(router, replayer):
        router.routing(logits)  # first use: the fault counters
        trip = walk(lambda: router.routing(logits), end=KERNEL_ROOMS)
    assert len(trip.files) <= 8 and trip.returns <= 4, trip.stays
    assert "moe_ops/replay/kernels.py" in trip.stays
