"""Replay cost: ``replay_routing`` forward and backward against the router and the PyTorch reference,
and a compiled MoE layer of the reference model with replay on against live routing.

Cases (``CASES`` = ``BENCH_CASES["replay"]``, benchmarks/cases.py; each names the test that checks
the same shapes): DeepSeek-V3 routing (256 experts, top-8, 8 groups keep 4, routed scaling 2.5,
bias) and RENORMALIZE 128/8, bf16 logits, at n in ``BENCH_SIZES["replay"]`` = {1, 128, 4096, 16384}.
The record is the router's choice for slightly different logits (the rollout's: logits + N(0,
0.1^2)), so it is not the trainer's top-k, as in a real replay.

Tables, every peer timed as one call inside a CUDA graph of ``GRAPH_CALLS`` = 61 calls (DeepSeek-V3's
MoE layers each route once per step), peers interleaved trial by trial (benchmarks/harness.py):

* ``forward``: ``replay`` (``replay_routing``, Triton) against ``route`` (the Triton router, same
  method). Target: **<= 1.0x** (replay does no top-k).
* ``forward+backward``: ``replay`` (forward, then ``torch.autograd.grad`` to the logits) against
  ``eager-ref`` (autograd through ``moe_ops.router.reference.weights_for_ids`` at the recorded ids)
  and ``compiled-ref`` (the same, ``torch.compile``-d). Target: replay **>= 5x** faster than
  ``eager-ref`` at 4096 tokens; ``compiled-ref`` reported.
* ``moe layer``: the MoE block of the reference model's ``deepseek_small`` preset (its router gate,
  bias and experts, made trainable), compiled (``fullgraph=True``), forward + backward to the input
  and every parameter, with ``replay`` (the record), ``live`` (``replay_routing`` on rows of -1: the
  same op routing live) and ``live-ref`` (``route`` for the ids, autograd through
  ``weights_for_ids`` for the weights: live routing without this package's op). Target: replay
  **<= 1.02x** of live. Experts are the block's own ``"auto"`` choice (gathered below
  ``n * top_k < num_experts``, dense above), not a fast grouped GEMM: at 16384 tokens the dense
  experts dominate (tens of ms, tens of GB of activations; a size that does not fit is reported
  as OOM).

``eager_us`` (``do_bench``, Python dispatch included) and ``device_us`` (kernel time from the
profiler) are reported for the op tables as context.

    python benchmarks/bench_replay.py [--csv out.csv] [--sizes 1,128,4096,16384]
        [--layer-sizes 1,128,4096,16384] [--tables forward,backward,layer] [--launch-floor]
        [--sweep-forward] [--sweep-backward] [--dry-run]
    python -m benchmarks replay [the same flags]

``--launch-floor`` adds do-nothing kernels with replay's two grids; ``--sweep-forward`` and
``--sweep-backward`` time each kernel alone per (rows per program, warps), the default marked.

``--dry-run`` builds every case and peer on the CPU (small sizes, the "tiny" reference model, the
PyTorch twins, nothing compiled or timed) and calls each once: a check that the benchmark runs,
for machines without a GPU.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.cases import BENCH_CASES, BENCH_SIZES
from benchmarks.harness import Table, device_us_per_call, do_bench_median_us, graph_calls_us
from benchmarks.registry import benchmark, main, option, sizes_option, switch
from moe_ops import RoutingMethod, RoutingReplayer, RoutingShape, replay_routing, route
from moe_ops._runtime.triton import HAS_TRITON, next_power_of_2, triton_runs_on
from moe_ops.models import ReferenceMoEModel, reference_config
from moe_ops.replay.kernels import (
    backward_launch_config,
    forward_launch_config,
    replay_backward_triton,
    replay_rows_triton,
)
from moe_ops.router.args import tile_shape
from moe_ops.router.reference import weights_for_ids

GRAPH_CALLS = 61  # DeepSeek-V3's MoE-bearing depth
SLOTS, SELECTED = 4, 2  # micro-batch slots of the replayer peers, and the one they read
REF_CALLS = 8  # the eager reference is slow: a shorter graph
LAYER_CALLS = 4  # a MoE layer step with dense experts takes milliseconds at 4096+ tokens
ROLLOUT_NOISE = 0.1  # std of the rollout/trainer logit difference the record is drawn with
DRY_SIZES = (1, 8)
TARGET_FORWARD = 1.0
TARGET_BACKWARD_SPEEDUP = 5.0
TARGET_LAYER = 1.02
TARGET_SLOT = 1.02  # reading the record through a replayer's selected slot against a plain tensor


# the routers measured (benchmarks/cases.py BenchRouter: a router configuration and the test that checks it)
CASES = BENCH_CASES["replay"]


@dataclass
class Inputs:
    """The tensors of one (case, n): static addresses, as a CUDA-graphed training step holds them."""

    # (n, E) bf16 trainer logits (no grad: the forward peers)
    logits: torch.Tensor
    # (n, E) bf16 the same values, requiring grad (the forward+backward peers)
    trainable: torch.Tensor
    # (E,) float32 selection bias or None
    bias: torch.Tensor | None
    # (n, top_k) int32 the rollout's record: route() of logits + N(0, ROLLOUT_NOISE^2)
    recorded: torch.Tensor
    # (n, top_k) float32 incoming gradient of the weights
    grad_out: torch.Tensor
    # replay_routing / route backend: "triton" on a GPU, "torch" in the dry run
    backend: str
    # a RoutingReplayer of SLOTS micro-batch slots whose selected slot holds ``recorded`` (one layer)
    replayer: RoutingReplayer | None = None

    def kwargs(self, case) -> dict:
        return dict(
            bias=self.bias,
            n_group=case.n_group,
            topk_group=case.topk_group,
            routed_scaling_factor=case.routed_scaling_factor,
        )


def make_inputs(case, n: int, device: torch.device, backend: str) -> Inputs:
    g = torch.Generator(device=device).manual_seed(n)
    logits = torch.randn(n, case.num_experts, device=device, generator=g).to(torch.bfloat16)
    bias = torch.randn(case.num_experts, device=device, generator=g) * 0.1 if case.has_bias else None
    noise = torch.randn(n, case.num_experts, device=device, generator=g) * ROLLOUT_NOISE
    kw = dict(
        bias=bias,
        n_group=case.n_group,
        topk_group=case.topk_group,
        routed_scaling_factor=case.routed_scaling_factor,
    )
    recorded = route(logits.float() + noise, case.top_k, case.method, backend=backend, **kw)[1]
    shape = RoutingShape(num_layers=1, num_experts=case.num_experts, top_k=case.top_k)
    replayer = RoutingReplayer(shape, n, device, num_slots=SLOTS)
    for slot in range(SLOTS):  # the other micro-batches' slots hold other ids
        replayer.set_batch(recorded.roll(slot - SELECTED, dims=1)[:, None], slot=slot)
    replayer.select(SELECTED)
    return Inputs(
        logits=logits,
        trainable=logits.clone().requires_grad_(),
        bias=bias,
        recorded=recorded,
        grad_out=torch.randn(n, case.top_k, device=device, generator=g),
        backend=backend,
        replayer=replayer,
    )


def _scale(case) -> float:
    return 1.0 if case.routed_scaling_factor is None else case.routed_scaling_factor


# ---------------------------------------------------------------------------------------------------
# Peers: name -> builder(case, inputs, compile) -> zero-argument callable
# ---------------------------------------------------------------------------------------------------


def fwd_replay(case, x: Inputs, compile: bool) -> Callable[[], object]:
    kw = x.kwargs(case)
    return lambda: replay_routing(x.logits, x.recorded, case.method, backend=x.backend, **kw)


def fwd_replay_slot(case, x: Inputs, compile: bool) -> Callable[[], object]:
    """replay_routing reading the record as attach_replay's routers do: ``layer_ids`` of the selected
    slot of a SLOTS-slot replayer, with the replayer's row-count check in the forward kernel."""
    kw = dict(x.kwargs(case), backend=x.backend, row_count=x.replayer.row_count)
    n = x.logits.shape[0]
    return lambda: replay_routing(x.logits, x.replayer.layer_ids(0, n, device_check=False), case.method, **kw)


