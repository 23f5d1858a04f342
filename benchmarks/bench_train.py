"""The trainer's side of replay, timed inside the trainers: Megatron-Core's ``TopKRouter`` and MoE
layer stack, and a transformers Qwen3-MoE model, forward + backward with and without replay.

Cases (``BENCH_CASES["train"]``, benchmarks/cases.py; each names the test that checks the library at
that configuration): ``megatron-dsv3-64`` - a Megatron-Core 0.16 ``TopKRouter`` routed like
DeepSeek-V3 (sigmoid, expert bias, 8 groups keep 4, scale 2.5) over 64 experts, top-8, an fp32 router
in a bf16 model, no Transformer Engine (the GPU machine has none: the fused router is not measured);
``qwen3-moe-64`` - transformers' ``Qwen3MoeForCausalLM`` (softmax top-8 of 64, renormalised), bf16.
Tokens per micro-batch: ``BENCH_SIZES["train"]`` = {4096, 16384}.

Peers (each its own router or model with the same weights, trials interleaved peer by peer so that
clock drift hits every peer alike; CUDA events around each step; medians):

* ``live`` - no replay: the router's own routing.
* ``megatron`` - Megatron's own ``RouterReplay`` (``REPLAY_FORWARD``) with the record as target.
* ``moe-ops`` - ``moe_ops.integrations.megatron.attach_replay`` (``live_rows="rule"``, the default:
  the router's own routing never runs) / ``moe_ops.integrations.hf.attach_replay``.
* ``moe-ops router-rows`` - ``attach_replay(live_rows="router")``: rows of -1 keep the router's own
  output bit for bit, which runs the router's own routing on every call as well.
* ``moe-ops recorded`` - ``attach_replay(weights="recorded")`` (router table): the rollout's weights
  as the probs, the rule's gradient.

Tables:

* ``router call`` (Megatron): ``TopKRouter.routing(logits)`` forward + backward, the call the issue
  timed. Targets: moe-ops **<= 1.05x** live and faster than Megatron's ``RouterReplay``.
* ``layer stack`` (Megatron): ``LAYERS`` MoE layers (``MoELayer``, Megatron's local
  ``SequentialMLP`` experts, allgather dispatcher), forward + backward; tokens/s and the ratio to
  ``live``. Target: **>= 0.99x** live throughput.
* ``transformers step``: the Qwen3-MoE model's forward + backward (loss on the logits); tokens/s and
  the ratio to ``live``. Target: **>= 0.99x**.

The record is random distinct experts per row with the last row of each sequence -1 (what a rollout
leaves: the last token's routing is never captured), so the rows of -1 are routed live.

    python -m benchmarks train [--train-sizes 4096,16384] [--train-tables router,stack,hf] [--csv F]

``--dry-run`` runs the router table's peers once on the CPU (Megatron's ``TopKRouter.routing`` and a
tiny transformers model, untimed) and checks that every replaying peer returns the record.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import warnings
from collections.abc import Callable

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.cases import BENCH_CASES, BENCH_SIZES
from benchmarks.harness import Table, step
from benchmarks.registry import benchmark, main, option, sizes_option, table

CASES = BENCH_CASES["train"]
LAYERS = 4  # MoE layers of the Megatron stack
HIDDEN, FFN = 1024, 512  # the stack's hidden size and each expert's FFN size
DRY_TOKENS = 12
TARGET_ROUTER = 1.05
TARGET_STEP = 0.99
TABLES = ("router", "stack", "hf")


def _timed(steps: dict[str, Callable[[], object]], trials: int, reps: int) -> dict[str, float]:
    """Median over ``trials`` of each step's mean time over ``reps`` calls, in ms (CUDA events).
    Peers interleaved trial by trial; each warmed up first."""
    for fn in steps.values():
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(trials):
        for name, fn in steps.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / reps)
    return {name: statistics.median(t) for name, t in times.items()}


def record_rows(n: int, seq_len: int, layers: int, num_experts: int, top_k: int, seed: int = 0) -> np.ndarray:
    """(n, layers, top_k) int32: random distinct experts per row; the last row of each sequence of
    ``seq_len`` rows -1 (a rollout never captures its last token)."""
    rng = np.random.default_rng(seed)
    rows = np.argsort(rng.random((n, layers, num_experts)), axis=-1)[..., :top_k].astype(np.int32)
    rows[seq_len - 1 :: seq_len] = -1
    return rows


# ---------------------------------------------------------------------------------------------------
# Megatron-Core
# ---------------------------------------------------------------------------------------------------


def megatron_setup(device: str) -> None:
    """A process group of world size 1 and Megatron's model-parallel state (once per process);
    megatron-core 0.16.1 without Transformer Engine needs ``te_general_gemm`` bound to None (the
    torch branch of its gate, as the tests do)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils

    if not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(), "store")
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    if device == "cuda":
        torch.cuda.set_device(0)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def megatron_config(case, *, layers: int = 1, hidden: int = HIDDEN, device: str = "cuda"):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=8,
        num_moe_experts=case.num_experts,
        moe_router_topk=case.top_k,
        moe_router_score_function="sigmoid",
        moe_router_num_groups=case.num_groups,
        moe_router_group_topk=case.group_topk,
        moe_router_topk_scaling_factor=case.scale,
        # a CPU-only torch cannot build the bias buffers (TopKRouter allocates them on CUDA): the
        # dry run registers them by hand (megatron_router)
        moe_router_enable_expert_bias=case.expert_bias and device == "cuda",
        moe_router_dtype="fp32",
        moe_ffn_hidden_size=FFN,
        moe_token_dispatcher_type="allgather",
        moe_aux_loss_coeff=0.0,
        add_bias_linear=False,
        use_cpu_initialization=True,
        bf16=device == "cuda",
        params_dtype=torch.bfloat16 if device == "cuda" else torch.float32,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformerConfig(**fields)


