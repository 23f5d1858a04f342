"""Routers (moe_ops.route, moe_ops.router): routing configurations of real models, random shapes,
logits with and without ties, and capture targets around them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import strategies as st

from moe_ops import BatchLayout, GroupScore, RoutingMethod
from moe_ops.router.args import group_score_from_value
from moe_ops.router.methods import METHODS, UNNORMALIZED_METHODS

from .capture import capture_cases

__all__ = [
    "GPU_CAPTURE_ROUTERS",
    "GPU_ROUTER_CASES",
    "LOGIT_DTYPES",
    "MODEL_ROUTERS",
    "REPLAY_LOGIT_DTYPES",
    "ROUTED_SCALES",
    "HashCase",
    "RouterCase",
    "RouterConfig",
    "group_cases",
    "group_configs",
    "hash_cases",
    "knob_configs",
    "routed_capture_cases",
    "router_cases",
    "router_configs",
    "scaled_router_cases",
    "shared_capture_cases",
    "sqrtsoftplus_cases",
]


@dataclass(frozen=True)
class RouterConfig:
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
    # route's renormalize (None: the method's own rule)
    renormalize: bool | None = None
    # route's group_score (None: the method's own rule)
    group_score: GroupScore | None = None

    def route_kwargs(self, bias) -> dict:
        """Keyword arguments of moe_ops.route for this configuration."""
        kwargs = dict(
            bias=bias,
            n_group=self.n_group,
            topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
            renormalize=self.renormalize,
        )
        if self.group_score is not None:
            kwargs["group_score"] = self.group_score
        return kwargs

    @property
    def group_top(self) -> int:
        """The keys a group score sums (RouteConfig.group_top): what the references take."""
        n_group, topk_group = self.groups
        if n_group <= 1:
            return 2
        score = self.group_score or METHODS[self.method].group_score
        return group_score_from_value(score).keys_summed(self.top_k, topk_group)

    @property
    def groups(self) -> tuple[int, int]:
        """(n_group, topk_group) as the kernels see them: (1, 1) without grouping."""
        if self.n_group is None or self.n_group <= 1:
            return 1, 1
        return self.n_group, self.topk_group

    @classmethod
    def of(cls, router) -> RouterConfig:
        """The configuration of any object with these fields, e.g. a benchmark's router
        (benchmarks/cases.py ``BenchRouter``: these fields and the test that checks it)."""
        return cls(*(getattr(router, f, None) for f in cls.__dataclass_fields__))


M = RoutingMethod
# Routing of released models (config.json of each); methods no listed model uses get generic shapes.
MODEL_ROUTERS = (
    RouterConfig("DeepSeek-V3", M.DEEPSEEK_V3, 256, 8, 8, 4, 2.5, True),
    RouterConfig("Kimi-K2", M.DEEPSEEK_V3, 384, 8, 1, 1, 2.827, True),
    RouterConfig("Qwen3-MoE", M.RENORMALIZE_NAIVE, 128, 8),
    RouterConfig("Qwen3-Next", M.RENORMALIZE_NAIVE, 512, 10),
    RouterConfig("Mixtral", M.RENORMALIZE, 8, 2),
    RouterConfig("Llama-4", M.LLAMA4, 16, 1),
    RouterConfig("GPT-OSS", M.RENORMALIZE, 128, 4),
    RouterConfig("MiniMax-M2", M.MINIMAX2, 256, 8, routed_scaling_factor=1.0, has_bias=True),
    RouterConfig("Qwen1.5-MoE", M.DEFAULT, 60, 4),
    RouterConfig("sigmoid-renorm", M.SIGMOID_RENORM, 128, 8),
    RouterConfig("topk", M.TOPK, 64, 6),
    RouterConfig("sigmoid", M.SIGMOID, 160, 6),
    RouterConfig("topk-sigmoid", M.TOPK_SIGMOID, 32, 4),
    # DeepSeek-V2 and V2.5: group_limited_greedy, 8 groups keep 3 (its routed_scaling_factor 16.0
    # multiplies after the method's weights: the model's ReplayRule applies it)
    RouterConfig("DeepSeek-V2", M.DEEPSEEK_V2, 160, 6, 8, 3),
    # DeepSeek-V2-Lite: topk_method "greedy", no groups
    RouterConfig("DeepSeek-V2-Lite", M.DEEPSEEK_V2, 64, 6),
    RouterConfig("softmax-bias", M.SOFTMAX_BIAS, 128, 8, has_bias=True),
    # transformers' DeepseekV4Config defaults (n_routed_experts, num_experts_per_tok, scale)
    RouterConfig("DeepSeek-V4", M.SQRTSOFTPLUS, 256, 6, routed_scaling_factor=1.5, has_bias=True),
)
del M

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# replay_routing also takes float64 logits (computed in float64)
REPLAY_LOGIT_DTYPES = (*LOGIT_DTYPES, torch.float64)


@st.composite
def router_configs(draw, methods=tuple(RoutingMethod), max_experts: int = 520, max_top_k: int = 32):
    """A configuration: a real model's (half the time) or a random one of ``methods``."""
    models = [c for c in MODEL_ROUTERS if c.method in methods and c.num_experts <= max_experts]
    if models and draw(st.booleans()):
        return draw(st.sampled_from(models))
    method = draw(st.sampled_from(methods))
    spec = METHODS[method]  # what the method takes: the method table's row
    group_score = None
    if spec.groups and draw(st.booleans()):
        n_group = draw(st.integers(2, 8))
        size = draw(st.integers(1, max(1, max_experts // n_group)))
        num_experts = n_group * size
        topk_group = draw(st.integers(1, n_group))
        top_k = draw(st.integers(1, min(max_top_k, topk_group * size)))
        # Megatron's share rule where it applies (its share within 1..size; a sum on a score key)
        share = top_k // topk_group
        if 1 <= share <= size and (share == 1 or spec.group_score != GroupScore.MAX) and draw(st.booleans()):
            group_score = GroupScore.TOPK_SHARE_SUM
    else:
        num_experts = draw(st.integers(1, max_experts))
        top_k = spec.top_k or draw(st.integers(1, min(max_top_k, num_experts)))
        n_group = topk_group = None
    scale = draw(st.sampled_from([None, 1.0, 2.5, 0.3]))  # every method takes the factor
    return RouterConfig(
        f"random-{method.name}",
        method,
        num_experts,
        top_k,
        n_group,
        topk_group,
        scale,
        has_bias=spec.bias and draw(st.booleans()),
        group_score=group_score,
    )


@st.composite
def knob_configs(
    draw, renormalize=(None, True, False), max_experts: int = 520, max_top_k: int = 32, methods=None
):
    """A configuration of a method with a renormalize=False rule (``methods``, default
    UNNORMALIZED_METHODS), with ``renormalize`` drawn from ``renormalize`` (True and None: the
    method's own rule)."""
    methods = methods or tuple(sorted(UNNORMALIZED_METHODS))
    config = draw(router_configs(methods, max_experts, max_top_k))
    value = draw(st.sampled_from(renormalize))
    return dataclasses.replace(config, name=f"{config.name} renormalize={value}", renormalize=value)


@dataclass
class RouterCase:
    config: RouterConfig
    # tokens (rows of the logits)
    n: int
    dtype: torch.dtype
    seed: int
    # "normal": N(0, scale^2); "ties": small integers (many exact ties); "special": normal plus
    # +-inf, NaN and -0.0 entries
    kind: str
    scale: float

    def tensors(self, device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(router_logits (n, E) dtype, bias (E,) float32 or None) on ``device``."""
        rng = np.random.default_rng(self.seed)
        e = self.config.num_experts
        if self.kind == "ties":
            x = rng.integers(-3, 4, size=(self.n, e)).astype(np.float32)
            bias = rng.choice([0.0, 0.5], size=e).astype(np.float32)
        else:
            x = (rng.standard_normal((self.n, e)) * self.scale).astype(np.float32)
            bias = (rng.standard_normal(e) * 0.1).astype(np.float32)
            if self.kind == "special" and x.size:
                cells = rng.integers(0, x.size, size=max(1, x.size // 20))
                x.flat[cells] = rng.choice([np.inf, -np.inf, np.nan, -0.0, 0.0], size=cells.size)
        logits = torch.from_numpy(x).to(device=device, dtype=self.dtype)
        b = torch.from_numpy(bias).to(device) if self.config.has_bias else None
        return logits, b


@st.composite
def router_cases(
    draw,
    configs=None,
    max_tokens: int = 40,
    dtypes=LOGIT_DTYPES,
    kinds=("normal", "normal", "ties", "special"),
):
    """A batch of router logits for a configuration drawn from ``configs`` (default: any)."""
    config = draw(configs if configs is not None else router_configs())
    return RouterCase(
        config=config,
        n=draw(st.integers(0, max_tokens)),
        dtype=draw(st.sampled_from(dtypes)),
        seed=draw(st.integers(0, 2**32 - 1)),
        kind=draw(st.sampled_from(kinds)),
        scale=draw(st.sampled_from([0.5, 1.0, 4.0])),
    )


# What the GPU router tests draw from: the model configurations in two dtypes, and token counts
# below 512 (one launch configuration per expert width), i.e. about 26 kernel variants.
GPU_ROUTER_CASES = dict(
    configs=st.sampled_from(MODEL_ROUTERS),
    max_tokens=300,
    dtypes=(torch.float32, torch.bfloat16),
)


@st.composite
def routed_capture_cases(draw, configs=None, capture_kw=None, dtypes=LOGIT_DTYPES):
    """(CaptureCase, RouterCase) with matching rows and top_k: a batch to route and record.

    The CaptureCase supplies the layout, counts, padding, buffer and layer; its ``rows`` are
    replaced by the router's ids at test time (the router decides them).
    """
    config = draw(configs if configs is not None else router_configs(max_top_k=16))
    case = draw(
        capture_cases(
            layouts=tuple(BatchLayout),
            top_ks=(config.top_k,),
            **(capture_kw or {}),
        )
    )
    router = RouterCase(
        config=config,
        n=case.rows.shape[0],
        dtype=draw(st.sampled_from(dtypes)),
        seed=draw(st.integers(0, 2**32 - 1)),
        kind="normal",
        scale=1.0,
    )
    return case, router


# What the GPU fused-capture tests draw from: DeepSeek-V3 routing of bf16 logits into int32/int16
# buffers; the shard-size count (dp_size * shards_per_rank, rounded up to a power of two) adds
# variants: <= 12.
GPU_CAPTURE_ROUTERS = dict(
    configs=st.just(MODEL_ROUTERS[0]),
    capture_kw=dict(buffer_dtypes=(torch.int32, torch.int16)),
    dtypes=(torch.bfloat16,),
)


# routed_scaling_factor values other than 1: DeepSeek-V3's 2.5, below 1, large, negative, and 0
# (every weight and every gradient 0)
ROUTED_SCALES = (2.5, 0.3, 16.0, -1.5, 0.0)


@st.composite
def scaled_router_cases(
    draw,
    methods=tuple(RoutingMethod),
    max_tokens: int = 12,
    max_experts: int = 40,
    dtypes=LOGIT_DTYPES,
    kinds=("normal", "ties", "special"),
):
    """A batch of router logits of any of ``methods`` with a routed_scaling_factor from
    :data:`ROUTED_SCALES` (small shapes: interpreted Triton runs them)."""
    config = draw(router_configs(methods, max_experts=max_experts, max_top_k=8))
    scale = draw(st.sampled_from(ROUTED_SCALES))
    config = dataclasses.replace(config, name=f"{config.name} scale={scale}", routed_scaling_factor=scale)
    return draw(router_cases(st.just(config), max_tokens, dtypes, kinds))


@dataclass(frozen=True)
class SqrtSoftplusCase:
    """One SQRTSOFTPLUS routing problem: logits (possibly a strided or sliced view), bias, knobs."""

    logits: torch.Tensor
    bias: torch.Tensor | None
    top_k: int
    routed_scaling_factor: float | None
    renormalize: bool | None
    # how the logits were built: "random", "exact-ties" or "near-ties"; and their layout
    ties: str
    layout: str


@st.composite
def sqrtsoftplus_cases(draw, max_tokens: int = 12, max_experts: int = 40):
    """SQRTSOFTPLUS (DeepSeek-V4) problems: logits over the whole range softplus treats differently
    (below -104 its float32 value underflows, above 20 it is ``x``), exact ties (equal logits and
    biases) and near ties (keys one float32 ulp apart), contiguous, column-strided (a transposed
    buffer) or sliced (every other column of a wider row) logits."""
    n = draw(st.integers(0, max_tokens), label="n_tokens")
    num_experts = draw(st.integers(1, max_experts), label="num_experts")
    top_k = draw(st.integers(1, min(8, num_experts)), label="top_k")
    ties = draw(st.sampled_from(["random", "exact-ties", "near-ties"]), label="ties")
    layout = draw(st.sampled_from(["contiguous", "strided", "sliced"]), label="layout")
    has_bias = draw(st.booleans(), label="bias")
    scale = draw(st.sampled_from([None, 1.0, 1.5, 2.5]), label="scale")
    renormalize = draw(st.sampled_from([None, True, False]), label="renormalize")
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="seed"))
    spread = draw(st.sampled_from([1.0, 4.0, 40.0]), label="spread")
    x = (rng.standard_normal((n, num_experts)) * spread).astype(np.float32)
    if ties == "exact-ties" and num_experts > 1:
        x = rng.integers(-2, 3, (n, num_experts)).astype(np.float32)
    elif ties == "near-ties" and num_experts > 1:
        # pairs one ulp apart: their keys round together or one ulp apart
        x[:, 1::2] = np.nextafter(x[:, 0::2][:, : x[:, 1::2].shape[1]], np.float32(np.inf))
    bias = None
    if has_bias:
        b = (rng.standard_normal(num_experts) * 0.05).astype(np.float32)
        if ties == "exact-ties":
            b = np.zeros(num_experts, dtype=np.float32)
        bias = torch.from_numpy(b)
    logits = torch.from_numpy(x)
    if layout == "strided":
        logits = logits.t().contiguous().t()  # column stride 1 -> row stride 1
    elif layout == "sliced":
        wide = torch.full((n, 2 * num_experts), float("nan"))  # the skipped columns must not be read
        wide[:, ::2] = logits
        logits = wide[:, ::2]
    return SqrtSoftplusCase(logits, bias, top_k, scale, renormalize, ties, layout)


@dataclass
class HashCase:
    """A hash layer's batch: logits, a token-id table and token ids, some of them faulty."""

    method: RoutingMethod
    num_experts: int
    top_k: int
    # rows of the table (the vocabulary)
    vocab: int
    # tokens (rows of the logits)
    n: int
    dtype: torch.dtype
    seed: int
    routed_scaling_factor: float | None
    table_dtype: torch.dtype
    token_dtype: torch.dtype
    # "contiguous"; "row_padded" (rows of E + 3, the tail NaN); "column_strided" (every other column)
    logits_view: str
    # rows whose token id is outside [0, vocab), and rows with a table entry outside [0, E)
    bad_tokens: int
    bad_entries: int

    def route_kwargs(self) -> dict:
        return dict(routed_scaling_factor=self.routed_scaling_factor)

    def tensors(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router_logits (n, E) in ``logits_view``, hash_table (vocab, top_k), token_ids (n,)) on
        ``device``. The table is rows 1..vocab of a (vocab + 2, top_k) tensor whose first and last
        rows hold valid ids: a read of token id -1 or vocab would show up as ids, not -1. A logits
        view's gaps hold NaN: a read there shows up as NaN weights."""
        rng = np.random.default_rng(self.seed)
        e, k = self.num_experts, self.top_k
        x = torch.from_numpy(rng.standard_normal((self.n, e)).astype(np.float32)).to(self.dtype)
        if self.logits_view == "row_padded":
            base = torch.full((self.n, e + 3), float("nan"), dtype=self.dtype)
            logits = base[:, :e]
        elif self.logits_view == "column_strided":
            base = torch.full((self.n, 2 * e), float("nan"), dtype=self.dtype)
            logits = base[:, ::2]
        else:
            base = logits = torch.empty((self.n, e), dtype=self.dtype)
        logits.copy_(x)
        table = np.stack([rng.permutation(e)[:k] for _ in range(self.vocab + 2)])
        tokens = rng.integers(0, self.vocab, size=self.n)
        rows = rng.permutation(self.n)
        for r in rows[: self.bad_entries]:
            table[tokens[r] + 1, rng.integers(0, k)] = rng.choice([-1, e, e + 7] if self._signed else [e])
        for r in rows[self.bad_entries : self.bad_entries + self.bad_tokens]:
            tokens[r] = rng.choice([-1, self.vocab, self.vocab + 1] if self._signed_tokens else [self.vocab])
        full = torch.from_numpy(table).to(self.table_dtype)
        hash_table = full.to(device)[1 : self.vocab + 1]
        token_ids = torch.from_numpy(tokens).to(self.token_dtype).to(device)
        return logits.to(device), hash_table, token_ids

    @property
    def _signed(self) -> bool:
        return self.table_dtype != torch.uint8

    @property
    def _signed_tokens(self) -> bool:
        return self.token_dtype != torch.uint8


@st.composite
def hash_cases(draw, methods=tuple(RoutingMethod), max_experts: int = 64, max_tokens: int = 24, faults=True):
    """A :class:`HashCase` of any method (what it takes from the method table), random shapes,
    table and token dtypes, logits layouts and (with ``faults``) faulty rows."""
    method = draw(st.sampled_from(methods))
    spec = METHODS[method]
    num_experts = draw(st.integers(1, max_experts))
    top_k = spec.top_k or draw(st.integers(1, min(8, num_experts)))
    vocab = draw(st.integers(1, 200))
    n = draw(st.integers(0, max_tokens))
    bad_entries = draw(st.integers(0, n // 3)) if faults else 0
    bad_tokens = draw(st.integers(0, n // 3)) if faults else 0
    # uint8 tables hold ids up to 255 (an entry of num_experts stands for "too large")
    table_dtypes = [torch.int32, torch.int64, torch.int16] + ([torch.uint8] if num_experts < 248 else [])
    return HashCase(
        method=method,
        num_experts=num_experts,
        top_k=top_k,
        vocab=vocab,
        n=n,
        dtype=draw(st.sampled_from(LOGIT_DTYPES)),
        seed=draw(st.integers(0, 2**32 - 1)),
        routed_scaling_factor=draw(st.sampled_from([None, 1.0, 2.5])) if spec.scaled else None,
        table_dtype=draw(st.sampled_from(table_dtypes)),
        token_dtype=draw(
            st.sampled_from([torch.int64, torch.int32] + ([torch.uint8] if vocab < 250 else []))
        ),
        logits_view=draw(st.sampled_from(["contiguous", "row_padded", "column_strided"])),
        bad_tokens=bad_tokens,
        bad_entries=bad_entries,
    )


@st.composite
def group_configs(draw, methods=None, max_groups: int = 8, max_size: int = 12, max_top_k: int = 12):
    """A grouped configuration of a method of GROUP_METHODS (default: any) with a group score that
    applies to it (MAX everywhere; TOP2_SUM and TOPK_SHARE_SUM on a key that is a score, the share
    rule only where it sums 1..size keys; None: the method's own) and a renormalize value it takes."""
    methods = methods or tuple(sorted(m for m, spec in METHODS.items() if spec.groups))
    method = draw(st.sampled_from(methods))
    spec = METHODS[method]
    n_group = draw(st.integers(2, max_groups))
    size = draw(st.integers(1, max_size))
    topk_group = draw(st.integers(1, n_group))
    top_k = draw(st.integers(1, min(max_top_k, topk_group * size)))
    share = top_k // topk_group
    sums = spec.group_score != GroupScore.MAX  # a key that is a score
    rules = [None, GroupScore.MAX]
    if sums:
        rules.append(GroupScore.TOP2_SUM)
    if 1 <= share <= size and (sums or share == 1):
        rules.append(GroupScore.TOPK_SHARE_SUM)
    group_score = draw(st.sampled_from(rules))
    renormalize = draw(st.sampled_from([None, True, False] if spec.renormalizes is not None else [None]))
    return RouterConfig(
        f"groups-{method.name}-{getattr(group_score, 'name', None)}",
        method,
        n_group * size,
        top_k,
        n_group,
        topk_group,
        None,
        has_bias=spec.bias and draw(st.booleans()),
        renormalize=renormalize,
        group_score=group_score,
    )


@st.composite
def shared_capture_cases(draw, configs=None, max_shared: int = 3, capture_kw=None, dtypes=LOGIT_DTYPES):
    """(CaptureCase, RouterCase, num_fused_shared_experts, capture_shared_experts): a batch to
    route with fused shared experts and record. The CaptureCase's buffer is as wide as what the
    capture keeps: ``top_k`` (the routed columns) or ``top_k + s`` (the shared ones too)."""
    config = draw(configs if configs is not None else router_configs(max_experts=64, max_top_k=8))
    n_shared = draw(st.integers(1, max_shared))
    keep = draw(st.booleans())
    width = config.top_k + (n_shared if keep else 0)
    case = draw(capture_cases(layouts=tuple(BatchLayout), top_ks=(width,), **(capture_kw or {})))
    router = RouterCase(
        config=config,
        n=case.rows.shape[0],
        dtype=draw(st.sampled_from(dtypes)),
        seed=draw(st.integers(0, 2**32 - 1)),
        kind=draw(st.sampled_from(("normal", "ties"))),
        scale=1.0,
    )
    return case, router, n_shared, keep


@st.composite
def group_cases(draw, methods=None, max_tokens: int = 12):
    """(config of :func:`group_configs`, tokens, kind, seed): a batch of grouped routing; kind
    "normal" (N(0, 4)), "ties" (small integers: exact ties inside and across groups) or "near" (pairs
    of logits one float32 ulp apart), built by the test from the seed."""
    config = draw(group_configs(methods=methods))
    kind = draw(st.sampled_from(["normal", "ties", "near"]))
    return config, draw(st.integers(0, max_tokens)), kind, draw(st.integers(0, 2**31 - 1))
