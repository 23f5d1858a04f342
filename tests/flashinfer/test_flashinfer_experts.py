"""The monolithic capture contract: scratch allocation and sizing, the per-call helper, the capture step's
layout and rows, binding (and its fail-fast errors), rebinding after a kernel rebuild, and fake tracing
of an MoE layer under torch.compile(fullgraph=True).

On CPU the kernels cannot run: the capture-step tests fill the scratch rows the way the kernel does
(rows [0, num_tokens), padding included) and check what the capture op makes of them; the compile tests
trace on meta tensors, where the ops' fake implementations run.
"""

from __future__ import annotations

import gc
import inspect
import weakref
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from strategies import PAD_ID, POISON, replay_cases

from moe_ops import (
    BatchLayout,
    LayerCapture,
    MoEDispatchConfig,
    RoutingReplayExperts,
    RoutingReplayLayer,
    bind_routing_capture,
    unbind_routing_capture,
)
from moe_ops.flashinfer import FlashInferExperts
from moe_ops.graphs import CompileCounters, count_graph_breaks

E, H, INTER = 16, 256, 128  # experts, hidden size, intermediate size of the tiny layers


@dataclass
class Capturer:
    """A RoutingCapturerLike: the four fields moe_ops.RoutingCapturer exposes."""

    buffer: torch.Tensor
    token_counts: torch.Tensor
    dp_rank: int = 0
    shard_sizes: torch.Tensor | None = None


def capturer(max_tokens=32, num_layers=4, top_k=4, dp_size=1, dp_rank=0, device="cpu", shard_sizes=None):
    return Capturer(
        buffer=torch.full((max_tokens, num_layers, top_k), POISON, dtype=torch.int32, device=device),
        token_counts=torch.zeros(dp_size, dtype=torch.int32, device=device),
        dp_rank=dp_rank,
        shard_sizes=shard_sizes,
    )