def fwd_route(case, x: Inputs, compile: bool) -> Callable[[], object]:
    kw = x.kwargs(case)
    return lambda: route(x.logits, case.top_k, case.method, backend=x.backend, **kw)


def fb_replay(case, x: Inputs, compile: bool) -> Callable[[], object]:
    kw = x.kwargs(case)

    def step():
        weights, _ = replay_routing(x.trainable, x.recorded, case.method, backend=x.backend, **kw)
        return torch.autograd.grad(weights, x.trainable, x.grad_out)

    return step


def fb_replay_slot(case, x: Inputs, compile: bool) -> Callable[[], object]:
    kw = x.kwargs(case)
    n = x.logits.shape[0]

    def step():
        recorded = x.replayer.layer_ids(0, n, device_check=False)
        weights, _ = replay_routing(
            x.trainable, recorded, case.method, backend=x.backend, row_count=x.replayer.row_count, **kw
        )
        return torch.autograd.grad(weights, x.trainable, x.grad_out)

    return step


def _reference_weights(case, x: Inputs) -> Callable[[torch.Tensor], torch.Tensor]:
    ids = x.recorded.long()
    return lambda logits: weights_for_ids(logits.float(), ids, case.method, _scale(case))


def fb_eager_reference(case, x: Inputs, compile: bool) -> Callable[[], object]:
    ref = _reference_weights(case, x)
    return lambda: torch.autograd.grad(ref(x.trainable), x.trainable, x.grad_out)


