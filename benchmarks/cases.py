"""Every shape a benchmark measures, defined once here with the test that checks the library at that
shape (``tests/<file>.py::<function>``), so a benchmark never measures a shape no test covers.

``BENCH_CASES[name]`` is what the benchmark ``name`` registers and measures, in table order;
``BENCH_SIZES[name]`` the sizes it measures by default. The benchmarks import nothing of ``tests/``;
the tests that check these shapes import them from here, and ``python -m benchmarks --dry-run``
(``registry.missing_tests``) checks that every named test exists.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moe_ops import BatchLayout, RoutingMethod, RoutingShape
from moe_ops.distributed import ParallelLayout

__all__ = [
    "BENCH_CASES",
    "BENCH_DEEPSEEK_V2",
    "BENCH_DEEPSEEK_V3",
    "BENCH_DEEPSEEK_V4",
    "BENCH_DIST_SHAPE",
    "BENCH_RENORMALIZE_128",
    "BENCH_RENORMALIZE_512",
    "BENCH_SIZES",
    "BenchCapture",
    "BenchGrid",
    "BenchIndexer",
    "BenchModel",
    "BenchRouter",
    "BenchShape",
    "BenchTrainer",
]


@dataclass(frozen=True)
class BenchRouter:
    """A router a benchmark measures and the test that checks it. Its fields before ``test`` are the
    router tests' ``RouterConfig`` fields, in that order (``RouterConfig.of(case)`` in
    tests/strategies/router.py makes one of it)."""

    # row label
    name: str
    method: RoutingMethod
    # experts of the router
    num_experts: int
    # experts per token
    top_k: int
    # DEEPSEEK_V3 groups (None: no grouping) and groups kept per token
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float | None = None
    # whether the model has a selection bias (e_score_correction_bias)
    has_bias: bool = False
    # tests/<file>.py::<function> that routes this configuration (at the benchmark's sizes on a GPU)
    test: str = ""


@dataclass(frozen=True)
class BenchGrid:
    """A process grid the distributed benchmark measures (DeepSeek-V3 routing, BENCH_DIST_SHAPE)."""

    # row label
    name: str
    # the layout the MoE layer routes
    layout: BatchLayout
    # TP ranks per DP rank; dp_size = world // tp_size
    tp_size: int
    use_ep: bool
    # the test that runs this grid at the benchmark's experts, top-k and process grid
    test: str = "tests/distributed/test_distributed.py::test_benchmark_shapes_gloo"

    def parallel(self, world: int) -> ParallelLayout | None:
        """The grid on ``world`` ranks; None when ``tp_size`` does not divide ``world``."""
        if world % self.tp_size:
            return None
        return ParallelLayout(world // self.tp_size, self.tp_size, use_ep=self.use_ep, layout=self.layout)


@dataclass(frozen=True)
class BenchModel:
    """A reference-model preset (``moe_ops.models.PRESETS``) a benchmark steps."""

    # the preset's name: the row label and reference_config's argument
    name: str
    # the test that checks this preset's routing shape and capture
    test: str


@dataclass(frozen=True)
class BenchCapture:
    """A capture-op shape: ``layers`` x ``top_k`` int32 ids captured in ``layout`` by the last of
    ``dp_size`` ranks (GATHERED: its offset is the sum over every other rank)."""

    # row label
    name: str
    layout: BatchLayout
    # DP ranks of the batch: 1 for LOCAL
    dp_size: int
    layers: int
    top_k: int
    # the test that captures this layout from a CUDA graph
    test: str


@dataclass(frozen=True)
class BenchTrainer:
    """A trainer's MoE routing the train benchmark replays in (Megatron-Core or transformers)."""

    # row label
    name: str
    # "megatron" (TopKRouter, sigmoid score function) or "transformers" (Qwen3-MoE)
    framework: str
    num_experts: int
    top_k: int
    # Megatron's moe_router_num_groups / moe_router_group_topk (None: no grouping)
    num_groups: int | None
    group_topk: int | None
    # moe_router_topk_scaling_factor (None: none)
    scale: float | None
    # moe_router_enable_expert_bias
    expert_bias: bool
    # the test that replays this configuration against the trainer's own routing
    test: str


@dataclass(frozen=True)
class BenchIndexer:
    """An indexer record the indexer benchmark selects, captures and encodes (k positions per query
    row over a context of keys)."""

    # row label
    name: str
    # positions per query row (index_topk)
    k: int
    # keys per query row (the sequence's length)
    context: int
    # the test that checks selection, capture and the compact round trip at this k
    test: str


@dataclass(frozen=True)
class BenchShape:
    """A routing shape the transfer benchmark moves (snapshot, store, wire)."""

    # row label
    name: str
    shape: RoutingShape
    # the test that snapshots and encodes rows of this shape
    test: str