def megatron_router(case, device: str, seed: int = 0):
    """A ``TopKRouter`` of ``case`` (layer 1), gate and expert bias drawn from ``seed``."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter

    config = megatron_config(case, device=device)
    router = TopKRouter(config, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    router.set_layer_number(1)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(case.num_experts, HIDDEN, generator=gen) * 0.02)
    if case.expert_bias:
        bias = 0.1 * torch.randn(case.num_experts, generator=gen)
        if router.expert_bias is None:  # CPU build (see megatron_config)
            config.moe_router_enable_expert_bias = router.enable_expert_bias = True
            del router.local_tokens_per_expert, router.expert_bias
            router.register_buffer("local_tokens_per_expert", torch.zeros(case.num_experts), persistent=False)
            router.register_buffer("expert_bias", bias)
        else:
            with torch.no_grad():
                router.expert_bias.copy_(bias)
    return router.to(device)


def _router_peers(case, n: int, device: str, rows: np.ndarray):
    """(steps by peer, handles to remove, routers by peer, logits): one router per peer, same
    weights; a step is ``routing(logits)`` forward + backward of ``sum(probs * g)``."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    import moe_ops.integrations.megatron as mg
    from moe_ops import RoutingReplayer

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(n, case.num_experts, generator=gen).to(device)
    g = torch.randn(n, case.num_experts, generator=gen).to(device)
    names = ("live", "megatron", "moe-ops", "moe-ops router-rows", "moe-ops recorded")
    routers = {name: megatron_router(case, device) for name in names}
    target = torch.from_numpy(rows[:, 0]).long()
    # Megatron's RouterReplay has no "route live" row: the -1 rows take the live router's ids
    with torch.no_grad():
        live_ids = mg.routing_ids(routers["live"].routing(logits)[1], case.top_k).cpu()
    target = torch.where(target < 0, live_ids, target).to(device)
    replay = RouterReplay()
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    replay.set_target_indices(target)
    routers["megatron"].router_replay = replay
    replayer = RoutingReplayer(
        mg.routing_shape(routers["live"].config), n, device, weights_dtype=torch.float32
    )
    # the rollout's weights: k/128 (exact in every weights dtype), NaN where no record
    weights = np.random.default_rng(2).integers(1, 128, size=rows.shape).astype(np.float32) / 128
    replayer.set_batch(rows, weights=np.where(rows >= 0, weights, np.nan))
    handles = [
        mg.attach_replay(routers["moe-ops"], replayer),
        mg.attach_replay(routers["moe-ops router-rows"], replayer, live_rows="router"),
        mg.attach_replay(routers["moe-ops recorded"], replayer, weights="recorded"),
    ]

    def make(router):
        def run():
            x = logits.detach().requires_grad_()
            probs, routing_map = router.routing(x)
            (probs * g).sum().backward()
            return probs, routing_map

        return run

    return {name: make(r) for name, r in routers.items()}, handles, target