def fb_compiled_reference(case, x: Inputs, compile: bool) -> Callable[[], object] | None:
    if not compile:
        return None
    ref = torch.compile(_reference_weights(case, x), fullgraph=True, dynamic=False)
    return lambda: torch.autograd.grad(ref(x.trainable), x.trainable, x.grad_out)


FORWARD_PEERS = {"replay": fwd_replay, "replay-slot": fwd_replay_slot, "route": fwd_route}
BACKWARD_PEERS = {
    "replay": fb_replay,
    "replay-slot": fb_replay_slot,
    "eager-ref": fb_eager_reference,
    "compiled-ref": fb_compiled_reference,
}
BACKWARD_REFERENCES = ("eager-ref", "compiled-ref")


def check_forward(case, x: Inputs) -> None:
    """The benchmarked replay returns the record, and route's own weights when given route's ids."""
    _, ids = fwd_replay(case, x, False)()
    assert torch.equal(ids, x.recorded), "replay did not return the record"
    _, ids = fwd_replay_slot(case, x, False)()
    assert torch.equal(ids, x.recorded), "replay through the selected slot did not return its record"
    route_w, route_ids = fwd_route(case, x, False)()
    same_w, same_ids = replay_routing(x.logits, route_ids, case.method, backend=x.backend, **x.kwargs(case))
    assert torch.equal(same_ids, route_ids)
    torch.testing.assert_close(same_w, route_w, rtol=0, atol=1e-6)
    grads = {name: build(case, x, False) for name, build in BACKWARD_PEERS.items()}
    (mine,) = grads["replay"]()
    (ref,) = grads["eager-ref"]()
    torch.testing.assert_close(mine.float(), ref.float(), rtol=2e-2, atol=1e-3)  # bf16 gradients


# ---------------------------------------------------------------------------------------------------
# The launch floor and the backward launch sweep
# ---------------------------------------------------------------------------------------------------

if HAS_TRITON:
    import triton

    @triton.jit
    def _empty_kernel(x_ptr):
        """Does nothing: what a launch of this grid costs inside a CUDA graph."""
        pass


