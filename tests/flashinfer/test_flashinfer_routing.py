"""route_flashinfer: DeepSeek-V3 routing with fused_topk_deepseek and the fused capture through
routing_replay_out.

CPU: argument errors, the persistent scratch, and fake tracing under torch.compile(fullgraph=True) on
meta tensors. GPU (marker gpu): the kernel's ids and replay rows against a float64 PyTorch reference at
n in {1, 7, 128, 4096}, tail rows untouched, inside a CUDA graph, compiled, and opcheck.
"""

from __future__ import annotations

import pytest
import torch
from strategies import POISON

from moe_ops import BatchLayout, CaptureTarget, RoutingMethod, check_capture_errors, route
from moe_ops.flashinfer import ops, route_flashinfer
from moe_ops.flashinfer.routing import _replay_scratch, _scratch
from moe_ops.graphs import CompileCounters, count_graph_breaks

# DeepSeek-V3's router: 256 experts in 8 groups, 4 groups kept, 8 experts, weights scaled by 2.5
NUM_EXPERTS, TOP_K, N_GROUP, TOPK_GROUP, SCALE = 256, 8, 8, 4, 2.5


def deepseek_v3_reference(logits, bias, top_k=TOP_K, n_group=N_GROUP, topk_group=TOPK_GROUP, scale=SCALE):
    """DeepSeek-V3 (noaux_tc) routing in float64: (weights (n, k), ids (n, k) int64, selection margin (n,)).

    scores = sigmoid(logits); selection uses scores + bias: each group scores the sum of its top-2,
    the best ``topk_group`` groups stay, the top ``top_k`` experts of those are chosen; weights are
    the chosen (unbiased) scores normalised to sum 1, times ``scale``. ``margin`` is the smallest gap
    at a decision boundary (group ``topk_group`` vs the next, expert ``top_k`` vs the next): rows
    with a tiny margin may legitimately differ in a float32 kernel.
    """
    scores = torch.sigmoid(logits.double())
    biased = scores + bias.double()
    n = logits.shape[0]
    grouped = biased.view(n, n_group, -1)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)
    ranked = group_scores.sort(dim=-1, descending=True).values
    group_gap = (
        ranked[:, topk_group - 1] - ranked[:, topk_group] if topk_group < n_group else torch.full((n,), 1.0)
    )
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
    masked = biased.masked_fill(~keep.repeat_interleave(grouped.shape[2], dim=1), float("-inf"))
    top = masked.topk(top_k + 1, dim=-1)
    ids = top.indices[:, :top_k]
    expert_gap = top.values[:, top_k - 1] - top.values[:, top_k]
    weights = scores.gather(1, ids)
    weights = weights / weights.sum(-1, keepdim=True) * scale
    return weights, ids, torch.minimum(group_gap.to(expert_gap.dtype), expert_gap)