def router_table(cases, sizes, quick: bool) -> Table:
    """Megatron's ``TopKRouter.routing`` forward + backward per peer (ms) and the ratios."""
    import moe_ops.integrations.megatron as mg

    megatron_setup("cuda")
    t = Table(
        "train: Megatron TopKRouter.routing forward+backward (ms, CUDA events, median)",
        ["case", "n", "live", "megatron", "moe-ops", "moe-ops router-rows", "moe-ops recorded",
         "moe-ops/live", "moe-ops/megatron", "target", "met"],
    )  # fmt: skip
    for case in (c for c in cases if c.framework == "megatron"):
        for n in sizes:
            step(f"router call {case.name} n={n}")
            rows = record_rows(n, n, 1, case.num_experts, case.top_k)
            steps, handles, target = _router_peers(case, n, "cuda", rows)
            try:
                ms = _timed(steps, trials=5 if quick else 15, reps=5 if quick else 20)
                _, routing_map = steps["moe-ops"]()
                replayed = torch.from_numpy(rows[:, 0, 0] >= 0).cuda()
                ids = mg.routing_ids(routing_map, case.top_k)
                assert torch.equal(ids[replayed], target[replayed].sort(1).values), "moe-ops did not replay"
            finally:
                for h in handles:
                    h.remove()
            ratio = ms["moe-ops"] / ms["live"]
            t.add(
                case.name, n, ms["live"], ms["megatron"], ms["moe-ops"], ms["moe-ops router-rows"],
                ms["moe-ops recorded"], ratio,
                ms["moe-ops"] / ms["megatron"], f"<= {TARGET_ROUTER} live, < megatron",
                "met" if ratio <= TARGET_ROUTER and ms["moe-ops"] < ms["megatron"] else "missed",
            )  # fmt: skip
    return t


