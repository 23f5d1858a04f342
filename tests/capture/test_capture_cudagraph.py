"""CUDA graphs: capture once at a padded size, then replay with live counts changed in place."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from capture_models import TinyRouted, layout_inputs
from strategies import POISON

from moe_ops import BatchLayout, capture_routing, check_capture_errors
from moe_ops.graphs import CompileCounters

pytestmark = pytest.mark.gpu

# live count vectors (dp_size 3, this is rank 1), each within the padded size 8 per rank
LIVE_COUNTS = [[8, 8, 8], [3, 5, 1], [0, 0, 0], [1, 8, 0], [7, 2, 6], [0, 6, 8], [5, 1, 5]]
PADDED = 8
TOP_K = 4


def _inputs(layout, device):
    """Static tensors for a graph captured at padded size 8 per rank, three DP ranks."""
    counts = torch.tensor(LIVE_COUNTS[0], dtype=torch.int32, device=device)
    sizes = None
    if layout in (BatchLayout.LOCAL, BatchLayout.SEQUENCE_PARALLEL):
        n = PADDED
    elif layout == BatchLayout.GATHERED:
        n = 3 * PADDED
        sizes = torch.full((3,), PADDED, dtype=torch.int32, device=device)
    else:
        n = 3 * PADDED  # two shards of 4 per rank
        sizes = torch.full((6,), PADDED // 2, dtype=torch.int32, device=device)
    ids = torch.empty(n, TOP_K, dtype=torch.int32, device=device)
    return ids, counts, sizes


@pytest.mark.parametrize("layout", list(BatchLayout), ids=lambda v: v.name)
def test_manual_cuda_graph_replays_follow_live_counts(cuda_device, layout):
    ids, counts, sizes = _inputs(layout, cuda_device)
    buffer = torch.full((16, 5, TOP_K), POISON, dtype=torch.int32, device=cuda_device)

    def step():
        capture_routing(buffer, ids, 3, token_counts=counts, dp_rank=1, layout=layout, shard_sizes=sizes)

    ids.random_(0, 256)
    step()  # warm-up: compiles the kernel, allocates the fault counter
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    rng = np.random.default_rng(0)
    block = 0 if layout in (BatchLayout.LOCAL, BatchLayout.SEQUENCE_PARALLEL) else PADDED
    for live in LIVE_COUNTS:
        counts.copy_(torch.tensor(live, dtype=torch.int32))
        ids.copy_(torch.from_numpy(rng.integers(0, 256, size=tuple(ids.shape), dtype=np.int32)))
        buffer.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        c = live[1]
        expected = torch.full_like(buffer, POISON)
        expected[:c, 3] = ids[block : block + c]
        assert torch.equal(buffer, expected), f"replay with counts {live} wrote the wrong rows"
    assert check_capture_errors(cuda_device) == 0


def test_reduce_overhead_has_no_cudagraph_skips(cuda_device):
    model = TinyRouted(layout=BatchLayout.GATHERED, dp_rank=1).to(cuda_device)
    x, counts, sizes, start = layout_inputs(BatchLayout.GATHERED, [5, 6], [8, 8], device=cuda_device)
    torch._dynamo.reset()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with CompileCounters() as cc:
        for step, live in enumerate([[5, 6], [0, 3], [8, 8], [2, 0], [7, 1], [1, 8], [4, 4]]):
            counts.copy_(torch.tensor(live, dtype=torch.int32))
            model.routing.fill_(POISON)
            _, ids = compiled(x, counts, sizes)
            c = live[1]
            assert torch.equal(model.routing[:c], ids[start : start + c].to(torch.int32)), f"step {step}"
            assert (model.routing[c:] == POISON).all(), f"step {step}: rows past the live count written"
    assert cc.cudagraph_skips == 0, "inductor skipped CUDA graphs (the capture mutation must be allowed)"
    assert cc.graph_breaks == 0 and cc.graphs == 1
