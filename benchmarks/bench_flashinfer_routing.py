"""DeepSeek-V3 routing with fused_topk_deepseek: what routing_replay_out and the fused capture cost.

DeepSeek-V3's router (256 experts, top_k 8, 8 groups, 4 kept, scaling 2.5), float32 logits, at
n in {1, 128, 4096} tokens, eager (do_bench medians) and per replay of a CUDA graph:

* ``fused_topk``          - fused_topk_deepseek alone: the floor every ratio is taken against;
* ``fused_topk+replay``   - the same kernel also writing routing_replay_out (target: <= 1.05x);
* ``route_flashinfer+capture`` - route_flashinfer with a capture target: kernel + replay + the
  capture op copying this rank's rows into a (4096, 61, 8) int32 buffer;
* ``route_triton+capture`` - ``moe_ops.route(..., backend="triton", capture=...)`` (issue 3), the
  peer route(backend="auto") chooses against; skipped with a message while it does not exist.

    python benchmarks/bench_flashinfer_routing.py [--csv out.csv] [--sizes 1,128,4096]

The first call JIT-compiles fused_topk_deepseek with nvcc (about 20 s on an H200).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import moe_ops
from benchmarks.harness import Table, do_bench_median_us, graph_replay_us
from moe_ops import BatchLayout
from moe_ops.flashinfer import CaptureTarget, ops, route_flashinfer
from moe_ops.flashinfer.backends import DEEPSEEK_V3, fused_topk_support

NUM_EXPERTS, TOP_K, N_GROUP, TOPK_GROUP, SCALE = 256, 8, 8, 4, 2.5
LAYERS, MAX_TOKENS = 61, 4096


def _capture_target(buffer, counts):
    """moe_ops.capture.target.CaptureTarget (issue 3) when it exists, else this package's twin."""
    fields = dict(
        buffer=buffer,
        layer_id=LAYERS - 1,
        token_counts=counts,
        dp_rank=0,
        layout=BatchLayout.LOCAL,
        shard_sizes=None,
    )
    try:
        from moe_ops.capture.target import CaptureTarget as Target

        return Target(**fields)
    except (ImportError, TypeError) as exc:
        print(f"using moe_ops.flashinfer.CaptureTarget ({type(exc).__name__}: {exc})")
        return CaptureTarget(**fields)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--csv", default=None)
    parser.add_argument("--sizes", default="1,128,4096")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_flashinfer_routing needs a CUDA GPU; nothing measured")
        return
    dev = torch.device("cuda")
    support = fused_topk_support(dev)
    if not support.ok:
        print(f"bench_flashinfer_routing: {support.reason}; nothing measured")
        return
    route = getattr(moe_ops, "route", None)
    method = getattr(getattr(moe_ops, "RoutingMethod", None), "DEEPSEEK_V3", DEEPSEEK_V3)
    if route is None:
        print("moe_ops.route does not exist on this branch (issue 3): route_triton+capture is skipped")

    table = Table(
        "DeepSeek-V3 routing (256 experts, top_k 8, 8 groups, 4 kept), float32 logits",
        ["variant", "n", "eager_us", "graph_us", "graph_ratio_vs_fused_topk"],
    )
    buffer = torch.zeros(MAX_TOKENS, LAYERS, TOP_K, dtype=torch.int32, device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    for n in (int(s) for s in args.sizes.split(",")):
        logits = torch.randn(n, NUM_EXPERTS, device=dev, generator=g)
        bias = torch.randn(NUM_EXPERTS, device=dev, generator=g) * 0.05
        values = torch.empty(n, TOP_K, device=dev)
        indices = torch.empty(n, TOP_K, dtype=torch.int32, device=dev)
        replay = torch.empty(n, TOP_K, dtype=torch.int16, device=dev)
        counts = torch.tensor([n], dtype=torch.int32, device=dev)
        target = _capture_target(buffer, counts)
        common = dict(bias=bias, n_group=N_GROUP, topk_group=TOPK_GROUP, routed_scaling_factor=SCALE)

        def fused(replay_out):
            return lambda: ops.call(
                "fused_topk_deepseek",
                scores=logits,
                bias=bias,
                n_group=N_GROUP,
                topk_group=TOPK_GROUP,
                topk=TOP_K,
                routed_scaling_factor=SCALE,
                topk_values=values,
                topk_indices=indices,
                routing_replay_out=replay_out,
            )

        variants = {
            "fused_topk": fused(None),
            "fused_topk+replay": fused(replay),
            "route_flashinfer+capture": lambda: route_flashinfer(
                logits, TOP_K, DEEPSEEK_V3, capture=target, **common
            ),
        }
        if route is not None:
            variants["route_triton+capture"] = lambda: route(
                logits, TOP_K, method, capture=target, backend="triton", **common
            )
        floor = None
        for name, fn in variants.items():
            fn()  # warm-up: JIT compile, persistent scratch, capture fault counter
            torch.cuda.synchronize()
            eager = do_bench_median_us(fn)
            graph = graph_replay_us(fn)
            floor = graph if floor is None else floor
            table.add(name, n, eager, graph, graph / floor)
        fused(replay)()
        torch.cuda.synchronize()
        assert torch.equal(replay.long(), indices.long()), "routing_replay_out differs from topk_indices"
    if args.csv:
        table.write_csv(args.csv)
    table.print()


if __name__ == "__main__":
    main()