def _stack(case, n: int, seq_len: int):
    """``LAYERS`` Megatron MoE layers (local spec: SequentialMLP experts) on CUDA, bf16, and an
    input of ``n`` tokens ([seq_len, n // seq_len, hidden])."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    config = megatron_config(case, layers=LAYERS)
    spec = get_gpt_layer_local_spec(num_experts=case.num_experts, moe_grouped_gemm=False)
    submodules = spec.submodules.mlp.submodules
    torch.manual_seed(0)
    layers = []
    for i in range(LAYERS):
        layer = MoELayer(config, submodules)
        layer.set_layer_number(i + 1)
        layers.append(layer.cuda().to(torch.bfloat16))
    for layer in layers:
        with torch.no_grad():
            layer.router.weight.normal_(0, 0.02)
    x = torch.randn(seq_len, n // seq_len, HIDDEN, device="cuda", dtype=torch.bfloat16)
    return config, torch.nn.ModuleList(layers), x


def _stack_ms(case, n: int, quick: bool) -> dict[str, float]:
    """ms per forward + backward of the layer stack at ``n`` tokens, per peer (live, megatron,
    moe-ops), each peer timed on the same layers in turn."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    import moe_ops.integrations.megatron as mg
    from moe_ops import RoutingReplayer

    seq_len = min(n, 4096)
    config, layers, x = _stack(case, n, seq_len)
    rows = mg.to_megatron_order(record_rows(n, seq_len, LAYERS, case.num_experts, case.top_k), n // seq_len)

    def run():
        y = x.detach().requires_grad_()
        for layer in layers:
            y = layer(y)[0]
        y.float().sum().backward()

    trials, reps = (3, 2) if quick else (7, 3)
    ms = {"live": _timed({"live": run}, trials, reps)["live"]}
    for i, layer in enumerate(layers):
        # Megatron's RouterReplay has no "route live" row: a -1 row replays experts 0..k-1
        target = torch.from_numpy(rows[:, i]).long().cuda()
        target[target[:, 0] < 0] = torch.arange(case.top_k, device="cuda")
        replay = RouterReplay()
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        replay.set_target_indices(target)
        layer.router.router_replay = replay
    ms["megatron"] = _timed({"megatron": run}, trials, reps)["megatron"]
    for layer in layers:
        layer.router.router_replay = None
    replayer = RoutingReplayer(mg.routing_shape(config), n, "cuda")
    replayer.set_batch(rows)
    with mg.attach_replay(list(layers), replayer):
        ms["moe-ops"] = _timed({"moe-ops": run}, trials, reps)["moe-ops"]
    return ms


def stack_table(cases, sizes, quick: bool) -> Table:
    """The Megatron MoE layer stack's forward + backward per peer: tokens/s and the ratio to live."""
    megatron_setup("cuda")
    t = Table(
        f"train: Megatron MoE layer stack ({LAYERS} MoELayers, SequentialMLP) forward+backward, tokens/s",
        ["case", "n", "live tok/s", "megatron tok/s", "moe-ops tok/s", "moe-ops/live", "megatron/live",
         "target", "met"],
    )  # fmt: skip
    for case in (c for c in cases if c.framework == "megatron"):
        for n in sizes:
            step(f"layer stack {case.name} n={n}")
            tok = {k: n / (v / 1e3) for k, v in _stack_ms(case, n, quick).items()}
            torch.cuda.empty_cache()
            ratio = tok["moe-ops"] / tok["live"]
            t.add(
                case.name, n, tok["live"], tok["megatron"], tok["moe-ops"], ratio,
                tok["megatron"] / tok["live"], f">= {TARGET_STEP}",
                "met" if ratio >= TARGET_STEP else "missed",
            )  # fmt: skip
    return t


# ---------------------------------------------------------------------------------------------------
# transformers
# ---------------------------------------------------------------------------------------------------


def hf_model(case, device: str, dtype: torch.dtype, *, tiny: bool = False):
    """Qwen3-MoE of ``case`` (the real config class): ``LAYERS`` layers, 64 experts top-8 (the
    tiny dry-run model: transformers' own tiny sizes)."""
    from moe_ops.integrations.hf import build_tiny_model

    sizes = {} if tiny else dict(
        hidden_size=HIDDEN, intermediate_size=2 * FFN, moe_intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_experts=case.num_experts, num_experts_per_tok=case.top_k, num_attention_heads=8,
        num_key_value_heads=8, norm_topk_prob=True, head_dim=128, vocab_size=4096,
    )  # fmt: skip
    model = build_tiny_model("qwen3_moe", dtype=dtype, device=device, **sizes)
    return model.train()


def _hf_ms(model, n: int, quick: bool) -> dict[str, float]:
    """ms per forward + backward of ``model`` at ``n`` tokens, live and replaying."""
    from moe_ops import RoutingReplayer
    from moe_ops import resolve_routing_shape as routing_shape
    from moe_ops.integrations.hf import attach_replay

    shape = routing_shape(model.config)
    seq_len = min(n, 4096)
    ids = torch.randint(0, model.config.vocab_size, (n // seq_len, seq_len), device="cuda")
    rows = record_rows(n, seq_len, shape.num_layers, shape.num_experts, shape.top_k)

    def run():
        model(input_ids=ids).logits.float().mean().backward()

    trials, reps = (3, 2) if quick else (7, 3)
    ms = {"live": _timed({"live": run}, trials, reps)["live"]}
    replayer = RoutingReplayer(shape, n, "cuda")
    replayer.set_batch(rows)
    with attach_replay(model, replayer):
        ms["moe-ops"] = _timed({"moe-ops": run}, trials, reps)["moe-ops"]
    return ms


def hf_table(cases, sizes, quick: bool) -> Table:
    """The transformers Qwen3-MoE model's forward + backward: tokens/s, replay against live."""
    t = Table(
        f"train: transformers Qwen3-MoE ({LAYERS} layers) forward+backward, tokens/s",
        ["case", "n", "live tok/s", "moe-ops tok/s", "moe-ops/live", "target", "met"],
    )
    for case in (c for c in cases if c.framework == "transformers"):
        model = hf_model(case, "cuda", torch.bfloat16)
        for n in sizes:
            step(f"transformers {case.name} n={n}")
            ms = _hf_ms(model, n, quick)
            ratio = ms["live"] / ms["moe-ops"]
            t.add(case.name, n, n / ms["live"] * 1e3, n / ms["moe-ops"] * 1e3, ratio, f">= {TARGET_STEP}",
                  "met" if ratio >= TARGET_STEP else "missed")  # fmt: skip
        del model
        torch.cuda.empty_cache()
    return t


def dry_run(cases, run) -> Table:
    """Every peer of the router table once on the CPU (Megatron's routing, untimed) and a tiny
    transformers model replaying: each replaying peer returns the record."""
    import moe_ops.integrations.megatron as mg
    from moe_ops import RoutingReplayer
    from moe_ops import resolve_routing_shape as routing_shape
    from moe_ops.integrations.hf import attach_replay

    t = Table("train: dry run (cpu, untimed)", ["case", "peer", "replayed rows", "output"])
    for case in cases:
        if case.framework == "megatron":
            megatron_setup("cpu")
            with torch._dynamo.config.patch(disable=True):  # Megatron compiles _apply_expert_bias
                rows = record_rows(DRY_TOKENS, 4, 1, case.num_experts, case.top_k)
                steps, handles, target = _router_peers(case, DRY_TOKENS, "cpu", rows)
                try:
                    replayed = torch.from_numpy(rows[:, 0, 0] >= 0)
                    for name, fn in steps.items():
                        probs, routing_map = fn()
                        if name != "live":
                            ids = mg.routing_ids(routing_map, case.top_k)
                            assert torch.equal(ids[replayed], target[replayed].sort(1).values), name
                        t.add(
                            case.name, name, int(replayed.sum()) if name != "live" else 0, tuple(probs.shape)
                        )
                finally:
                    for h in handles:
                        h.remove()
        else:
            model = hf_model(case, "cpu", torch.float32, tiny=True)
            shape = routing_shape(model.config)
            rows = record_rows(DRY_TOKENS, DRY_TOKENS, shape.num_layers, shape.num_experts, shape.top_k)
            replayer = RoutingReplayer(shape, DRY_TOKENS, "cpu")
            replayer.set_batch(rows)
            ids = torch.randint(0, model.config.vocab_size, (1, DRY_TOKENS))
            with attach_replay(model, replayer):
                out = model(input_ids=ids).logits
                out.float().mean().backward()
            t.add(case.name, "moe-ops", DRY_TOKENS - 1, tuple(out.shape))
    return t


@benchmark(
    "train",
    cases=CASES,
    options=[
        sizes_option("--train-sizes", BENCH_SIZES["train"]),
        option("--train-tables", ",".join(TABLES), help=f"comma-separated: {', '.join(TABLES)}"),
    ],
    dry_run=dry_run,
    tables=[
        table(
            "Megatron TopKRouter.routing fwd+bwd: replay vs live and Megatron's RouterReplay",
            flags="--train-tables router",
        ),
        table("Megatron MoE layer stack forward+backward tokens/s", flags="--train-tables stack"),
        table("transformers Qwen3-MoE forward+backward tokens/s", flags="--train-tables hf"),
    ],
)
def train(cases, run) -> list[Table]:
    """Replay inside the trainers: Megatron-Core's router and layer stack, a transformers model."""
    chosen = [x for x in run.train_tables.split(",") if x]
    unknown = [x for x in chosen if x not in TABLES]
    if unknown:
        raise ValueError(f"--train-tables: {', '.join(unknown)} is not one of {', '.join(TABLES)}")
    out = []
    builders = {"router": router_table, "stack": stack_table, "hf": hf_table}
    for name in chosen:
        out.append(builders[name](cases, run.train_sizes, run.quick))
    return out


if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