def separated_logits(n, seed, bias, margin=1e-4):
    """(n, 256) float32 logits whose DeepSeek-V3 decisions all have a gap > ``margin`` (resampled rows)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, NUM_EXPERTS, generator=g)
    for _ in range(100):
        *_, gap = deepseek_v3_reference(logits, bias)
        close = gap <= margin
        if not close.any():
            return logits
        logits[close] = torch.randn(int(close.sum()), NUM_EXPERTS, generator=g)
    raise AssertionError("could not draw well-separated logits")


def rows_as_sets(ids: torch.Tensor) -> torch.Tensor:
    return ids.long().sort(dim=-1).values


def assert_weights_match(tri_w, tri_ids, ref_w, ref_ids):
    """Weights of the same experts agree (both sides put in expert-id order; the kernel's column
    order is its own). float32 kernel vs float64 reference: 1e-5."""
    tri = tri_w.double().gather(1, tri_ids.long().argsort(dim=-1))
    ref = ref_w.gather(1, ref_ids.argsort(dim=-1))
    torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ CPU: errors and the scratch


def _meta_logits(n=6, experts=NUM_EXPERTS):
    return torch.empty(n, experts, device="meta")


@pytest.mark.parametrize("method", [0, 1, 3, 4])
def test_other_methods_are_refused(method):
    with pytest.raises(ValueError, match=r"DEEPSEEK_V3 \(2\) only; got method"):
        route_flashinfer(_meta_logits(), TOP_K, method)


def test_cpu_logits_are_refused():
    with pytest.raises(
        ValueError, match=r"needs a CUDA device .* router_logits is on cpu\. Use backend='triton'"
    ):
        route_flashinfer(torch.randn(4, NUM_EXPERTS), TOP_K, 2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(top_k=9), r"top_k must be an int in \[1, min\(8"),
        (dict(n_group=7), "n_group must divide num_experts=256"),
        (dict(n_group=8, topk_group=9), r"topk_group must be in \[1, n_group=8\]"),
        (dict(n_group=4, topk_group=2), "num_experts / n_group <= 32"),
        (dict(n_group=None, experts=512), "num_experts <= 384 without groups"),
        (dict(bias=torch.empty(255, device="meta")), r"bias must be a \(256,\) float tensor"),
        (
            dict(logits=torch.empty(4, NUM_EXPERTS, dtype=torch.int32, device="meta")),
            "float32, bfloat16 or float16",
        ),
    ],
)
def test_kernel_limits_are_checked_before_the_call(kwargs, message):
    kwargs = dict(kwargs)
    top_k = kwargs.pop("top_k", TOP_K)
    logits = kwargs.pop("logits", None)
    if logits is None:
        logits = _meta_logits(experts=kwargs.pop("experts", NUM_EXPERTS))
    kwargs.setdefault("n_group", N_GROUP)
    kwargs.setdefault("topk_group", 1)
    with pytest.raises(ValueError, match=message):
        route_flashinfer(logits, top_k, 2, **kwargs)


def test_bad_capture_targets_are_refused_before_the_kernel():
    buffer = torch.full((16, 2, TOP_K), POISON, dtype=torch.int32, device="meta")
    counts = torch.zeros(1, dtype=torch.int32, device="meta")
    with pytest.raises(TypeError, match="capture must be a CaptureTarget or None, got object"):
        route_flashinfer(_meta_logits(), TOP_K, 2, n_group=8, topk_group=4, capture=object())
    with pytest.raises(IndexError, match="layer_id"):
        target = CaptureTarget(buffer, 2, token_counts=counts)
        route_flashinfer(_meta_logits(), TOP_K, 2, n_group=8, topk_group=4, capture=target)
    with pytest.raises(ValueError, match="top_k"):
        target = CaptureTarget(buffer[..., :4], 0, token_counts=counts)
        route_flashinfer(_meta_logits(), TOP_K, 2, n_group=8, topk_group=4, capture=target)


def test_replay_scratch_is_persistent_and_grows_to_powers_of_two():
    device = torch.device("cpu")
    _replay_scratch.pop((device, 5), None)
    a = _scratch(device, 5, 6)
    assert a.shape == (6, 5) and a.dtype == torch.int16 and a.is_contiguous()
    assert _replay_scratch[(device, 5)].shape == (8, 5)
    b = _scratch(device, 5, 3)
    assert b.data_ptr() == a.data_ptr(), "a smaller call must reuse the scratch"
    c = _scratch(device, 5, 9)
    assert _replay_scratch[(device, 5)].shape == (16, 5) and c.shape == (9, 5)
    _replay_scratch.pop((device, 5))


def _recording_backend(graphs: list):
    from torch._dynamo.backends.common import aot_autograd

    def fw_compiler(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return aot_autograd(fw_compiler=fw_compiler)


@pytest.mark.parametrize("layout", [BatchLayout.LOCAL, BatchLayout.GATHERED], ids=lambda v: v.name)
def test_route_with_capture_compiles_fullgraph_on_fake_tensors(layout):
    torch._dynamo.reset()
    dev = "meta"
    dp_size = 1 if layout == BatchLayout.LOCAL else 3
    buffer = torch.full((16, 2, TOP_K), POISON, dtype=torch.int32, device=dev)
    counts = torch.zeros(dp_size, dtype=torch.int32, device=dev)
    target = CaptureTarget(buffer, 1, token_counts=counts, dp_rank=dp_size - 1, layout=layout)

    def step(logits, bias):
        return route_flashinfer(
            logits,
            TOP_K,
            2,
            bias=bias,
            n_group=N_GROUP,
            topk_group=TOPK_GROUP,
            routed_scaling_factor=SCALE,
            capture=target,
        )

    logits, bias = torch.empty(12, NUM_EXPERTS, device=dev), torch.empty(NUM_EXPERTS, device=dev)
    assert count_graph_breaks(step, logits, bias) == 0
    torch._dynamo.reset()
    graphs: list = []
    compiled = torch.compile(step, fullgraph=True, backend=_recording_backend(graphs))
    with CompileCounters() as cc:
        weights, ids = compiled(logits, bias)
    assert cc.graph_breaks == 0 and cc.graphs == 1
    assert (
        weights.shape == ids.shape == (12, TOP_K)
        and weights.dtype == torch.float32
        and ids.dtype == torch.int32
    )
    nodes = [
        n for n in graphs[0].graph.nodes if n.op == "call_function" and "auto_functionalized" in str(n.target)
    ]
    (route,) = [n for n in nodes if "flashinfer_fused_topk_deepseek" in str(n.args[0])]
    (capture,) = [n for n in nodes if "capture_routing_" in str(n.args[0])]
    replay = capture.kwargs["topk_ids"]
    assert replay.op == "call_function" and replay.args[0] is route, (
        "capture must read the kernel's replay output"
    )
    # the row rule's offset: GATHERED rank dp_size - 1 starts after the blocks of the ranks before it
    n_first = 0 if layout == BatchLayout.LOCAL else dp_size - 1
    assert capture.kwargs["n_first"] == n_first and capture.kwargs["dp_rank"] == dp_size - 1


def test_zero_tokens_skip_the_kernel_but_not_the_capture():
    buffer = torch.full((4, 1, TOP_K), POISON, dtype=torch.int32, device="meta")
    target = CaptureTarget(buffer, 0, token_counts=torch.zeros(1, dtype=torch.int32, device="meta"))
    weights, ids = route_flashinfer(_meta_logits(0), TOP_K, 2, n_group=8, topk_group=4, capture=target)
    assert weights.shape == ids.shape == (0, TOP_K)


# ------------------------------------------------------------------ GPU: against the reference

GPU_N = [1, 7, 128, 4096]


@pytest.fixture
def fused_topk_device(cuda_device):
    from moe_ops.flashinfer.backends import fused_topk_support

    support = fused_topk_support(cuda_device)
    if not support.ok:
        pytest.skip(support.reason)
    return cuda_device


def _inputs(n, device, seed=0):
    bias = torch.randn(NUM_EXPERTS, generator=torch.Generator().manual_seed(seed + 1)) * 0.05
    logits = separated_logits(n, seed, bias)
    return logits.to(device), bias.to(device), logits, bias


@pytest.mark.gpu
@pytest.mark.parametrize("n", GPU_N)
def test_fused_topk_replay_matches_reference(fused_topk_device, n):
    dev = fused_topk_device
    logits, bias, logits_cpu, bias_cpu = _inputs(n, dev, seed=n)
    ref_w, ref_ids, _ = deepseek_v3_reference(logits_cpu, bias_cpu)
    replay = torch.full((n + 5, TOP_K), POISON, dtype=torch.int16, device=dev)
    values, ids = ops.call(
        "fused_topk_deepseek",
        scores=logits,
        bias=bias,
        n_group=N_GROUP,
        topk_group=TOPK_GROUP,
        topk=TOP_K,
        routed_scaling_factor=SCALE,
        routing_replay_out=replay,
    )
    torch.cuda.synchronize()
    tri_ids = ids.cpu()
    assert torch.equal(rows_as_sets(tri_ids), rows_as_sets(ref_ids)), (
        "expert id sets differ from the reference"
    )
    assert torch.equal(replay[:n].cpu().long(), tri_ids.long()), "replay rows differ from topk_indices"
    assert (replay[n:] == POISON).all(), "rows past num_tokens were written"
    assert_weights_match(values.cpu(), tri_ids, ref_w, ref_ids)
    # the project's own routers (Triton kernel and PyTorch reference) choose the same sets
    for backend in ("triton", "torch"):
        _, our_ids = route(
            logits,
            TOP_K,
            RoutingMethod.DEEPSEEK_V3,
            bias=bias,
            n_group=N_GROUP,
            topk_group=TOPK_GROUP,
            routed_scaling_factor=SCALE,
            backend=backend,
        )
        assert torch.equal(rows_as_sets(our_ids.cpu()), rows_as_sets(tri_ids)), f"route(backend={backend!r})"
    # backend="auto" routes with the Triton router (measured faster than this kernel with its weight
    # cast: docs/routing.md, Backends), id for id
    kw = dict(bias=bias, n_group=N_GROUP, topk_group=TOPK_GROUP, routed_scaling_factor=SCALE)
    auto_w, auto_ids = route(logits, TOP_K, RoutingMethod.DEEPSEEK_V3, **kw)
    tri_w, tri_ids2 = route(logits, TOP_K, RoutingMethod.DEEPSEEK_V3, backend="triton", **kw)
    assert torch.equal(auto_ids, tri_ids2) and torch.equal(auto_w, tri_w), "auto should use the Triton router"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [BatchLayout.LOCAL, BatchLayout.GATHERED], ids=lambda v: v.name)
def test_route_flashinfer_captures_this_ranks_rows(fused_topk_device, layout):
    dev = fused_topk_device
    counts_list = [5] if layout == BatchLayout.LOCAL else [3, 5, 2]
    padded = [8] * len(counts_list)
    rank = len(counts_list) - 1 if layout == BatchLayout.GATHERED else 0
    n = sum(padded) if layout == BatchLayout.GATHERED else padded[0]
    logits, bias, logits_cpu, bias_cpu = _inputs(n, dev, seed=11)
    _, ref_ids, _ = deepseek_v3_reference(logits_cpu, bias_cpu)
    buffer = torch.full((16, 3, TOP_K), POISON, dtype=torch.int32, device=dev)
    counts = torch.tensor(counts_list, dtype=torch.int32, device=dev)
    sizes = torch.tensor(padded, dtype=torch.int32, device=dev) if layout == BatchLayout.GATHERED else None
    target = CaptureTarget(buffer, 2, token_counts=counts, dp_rank=rank, layout=layout, shard_sizes=sizes)
    weights, ids = route_flashinfer(
        logits,
        TOP_K,
        2,
        bias=bias,
        n_group=N_GROUP,
        topk_group=TOPK_GROUP,
        routed_scaling_factor=SCALE,
        capture=target,
    )
    torch.cuda.synchronize()
    start, c = sum(padded[:rank]) if layout == BatchLayout.GATHERED else 0, counts_list[rank]
    expected = torch.full_like(buffer, POISON)
    expected[:c, 2] = ids[start : start + c]
    assert torch.equal(buffer, expected)
    assert torch.equal(rows_as_sets(ids.cpu()), rows_as_sets(ref_ids))
    assert weights.dtype == torch.float32
    assert check_capture_errors(dev) == 0


@pytest.mark.gpu
def test_route_flashinfer_in_a_cuda_graph_follows_live_counts(fused_topk_device):
    dev = fused_topk_device
    padded = 128
    logits, bias, *_ = _inputs(padded, dev, seed=3)
    buffer = torch.full((padded, 2, TOP_K), POISON, dtype=torch.int32, device=dev)
    counts = torch.tensor([padded], dtype=torch.int32, device=dev)
    target = CaptureTarget(buffer, 1, token_counts=counts)

    def step():
        return route_flashinfer(
            logits,
            TOP_K,
            2,
            bias=bias,
            n_group=N_GROUP,
            topk_group=TOPK_GROUP,
            routed_scaling_factor=SCALE,
            capture=target,
        )

    step()  # warm-up: JIT, the persistent scratch, the capture kernel and its fault counter
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_w, static_ids = step()
    for seed, live in ((4, 128), (5, 1), (6, 77), (7, 0)):
        new_logits, new_bias, logits_cpu, bias_cpu = _inputs(padded, dev, seed=seed)
        logits.copy_(new_logits)
        bias.copy_(new_bias)
        counts.fill_(live)
        buffer.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        ref_w, ref_ids, _ = deepseek_v3_reference(logits_cpu, bias_cpu)
        assert torch.equal(rows_as_sets(static_ids.cpu()), rows_as_sets(ref_ids)), f"replay {seed}: wrong ids"
        assert_weights_match(static_w.cpu(), static_ids.cpu(), ref_w, ref_ids)
        expected = torch.full_like(buffer, POISON)
        expected[:live, 1] = static_ids[:live]
        assert torch.equal(buffer, expected), f"replay with count {live} captured the wrong rows"
    assert check_capture_errors(dev) == 0


@pytest.mark.gpu
def test_route_flashinfer_compiled_equals_eager(fused_topk_device):
    dev = fused_topk_device
    torch._dynamo.reset()
    logits, bias, logits_cpu, bias_cpu = _inputs(64, dev, seed=9)
    buffers = [torch.full((64, 1, TOP_K), POISON, dtype=torch.int32, device=dev) for _ in range(2)]
    counts = torch.tensor([50], dtype=torch.int32, device=dev)

    targets = [CaptureTarget(buffer, 0, token_counts=counts) for buffer in buffers]

    def step(logits, bias, target):
        return route_flashinfer(
            logits,
            TOP_K,
            2,
            bias=bias,
            n_group=N_GROUP,
            topk_group=TOPK_GROUP,
            routed_scaling_factor=SCALE,
            capture=target,
        )

    compiled = torch.compile(step, fullgraph=True)
    with CompileCounters() as cc:
        w_c, ids_c = compiled(logits, bias, targets[0])
    w_e, ids_e = step(logits, bias, targets[1])
    torch.cuda.synchronize()
    assert cc.graph_breaks == 0
    assert torch.equal(ids_c, ids_e) and torch.equal(buffers[0], buffers[1])
    torch.testing.assert_close(w_c, w_e)
    assert (buffers[0][50:] == POISON).all()
    _, ref_ids, _ = deepseek_v3_reference(logits_cpu, bias_cpu)
    assert torch.equal(rows_as_sets(ids_c.cpu()), rows_as_sets(ref_ids))


@pytest.mark.gpu
def test_opcheck_fused_topk_deepseek(fused_topk_device):
    dev = fused_topk_device
    logits, bias, *_ = _inputs(16, dev, seed=21)
    args = (
        logits,
        bias,
        N_GROUP,
        TOPK_GROUP,
        TOP_K,
        SCALE,
        torch.empty(16, TOP_K, device=dev),
        torch.empty(16, TOP_K, dtype=torch.int32, device=dev),
        True,  # launch_with_pdl: the schema has no defaults (see ops.OpSpec.schema)
        torch.empty(20, TOP_K, dtype=torch.int16, device=dev),  # routing_replay_out
        "default",  # backend
    )
    torch.library.opcheck(ops.op_for("fused_topk_deepseek"), args)
