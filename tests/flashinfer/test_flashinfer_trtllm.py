"""FlashInfer's monolithic trtllm MoE kernels on the GPU: routing_replay_out holds the routed ids, the
routed variant leaves it untouched, and the experts contract captures through it.

These kernels run on SM100/SM103 only; elsewhere every test skips with the reason
:func:`moe_ops.flashinfer.backends.trtllm_moe_support` gives (e.g. "trtllm MoE: needs SM100/SM103,
found SM90"). Weights are random: the MoE output is not checked here, the routing is.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from strategies import POISON
from test_flashinfer_routing import (
    N_GROUP,
    NUM_EXPERTS,
    SCALE,
    TOP_K,
    TOPK_GROUP,
    deepseek_v3_reference,
    rows_as_sets,
    separated_logits,
)

from moe_ops import LayerCapture, MoEDispatchConfig, check_capture_errors
from moe_ops.flashinfer import FlashInferExperts, ops

pytestmark = pytest.mark.gpu

HIDDEN, INTER = 512, 256


@pytest.fixture
def trtllm_device(cuda_device):
    from moe_ops.flashinfer.backends import trtllm_moe_support

    support = trtllm_moe_support(cuda_device)
    if not support.ok:
        pytest.skip(support.reason)
    return cuda_device


def _layer_args(device):
    g = torch.Generator(device=device).manual_seed(0)

    def weights(*shape):
        return (torch.randn(*shape, generator=g, device=device) * 0.02).to(torch.bfloat16)

    return dict(
        # BlockMajorK: [experts, K / 64, M, 64] (64 bf16 = 128 bytes per block)
        gemm1_weights=weights(NUM_EXPERTS, HIDDEN // 64, 2 * INTER, 64),
        gemm2_weights=weights(NUM_EXPERTS, INTER // 64, HIDDEN, 64),
        num_experts=NUM_EXPERTS,
        top_k=TOP_K,
        n_group=N_GROUP,
        topk_group=TOPK_GROUP,
        intermediate_size=INTER,
        local_expert_offset=0,
        local_num_experts=NUM_EXPERTS,
        routed_scaling_factor=SCALE,
        routing_method_type=2,  # DeepSeekV3
    )


def _routing_inputs(n, device, seed):
    # bf16-representable bias, so the float64 reference sees the values the kernel sees
    bias = (torch.randn(NUM_EXPERTS, generator=torch.Generator().manual_seed(seed)) * 0.05).bfloat16().float()
    logits = separated_logits(n, seed, bias)
    hidden = torch.randn(n, HIDDEN, device=device).to(torch.bfloat16)
    return logits, bias, hidden


@pytest.mark.parametrize("n", [1, 7, 128])
def test_trtllm_bf16_moe_writes_routed_ids_into_replay(trtllm_device, n):
    dev = trtllm_device
    logits, bias, hidden = _routing_inputs(n, dev, seed=n)
    replay = torch.full((n + 3, TOP_K), POISON, dtype=torch.int16, device=dev)
    out = ops.call(
        "trtllm_bf16_moe",
        routing_logits=logits.to(dev),
        routing_bias=bias.to(dev, torch.bfloat16),
        hidden_states=hidden,
        routing_replay_out=replay,
        **_layer_args(dev),
    )
    torch.cuda.synchronize()
    _, ref_ids, _ = deepseek_v3_reference(logits, bias)
    assert out.shape == (n, HIDDEN) and out.dtype == torch.bfloat16
    assert torch.equal(rows_as_sets(replay[:n].cpu()), rows_as_sets(ref_ids))
    assert (replay[n:] == POISON).all(), "rows past num_tokens were written"


def test_trtllm_bf16_routed_moe_leaves_replay_untouched(trtllm_device):
    dev = trtllm_device
    n = 16
    logits, bias, hidden = _routing_inputs(n, dev, seed=2)
    ref_w, ref_ids, _ = deepseek_v3_reference(logits, bias)
    replay = torch.full((n, TOP_K), POISON, dtype=torch.int16, device=dev)
    args = _layer_args(dev)
    ops.call(
        "trtllm_bf16_routed_moe",
        topk_ids=ref_ids.to(dev, torch.int32),
        topk_weights=ref_w.to(dev, torch.bfloat16),
        hidden_states=hidden,
        routing_replay_out=replay,
        **args,
    )
    torch.cuda.synchronize()
    assert (replay == POISON).all(), "a routed (precomputed top-k) kernel wrote routing_replay_out"


@dataclass
class Capturer:
    buffer: torch.Tensor
    token_counts: torch.Tensor
    dp_rank: int = 0
    shard_sizes: torch.Tensor | None = None


def test_monolithic_experts_capture_through_replay(trtllm_device):
    dev = trtllm_device
    n, live = 24, 19
    experts = FlashInferExperts(
        "trtllm_bf16_moe", MoEDispatchConfig(max_num_tokens=32, top_k=TOP_K), **_layer_args(dev)
    )
    cap = Capturer(
        torch.full((32, 2, TOP_K), POISON, dtype=torch.int32, device=dev),
        torch.tensor([live], dtype=torch.int32, device=dev),
    )
    experts.set_capture_fn(LayerCapture(cap, 1))
    logits, bias, hidden = _routing_inputs(n, dev, seed=5)
    experts(routing_logits=logits.to(dev), routing_bias=bias.to(dev, torch.bfloat16), hidden_states=hidden)
    torch.cuda.synchronize()
    _, ref_ids, _ = deepseek_v3_reference(logits, bias)
    assert torch.equal(rows_as_sets(cap.buffer[:live, 1].cpu()), rows_as_sets(ref_ids[:live]))
    assert (cap.buffer[live:] == POISON).all() and (cap.buffer[:, 0] == POISON).all()
    assert check_capture_errors(dev) == 0