_CAPTURE_TEST = "tests/test_benchmarks.py::test_bench_capture_cases_capture_exactly"
_ROUTER_TEST = "tests/test_benchmarks.py::test_bench_routers_route_like_the_reference"
_REPLAY_TEST = "tests/replay/test_replay.py::test_benchmark_shapes_gpu"
_SESSION_TEST = "tests/store/test_session.py::test_a_hit_on_the_last_turn_sends_only_the_new_rows"
# DeepSeek-V3 (the router tests' MODEL_ROUTERS[0]): 256 experts, top-8, 8 groups keep 4, routed
# scaling 2.5, bias
BENCH_DEEPSEEK_V3 = BenchRouter(
    "deepseek-v3", RoutingMethod.DEEPSEEK_V3, 256, 8, 8, 4, 2.5, True, _ROUTER_TEST
)
BENCH_RENORMALIZE_128 = BenchRouter("renormalize-128", RoutingMethod.RENORMALIZE, 128, 8, test=_ROUTER_TEST)
BENCH_RENORMALIZE_512 = BenchRouter("renormalize-512", RoutingMethod.RENORMALIZE, 512, 8, test=_ROUTER_TEST)
# DeepSeek-V2/V2.5: 160 experts, top-6, 8 groups keep 3 (a group's score its best), routed scaling
# 16.0, no bias (the router tests' MODEL_ROUTERS "DeepSeek-V2" with the model's scale)
BENCH_DEEPSEEK_V2 = BenchRouter(
    "deepseek-v2", RoutingMethod.DEEPSEEK_V2, 160, 6, 8, 3, 16.0, False, _ROUTER_TEST
)
# DeepSeek-V4: sqrt(softplus) + bias, 256 experts, top-6, no groups, routed scaling 1.5
# (transformers' DeepseekV4Config defaults; MODEL_ROUTERS "DeepSeek-V4")
BENCH_DEEPSEEK_V4 = BenchRouter(
    "deepseek-v4", RoutingMethod.SQRTSOFTPLUS, 256, 6, None, None, 1.5, True, _ROUTER_TEST
)
# DeepSeek-V3's capture shape: 61 layers, 58 of them MoE (the first 3 dense), top-8 of 256 experts
BENCH_DIST_SHAPE = RoutingShape(num_layers=58, num_experts=256, top_k=8)

# benchmark name -> the cases it measures, in table order
BENCH_CASES: dict[str, tuple] = {
    "capture": (
        BenchCapture("LOCAL", BatchLayout.LOCAL, 1, 61, 8, _CAPTURE_TEST),
        BenchCapture("GATHERED", BatchLayout.GATHERED, 4, 61, 8, _CAPTURE_TEST),
    ),
    "routing": (
        BENCH_DEEPSEEK_V3,
        BENCH_RENORMALIZE_128,
        BENCH_RENORMALIZE_512,
        BENCH_DEEPSEEK_V2,
        BENCH_DEEPSEEK_V4,
    ),
    "transfer": (
        BenchShape(
            "deepseek-v3",
            RoutingShape(num_layers=61, num_experts=256, top_k=8),
            "tests/test_benchmarks.py::test_bench_transfer_shape_snapshots_and_encodes_exactly",
        ),
    ),
    # the multi-turn bytes table: models by (layers, experts, top-k)
    "sessions": tuple(
        BenchShape(name, RoutingShape(num_layers=layers, num_experts=experts, top_k=top_k), _SESSION_TEST)
        for name, layers, experts, top_k in (
            ("qwen3-30b-a3b", 48, 128, 8),
            ("deepseek-v3", 58, 256, 8),
            ("kimi-k2", 60, 384, 8),
            ("512-experts", 48, 512, 10),  # Qwen3-Next's: 512 experts, top-10
        )
    ),
    "replay": (
        replace(BENCH_DEEPSEEK_V3, test=_REPLAY_TEST),
        replace(BENCH_RENORMALIZE_128, test=_REPLAY_TEST),
        replace(BENCH_DEEPSEEK_V2, test=_REPLAY_TEST),
        replace(BENCH_DEEPSEEK_V4, test=_REPLAY_TEST),
    ),
    "e2e": (
        BenchModel("deepseek_small", "tests/test_benchmarks.py::test_e2e_preset_is_the_benchmarked_shape"),
    ),
    "train": (
        BenchTrainer(
            "megatron-dsv3-64",
            "megatron",
            64,
            8,
            8,
            4,
            2.5,
            True,
            "tests/integrations/test_megatron.py::test_bench_train_router_replays_like_megatron",
        ),
        BenchTrainer(
            "qwen3-moe-64",
            "transformers",
            64,
            8,
            None,
            None,
            None,
            False,
            "tests/integrations/test_replay_attach.py::test_gradients_reach_the_router_weights",
        ),
    ),
    "indexer": tuple(
        BenchIndexer(
            f"k{k}-ctx{context // 1024}k",
            k,
            context,
            "tests/indexer/test_select_indexer.py::test_distinct_scores_choose_torch_topk_set",
        )
        for k in (512, 2048)
        for context in (8192, 32768, 131072)
    ),
    "distributed": (
        BenchGrid("dp", BatchLayout.LOCAL, 1, False),
        BenchGrid("dp+ep gathered", BatchLayout.GATHERED, 1, True),
        BenchGrid("dp+ep sharded", BatchLayout.SHARDED, 2, True),
        BenchGrid("tp+sp", BatchLayout.SEQUENCE_PARALLEL, 2, False),
    ),
}

# benchmark name -> the sizes it measures by default (tokens per step; decode batch for e2e)
BENCH_SIZES: dict[str, tuple[int, ...]] = {
    "capture": (1, 64, 512, 8192),
    "routing": (1, 128, 4096),
    "replay": (1, 128, 4096, 16384),
    "e2e": (1, 16, 128),
    "distributed": (8192,),
    "train": (4096, 16384),
    # query rows
    "indexer": (1, 128, 4096),
    "transfer": (1024, 8192, 32768),
}