def _replay_grids(case, n: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((programs, warps) of the forward, (programs, warps) of the backward) at n tokens."""
    ng_pad, g_pad = tile_shape(case.num_experts, case.n_group or 1)
    fwd_m, fwd_warps = forward_launch_config(n, ng_pad, g_pad)
    bwd_m, bwd_warps = backward_launch_config(n, next_power_of_2(case.num_experts))
    return (-(-n // fwd_m), fwd_warps), (-(-n // bwd_m), bwd_warps)


def floor_peers(case, x: Inputs) -> dict[str, Callable[[], object]]:
    """``floor-1``: one do-nothing kernel with the backward's grid; ``floor-2``: two, with the
    forward's and the backward's grids (replay's launch structure, no work), on ``x.logits``."""
    (fwd_p, fwd_w), (bwd_p, bwd_w) = _replay_grids(case, x.logits.shape[0])
    arg = x.logits

    def one():
        _empty_kernel[(max(bwd_p, 1),)](arg, num_warps=bwd_w)

    def two():
        _empty_kernel[(max(fwd_p, 1),)](arg, num_warps=fwd_w)
        _empty_kernel[(max(bwd_p, 1),)](arg, num_warps=bwd_w)

    return {"floor-1": one, "floor-2": two}


# rows per program x warps of the backward kernel that --sweep-backward times
SWEEP_BLOCK_M = (1, 2, 4, 8, 16)
SWEEP_WARPS = (1, 2, 4, 8)
# rows per program of the forward kernel that --sweep-forward times (with SWEEP_WARPS)
SWEEP_FORWARD_BLOCK_M = (1, 2, 4, 8, 16, 32)


def sweep_peers(case, x: Inputs, configs=None) -> dict[str, Callable[[], object]]:
    """The backward kernel alone (one forward's saved tensors) per (block_m, num_warps), named
    ``bwd m=M w=W``; ``configs`` defaults to every SWEEP_BLOCK_M x SWEEP_WARPS pair."""
    weights, ids = replay_routing(x.logits, x.recorded, case.method, backend=x.backend, **x.kwargs(case))
    out = torch.empty_like(x.logits)
    method, scale = int(case.method), _scale(case)
    configs = configs or [(m, w) for m in SWEEP_BLOCK_M for w in SWEEP_WARPS]

    def peer(m, w):
        return lambda: replay_backward_triton(
            grad_weights=x.grad_out, router_logits=x.logits, weights=weights, ids=ids, grad_logits=out,
            method=method, routed_scaling_factor=scale, unnormalized=False, block_m=m, num_warps=w,
        )  # fmt: skip

    return {f"bwd m={m} w={w}": peer(m, w) for m, w in configs}


# ---------------------------------------------------------------------------------------------------
# The MoE layer of the reference model
# ---------------------------------------------------------------------------------------------------

LAYER_MODES = ("replay", "live", "live-ref")


def make_block(config, device: torch.device) -> torch.nn.Module:
    """The MoE block of a one-MoE-layer reference model, its parameters made trainable (the
    reference model is inference-only) except the selection bias, which gets no gradient."""
    model = ReferenceMoEModel(config, device)
    block = model.layers[config.first_k_dense].mlp
    for name, p in block.named_parameters():
        p.requires_grad_(name != "bias")
    return block


def layer_forward(block, x: torch.Tensor, recorded: torch.Tensor, *, mode: str, backend: str) -> torch.Tensor:
    """The block's forward (``_MoEBlock.forward``) with its routing chosen by ``mode``: "replay"
    (``replay_routing`` of ``recorded``; the "live" peer passes a record of -1 rows to the same
    function, so the two share one compiled graph) or "live-ref"."""
    cfg = block.config
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * block.norm
    logits = h.to(block.gate.dtype) @ block.gate
    kw = dict(
        bias=block.bias,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        routed_scaling_factor=cfg.routed_scaling_factor,
    )
    method = RoutingMethod(cfg.routing_method)
    if mode == "live-ref":
        _, ids = route(logits.detach().float(), cfg.top_k, method, backend=backend, **kw)
        scale = 1.0 if cfg.routed_scaling_factor is None else cfg.routed_scaling_factor
        weights = weights_for_ids(logits.float(), ids.long(), method, scale)
    else:
        weights, ids = replay_routing(logits.float(), recorded, method, backend=backend, **kw)
    weights = weights.to(h.dtype)
    if h.shape[0] * cfg.top_k < cfg.num_experts:
        return block._gathered(h, weights, ids)
    return block._dense(h, weights, ids)


def layer_peer(
    block, n: int, mode: str, backend: str, compile: bool, compiled: dict | None = None
) -> Callable[[], object]:
    """Forward + backward of the block at n tokens for ``mode`` in LAYER_MODES. ``compiled``
    (shared by the peers of one size) holds one compiled function per routing kind: "live" runs
    replay's on a record of -1 rows (same shapes and dtypes: no second compile, and the two modes
    differ only in the record)."""
    cfg = block.config
    device = block.gate.device
    g = torch.Generator(device=device).manual_seed(n)
    x = torch.randn(n, cfg.hidden_size, device=device, generator=g).to(cfg.dtype).requires_grad_()
    grad_y = torch.randn(n, cfg.hidden_size, device=device, generator=g).to(cfg.dtype)
    with torch.no_grad():
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * block.norm
        logits = (h.to(block.gate.dtype) @ block.gate).float()
        logits = logits + torch.randn(logits.shape, device=device, generator=g) * ROLLOUT_NOISE
        kw = dict(bias=block.bias, n_group=cfg.n_group, topk_group=cfg.topk_group)
        kw["routed_scaling_factor"] = cfg.routed_scaling_factor
        recorded = route(logits, cfg.top_k, cfg.routing_method, backend=backend, **kw)[1]
    if mode == "live":
        recorded = torch.full_like(recorded, -1)
    kind = "live-ref" if mode == "live-ref" else "replay"
    compiled = {} if compiled is None else compiled
    fn = compiled.get(kind)
    if fn is None:
        fn = functools.partial(layer_forward, block, mode=kind, backend=backend)
        if compile:
            fn = torch.compile(fn, fullgraph=True, dynamic=False)
        compiled[kind] = fn
    params = [x, *(p for p in block.parameters() if p.requires_grad)]
    return lambda: torch.autograd.grad(fn(x, recorded), params, grad_y)


# ---------------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------------


def measure_ops(sizes: list[int], tables: set[str], cases=CASES) -> list[Table]:
    dev = torch.device("cuda")
    cols = ["case", "n", "peer", "eager_us", "graph_us", "device_us", "graph_vs_replay"]
    forward = Table(
        f"replay forward (bf16 logits; graph = one call of a {GRAPH_CALLS}-call CUDA graph)", cols
    )
    backward = Table("replay forward+backward (gradient w.r.t. the logits)", cols)
    summary = Table(
        "targets (graph time per call)",
        [
            "case",
            "n",
            "replay/route fwd",
            f"<= {TARGET_FORWARD}",
            "eager-ref/replay fwd+bwd",
            "compiled-ref/replay",
            "slot/replay fwd",
            "slot/replay fwd+bwd",
            f"<= {TARGET_SLOT}",
        ],
    )
    for case in cases:
        for n in sizes:
            # one compile per (case, n) of shared code: stay below dynamo's per-code cache limit
            torch._dynamo.reset()
            x = make_inputs(case, n, dev, "triton")
            check_forward(case, x)
            torch.cuda.synchronize()
            fwd_ratio = bwd_ratio = compiled_ratio = slot_fwd = slot_bwd = ""
            if "forward" in tables:
                fns = {name: build(case, x, True) for name, build in FORWARD_PEERS.items()}
                graph = graph_calls_us(fns, calls=GRAPH_CALLS)
                for name, fn in fns.items():
                    forward.add(
                        case.name,
                        n,
                        name,
                        do_bench_median_us(fn),
                        graph[name],
                        device_us_per_call(fn),
                        graph[name] / graph["replay"],
                    )
                fwd_ratio = graph["replay"] / graph["route"]
                slot_fwd = graph["replay-slot"] / graph["replay"]
            if "backward" in tables:
                fns = {name: build(case, x, True) for name, build in BACKWARD_PEERS.items()}
                fns = {name: fn for name, fn in fns.items() if fn is not None}
                fast = {name: fn for name, fn in fns.items() if name not in BACKWARD_REFERENCES}
                refs = {name: fn for name, fn in fns.items() if name in BACKWARD_REFERENCES}
                graph = graph_calls_us(fast, calls=GRAPH_CALLS)
                graph.update(graph_calls_us(refs, calls=REF_CALLS, trials=7))
                for name, fn in fns.items():
                    backward.add(
                        case.name,
                        n,
                        name,
                        do_bench_median_us(fn),
                        graph[name],
                        device_us_per_call(fn),
                        graph[name] / graph["replay"],
                    )
                bwd_ratio = graph["eager-ref"] / graph["replay"]
                slot_bwd = graph["replay-slot"] / graph["replay"]
                compiled_ratio = graph["compiled-ref"] / graph["replay"]
            ok = "" if fwd_ratio == "" else fwd_ratio <= TARGET_FORWARD
            slots_ok = all(r == "" or r <= TARGET_SLOT for r in (slot_fwd, slot_bwd))
            summary.add(case.name, n, fwd_ratio, ok, bwd_ratio, compiled_ratio, slot_fwd, slot_bwd, slots_ok)
    out = [t for t, key in ((forward, "forward"), (backward, "backward")) if key in tables]
    return [*out, summary]


def measure_floor(sizes: list[int], cases=CASES) -> Table:
    """Replay's forward and forward+backward against do-nothing kernels of the same grids, every
    peer one call of a GRAPH_CALLS-call CUDA graph, interleaved."""
    dev = torch.device("cuda")
    table = Table(
        f"launch floor (do-nothing kernels with replay's grids; one call of a {GRAPH_CALLS}-call graph)",
        ["case", "n", "floor-1_us", "floor-2_us", "replay_fwd_us", "replay_fwd+bwd_us", "fwd+bwd - floor-2"],
    )
    for case in cases:
        for n in sizes:
            x = make_inputs(case, n, dev, "triton")
            fns = floor_peers(case, x)
            fns["fwd"] = fwd_replay(case, x, False)
            fns["fwd+bwd"] = fb_replay(case, x, False)
            graph = graph_calls_us(fns, calls=GRAPH_CALLS)
            table.add(
                case.name,
                n,
                graph["floor-1"],
                graph["floor-2"],
                graph["fwd"],
                graph["fwd+bwd"],
                graph["fwd+bwd"] - graph["floor-2"],
            )
    return table


def measure_sweep(sizes: list[int], cases=CASES) -> Table:
    """The backward kernel alone per launch configuration (one call of a GRAPH_CALLS-call graph);
    ``default`` marks backward_launch_config's choice."""
    dev = torch.device("cuda")
    table = Table(
        f"backward kernel launch sweep (one call of a {GRAPH_CALLS}-call graph)",
        ["case", "n", "block_m", "warps", "graph_us", "default"],
    )
    for case in cases:
        for n in sizes:
            x = make_inputs(case, n, dev, "triton")
            default = backward_launch_config(n, next_power_of_2(case.num_experts))
            configs = [(m, w) for m in SWEEP_BLOCK_M for w in SWEEP_WARPS if m <= next_power_of_2(n)]
            fns = sweep_peers(case, x, configs)
            graph = graph_calls_us(fns, calls=GRAPH_CALLS, trials=11)
            for (m, w), name in zip(configs, fns):
                table.add(case.name, n, m, w, graph[name], (m, w) == default)
    return table


def forward_sweep_peers(case, x: Inputs, configs=None) -> dict[str, Callable[[], object]]:
    """The forward kernel alone per (block_m, num_warps), named ``fwd m=M w=W``, into fixed
    outputs; ``configs`` defaults to every SWEEP_BLOCK_M x SWEEP_WARPS pair."""
    n, k = x.recorded.shape
    dev = x.logits.device
    weights = torch.empty(n, k, dtype=torch.float32, device=dev)
    ids = torch.empty(n, k, dtype=torch.int32, device=dev)
    errors = torch.zeros(2, dtype=torch.int32, device=dev)
    nonfinite = torch.zeros(1, dtype=torch.int32, device=dev)
    method, scale = int(case.method), _scale(case)
    n_group, topk_group = (case.n_group, case.topk_group) if case.n_group else (1, 1)
    configs = configs or [(m, w) for m in SWEEP_BLOCK_M for w in SWEEP_WARPS]

    def peer(m, w):
        return lambda: replay_rows_triton(
            router_logits=x.logits, recorded_ids=x.recorded, weights=weights, ids=ids, errors=errors,
            nonfinite=nonfinite, row_count=None, bias=x.bias, hash_table=None, token_ids=None,
            method=method, n_group=n_group, topk_group=topk_group, routed_scaling_factor=scale,
            unnormalized=False, group_top=2, block_m=m, num_warps=w,
        )  # fmt: skip

    return {f"fwd m={m} w={w}": peer(m, w) for m, w in configs}


def measure_forward_sweep(sizes: list[int], cases=CASES) -> Table:
    """The forward kernel alone per launch configuration (one call of a GRAPH_CALLS-call graph);
    ``default`` marks forward_launch_config's choice."""
    dev = torch.device("cuda")
    table = Table(
        f"forward kernel launch sweep (one call of a {GRAPH_CALLS}-call graph)",
        ["case", "n", "block_m", "warps", "graph_us", "default"],
    )
    for case in cases:
        for n in sizes:
            x = make_inputs(case, n, dev, "triton")
            default = forward_launch_config(n, *tile_shape(case.num_experts, case.n_group or 1))
            configs = [(m, w) for m in SWEEP_FORWARD_BLOCK_M for w in SWEEP_WARPS if m <= next_power_of_2(n)]
            if default not in configs:
                configs.append(default)
            fns = forward_sweep_peers(case, x, configs)
            graph = graph_calls_us(fns, calls=GRAPH_CALLS, trials=11)
            for (m, w), name in zip(configs, fns):
                table.add(case.name, n, m, w, graph[name], (m, w) == default)
    return table


def measure_select(sizes: list[int]) -> Table:
    """What selecting a micro-batch's slot costs, once per micro-batch (never per router call):
    ``select`` alternating between two slots of a DeepSeek-V3-shaped replayer (58 MoE layers x 8
    ids), against ``copy_`` of the same rows, its floor. Eager (select is a host method), medians of
    ``do_bench``, host time included."""
    dev = torch.device("cuda")
    shape = RoutingShape(num_layers=58, num_experts=256, top_k=8)
    table = Table(
        "select(slot): copy of a micro-batch's rows into the read buffer (58 layers x 8, eager)",
        ["n", "select_us", "copy_us", "select/copy", "MB"],
    )
    for n in sizes:
        replayer = RoutingReplayer(shape, n, dev, num_slots=2)
        rows = torch.randint(0, 256, (n, 58, 8), dtype=torch.int32, device=dev)
        replayer.set_batch(rows, slot=0)
        replayer.set_batch(rows.flip(0), slot=1)
        state = [0]

        def select():
            state[0] ^= 1
            replayer.select(state[0])

        src = replayer._slots[1]
        select_us = do_bench_median_us(select)
        copy_us = do_bench_median_us(lambda: replayer.buffer.copy_(src))
        table.add(n, select_us, copy_us, select_us / copy_us, rows.numel() * 4 / 1e6)
    return table


def measure_layer(sizes: list[int]) -> Table:
    dev = torch.device("cuda")
    config = reference_config("deepseek_small", num_layers=2)  # one dense, one MoE layer
    block = make_block(config, dev)
    table = Table(
        f"compiled MoE layer of deepseek_small, forward+backward (one call of a {LAYER_CALLS}-call graph)",
        [
            "n",
            "experts",
            "replay_us",
            "live_us",
            "live-ref_us",
            "replay/live",
            f"<= {TARGET_LAYER}",
            "replay/live-ref",
        ],
    )
    for n in sizes:
        experts = "gathered" if n * config.top_k < config.num_experts else "dense"
        torch._dynamo.reset()  # two compiles of layer_forward per size, below the cache limit
        try:
            compiled: dict = {}  # replay and live share one compiled graph (about a third of the time)
            fns = {mode: layer_peer(block, n, mode, "triton", True, compiled) for mode in LAYER_MODES}
            graph = graph_calls_us(fns, calls=LAYER_CALLS, replays=3, trials=7)
        except torch.cuda.OutOfMemoryError:
            table.add(n, experts, "OOM", "OOM", "OOM", "", "", "")
            torch.cuda.empty_cache()
            continue
        ratio = graph["replay"] / graph["live"]
        table.add(
            n,
            experts,
            graph["replay"],
            graph["live"],
            graph["live-ref"],
            ratio,
            ratio <= TARGET_LAYER,
            graph["replay"] / graph["live-ref"],
        )
        del fns
        torch.cuda.empty_cache()
    return table


def dry_run(sizes: list[int], compile: bool = False, cases=CASES) -> Table:
    """Builds every case and peer on the CPU and calls each once (no timing); returns what ran."""
    dev = torch.device("cpu")
    table = Table("dry run (cpu, PyTorch twins, not timed)", ["table", "case", "n", "peer", "output"])
    for case in cases:
        for n in sizes:
            x = make_inputs(case, n, dev, "torch")
            check_forward(case, x)
            for label, peers in (("forward", FORWARD_PEERS), ("backward", BACKWARD_PEERS)):
                for name, build in peers.items():
                    fn = build(case, x, compile)
                    if fn is not None:
                        out = fn()
                        table.add(label, case.name, n, name, tuple(out[0].shape))
            if triton_runs_on(dev):  # the do-nothing kernels and the sweep are Triton-only
                for name, fn in floor_peers(case, x).items():
                    fn()
                    table.add("floor", case.name, n, name, ())
                for name, fn in sweep_peers(case, x, [(1, 1)]).items():  # the twin's forward
                    fn()
                    table.add("sweep", case.name, n, name, ())
                for name, fn in forward_sweep_peers(case, x, [(1, 1), (8, 4)]).items():
                    fn()
                    table.add("sweep", case.name, n, name, ())
            else:
                table.add("floor", case.name, n, "skipped", "no Triton on cpu: TRITON_INTERPRET=1 runs it")
    block = make_block(reference_config("tiny", dtype=torch.float32, num_layers=2), dev)
    for n in sizes:
        for mode in LAYER_MODES:
            grads = layer_peer(block, n, mode, "torch", compile)()
            assert all(torch.isfinite(g).all() for g in grads), f"layer {mode} n={n}: non-finite gradient"
            table.add("layer", "tiny", n, mode, tuple(grads[0].shape))
    return table


@benchmark(
    "replay",
    cases=CASES,
    options=[
        sizes_option("--sizes", BENCH_SIZES["replay"]),
        sizes_option("--layer-sizes", BENCH_SIZES["replay"]),
        option(
            "--tables",
            "forward,backward,select,layer",
            help="comma-separated: forward, backward, select, layer",
        ),
        switch("--launch-floor", "also time do-nothing kernels with replay's grids (two launches' floor)"),
        switch("--sweep-backward", "also time the backward kernel alone per (rows per program, warps)"),
        switch("--sweep-forward", "also time the forward kernel alone per (rows per program, warps)"),
    ],
    dry_run=lambda cases, run: dry_run(list(DRY_SIZES), cases=cases),
)
def replay(cases, run) -> list[Table]:
    """replay_routing forward/backward against the router and the reference; a compiled MoE layer."""
    tables = set(run.tables.split(","))
    unknown = tables - {"forward", "backward", "select", "layer"}
    if unknown:
        raise ValueError(
            f"--tables takes forward, backward, select and layer, got {', '.join(sorted(unknown))}"
        )
    sizes = list(run.sizes)
    out = measure_ops(sizes, tables, cases) if tables & {"forward", "backward"} else []
    if run.launch_floor:
        out.append(measure_floor(sizes, cases))
    if run.sweep_forward:
        out.append(measure_forward_sweep(sizes, cases))
    if run.sweep_backward:
        out.append(measure_sweep(sizes, cases))
    if "select" in tables:
        out.append(measure_select(sizes))
    if "layer" in tables:
        out.append(measure_layer(list(run.layer_sizes)))
    return out


if __name__ == "__main__":
    sys.exit(main(["replay", *sys.argv[1:]]))