def bf16_experts(config: MoEDispatchConfig, kernel="trtllm_bf16_moe", device="cpu") -> FlashInferExperts:
    """FlashInfer BF16 experts (BlockMajorK weights [E, K/64, M, 64]); weights are never read on CPU."""
    return FlashInferExperts(
        kernel,
        config,
        gemm1_weights=torch.empty(E, H // 64, 2 * INTER, 64, dtype=torch.bfloat16, device=device),
        gemm2_weights=torch.empty(E, INTER // 64, H, 64, dtype=torch.bfloat16, device=device),
        num_experts=E,
        top_k=config.top_k,
        n_group=None,
        topk_group=None,
        intermediate_size=INTER,
        local_expert_offset=0,
        local_num_experts=E,
        routing_method_type=1,  # Renormalize
        **({} if kernel.endswith("routed_moe") else {"routing_bias": None}),
    )


class PerChannelFp8Experts(RoutingReplayExperts):
    """An engine's experts for FlashInfer's trtllm_fp8_per_channel_scale_moe: it routes from logits
    inside the kernel and has no routing_replay_out (checked against FlashInfer below)."""

    kernel_name = "trtllm_fp8_per_channel_scale_moe"
    monolithic = True


def test_per_channel_fp8_really_has_no_replay_output():
    flashinfer = pytest.importorskip("flashinfer.fused_moe")
    fn = inspect.unwrap(flashinfer.trtllm_fp8_per_channel_scale_moe)
    params = inspect.signature(fn).parameters
    assert "routing_logits" in params and "routing_replay_out" not in params


class TinyMoE(RoutingReplayLayer, torch.nn.Module):
    """A MoE layer: a gate, then a monolithic experts kernel that routes from the logits itself."""

    def __init__(self, layer_id: int, experts: RoutingReplayExperts, device="cpu"):
        super().__init__()
        self.layer_id = layer_id
        self.gate = torch.nn.Parameter(torch.randn(H, E, device=device))
        self.experts = experts

    def forward(self, x):
        return self.experts(routing_logits=x.float() @ self.gate, hidden_states=x)


# ------------------------------------------------------------------ scratch: allocation and sizing


def test_no_allocation_and_no_replay_when_capture_is_off():
    experts = bf16_experts(MoEDispatchConfig(max_num_tokens=16, top_k=4))
    assert experts.supports_routing_replay_capture()
    assert experts.replay_scratch is None and experts.capture_fn is None
    assert experts.routing_replay_out(8, torch.device("cpu")) is None
    experts.capture_routing_replay(None)  # a no-op, not an error


def test_set_capture_fn_none_frees_the_scratch():
    experts = bf16_experts(MoEDispatchConfig(max_num_tokens=16, top_k=4))
    experts.set_capture_fn(LayerCapture(capturer(), 2))
    ref = weakref.ref(experts.replay_scratch)
    experts.set_capture_fn(None)
    gc.collect()
    assert experts.replay_scratch is None and experts.capture_fn is None
    assert ref() is None, "the scratch is still referenced after capture was turned off"


@pytest.mark.parametrize(
    ("dp_size", "ep_size", "use_ep", "group"),
    [(1, 1, False, 1), (4, 1, False, 4), (2, 8, True, 8), (4, 8, False, 4), (8, 8, True, 8)],
)
def test_scratch_is_max_tokens_times_dispatch_group(dp_size, ep_size, use_ep, group):
    layout = BatchLayout.GATHERED if group > 1 else BatchLayout.LOCAL
    config = MoEDispatchConfig(
        max_num_tokens=24, top_k=6, dp_size=dp_size, ep_size=ep_size, use_ep=use_ep, layout=layout
    )
    assert config.dispatch_group_size == group
    experts = bf16_experts(config)
    experts.set_capture_fn(LayerCapture(capturer(top_k=6, dp_size=dp_size), 0))
    scratch = experts.replay_scratch
    assert scratch.shape == (24 * group, 6) and scratch.dtype == torch.int16 and scratch.is_contiguous()
    assert (scratch == -1).all(), "unwritten scratch rows must not read as expert 0"
    same = scratch
    experts.set_capture_fn(LayerCapture(capturer(top_k=6, dp_size=dp_size), 1))
    assert experts.replay_scratch is same, "rebinding with the same shape must keep the scratch"


def test_helper_returns_the_calls_rows_and_rejects_too_many_tokens():
    experts = bf16_experts(
        MoEDispatchConfig(max_num_tokens=10, top_k=4, dp_size=2, layout=BatchLayout.GATHERED)
    )
    experts.set_capture_fn(LayerCapture(capturer(dp_size=2), 0))
    rows = experts.routing_replay_out(20, torch.device("cpu"))
    assert (
        rows.shape == (20, 4)
        and rows.data_ptr() == experts.replay_scratch.data_ptr()
        and rows.is_contiguous()
    )
    with pytest.raises(
        ValueError,
        match=r"21 tokens but the routing-replay scratch holds 20 rows .*max_num_tokens=10 x "
        r"dispatch_group_size=2",
    ):
        experts.routing_replay_out(21, torch.device("cpu"))


def test_helper_rejects_another_device():
    experts = bf16_experts(MoEDispatchConfig(max_num_tokens=10, top_k=4))
    experts.set_capture_fn(LayerCapture(capturer(), 0))
    with pytest.raises(ValueError, match=r"runs on meta but the routing-replay scratch .* is on cpu"):
        experts.routing_replay_out(4, torch.device("meta"))


BAD_FNS = {
    "top_k": (
        lambda: LayerCapture(capturer(top_k=8), 0),
        ValueError,
        "top_k=8 columns but trtllm_bf16_moe routes top_k=4",
    ),
    "layer": (lambda: LayerCapture(capturer(num_layers=2), 2), ValueError, r"layer_id must be in \[0, 2\)"),
    "rows": (lambda: LayerCapture(capturer(max_tokens=8), 0), ValueError, "max_num_tokens=16 rows"),
    "type": (lambda: capturer(), TypeError, "needs a LayerCapture"),
    "fields": (
        lambda: LayerCapture(object(), 0),
        TypeError,
        "lacks buffer, token_counts, dp_rank, shard_sizes",
    ),
}


@pytest.mark.parametrize("bad", list(BAD_FNS))
def test_set_capture_fn_rejects_bad_bindings_without_changing_state(bad):
    experts = bf16_experts(MoEDispatchConfig(max_num_tokens=16, top_k=4))
    good = LayerCapture(capturer(), 0)
    experts.set_capture_fn(good)
    scratch = experts.replay_scratch
    make, error, message = BAD_FNS[bad]
    with pytest.raises(error, match=message):
        experts.set_capture_fn(make())
    assert experts.capture_fn is good and experts.replay_scratch is scratch


def test_sharded_dispatch_needs_shard_sizes():
    config = MoEDispatchConfig(
        max_num_tokens=8, top_k=4, dp_size=2, ep_size=4, use_ep=True, layout=BatchLayout.SHARDED
    )
    with pytest.raises(ValueError, match=r"SHARDED dispatch needs capturer\.shard_sizes"):
        bf16_experts(config).set_capture_fn(LayerCapture(capturer(dp_size=2), 0))


def test_dispatch_config_validation():
    with pytest.raises(ValueError, match="max_num_tokens must be an int >= 1"):
        MoEDispatchConfig(max_num_tokens=0, top_k=4)
    with pytest.raises(ValueError, match="LOCAL, GATHERED or SHARDED"):
        MoEDispatchConfig(max_num_tokens=4, top_k=4, layout=BatchLayout.SEQUENCE_PARALLEL)
    with pytest.raises(ValueError, match=r"kernel_args top_k=8 must equal config\.top_k=4"):
        FlashInferExperts("trtllm_bf16_moe", MoEDispatchConfig(max_num_tokens=4, top_k=4), top_k=8)
    with pytest.raises(ValueError, match="only routes"):
        FlashInferExperts("fused_topk_deepseek", MoEDispatchConfig(max_num_tokens=4, top_k=4), top_k=4)


# ------------------------------------------------------------------ the capture step: layout and rows


@settings(max_examples=200)
@given(replay_cases())
def test_capture_step_records_this_ranks_real_rows(rc):
    """The kernel writes every row of its batch (padding included) into routing_replay_out; the capture
    step must put exactly this DP rank's real rows into the buffer and nothing else."""
    case = rc.case
    config = MoEDispatchConfig(
        max_num_tokens=rc.max_num_tokens,
        top_k=case.top_k,
        dp_size=rc.dp_size,
        ep_size=rc.ep_size,
        use_ep=rc.use_ep,
        layout=case.layout,
    )
    buffer, ids, counts, sizes = case.tensors("cpu")
    cap = Capturer(buffer, counts, case.dp_rank, sizes)
    experts = bf16_experts(config)
    experts.set_capture_fn(LayerCapture(cap, case.layer_id))
    assert experts.replay_scratch.shape[0] >= ids.shape[0]
    experts.replay_scratch.fill_(PAD_ID)  # rows past the call's must never be read
    before = buffer.clone()

    replay = experts.routing_replay_out(ids.shape[0], torch.device("cpu"))
    replay.copy_(ids)  # what the kernel writes: one row per token of its batch
    experts.capture_routing_replay(replay)

    assert torch.equal(buffer, case.expected(before)), f"{case.layout.name}: wrong rows captured"
    assert not (buffer == PAD_ID).any(), "a padding row reached the capture buffer"


# ------------------------------------------------------------------ binding


def two_layer_model(experts_factory=None):
    factory = experts_factory or (lambda: bf16_experts(MoEDispatchConfig(max_num_tokens=16, top_k=4)))
    return torch.nn.Sequential(TinyMoE(0, factory()), torch.nn.Linear(H, H), TinyMoE(1, factory()))


def test_binding_binds_every_moe_layer():
    model = two_layer_model()
    cap = capturer()
    assert bind_routing_capture(model, cap) == [0, 1]
    for layer in (model[0], model[2]):
        assert layer.experts.capture_fn == LayerCapture(cap, layer.layer_id)
        assert layer.experts.replay_scratch.shape == (16, 4)
    assert unbind_routing_capture(model) == 2
    assert model[0].experts.replay_scratch is None and model[2].experts.capture_fn is None


def test_binding_a_routing_capturer_maps_model_layers_to_buffer_columns():
    """With moe_ops.RoutingCapturer (MoE-only layer axis) a layer's model index maps to its column."""
    from moe_ops import RoutingCapturer, RoutingShape

    factory = lambda: bf16_experts(MoEDispatchConfig(max_num_tokens=16, top_k=4))
    # model layers 0 and 2 are dense: MoE layers 1 and 3 are buffer columns 0 and 1
    model = torch.nn.Sequential(TinyMoE(1, factory()), torch.nn.Linear(H, H), TinyMoE(3, factory()))
    cap = RoutingCapturer(RoutingShape(2, E, 4, moe_layers=(1, 3), num_model_layers=4), 16, "cpu")
    assert bind_routing_capture(model, cap) == [1, 3]
    assert model[0].experts.capture_fn == LayerCapture(cap, 0)
    assert model[2].experts.capture_fn == LayerCapture(cap, 1)
    assert model[2].experts.capture_fn.target().layer_id == 1
    unbind_routing_capture(model)
    dense = torch.nn.Sequential(TinyMoE(2, factory()))
    with pytest.raises(ValueError, match="model layer 2 is dense"):
        bind_routing_capture(dense, cap)


def test_binding_a_model_without_moe_layers_raises():
    with pytest.raises(ValueError, match=r"found no MoE layer .* in Sequential: nothing would be captured"):
        bind_routing_capture(torch.nn.Sequential(torch.nn.Linear(4, 4)), capturer())


def test_binding_a_monolithic_kernel_without_replay_raises_naming_it():
    model = two_layer_model()
    model[2].experts = PerChannelFp8Experts(MoEDispatchConfig(max_num_tokens=16, top_k=4))
    with pytest.raises(ValueError, match=r"layer 1: trtllm_fp8_per_channel_scale_moe.*silently all-zero"):
        bind_routing_capture(model, capturer())
    assert model[0].experts.capture_fn is None and model[0].experts.replay_scratch is None, (
        "a layer got bound"
    )
    with pytest.raises(ValueError, match="trtllm_fp8_per_channel_scale_moe routes inside the kernel"):
        model[2].experts.set_capture_fn(LayerCapture(capturer(), 1))


def test_routed_kernels_bind_without_scratch_and_give_the_router_a_target():
    model = two_layer_model(
        lambda: bf16_experts(MoEDispatchConfig(max_num_tokens=16, top_k=4), "trtllm_bf16_routed_moe")
    )
    cap = capturer()
    bind_routing_capture(model, cap)
    experts = model[2].experts
    assert not experts.monolithic and not experts.supports_routing_replay_capture()
    assert experts.replay_scratch is None and experts.routing_replay_out(4, torch.device("cpu")) is None
    target = experts.capture_fn.target(BatchLayout.LOCAL)
    assert target.buffer is cap.buffer and target.layer_id == 1 and target.layout == BatchLayout.LOCAL


def test_binding_rejects_duplicate_layer_ids_and_misfit_buffers():
    model = two_layer_model()
    model[2].layer_id = 0
    with pytest.raises(ValueError, match="two MoE layers have layer_id 0"):
        bind_routing_capture(model, capturer())
    model[2].layer_id = 5
    with pytest.raises(ValueError, match=r"layer_id must be in \[0, 4\)"):
        bind_routing_capture(model, capturer())
    assert model[0].experts.capture_fn is None, "a failed binding left a layer bound"
    with pytest.raises(TypeError, match="lacks"):
        bind_routing_capture(model, object())


def test_rebinding_survives_an_experts_rebuild():
    """A weight reload that rebuilds the experts object must keep the capture (serving engines lost it)."""
    model = two_layer_model()
    cap = capturer()
    bind_routing_capture(model, cap)
    old = model[0].experts
    old_scratch = weakref.ref(old.replay_scratch)
    model[0].experts = bf16_experts(MoEDispatchConfig(max_num_tokens=16, top_k=4))  # the rebuild
    new = model[0].experts
    assert new is not old
    assert new.capture_fn == LayerCapture(cap, 0) and new.replay_scratch.shape == (16, 4)
    gc.collect()
    assert old.capture_fn is None and old_scratch() is None, "the replaced experts still hold a scratch"

    with pytest.raises(ValueError, match="silently all-zero"):
        model[0].experts = PerChannelFp8Experts(MoEDispatchConfig(max_num_tokens=16, top_k=4))
    assert model[0].experts is new and new.capture_fn == LayerCapture(cap, 0), (
        "a refused rebuild dropped the capture"
    )


def test_assigning_experts_before_binding_allocates_nothing():
    layer = TinyMoE(0, bf16_experts(MoEDispatchConfig(max_num_tokens=16, top_k=4)))
    layer.experts = bf16_experts(MoEDispatchConfig(max_num_tokens=16, top_k=4))
    assert layer.experts.replay_scratch is None and layer.routing_capturer is None


# ------------------------------------------------------------------ fake tracing under torch.compile


def _recording_backend(graphs: list):
    """An aot_autograd backend that keeps the functionalised forward graph and runs it (on meta)."""
    from torch._dynamo.backends.common import aot_autograd

    def fw_compiler(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return aot_autograd(fw_compiler=fw_compiler)


def _mutated_arg(node, name: str):
    """The tensor an auto_functionalized(_v2) node mutates as ``name`` (None when passed None)."""
    if f"_{name}_base_index" in node.kwargs:  # v2: an index into _all_bases
        index = node.kwargs[f"_{name}_base_index"]
        return None if index is None else node.kwargs["_all_bases"][index]
    return node.kwargs.get(name)  # v1 passes the tensor itself


def _op_calls(gm, op_name: str) -> list:
    """auto_functionalized(_v2) nodes of ``torch.ops.moe_ops.<op_name>`` in a functionalised graph."""
    calls = []
    for node in gm.graph.nodes:
        is_functionalized = node.op == "call_function" and "auto_functionalized" in str(node.target)
        if is_functionalized and str(node.args[0]).startswith(f"moe_ops.{op_name}."):
            calls.append(node)
    return calls


@pytest.mark.parametrize("layout", [BatchLayout.LOCAL, BatchLayout.GATHERED], ids=lambda v: v.name)
def test_moe_layers_compile_fullgraph_with_visible_replay_writes(layout):
    torch._dynamo.reset()
    dev = "meta"
    dp_size = 1 if layout == BatchLayout.LOCAL else 2
    config = MoEDispatchConfig(max_num_tokens=32, top_k=4, dp_size=dp_size, layout=layout)
    model = torch.nn.Sequential(*(TinyMoE(i, bf16_experts(config, device=dev), device=dev) for i in range(2)))
    bind_routing_capture(model, capturer(dp_size=dp_size, dp_rank=dp_size - 1, device=dev))
    x = torch.empty(24 * dp_size, H, dtype=torch.bfloat16, device=dev)
    assert count_graph_breaks(model, x) == 0
    torch._dynamo.reset()

    graphs: list = []
    compiled = torch.compile(model, fullgraph=True, backend=_recording_backend(graphs))
    with CompileCounters() as cc:
        out = compiled(x)
    assert cc.graph_breaks == 0 and cc.graphs == 1
    assert out.shape == (24 * dp_size, H) and out.dtype == torch.bfloat16
    (gm,) = graphs
    kernels = _op_calls(gm, "flashinfer_trtllm_bf16_moe")
    captures = _op_calls(gm, "capture_routing_")
    assert len(kernels) == 2 and len(captures) == 2
    for kernel, capture in zip(kernels, captures):
        assert _mutated_arg(kernel, "routing_replay_out") is not None, (
            "routing_replay_out not declared mutated"
        )
        # the row rule's offset reached the op: GATHERED rank 1 of 2 starts after one rank's block
        assert capture.kwargs["n_first"] == (0 if layout == BatchLayout.LOCAL else 1)
        # the capture reads the kernel's functionalised replay output, so it is ordered after the write
        source = capture.kwargs["topk_ids"]
        while source.op == "call_function" and "getitem" not in str(source.target):
            source = source.args[0]
        assert source.args[0] is kernel


def test_capture_off_traces_no_capture_and_no_replay_buffer():
    torch._dynamo.reset()
    dev = "meta"
    model = TinyMoE(0, bf16_experts(MoEDispatchConfig(max_num_tokens=32, top_k=4), device=dev), device=dev)
    graphs: list = []
    torch.compile(model, fullgraph=True, backend=_recording_backend(graphs))(
        torch.empty(8, H, dtype=torch.bfloat16, device=dev)
    )
    (kernel,) = _op_calls(graphs[0], "flashinfer_trtllm_bf16_moe")
    assert _mutated_arg(kernel, "routing_replay_out") is None
    assert not _op_calls(graphs[0], "capture_routing_")
