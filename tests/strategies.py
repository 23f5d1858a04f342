"""Shared hypothesis strategies: batches in every layout, with padding, and their expected rows.

The expected rows are computed here from first principles (which block of the concatenated batch
belongs to the rank), independently of the library's offset code, so the tests check the library
against the layout definitions rather than against itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch
from hypothesis import strategies as st

from moe_ops import BatchLayout

POISON = -7  # buffer cells that must not be written
PAD_ID = -99  # ids in padding rows of topk_ids: must never reach the buffer


@dataclass
class CaptureCase:
    layout: BatchLayout
    # counts[i] is the number of REAL tokens of DP rank i
    counts: list[int]
    dp_rank: int
    # GATHERED: rows each rank occupies (None: counts, no padding); SHARDED: dp * spr shard sizes
    shard_sizes: list[int] | None
    # (n, top_k) ids in the layout's row order; padding rows hold PAD_ID
    rows: np.ndarray
    # first row of this rank's block; rows [start, start + c) are expected in the buffer
    start: int
    max_tokens: int
    num_layers: int
    layer_id: int
    buffer_dtype: torch.dtype
    ids_dtype: torch.dtype
    # memory layout of topk_ids: one of ID_VIEWS (same values, other strides)
    ids_view: str = "contiguous"
    # memory layout of token_counts / shard_sizes: one of COUNT_VIEWS
    counts_view: str = "contiguous"
    # memory layout of the buffer: one of BUFFER_VIEWS
    buffer_view: str = "contiguous"

    @property
    def c(self) -> int:
        return self.counts[self.dp_rank]

    @property
    def top_k(self) -> int:
        return self.rows.shape[1]

    def tensors(self, device):
        """(buffer poisoned, topk_ids, token_counts, shard_sizes or None) on ``device``, each in the
        case's memory layout (a strided, sliced or expanded view carries the same values)."""
        shape = (self.max_tokens, self.num_layers, self.top_k)
        buffer = buffer_view(
            torch.full(shape, POISON, dtype=self.buffer_dtype, device=device), self.buffer_view
        )
        topk_ids = ids_view(
            torch.from_numpy(self.rows).to(device=device, dtype=self.ids_dtype), self.ids_view
        )
        counts = count_view(torch.tensor(self.counts, dtype=torch.int32, device=device), self.counts_view)
        sizes = None
        if self.shard_sizes is not None:
            view = "strided" if self.counts_view == "expanded" else self.counts_view
            sizes = count_view(torch.tensor(self.shard_sizes, dtype=torch.int32, device=device), view)
        return buffer, topk_ids, counts, sizes

    def expected(self, buffer_before: torch.Tensor) -> torch.Tensor:
        out = buffer_before.clone()
        block = torch.from_numpy(self.rows[self.start : self.start + self.c]).to(out.dtype)
        out[: self.c, self.layer_id] = block.to(out.device)
        return out


# Memory layouts the kernels must read by stride: a Triton kernel that assumes contiguity is wrong only
# on the GPU path, which the PyTorch twin cannot show.
ID_VIEWS = ("contiguous", "sliced", "strided", "transposed")
COUNT_VIEWS = ("contiguous", "strided", "expanded")
BUFFER_VIEWS = ("contiguous", "sliced")
VIEW_GUARD = -31  # cells of a view's base outside the view: must never be read or written


def ids_view(t: torch.Tensor, kind: str) -> torch.Tensor:
    """``t`` (n, k) with the same values in another memory layout: ``sliced`` the first k columns
    of a wider tensor (e.g. ids[:, :top_k] of a fused shared-expert tensor), ``strided`` every
    other row, ``transposed`` column-major."""
    n, k = t.shape
    if kind == "sliced":
        wide = torch.full((n, k + 3), VIEW_GUARD, dtype=t.dtype, device=t.device)
        wide[:, :k] = t
        return wide[:, :k]
    if kind == "strided":
        tall = torch.full((2 * n, k), VIEW_GUARD, dtype=t.dtype, device=t.device)
        tall[::2] = t
        return tall[::2]
    if kind == "transposed":
        return t.t().contiguous().t()
    return t


def count_view(t: torch.Tensor, kind: str) -> torch.Tensor:
    """``t`` (n,) in another memory layout: ``strided`` a column of an (n, 2) tensor (counts sliced
    out of a larger one), ``expanded`` a stride-0 view of one element (all values equal)."""
    if kind == "strided":
        wide = torch.full((t.shape[0], 2), VIEW_GUARD, dtype=t.dtype, device=t.device)
        wide[:, 0] = t
        return wide[:, 0]
    if kind == "expanded":
        assert bool((t == t[0]).all()), "an expanded view needs equal values"
        return t[:1].expand(t.shape[0])
    return t


def buffer_view(t: torch.Tensor, kind: str) -> torch.Tensor:
    """``t`` (m, L, k) in another layout: ``sliced`` the first k columns of a wider buffer."""
    if kind == "sliced":
        m, layers, k = t.shape
        wide = torch.full((m, layers, k + 2), VIEW_GUARD, dtype=t.dtype, device=t.device)
        wide[..., :k] = t
        return wide[..., :k]
    return t


def view_base_untouched(t: torch.Tensor) -> bool:
    """For a sliced buffer: the base's cells outside the view still hold VIEW_GUARD."""
    base = t._base
    if base is None:
        return True
    return bool((base[..., t.shape[-1] :] == VIEW_GUARD).all())


def _ids(draw, n_rows: int, top_k: int, n_experts: int) -> np.ndarray:
    seed = draw(st.integers(0, 2**32 - 1))
    return np.random.default_rng(seed).integers(0, n_experts, size=(n_rows, top_k), dtype=np.int64)


def _block(draw, real: int, padded: int, top_k: int, n_experts: int) -> np.ndarray:
    rows = np.full((padded, top_k), PAD_ID, dtype=np.int64)
    rows[:real] = _ids(draw, real, top_k, n_experts)
    return rows


def _split(draw, total: int, parts: int) -> list[int]:
    """Splits ``total`` padded rows into ``parts`` contiguous shards: SP ceil-div or arbitrary."""
    if draw(st.booleans()):
        per = -(-total // parts)  # sequence-parallel: ceil(total / parts), the tail shard padded
        return [per] * parts
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1)))
    bounds = [0, *cuts, total]
    return [bounds[i + 1] - bounds[i] for i in range(parts)]


@st.composite
def capture_cases(
    draw,
    layouts=tuple(BatchLayout),
    max_count: int = 24,
    top_ks=tuple(range(1, 17)),
    buffer_dtypes=(torch.int32, torch.int16, torch.int64),
    ids_dtypes=(torch.int32, torch.int64, torch.int16),
    views: bool = True,
):
    """A batch in one of ``layouts`` (SEQUENCE_PARALLEL here means tp_size 1, i.e. no group), its
    tensors in one of the memory layouts of ID_VIEWS / COUNT_VIEWS / BUFFER_VIEWS (``views``).

    On a GPU each distinct (dtype, top_k) pair is a Triton compile, so GPU tests narrow
    ``top_ks`` and the dtypes; the CPU tests (reference and interpreted Triton) take them all.
    """
    layout = draw(st.sampled_from(layouts))
    single_dp = layout in (BatchLayout.LOCAL, BatchLayout.SEQUENCE_PARALLEL) and draw(st.booleans())
    dp_size = 1 if single_dp else draw(st.integers(1, 8))
    dp_rank = draw(st.integers(0, dp_size - 1))
    counts = draw(st.lists(st.integers(0, max_count), min_size=dp_size, max_size=dp_size))
    counts_kind = draw(st.sampled_from(COUNT_VIEWS)) if views else "contiguous"
    if counts_kind == "expanded":
        counts = [counts[0]] * dp_size
    top_k = draw(st.sampled_from(top_ks))
    n_experts = draw(st.sampled_from([8, 64, 256, 512]))
    # CUDA-graph style padding of each rank's batch up to a captured size
    pads = draw(st.lists(st.integers(0, 9), min_size=dp_size, max_size=dp_size))
    padded = [c + p for c, p in zip(counts, pads)]
    shard_sizes = None

    if layout in (BatchLayout.LOCAL, BatchLayout.SEQUENCE_PARALLEL):
        rows = _block(draw, counts[dp_rank], padded[dp_rank], top_k, n_experts)
        start = 0
        min_rows = rows.shape[0]  # LOCAL: the buffer holds the whole padded local batch
    elif layout == BatchLayout.GATHERED:
        if draw(st.booleans()):
            shard_sizes = padded  # padded all-gather: sizes passed explicitly
        else:
            padded = list(counts)  # unpadded gather: sizes default to token_counts
        blocks = [_block(draw, c, p, top_k, n_experts) for c, p in zip(counts, padded)]
        rows = np.concatenate(blocks, axis=0)
        start = sum(padded[:dp_rank])
        min_rows = counts[dp_rank]
    else:  # SHARDED
        spr = draw(st.integers(1, 4))
        shard_sizes = []
        blocks = []
        for c, p in zip(counts, padded):
            parts = _split(draw, p, spr)
            shard_sizes += parts
            blocks.append(_block(draw, c, sum(parts), top_k, n_experts))
        rows = np.concatenate(blocks, axis=0)
        start = sum(shard_sizes[: dp_rank * spr])
        min_rows = counts[dp_rank]

    num_layers = draw(st.integers(1, 6))
    return CaptureCase(
        layout=layout,
        counts=counts,
        dp_rank=dp_rank,
        shard_sizes=shard_sizes,
        rows=rows,
        start=start,
        max_tokens=min_rows + draw(st.integers(0, 5)),
        num_layers=num_layers,
        layer_id=draw(st.integers(0, num_layers - 1)),
        buffer_dtype=draw(st.sampled_from(buffer_dtypes)),
        ids_dtype=draw(st.sampled_from(ids_dtypes)),
        ids_view=draw(st.sampled_from(ID_VIEWS)) if views else "contiguous",
        counts_view=counts_kind,
        buffer_view=draw(st.sampled_from(BUFFER_VIEWS)) if views else "contiguous",
    )


@st.composite
def layout_queries(draw):
    """(token_counts, local_sizes, dp_rank, tp_size) for infer_layout."""
    dp_size = draw(st.integers(1, 8))
    counts = draw(st.lists(st.integers(0, 64), min_size=dp_size, max_size=dp_size))
    pads = draw(st.lists(st.integers(0, 16), min_size=dp_size, max_size=dp_size))
    local_sizes = [c + p for c, p in zip(counts, pads)] if draw(st.booleans()) else None
    return counts, local_sizes, draw(st.integers(0, dp_size - 1)), draw(st.sampled_from([1, 1, 2, 4]))


# What the GPU property tests draw from: a few compiles, not hundreds (each costs ~0.4 s).
GPU_CASES = dict(
    top_ks=(1, 2, 6, 8), buffer_dtypes=(torch.int32, torch.int16), ids_dtypes=(torch.int32, torch.int64)
)


# ---------------------------------------------------------------------------------------------------
# FlashInfer monolithic capture contract: the batch a monolithic kernel sees and the
# dispatch config that sized its routing-replay scratch.
# ---------------------------------------------------------------------------------------------------

# the layouts a kernel's batch can have after dispatch (SEQUENCE_PARALLEL is gathered before routing)
DISPATCH_LAYOUTS = (BatchLayout.LOCAL, BatchLayout.GATHERED, BatchLayout.SHARDED)


@dataclass
class ReplayCase:
    # the batch: rows are what the kernel writes into routing_replay_out (padding rows hold PAD_ID)
    case: CaptureCase
    # MoEDispatchConfig arguments that size the scratch for this batch
    max_num_tokens: int
    dp_size: int
    ep_size: int
    use_ep: bool


@st.composite
def replay_cases(draw, top_ks=(1, 2, 6, 8), buffer_dtypes=(torch.int32, torch.int16)):
    """A batch in one of the dispatch layouts, with a dispatch config whose scratch holds it.

    LOCAL: no gather (dp_size ranks, scratch sized for dp_size of them anyway); GATHERED: the DP
    group, with or without EP (ep_size == dp_size then); SHARDED: an EP group of dp_size *
    shards_per_rank ranks that gathered sequence-parallel shards.
    """
    case = draw(
        capture_cases(
            layouts=DISPATCH_LAYOUTS,
            max_count=12,
            top_ks=top_ks,
            buffer_dtypes=buffer_dtypes,
            ids_dtypes=(torch.int16,),
        )
    )
    n = case.rows.shape[0]
    dp_size = len(case.counts)
    if case.layout == BatchLayout.LOCAL:
        # a LOCAL buffer must hold max_num_tokens rows: size the config for this batch exactly
        case.max_tokens = max(case.max_tokens, n, 1)
        return ReplayCase(case, max(n, 1), dp_size, 1, False)
    if case.layout == BatchLayout.GATHERED:
        use_ep = draw(st.booleans())
        per_rank = max(case.shard_sizes or case.counts)
        return ReplayCase(case, max(per_rank, 1), dp_size, dp_size if use_ep else 1, use_ep)
    spr = len(case.shard_sizes) // dp_size
    per_rank = max(sum(case.shard_sizes[i * spr : (i + 1) * spr]) for i in range(dp_size))
    return ReplayCase(case, max(per_rank, 1), dp_size, dp_size * spr, True)


# ---------------------------------------------------------------------------------------------------
# Routers (moe_ops.route): routing configurations of real models, random shapes, logits with and
# without ties, and capture targets around them.
# ---------------------------------------------------------------------------------------------------

from moe_ops import RoutingMethod  # noqa: E402 - this section is appended; the imports above are the capture ones


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

    def route_kwargs(self, bias) -> dict:
        """Keyword arguments of moe_ops.route for this configuration."""
        return dict(
            bias=bias,
            n_group=self.n_group,
            topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
        )

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
        return cls(*(getattr(router, f) for f in cls.__dataclass_fields__))


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
    if method == RoutingMethod.DEEPSEEK_V3 and draw(st.booleans()):
        n_group = draw(st.integers(2, 8))
        size = draw(st.integers(1, max(1, max_experts // n_group)))
        num_experts = n_group * size
        topk_group = draw(st.integers(1, n_group))
        top_k = draw(st.integers(1, min(max_top_k, topk_group * size)))
    else:
        num_experts = draw(st.integers(1, max_experts))
        top_k = 1 if method == RoutingMethod.LLAMA4 else draw(st.integers(1, min(max_top_k, num_experts)))
        n_group = topk_group = None
    scaled = method in (RoutingMethod.DEEPSEEK_V3, RoutingMethod.MINIMAX2)
    scale = draw(st.sampled_from([None, 1.0, 2.5, 0.3])) if scaled else None
    return RouterConfig(
        f"random-{method.name}",
        method,
        num_experts,
        top_k,
        n_group,
        topk_group,
        scale,
        has_bias=scaled and draw(st.booleans()),
    )


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


# ---------------------------------------------------------------------------------------------------
# Routing shapes and routing arrays (capturer, transfer, store, wire)
# ---------------------------------------------------------------------------------------------------


@st.composite
def routing_shapes(draw, max_layers: int = 6, max_top_k: int = 8, experts=(8, 64, 256, 257, 4096, 70000)):
    """A RoutingShape with some dense layers mixed in (moe_layers a random subset of the model)."""
    from moe_ops import RoutingShape

    num_model_layers = draw(st.integers(1, max_layers))
    moe = draw(st.lists(st.booleans(), min_size=num_model_layers, max_size=num_model_layers))
    moe_layers = [i for i, m in enumerate(moe) if m] or [num_model_layers - 1]
    num_experts = draw(st.sampled_from(experts))
    top_k = draw(st.integers(1, min(max_top_k, num_experts)))
    return RoutingShape(
        num_layers=len(moe_layers),
        num_experts=num_experts,
        top_k=top_k,
        moe_layers=tuple(moe_layers),
        num_model_layers=num_model_layers,
    )


def routing_rows(rng: np.random.Generator, n: int, shape, dtype=None) -> np.ndarray:
    """(n, num_layers, top_k) ids in [0, num_experts) in ``dtype`` (default: the shape's narrow dtype)."""
    dtype = shape.id_dtype if dtype is None else dtype
    return rng.integers(0, shape.num_experts, size=(n, shape.num_layers, shape.top_k)).astype(dtype)


# ---------------------------------------------------------------------------------------------------
# Batches a transformers model runs with attach_capture (moe_ops.integrations.hf)
# ---------------------------------------------------------------------------------------------------


@dataclass
class HFBatch:
    """A (batch, seq) batch of token ids; the router sees its batch * seq rows flattened, row-major."""

    # sequences in the batch, >= 1
    batch: int
    # tokens per sequence (transformers pads a batch to one length), >= 1
    seq: int
    # LOCAL (one rank) or GATHERED (the rows are every DP rank's blocks, concatenated)
    layout: BatchLayout
    # real tokens of each DP rank; LOCAL: counts[0] <= rows; GATHERED: sum(counts) <= rows
    counts: list[int]
    # this rank's index into counts
    dp_rank: int
    # seed of the token ids
    seed: int

    @property
    def rows(self) -> int:
        return self.batch * self.seq

    @property
    def start(self) -> int:
        """First row of this rank's block: 0 for LOCAL, the blocks of the ranks before it for GATHERED."""
        return sum(self.counts[: self.dp_rank]) if self.layout == BatchLayout.GATHERED else 0

    @property
    def c(self) -> int:
        return self.counts[self.dp_rank]


@st.composite
def hf_batches(draw, max_batch: int = 3, max_seq: int = 6) -> HFBatch:
    """A padded batch and the token counts the capture must honour (padding rows never recorded)."""
    batch = draw(st.integers(1, max_batch))
    seq = draw(st.integers(1, max_seq))
    rows = batch * seq
    seed = draw(st.integers(0, 2**31 - 1))
    if draw(st.booleans()):
        return HFBatch(batch, seq, BatchLayout.LOCAL, [draw(st.integers(0, rows))], 0, seed)
    first = draw(st.integers(0, rows))
    second = draw(st.integers(0, rows - first))
    return HFBatch(batch, seq, BatchLayout.GATHERED, [first, second], draw(st.integers(0, 1)), seed)


# ---------------------------------------------------------------------------------------------------
# Serving workloads for the runner and the end-to-end tests
# ---------------------------------------------------------------------------------------------------


@st.composite
def serving_requests(
    draw, vocab_size: int, max_seq_len: int, max_requests: int = 6, max_prompt: int = 14, max_new: int = 10
):
    """Requests of random prompt lengths that generate random numbers of tokens (so they finish at
    different steps): a list of ``moe_ops.demo.DemoRequest``."""
    from moe_ops.demo import DemoRequest

    n = draw(st.integers(2, max_requests))
    out = []
    for i in range(n):
        prompt_len = draw(st.integers(1, max_prompt))
        new = draw(st.integers(1, min(max_new, max_seq_len - prompt_len)))
        seed = draw(st.integers(0, 2**32 - 1))
        prompt = np.random.default_rng(seed).integers(1, vocab_size, size=prompt_len)
        out.append(DemoRequest(i, tuple(int(t) for t in prompt), new))
    return out


# Row counts of consecutive steps: real rows of a padded runner, some above the largest capture size.
step_row_counts = st.lists(st.integers(1, 40), min_size=1, max_size=8)


# ---------------------------------------------------------------------------------------------------
# The snapshot's narrowing cast
# ---------------------------------------------------------------------------------------------------

NARROW_SOURCES = (torch.int16, torch.int32, torch.int64)
NARROW_TARGETS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


@dataclass(frozen=True)
class NarrowCase:
    # (max_rows, L, K) source rows and the number of leading rows to cast
    max_rows: int
    num_layers: int
    top_k: int
    num_rows: int
    src_dtype: torch.dtype
    dst_dtype: torch.dtype
    # ids drawn from [low, high]: past the target's range too, so truncation is exercised
    low: int
    high: int
    seed: int

    def source(self, device) -> torch.Tensor:
        info = torch.iinfo(self.src_dtype)
        low, high = max(self.low, info.min), min(self.high, info.max)
        g = torch.Generator().manual_seed(self.seed)
        shape = (self.max_rows, self.num_layers, self.top_k)
        return torch.randint(low, high + 1, shape, generator=g, dtype=torch.int64).to(device, self.src_dtype)


@st.composite
def narrow_cases(draw, max_rows: int = 40):
    rows = draw(st.integers(1, max_rows))
    ranges = [(0, 255), (-1, 300), (0, 65535), (-70000, 70000), (-(2**31), 2**31 - 1)]
    low, high = draw(st.sampled_from(ranges))
    return NarrowCase(
        max_rows=rows,
        num_layers=draw(st.integers(1, 7)),
        top_k=draw(st.sampled_from([1, 2, 6, 8, 9])),
        num_rows=draw(st.integers(0, rows)),
        src_dtype=draw(st.sampled_from(NARROW_SOURCES)),
        dst_dtype=draw(st.sampled_from(NARROW_TARGETS)),
        low=low,
        high=high,
        seed=draw(st.integers(0, 2**32 - 1)),
    )


# ---------------------------------------------------------------------------------------------------
# infer_layout over vLLM-style shard sizes: a step's shapes together with the batch it really is
# ---------------------------------------------------------------------------------------------------


def layout_token_id(dp_rank: int, j: int) -> int:
    """Id of real token ``j`` of DP rank ``dp_rank`` in a LayoutBatch: unique while j < 1000."""
    return 1000 * dp_rank + j


@dataclass
class LayoutBatch:
    """What infer_layout is told (counts, shard sizes, rank, tp) and the arrangement the rows are
    really in. The rows are built here from the layout definitions (blocks, shards, TP slices),
    independently of moe_ops.layout.

    A hypothesis is ``(layout, form)``: form "counts" lays the batch out over the real counts,
    "padded" over each rank's padded size (the sum of its shards), "shards" over ``local_sizes``
    exactly (SHARDED with more than one shard per rank).
    """

    # counts[i] is the number of REAL tokens of DP rank i
    counts: list[int]
    # dp_size * spr shard sizes in DP-then-TP order, padding included; None: no padding (spr 1)
    local_sizes: list[int] | None
    # this rank's index into counts
    dp_rank: int
    # tensor-parallel size; divides spr when spr > 1
    tp_size: int
    # the hypothesis the rows are really in; one of self.hypotheses()
    truth: tuple[BatchLayout, str]

    @property
    def dp_size(self) -> int:
        return len(self.counts)

    @property
    def spr(self) -> int:
        return 1 if self.local_sizes is None else len(self.local_sizes) // self.dp_size

    @property
    def shards(self) -> list[int]:
        return list(self.counts) if self.local_sizes is None else list(self.local_sizes)

    @property
    def padded(self) -> list[int]:
        """Each rank's padded size: the sum of its shards."""
        s = self.spr
        return [sum(self.shards[i * s : (i + 1) * s]) for i in range(self.dp_size)]

    @property
    def c(self) -> int:
        return self.counts[self.dp_rank]

    def real_ids(self) -> np.ndarray:
        """(c, 1) ids of this rank's real tokens: what the buffer must receive."""
        ids = [layout_token_id(self.dp_rank, j) for j in range(self.c)]
        return np.array(ids, dtype=np.int64).reshape(self.c, 1)

    def hypotheses(self) -> list[tuple[BatchLayout, str]]:
        """Every arrangement these shapes allow (the candidates of the layout definitions)."""
        out = [(BatchLayout.LOCAL, "counts"), (BatchLayout.LOCAL, "padded")]
        if self.dp_size > 1:
            out += [(BatchLayout.GATHERED, "counts"), (BatchLayout.GATHERED, "padded")]
            if self.spr > 1:
                out.append((BatchLayout.SHARDED, "shards"))
        if self.tp_size > 1:
            out += [(BatchLayout.SEQUENCE_PARALLEL, "counts"), (BatchLayout.SEQUENCE_PARALLEL, "padded")]
            if self.dp_size > 1:
                out.append((BatchLayout.SHARDED, "counts"))
                if self.spr == 1:
                    out.append((BatchLayout.SHARDED, "padded"))
        return out

    def _batch(self, rank: int, rows: int) -> np.ndarray:
        """DP rank ``rank``'s batch padded to ``rows``: its real tokens first, then PAD_ID."""
        out = np.full((rows, 1), PAD_ID, dtype=np.int64)
        out[: self.counts[rank], 0] = [layout_token_id(rank, j) for j in range(self.counts[rank])]
        return out

    def views(self, hypothesis: tuple[BatchLayout, str]) -> list[np.ndarray]:
        """The (n, 1) rows each TP rank of this DP rank feeds the MoE layer, TP-rank order."""
        layout, form = hypothesis
        tp, r = self.tp_size, self.dp_rank
        xs = self.counts if form == "counts" else self.padded
        if layout == BatchLayout.LOCAL:
            return [self._batch(r, xs[r])] * tp
        if layout == BatchLayout.GATHERED:
            return [np.concatenate([self._batch(i, x) for i, x in enumerate(xs)])] * tp
        if layout == BatchLayout.SEQUENCE_PARALLEL:
            per = -(-xs[r] // tp)  # ceil(X / tp) rows on every TP rank, the tail one padded
            batch = self._batch(r, tp * per)
            return [batch[j * per : (j + 1) * per] for j in range(tp)]
        # SHARDED: every shard of every rank, gathered in DP-then-TP order; a rank's shards are
        # consecutive chunks of its padded batch
        if form == "shards":
            s = self.spr
            per_rank = [self.shards[i * s : (i + 1) * s] for i in range(self.dp_size)]
        else:
            per_rank = [[-(-x // tp)] * tp for x in xs]
        pieces = []
        for i, parts in enumerate(per_rank):
            batch = self._batch(i, sum(parts))
            bounds = np.cumsum([0, *parts])
            pieces += [batch[bounds[k] : bounds[k + 1]] for k in range(len(parts))]
        return [np.concatenate(pieces)] * tp

    def selection(self, hypothesis: tuple[BatchLayout, str]) -> tuple[int, bool]:
        """(row of this rank's first real token, whether the TP shards are gathered first)."""
        if hypothesis[0] == BatchLayout.SEQUENCE_PARALLEL:
            return 0, True
        if self.c == 0:
            return 0, False
        rows = self.views(hypothesis)[0][:, 0]
        return int(np.flatnonzero(rows == layout_token_id(self.dp_rank, 0))[0]), False


@st.composite
def layout_batches(draw, max_dp: int = 5, max_count: int = 10, max_pad: int = 4):
    """A LayoutBatch: counts, CUDA-graph style padding (none, per rank, or every rank to one size),
    ``spr`` shards per rank split SP ceil-div or arbitrarily, and one of its hypotheses as truth."""
    dp_size = draw(st.integers(1, max_dp))
    tp = draw(st.sampled_from([1, 2, 4]))
    spr = draw(st.sampled_from([1, 2, 3] if tp == 1 else [1, tp, 2 * tp]))
    counts = draw(st.lists(st.integers(0, max_count), min_size=dp_size, max_size=dp_size))
    padding = draw(st.sampled_from(["none", "per-rank", "uniform"]))
    if padding == "none":
        totals = list(counts)
    elif padding == "per-rank":
        pads = draw(st.lists(st.integers(0, max_pad), min_size=dp_size, max_size=dp_size))
        totals = [c + p for c, p in zip(counts, pads)]
    else:  # DP padding under CUDA graphs: every rank runs the largest size
        totals = [max(counts) + draw(st.integers(0, max_pad))] * dp_size
    if spr == 1 and totals == counts and draw(st.booleans()):
        local_sizes = None
    else:
        local_sizes = [size for t in totals for size in _split(draw, t, spr)]
    dp_rank = draw(st.integers(0, dp_size - 1))
    probe = LayoutBatch(counts, local_sizes, dp_rank, tp, truth=(BatchLayout.LOCAL, "counts"))
    return replace(probe, truth=draw(st.sampled_from(probe.hypotheses())))


# Replayed routing (moe_ops.replay_routing) and routing-mismatch metrics
# ---------------------------------------------------------------------------------------------------

# Row kinds of a recorded routing: the live top-k with shuffled columns, other distinct experts, a
# row of -1 (route live), and three faulty kinds (routed live and counted).
RECORDED_KINDS = ("route", "other", "live", "out_of_range", "repeated", "partial")
FAULTY_KINDS = ("out_of_range", "repeated", "partial")


@dataclass
class RecordedCase:
    """Router logits and a recorded routing for them, row kind by row kind."""

    router: RouterCase
    # kinds[t] in RECORDED_KINDS: how row t of the record is built
    kinds: list[str]
    # dtype of the recorded ids
    ids_dtype: torch.dtype
    seed: int

    def recorded(self, route_ids: torch.Tensor) -> torch.Tensor:
        """(n, top_k) recorded ids built from ``route_ids`` (the live routing of the same logits)."""
        rng = np.random.default_rng(self.seed)
        num_experts, k = self.router.config.num_experts, self.router.config.top_k
        live = route_ids.cpu().numpy().astype(np.int64)
        info = torch.iinfo(self.ids_dtype)
        rows = np.empty_like(live)
        for t, kind in enumerate(self.kinds):
            row = rng.permutation(live[t]) if kind == "route" else rng.permutation(num_experts)[:k]
            if kind == "live":
                row = np.full(k, -1)
            elif kind == "out_of_range":
                bad = [num_experts, info.max, num_experts + 7]
                if info.min < 0:
                    bad += [-2, info.min]
                row[rng.integers(k)] = bad[rng.integers(len(bad))]
            elif kind == "repeated":
                i, j = rng.choice(k, size=2, replace=False)
                row[j] = row[i]
            elif kind == "partial":
                row[rng.choice(k, size=rng.integers(1, k), replace=False)] = -1
            rows[t] = row
        return torch.from_numpy(rows).to(self.ids_dtype)

    def routed_live(self) -> torch.Tensor:
        """(n,) bool: rows the op must route live (-1 rows and faulty rows)."""
        return torch.tensor([kind not in ("route", "other") for kind in self.kinds], dtype=torch.bool)

    @property
    def faulty_rows(self) -> int:
        return sum(kind in FAULTY_KINDS for kind in self.kinds)


@st.composite
def recorded_cases(draw, configs=None, max_tokens: int = 24, dtypes=LOGIT_DTYPES, kinds=("normal", "ties")):
    """A batch of router logits (see :func:`router_cases`) with a recorded routing whose rows mix
    every kind of RECORDED_KINDS that the configuration and the ids dtype can express."""
    router = draw(router_cases(configs=configs, max_tokens=max_tokens, dtypes=dtypes, kinds=kinds))
    num_experts, k = router.config.num_experts, router.config.top_k
    ids_dtypes = [torch.int16, torch.int32, torch.int64]
    if num_experts < 128:
        ids_dtypes.append(torch.int8)
    if num_experts < 240:  # num_experts + 7 (an out-of-range id) still fits
        ids_dtypes.append(torch.uint8)  # holds no -1: no live or partial rows
    ids_dtype = draw(st.sampled_from(ids_dtypes))
    allowed = ["route", "other", "out_of_range"]
    if ids_dtype != torch.uint8:
        allowed.append("live")
    if k >= 2:
        allowed.append("repeated")
        if ids_dtype != torch.uint8:
            allowed.append("partial")
    row_kinds = draw(st.lists(st.sampled_from(allowed), min_size=router.n, max_size=router.n))
    return RecordedCase(router, row_kinds, ids_dtype, draw(st.integers(0, 2**32 - 1)))


@dataclass
class MismatchCase:
    # (n, num_layers, top_k) recorded and live ids (None layers: the 2-D form)
    recorded: np.ndarray
    live: np.ndarray
    # (n,) valid flags, or None
    valid: np.ndarray | None
    # whether to pass the 2-D (n, top_k) form (num_layers is then 1)
    flat: bool
    # the no-record marker of the recorded rows: -1, or 0 (all-zero rows; top_k >= 2 only)
    no_record: int = -1


@st.composite
def mismatch_cases(draw, max_tokens: int = 20, max_layers: int = 4, max_top_k: int = 6):
    """Recorded and live routings of the same tokens: some rows equal up to column order, some
    sharing part of their experts, some disjoint, some with an id listed twice (on either side),
    some recorded rows without a record (all -1, or all ``no_record``)."""
    n = draw(st.integers(0, max_tokens))
    flat = draw(st.booleans())
    layers = 1 if flat else draw(st.integers(1, max_layers))
    k = draw(st.integers(1, max_top_k))
    num_experts = draw(st.integers(k, 3 * k + 2))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    recorded = np.zeros((n, layers, k), dtype=np.int64)
    for t in range(n):
        for layer in range(layers):
            recorded[t, layer] = rng.permutation(num_experts)[:k]
    live = recorded.copy()
    for t in range(n):
        for layer in range(layers):
            how = rng.integers(5)  # 4: unchanged
            if how == 0:
                live[t, layer] = rng.permutation(live[t, layer])  # same set, other order
            elif how == 1:
                live[t, layer] = rng.permutation(num_experts)[:k]  # anything
            elif how == 2:
                live[t, layer, rng.integers(k)] = live[t, layer, rng.integers(k)]  # maybe a duplicate
            elif how == 3:
                recorded[t, layer, rng.integers(k)] = recorded[t, layer, rng.integers(k)]
    no_record = draw(st.sampled_from([-1, 0])) if k >= 2 else -1
    unrecorded = rng.random((n, layers)) < 0.15
    recorded[unrecorded] = -1
    if no_record == 0:
        recorded[unrecorded & (rng.random((n, layers)) < 0.5)] = 0
    valid = rng.random(n) < 0.7 if draw(st.booleans()) else None
    return MismatchCase(recorded, live, valid, flat, no_record)


# ---------------------------------------------------------------------------------------------------
# Ids near the dtype limits: values a buffer dtype holds or not, in ids of a wider or narrower dtype.
# ---------------------------------------------------------------------------------------------------

_DTYPE_MAX = {torch.int16: 2**15 - 1, torch.int32: 2**31 - 1, torch.int64: 2**63 - 1}


def refused_ids(case: CaptureCase, buffer_before: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The buffer a capture of ``case`` leaves when ids that do not fit the buffer dtype (or are
    negative) are stored as -1, and how many ids were refused (computed here, from the dtypes)."""
    out = buffer_before.clone()
    block = torch.from_numpy(case.rows[case.start : case.start + case.c]).to(torch.int64)
    bad = (block < 0) | (block > _DTYPE_MAX[case.buffer_dtype])
    out[: case.c, case.layer_id] = torch.where(bad, -1, block).to(out.dtype).to(out.device)
    return out, int(bad.sum())


@st.composite
def limit_id_cases(draw, buffer_dtypes=(torch.int16, torch.int32, torch.int64), views: bool = True):
    """A capture case whose real rows hold ids at and beyond the buffer dtype's limits (and negative
    ones), in ids of a dtype at least as wide as the buffer's."""
    case = draw(capture_cases(buffer_dtypes=buffer_dtypes, ids_dtypes=(torch.int64,), views=views))
    limit = _DTYPE_MAX[case.buffer_dtype]
    ids_dtype = draw(
        st.sampled_from([d for d in (torch.int16, torch.int32, torch.int64) if _DTYPE_MAX[d] >= limit])
    )
    id_max = _DTYPE_MAX[ids_dtype]
    near = [0, 1, limit - 1, limit, -1, -(2**15)]
    if id_max > limit:
        near += [limit + 1, min(id_max, 2 * limit + 1), id_max]
    rows = case.rows.copy()
    real = np.zeros(rows.shape[0], dtype=bool)
    real[case.start : case.start + case.c] = True
    picks = draw(st.lists(st.sampled_from(near), min_size=rows.size, max_size=rows.size))
    values = np.array(picks, dtype=np.int64).reshape(rows.shape)
    rows[real] = values[real]
    case.rows = rows
    case.ids_dtype = ids_dtype
    return case


# Hostile input for the wire decoders and the config guards
# ---------------------------------------------------------------------------------------------------

import math  # noqa: E402 - this section is appended; the imports above are the capture ones
import re  # noqa: E402
import struct  # noqa: E402

# .npy descr values: what np.save writes for integer arrays, then near misses and other kinds
NPY_DESCRS = (
    "|u1", "<u1", "<u2", ">u2", "<i4", ">i4", "<i8", "|i1", "<u4", ">u8", "=i2", "i4",
    "<f4", "|b1", "|O", "O", "<U3", "|S2", "<u3", "uint8", "", "<i4 ", "<M8[s]", "|V4",
)  # fmt: skip
# text spliced into a header: a hostile " } (" (numpy's reader retried it through Python 2 token
# filtering and raised tokenize.TokenError), unbalanced brackets, quotes, NULs, Python 2 longs
NPY_HEADER_JUNK = ("", " } (", "(", ")", "[", "'", '"', "\\", "\x00", "#", " **", "\n\n", "L", ",", "{")


def _npy_dims():
    return st.one_of(
        st.integers(0, 4),
        st.integers(-3, 2**65),
        st.booleans(),
        st.sampled_from([1.0, None, "2", (1,)]),
    )


@st.composite
def npy_header_texts(draw) -> str:
    """The text of a .npy header dict: a third valid, the rest hostile (wrong types, bools, negative
    or huge dims, too many dims, extra or missing keys, junk spliced in anywhere)."""
    valid_descr = st.sampled_from([d for d in NPY_DESCRS if re.fullmatch(r"[<>|=]?[iu][1248]", d)])
    small_shape = st.lists(st.integers(0, 4), max_size=4).map(tuple)
    if draw(st.integers(0, 2)) == 0:
        entries = {
            "descr": draw(valid_descr),
            "fortran_order": draw(st.booleans()),
            "shape": draw(small_shape),
        }
        return repr(entries) + "\n"
    descr = draw(
        st.one_of(
            valid_descr, st.sampled_from(NPY_DESCRS), st.sampled_from([5, None, [("a", "<i4")], ["|u1"]])
        )
    )
    fortran = draw(st.sampled_from([False, True, False, True, 0, 1, None, "False"]))
    shape = draw(
        st.one_of(
            small_shape,
            st.lists(_npy_dims(), max_size=4).map(tuple),
            st.lists(st.integers(0, 2), min_size=33, max_size=36).map(tuple),
            st.integers(0, 5),
            st.lists(st.integers(0, 3), max_size=3),
        )
    )
    entries = {"descr": descr, "fortran_order": fortran, "shape": shape}
    if draw(st.integers(0, 5)) == 0:
        del entries[draw(st.sampled_from(sorted(entries)))]
    if draw(st.integers(0, 5)) == 0:
        entries[draw(st.sampled_from(["extra", "Shape", "descr "]))] = 0
    text = repr(entries)
    for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from(NPY_HEADER_JUNK)) + text[at:]
    return text + draw(st.sampled_from(["\n", "\n", "", " \n", "\n\x00"]))


def _npy_data_size(text: str) -> int | None:
    """Bytes of data a header text announces, when it parses (None otherwise or when large)."""
    import ast

    if re.search(r"\\|[0-9][A-Za-z_]", text):
        return None  # text the tokenizer warns about: no header announces a size with it
    try:
        header = ast.literal_eval(text)
        shape = header["shape"]
        if not isinstance(shape, tuple) or not all(type(d) is int and d >= 0 for d in shape):
            return None
        size = math.prod(shape) * np.dtype(header["descr"]).itemsize
    except Exception:  # any failure only means "no exact size": the payload gets random data
        return None
    return size if 0 <= size <= 4096 else None


@st.composite
def npy_payloads(draw) -> bytes:
    """.npy bytes around a generated header: magic and version (1.0, 2.0 or unknown), a length
    field right or wrong, the padding numpy writes or none, data of the announced size or not."""
    text = draw(npy_header_texts())
    if draw(st.booleans()):
        text = text.rstrip("\n") + " " * (-(len(text) + 10) % 64) + "\n"
    header = text.encode("latin-1")
    version = draw(st.sampled_from([(1, 0)] * 6 + [(2, 0)] * 2 + [(3, 0), (0, 9)]))
    length_field = "<H" if version[0] == 1 else "<I"
    length = len(header) if draw(st.integers(0, 4)) else draw(st.integers(0, 2**16 - 1))
    prefix = b"\x93NUMPY" + bytes(version) + struct.pack(length_field, min(length, 2**16 - 1))
    size = _npy_data_size(text)
    if size is not None and draw(st.integers(0, 3)):
        data = draw(st.binary(min_size=size, max_size=size))
    else:
        data = draw(st.binary(max_size=64))
    return prefix + header + data


@st.composite
def mutated(draw, data: bytes, keep: int = 0, max_ops: int = 4) -> bytes:
    """``data`` with a few byte-level edits: flips, overwrites, cuts, insertions, truncation. Edits
    mostly land past the first ``keep`` bytes (a magic number), so most cases reach the checks
    behind it."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, max_ops))):
        op = draw(st.sampled_from(["flip", "set", "cut", "insert", "truncate"]))
        low = 0 if draw(st.integers(0, 7)) == 0 else min(keep, len(out))
        at = draw(st.integers(low, len(out)))
        if op == "flip" and at < len(out):
            out[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and at < len(out):
            out[at] = draw(st.sampled_from([0, 1, 0x7F, 0x80, 0xFF, ord("("), ord("'"), ord("}")]))
        elif op == "cut":
            del out[at : at + draw(st.integers(1, 8))]
        elif op == "insert":
            out[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "truncate":
            del out[at:]
    return bytes(out)


WIRE_DTYPES = (np.uint8, np.uint16, np.int32, np.int16, np.int64, np.int8, np.uint32, np.uint64)


@st.composite
def routing_arrays(draw, dtypes=WIRE_DTYPES, max_rows: int = 6) -> np.ndarray:
    """A small integer array in any of ``dtypes``, byte order and memory order, values over the
    dtype's whole range; mostly 3-D (n, layers, top_k), sometimes another number of dims."""
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    if draw(st.integers(0, 4)):
        shape = (draw(st.integers(0, max_rows)), draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    else:
        shape = tuple(draw(st.lists(st.integers(0, 3), max_size=4)))
    info = np.iinfo(dtype)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    array = rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    if draw(st.booleans()):
        array = array.astype(dtype.newbyteorder(">"))
    if draw(st.booleans()):
        array = np.asfortranarray(array)
    return array


@st.composite
def raw_routing_payloads(draw) -> bytes:
    """Raw MOER bytes with every header field drawn (magic, version, dtype code, ndim, reserved
    byte, dims up to 2**64 - 1) and data of the announced size or not."""
    magic = draw(st.sampled_from([b"MOER"] * 6 + [b"MOEr", b"NOPE"]))
    version = draw(st.sampled_from([1] * 6 + [0, 2, 255]))
    code = draw(st.one_of(st.integers(1, 8), st.integers(1, 8), st.sampled_from([0, 9, 255])))
    ndim = draw(st.sampled_from([0, 1, 2, 3, 3, 3, 8, 9, 255]))
    reserved = draw(st.sampled_from([0] * 6 + [1, 0x80, 0xFF]))
    dims = draw(
        st.lists(
            st.one_of(st.integers(0, 4), st.integers(0, 4), st.integers(0, 2**64 - 1)),
            min_size=min(ndim, 9),
            max_size=min(ndim, 9),
        )
    )
    head = struct.pack("<4sBBBB", magic, version, code, ndim, reserved)
    head += b"".join(struct.pack("<Q", d) for d in dims)
    itemsize = {1: 1, 2: 2, 3: 4, 4: 2, 5: 8, 6: 1, 7: 4, 8: 8}.get(code, 1)
    size = int(np.prod(dims, dtype=object)) * itemsize if dims else itemsize
    if size <= 4096 and draw(st.integers(0, 3)):
        return head + draw(st.binary(min_size=size, max_size=size))
    return head + draw(st.binary(max_size=64))


# a value of every kind a config field may hold by mistake
HOSTILE_CONFIG_VALUES = (
    0, -1, 1, 2, 3, 10**12, True, False, None, 1.7, float("nan"), "1", "false", "moe", [], [None],
    [1.7], [8, "a"], [0, 1], [True], {}, (2,), ["moe", "dense"], ["sparse"], [[1]],
)  # fmt: skip
# every field resolve_routing_shape reads (docs/shapes.md), plus the MTP fields the guard reads
CONFIG_FIELDS = (
    "num_hidden_layers", "num_layers", "num_experts_per_tok", "num_experts_per_token", "top_k_experts",
    "moe_topk", "moe_top_k", "moe_k", "num_experts", "num_local_experts", "n_routed_experts",
    "moe_num_experts", "zero_expert_num", "model_type", "mlp_layer_types", "layers_block_type",
    "moe_layers", "enable_moe_block", "first_k_dense_replace", "moe_layer_freq", "decoder_sparse_step",
    "mlp_only_layers", "moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval",
    "expert_layer_period", "expert_layer_offset", "num_dense_layers", "interleave_moe_layer_step",
    "num_nextn_predict_layers", "mtp_num_hidden_layers", "mtp_layers_block_type", "mtp_mlp_layer_types",
)  # fmt: skip


@st.composite
def hostile_model_configs(draw) -> dict:
    """A dict config: a valid MoE base with a few fields overwritten by hostile values, sometimes
    nested under text_config / ffn_config, sometimes with a text_config cycle."""
    config = dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2)
    for name in draw(st.lists(st.sampled_from(CONFIG_FIELDS), max_size=4, unique=True)):
        value = draw(st.sampled_from(HOSTILE_CONFIG_VALUES))
        config[name] = list(value) if isinstance(value, list) else value
    shape = draw(st.sampled_from(["flat", "nested", "ffn", "cycle"]))
    if shape == "nested":
        return {"text_config": config}
    if shape == "ffn":
        return {**config, "ffn_config": {"moe_top_k": draw(st.sampled_from(HOSTILE_CONFIG_VALUES))}}
    if shape == "cycle":
        outer = {"text_config": config}
        config["text_config"] = outer
        return outer
    return config


# ---------------------------------------------------------------------------------------------------
# Replay in training: RoutingReplayer.set_batch and replay_batch (moe_ops.replay.replayer)
# ---------------------------------------------------------------------------------------------------


def distinct_rows(rng: np.random.Generator, n: int, shape, live_fraction: float = 0.0) -> np.ndarray:
    """(n, num_layers, top_k) int64 ids, each (token, layer) row distinct experts; about
    ``live_fraction`` of the (token, layer) rows are all -1 (no record)."""
    out = np.empty((n, shape.num_layers, shape.top_k), dtype=np.int64)
    for t in range(n):
        for layer in range(shape.num_layers):
            out[t, layer] = rng.choice(shape.num_experts, size=shape.top_k, replace=False)
    out[rng.random((n, shape.num_layers)) < live_fraction] = -1
    return out


def _small_shapes():
    return routing_shapes(max_layers=4, max_top_k=4, experts=(4, 8, 100, 256, 300))


@dataclass
class ReplayBatchSequence:
    """Batches a trainer sets one after another on one replayer (sizes going up and down)."""

    shape: object
    # rows of the replayer's buffer
    max_num_tokens: int
    # each (n <= max_num_tokens, num_layers, top_k) int64, -1 rows for padding / live tokens
    batches: list[np.ndarray]
    # per batch: "numpy", "tensor" (a CPU tensor) and the integer dtype it is passed in
    kinds: list[tuple[str, np.dtype]]

    def passed(self, i: int):
        """Batch ``i`` as the trainer hands it to set_batch."""
        how, dtype = self.kinds[i]
        array = self.batches[i].astype(dtype)
        return torch.from_numpy(array) if how == "tensor" else array


@st.composite
def replay_batch_sequences(draw, max_batches: int = 5, max_rows: int = 12):
    shape = draw(_small_shapes())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    max_num_tokens = draw(st.integers(1, max_rows))
    sizes = draw(st.lists(st.integers(0, max_num_tokens), min_size=1, max_size=max_batches))
    dtypes = [np.dtype(np.int32), np.dtype(np.int64)]
    if shape.num_experts <= 127:
        dtypes.append(np.dtype(np.int8))
    if shape.num_experts <= 32767:
        dtypes.append(np.dtype(np.int16))
    kinds = [(draw(st.sampled_from(["numpy", "tensor"])), draw(st.sampled_from(dtypes))) for _ in sizes]
    batches = [distinct_rows(rng, n, shape, live_fraction=0.2) for n in sizes]
    return ReplayBatchSequence(shape, max_num_tokens, batches, kinds)


@dataclass
class ReplayRequests:
    """Per-request routing as a client receives it from the rollout, and what it stands for."""

    shape: object
    # per request: (T - 1, num_layers, top_k) int64 ids on the MoE-only axis, -1 where never recorded
    truth: list[np.ndarray]
    # layout of the received arrays: "moe" or "model" (vLLM: a column per decoder layer)
    layer_axis: str
    # each request padded to pad_to rows (None: packed)
    pad_to: int | None
    # dtype of the received arrays: the narrow unsigned dtype (no record = its maximum) or a signed one
    dtype: np.dtype
    seed: int
    # per request: received with T rows (aligned to its tokens: a placeholder row for the last
    # token, verl's convention) instead of T - 1
    aligned: list[bool] = field(default_factory=list)
    # the no-record marker the client uses besides -1 / the fill: -1 (none) or 0 (all-zero rows)
    no_record: int = -1
    # per request: None or a (rows,) bool mask of rows received with a valid-looking id but no
    # record (a dropped step's rows: the store's fill, which can be a valid id)
    missing: list[np.ndarray | None] = field(default_factory=list)
    # pass num_tokens (each request's T) to replay_batch
    with_counts: bool = False

    def num_tokens(self) -> list[int] | None:
        """Each request's token count T, or None when the case does not pass them."""
        return [t.shape[0] + 1 for t in self.truth] if self.with_counts else None

    def masks(self) -> list[np.ndarray | None] | None:
        """What replay_batch's ``missing`` gets: one flag per received row (an aligned request's
        placeholder row is not masked), or None when no request has a mask."""
        if not any(m is not None for m in self.missing):
            return None
        out = []
        for i, mask in enumerate(self.missing):
            if mask is not None and i < len(self.aligned) and self.aligned[i]:
                mask = np.concatenate([mask, [False]])
            out.append(mask)
        return out

    def arrays(self) -> list[np.ndarray]:
        """The received arrays: missing ids as the dtype's fill (or, with no_record=0, some as
        all-zero rows), masked rows holding valid ids, dense columns holding garbage, a
        placeholder row on aligned requests."""
        rng = np.random.default_rng(self.seed)
        fill = np.iinfo(self.dtype).max if self.dtype.kind == "u" else -1
        out = []
        for i, truth in enumerate(self.truth):
            a = np.where(truth == -1, fill, truth)
            if self.no_record == 0:
                live = (truth == -1).all(-1) & (rng.random(truth.shape[:2]) < 0.5)
                a[live] = 0
            mask = self.missing[i] if i < len(self.missing) else None
            if mask is not None:
                a[mask] = rng.integers(0, self.shape.num_experts, size=a[mask].shape)
            if i < len(self.aligned) and self.aligned[i]:
                placeholder = np.full((1, *a.shape[1:]), 0 if self.no_record == 0 else fill)
                a = np.concatenate([a, placeholder])
            a = a.astype(self.dtype)
            if self.layer_axis == "model":
                wide = rng.integers(
                    0, self.shape.num_experts, size=(a.shape[0], self.shape.num_model_layers, a.shape[2])
                )
                wide = wide.astype(self.dtype)
                wide[:, list(self.shape.moe_layers)] = a
                a = wide
            out.append(a)
        return out

    def expected(self) -> np.ndarray:
        """The training rows, from the definition: per request its T - 1 rows (-1 where there is
        no record, masked rows included), a -1 row for its last token, then -1 padding rows up to
        pad_to."""
        rows = []
        empty = np.full((self.shape.num_layers, self.shape.top_k), -1, dtype=np.int64)
        for i, truth in enumerate(self.truth):
            mask = self.missing[i] if i < len(self.missing) else None
            tokens = truth.shape[0] + 1
            for j in range(self.pad_to if self.pad_to is not None else tokens):
                hidden = j < truth.shape[0] and mask is not None and mask[j]
                rows.append(truth[j] if j < truth.shape[0] and not hidden else empty)
        return np.array(rows, dtype=np.int64).reshape(-1, self.shape.num_layers, self.shape.top_k)


@st.composite
def replay_requests(draw, max_requests: int = 4, max_rows: int = 6):
    shape = draw(_small_shapes())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lengths = draw(st.lists(st.integers(0, max_rows), min_size=0, max_size=max_requests))
    truth = [distinct_rows(rng, n, shape, live_fraction=0.15) for n in lengths]
    pad_to = draw(st.none() | st.integers(max(lengths, default=0) + 1, max_rows + 3))
    narrow = shape.id_dtype
    dtypes = [np.dtype(np.int16), np.dtype(np.int32)]
    if np.iinfo(narrow).max >= shape.num_experts:  # its maximum can mark a missing id
        dtypes.append(narrow)
    dtype = draw(st.sampled_from(dtypes))
    with_counts = draw(st.booleans())
    aligned = [draw(st.booleans()) for _ in lengths] if with_counts else []
    no_record = draw(st.sampled_from([-1, 0])) if shape.top_k >= 2 else -1
    missing = [(rng.random(n) < 0.3) if draw(st.booleans()) else None for n in lengths]
    return ReplayRequests(
        shape,
        truth,
        draw(st.sampled_from(["moe", "model"])),
        pad_to,
        dtype,
        draw(st.integers(0, 2**32 - 1)),
        aligned=aligned,
        no_record=no_record,
        missing=missing,
        with_counts=with_counts,
    )


# ---------------------------------------------------------------------------------------------------
# Across processes (moe_ops.distributed): process layouts, per-step counts and padding, and the
# rank-specific router inputs every rank can recompute for every other rank
# ---------------------------------------------------------------------------------------------------

from moe_ops.distributed import ParallelLayout  # noqa: E402 - this section is appended, as above

DIST_MAX_TOKENS = 24  # rows of every rank's capture buffer: the largest padded DP batch
DIST_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24)  # the CUDA-graph sizes a padded step runs at
DIST_NUM_EXPERTS = 16
DIST_TOP_K = 4
# router configurations the distributed cases route with: (method, route keyword arguments)
DIST_ROUTERS = {
    "renormalize": (RoutingMethod.RENORMALIZE, {}),
    "deepseek": (RoutingMethod.DEEPSEEK_V3, {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}),
}
DIST_PADDING = ("none", "per-rank", "graph", "graph-per-rank")


@dataclass(frozen=True)
class DistStep:
    """One step of a distributed case."""

    # counts[d]: real tokens of DP rank d
    counts: tuple[int, ...]
    # padded[d]: rows of DP rank d's batch, in [counts[d], DIST_MAX_TOKENS]
    padded: tuple[int, ...]


@dataclass(frozen=True)
class DistCase:
    """A process layout and a few steps of counts and padding; the router inputs come from
    :func:`dist_logits`, so the expected ids of any rank are known to every process."""

    # dp_size, tp_size, use_ep and the layout the MoE layer routes
    parallel: ParallelLayout
    # the steps, in order; one plan per distinct padded tuple
    steps: tuple[DistStep, ...]
    # key into DIST_ROUTERS
    router: str
    # seeds the router inputs
    seed: int

    def route_args(self) -> tuple[RoutingMethod, dict]:
        """(method, keyword arguments of moe_ops.route), the DeepSeek-V3 bias included."""
        method, kwargs = DIST_ROUTERS[self.router]
        kwargs = dict(kwargs)
        if method == RoutingMethod.DEEPSEEK_V3:
            g = torch.Generator().manual_seed(self.seed)
            kwargs["bias"] = torch.randn(DIST_NUM_EXPERTS, generator=g) * 0.1
        return method, kwargs


def dist_logits(case: DistCase, step: int, dp_rank: int, layer: int) -> torch.Tensor:
    """(padded, DIST_NUM_EXPERTS) float32: DP rank ``dp_rank``'s router logits of model layer
    ``layer`` in step ``step``. Real token j's row depends on (seed, step, dp_rank, layer, j) only,
    not on the count; padding rows hold a ramp that routes to the last experts, so a padding row
    that reached a capture buffer would show."""
    s = case.steps[step]
    # the fields stay below 31, so distinct (step, dp_rank, layer) give distinct seeds
    g = torch.Generator().manual_seed(((case.seed * 31 + step) * 31 + dp_rank) * 31 + layer)
    table = torch.randn(DIST_MAX_TOKENS, DIST_NUM_EXPERTS, generator=g)
    out = table[: s.padded[dp_rank]].clone()
    out[s.counts[dp_rank] :] = torch.arange(DIST_NUM_EXPERTS, dtype=torch.float32) * 4.0
    return out


def _graph_size(count: int) -> int:
    return min(size for size in DIST_CAPTURE_SIZES if size >= max(count, 1))


def dist_grids(world: int, layout: BatchLayout) -> list[ParallelLayout]:
    """Every ParallelLayout of ``world`` ranks that routes ``layout`` (SHARDED needs EP)."""
    out = []
    for dp in range(1, world + 1):
        if world % dp:
            continue
        for use_ep in (False, True):
            if layout == BatchLayout.SHARDED and not use_ep:
                continue
            out.append(ParallelLayout(dp, world // dp, use_ep=use_ep, layout=layout))
    return out


@st.composite
def dist_steps(draw, dp_size: int, max_tokens: int = DIST_MAX_TOKENS) -> DistStep:
    """Counts (zero-token ranks often) and padding: none, per rank, every rank to one CUDA-graph
    size (vLLM under DP), or every rank to its own CUDA-graph size."""
    count = st.one_of(st.just(0), st.integers(0, max_tokens))
    counts = draw(st.lists(count, min_size=dp_size, max_size=dp_size))
    padding = draw(st.sampled_from(DIST_PADDING))
    if padding == "none":
        padded = list(counts)
    elif padding == "per-rank":
        padded = [draw(st.integers(c, max_tokens)) for c in counts]
    elif padding == "graph":
        padded = [_graph_size(max(counts))] * dp_size
    else:
        padded = [_graph_size(c) for c in counts]
    return DistStep(tuple(counts), tuple(padded))


@st.composite
def dist_cases(draw, world: int, layout: BatchLayout, max_steps: int = 3) -> DistCase:
    """A DistCase of ``world`` ranks routing ``layout``: one of its process layouts, 1..max_steps
    steps (a later step repeats an earlier padding now and then, reusing its plan), a router."""
    parallel = draw(st.sampled_from(dist_grids(world, layout)))
    steps = [draw(dist_steps(parallel.dp_size))]
    for _ in range(draw(st.integers(0, max_steps - 1))):
        new = draw(dist_steps(parallel.dp_size))
        if draw(st.booleans()):  # same shapes, new counts within them: the CUDA-graph case
            prev = steps[-1]
            new = DistStep(tuple(min(c, p) for c, p in zip(new.counts, prev.padded)), prev.padded)
        steps.append(new)
    router = draw(st.sampled_from(sorted(DIST_ROUTERS)))
    return DistCase(parallel, tuple(steps), router, draw(st.integers(0, 2**16)))


# ---------------------------------------------------------------------------------------------------
# Snapshot row counts around the narrowing graphs' buckets (TransferPipeline)
# ---------------------------------------------------------------------------------------------------


@st.composite
def bucket_row_counts(draw, max_rows: int):
    """A row count in ``[0, max_rows]``, half the time at a bucket edge (0, 1, a power of two or
    one off it, ``max_rows`` or one below)."""
    edges = {0, 1, max_rows - 1, max_rows}
    for k in range(max_rows.bit_length()):
        edges |= {2**k - 1, 2**k, 2**k + 1}
    edges = sorted(e for e in edges if 0 <= e <= max_rows)
    if draw(st.booleans()):
        return draw(st.sampled_from(edges))
    return draw(st.integers(0, max_rows))


# The replay backward kernel (moe_ops.replay.kernels.replay_backward_triton) against autograd
# ---------------------------------------------------------------------------------------------------

# Strided layouts the kernel must honour: a view's gaps hold NaN, so a read there shows up in the
# result and a write there shows up in the gap.
#   logits / grad_logits: "contiguous"; "row_padded" (rows of E + 3, the tail a gap);
#   "column_strided" (every other column of a (n, 2E) buffer).
#   incoming grad of the weights: those, plus "expanded" (stride 0 both ways, what autograd hands
#   over for w.sum()) and "transposed" (column-major).
BACKWARD_ROW_LAYOUTS = ("contiguous", "row_padded", "column_strided")
BACKWARD_GRAD_LAYOUTS = (*BACKWARD_ROW_LAYOUTS, "expanded", "transposed")


def strided_rows(values: torch.Tensor, layout: str) -> torch.Tensor:
    """``values`` (n, m) copied into a view of ``layout``; the buffer's other elements are NaN."""
    n, m = values.shape
    if layout == "contiguous":
        return values.clone()
    if layout == "transposed":
        return values.t().contiguous().t()
    if layout == "expanded":
        assert values.numel() == 0 or bool((values == values.flatten()[0]).all()), "expanded: one value"
        fill = values.flatten()[0] if values.numel() else torch.zeros((), dtype=values.dtype)
        return fill.reshape(1, 1).expand(n, m)
    if layout == "row_padded":
        base = torch.full((n, m + 3), float("nan"), dtype=values.dtype)
        view = base[:, :m]
    elif layout == "column_strided":
        base = torch.full((n, 2 * m), float("nan"), dtype=values.dtype)
        view = base[:, ::2]
    else:
        raise ValueError(f"layout must be one of {BACKWARD_GRAD_LAYOUTS}, got {layout!r}")
    view.copy_(values)
    return view


@dataclass
class BackwardCase:
    """One call of the replay backward kernel: logits, distinct recorded ids and the incoming
    gradient of the weights, each in a drawn layout."""

    # configuration, tokens, logit dtype and values (kinds "normal" and "ties": finite logits)
    router: RouterCase
    # layout of router_logits, of grad_logits (BACKWARD_ROW_LAYOUTS) and of the incoming gradient
    # (BACKWARD_GRAD_LAYOUTS)
    logits_layout: str
    out_layout: str
    grad_layout: str
    # rows per program of the kernel launch (None: its default launch configuration)
    block_m: int | None

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router_logits (n, E), recorded ids (n, k) int32 - distinct experts per row, not the
        top-k, grad_weights (n, k) float32, float64 for float64 logits), on the CPU, in the case's
        layouts."""
        cfg = self.router.config
        logits, _ = self.router.tensors("cpu")
        rng = np.random.default_rng(self.router.seed + 1)
        n, e, k = self.router.n, cfg.num_experts, cfg.top_k
        rows = np.stack([rng.permutation(e)[:k] for _ in range(n)]) if n else np.zeros((0, k))
        ids = torch.from_numpy(rows.astype(np.int32))
        wdtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        if self.grad_layout == "expanded":
            grad = torch.full((n, k), float(rng.standard_normal()), dtype=wdtype)
        else:
            grad = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32)).to(wdtype)
        return strided_rows(logits, self.logits_layout), ids, strided_rows(grad, self.grad_layout)


@st.composite
def backward_cases(draw, max_tokens: int = 12, max_experts: int = 70, max_top_k: int = 8):
    """A :class:`BackwardCase` of any method (small: the kernel runs interpreted on CPU)."""
    config = draw(router_configs(max_experts=max_experts, max_top_k=max_top_k))
    router = draw(
        router_cases(
            configs=st.just(config),
            max_tokens=max_tokens,
            dtypes=REPLAY_LOGIT_DTYPES,
            kinds=("normal", "ties"),
        )
    )
    return BackwardCase(
        router=router,
        logits_layout=draw(st.sampled_from(BACKWARD_ROW_LAYOUTS)),
        out_layout=draw(st.sampled_from(BACKWARD_ROW_LAYOUTS)),
        grad_layout=draw(st.sampled_from(BACKWARD_GRAD_LAYOUTS)),
        block_m=draw(st.sampled_from([None, 1, 2, 4, 16])),
    )


@dataclass
class ForwardCase:
    """One call of the replay forward kernel: a recorded routing of every row kind, the logits in a
    drawn layout, and poisoned output buffers in drawn layouts."""

    # logits, record and row kinds (see recorded_cases)
    recorded: RecordedCase
    # layout of router_logits, of the recorded ids and of both outputs (BACKWARD_ROW_LAYOUTS)
    logits_layout: str
    ids_layout: str
    out_layout: str
    # rows per program and warps of the kernel launch (None: its default launch configuration)
    block_m: int | None
    num_warps: int | None


@st.composite
def forward_cases(draw, max_tokens: int = 12):
    """A :class:`ForwardCase` of any method (small: the kernel runs interpreted on CPU)."""
    return ForwardCase(
        recorded=draw(
            recorded_cases(
                max_tokens=max_tokens, dtypes=REPLAY_LOGIT_DTYPES, kinds=("normal", "ties", "special")
            )
        ),
        logits_layout=draw(st.sampled_from(BACKWARD_ROW_LAYOUTS)),
        ids_layout=draw(st.sampled_from(BACKWARD_ROW_LAYOUTS)),
        out_layout=draw(st.sampled_from(BACKWARD_ROW_LAYOUTS)),
        block_m=draw(st.sampled_from([None, 1, 2, 8])),
        num_warps=draw(st.sampled_from([None, 1, 4])),
    )


# Non-finite logits (tests/test_nonfinite.py): every kernel path against its twin on NaN, +-inf, -0.0
# ---------------------------------------------------------------------------------------------------

# Finite logits come from a grid whose sigmoids lie far apart (>= 5e-3, or orders of magnitude below
# x = -4), so that sigmoid(x) + bias never comes near a tie that two float32 roundings could order
# differently: ids are then compared exactly on every row, live rows of the biased methods included.
# -50 .. -60 make SIGMOID_RENORM's sum of sigmoids fall below its 1e-20 floor (tiny rows).
NONFINITE_GRID = (*(i / 4 for i in range(-16, 17)), 20.0, -20.0)
NONFINITE_TINY = (-50.0, -55.0, -60.0)
NONFINITE_SPECIALS = (float("nan"), float("inf"), float("-inf"), -0.0)
# Row kinds of the logits: finite grid values; one or a few NaN / +inf / -inf among them; a mix of
# all three; a whole row of one special value; a tiny row (SIGMOID_RENORM below its floor), with
# some -inf in it half the time.
NONFINITE_ROW_KINDS = (
    "finite",
    "nan",
    "posinf",
    "neginf",
    "mixed",
    "all_nan",
    "all_posinf",
    "all_neginf",
    "tiny",
)
# Bias values (DEEPSEEK_V3/MINIMAX2): 0 and +-2 keep sigmoid(x) + bias in three disjoint bands.
NONFINITE_BIAS = {
    "finite": (0.0, 2.0, -2.0),
    "nonfinite": (0.0, 2.0, -2.0, float("inf"), float("-inf"), float("nan")),
}


@dataclass
class NonFiniteCase:
    """Router logits with non-finite rows, a record (recorded rows that take the non-finite experts
    first, -1 rows, faulty rows) and an incoming gradient of the weights."""

    config: RouterConfig
    dtype: torch.dtype
    # kinds[t] in NONFINITE_ROW_KINDS: how logit row t is built
    kinds: list[str]
    # records[t] in ("recorded", "live", "faulty"): how record row t is built
    records: list[str]
    # "finite" or "nonfinite" (NONFINITE_BIAS), or None: no bias
    bias_kind: str | None
    seed: int

    @property
    def n(self) -> int:
        return len(self.kinds)

    def tensors(self, device) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(router_logits (n, E) dtype, bias (E,) or None (float64 for float64 logits, else
        float32), recorded ids (n, k) int64, grad_weights (n, k) in the compute dtype) on ``device``."""
        rng = np.random.default_rng(self.seed)
        e, k = self.config.num_experts, self.config.top_k
        x = rng.choice(NONFINITE_GRID, size=(self.n, e))
        for t, kind in enumerate(self.kinds):
            cells = rng.choice(e, size=rng.integers(1, max(2, e // 3)), replace=False)
            if kind in ("nan", "posinf", "neginf"):
                x[t, cells] = {"nan": np.nan, "posinf": np.inf, "neginf": -np.inf}[kind]
            elif kind == "mixed":
                x[t, cells] = rng.choice(NONFINITE_SPECIALS, size=cells.size)
            elif kind.startswith("all_"):
                x[t] = {"all_nan": np.nan, "all_posinf": np.inf, "all_neginf": -np.inf}[kind]
            elif kind == "tiny":
                x[t] = rng.choice(NONFINITE_TINY, size=e)
                if rng.integers(2):
                    x[t, cells] = -np.inf
        rows = np.empty((self.n, k), dtype=np.int64)
        for t, kind in enumerate(self.records):
            if kind == "live":
                rows[t] = -1
                continue
            # the non-finite experts first (so that they are replayed), the others after them
            special = ~np.isfinite(x[t]) | (x[t] == 0) & np.signbit(x[t])
            order = np.concatenate(
                [rng.permutation(np.flatnonzero(special)), rng.permutation(np.flatnonzero(~special))]
            )
            rows[t] = rng.permutation(order[:k])
            if kind == "faulty":
                rows[t, rng.integers(k)] = e + 3
        wdtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        bias = None
        if self.bias_kind is not None:
            b = rng.choice(NONFINITE_BIAS[self.bias_kind], size=e)
            bias = torch.from_numpy(b).to(device=device, dtype=wdtype)
        grad = torch.from_numpy(rng.standard_normal((self.n, k))).to(device=device, dtype=wdtype)
        logits = torch.from_numpy(x).to(device=device, dtype=self.dtype)
        return logits, bias, torch.from_numpy(rows).to(device), grad


@st.composite
def nonfinite_cases(
    draw, methods=tuple(RoutingMethod), max_tokens: int = 10, max_experts: int = 24, dtypes=LOGIT_DTYPES
):
    """A :class:`NonFiniteCase` of one of ``methods``. Half the time top_k is the most the
    configuration allows, so that the router has to choose a row's NaN and -inf experts too
    (small: the kernels run interpreted on CPU)."""
    config = draw(router_configs(methods=methods, max_experts=max_experts, max_top_k=max_experts))
    if config.method != RoutingMethod.LLAMA4 and draw(st.booleans()):
        n_group, topk_group = config.groups
        config = replace(config, top_k=topk_group * (config.num_experts // n_group))
    n = draw(st.integers(1, max_tokens))
    kinds = draw(st.lists(st.sampled_from(NONFINITE_ROW_KINDS), min_size=n, max_size=n))
    records = draw(
        st.lists(st.sampled_from(("recorded", "recorded", "live", "faulty")), min_size=n, max_size=n)
    )
    bias_kind = draw(st.sampled_from(tuple(NONFINITE_BIAS))) if config.has_bias else None
    return NonFiniteCase(
        config, draw(st.sampled_from(dtypes)), kinds, records, bias_kind, draw(st.integers(0, 2**32 - 1))
    )


# ---------------------------------------------------------------------------------------------------
# Megatron-Core routers (moe_ops.integrations.megatron)
# ---------------------------------------------------------------------------------------------------

# Row kinds of a Megatron replay batch: distinct recorded experts, a row of -1 (route live), and two
# faulty kinds a host array can carry (an expert twice, a row partly -1): routed live and counted.
MEGATRON_ROW_KINDS = ("recorded", "live", "repeated", "partial")
MEGATRON_FAULTY_KINDS = ("repeated", "partial")
# moe_router_dtype: None routes in the activations' dtype (bf16 here, as in bf16 training)
MEGATRON_ROUTER_DTYPES = ("fp32", "fp64", None)


@dataclass
class MegatronRouterCase:
    """One TopKRouter configuration (every score-function branch of Megatron's routing) and a batch
    of ``[seq_len, batch]`` tokens with a recorded routing, row kind by row kind."""

    score_function: str
    pre_softmax: bool
    top_k: int
    num_experts: int
    # moe_router_topk_scaling_factor (None: no scaling)
    scaling: float | None
    # moe_router_enable_expert_bias (sigmoid only); the bias values are drawn from ``seed``
    expert_bias: bool
    # moe_router_num_groups / moe_router_group_topk (None: no grouping)
    num_groups: int | None
    group_topk: int | None
    # moe_router_dtype
    router_dtype: str | None
    seq_len: int
    batch: int
    # kinds[t] in MEGATRON_ROW_KINDS, t a row in Megatron's [s, b] order
    kinds: list[str]
    seed: int

    @property
    def n(self) -> int:
        return self.seq_len * self.batch

    def config_kwargs(self) -> dict:
        """TransformerConfig fields of the router."""
        return dict(
            num_moe_experts=self.num_experts,
            moe_router_topk=self.top_k,
            moe_router_score_function=self.score_function,
            moe_router_pre_softmax=self.pre_softmax,
            moe_router_topk_scaling_factor=self.scaling,
            moe_router_enable_expert_bias=self.expert_bias,
            moe_router_num_groups=self.num_groups,
            moe_router_group_topk=self.group_topk,
            moe_router_dtype=self.router_dtype,
        )

    def recorded(self) -> np.ndarray:
        """(n, top_k) int32 host rows by kind: ``recorded`` rows hold ``top_k`` random distinct
        experts (rarely the router's own choice), ``live`` rows -1, faulty rows as their kind says."""
        rng = np.random.default_rng(self.seed)
        rows = np.empty((self.n, self.top_k), dtype=np.int32)
        for t, kind in enumerate(self.kinds):
            row = rng.permutation(self.num_experts)[: self.top_k]
            if kind == "live":
                row = np.full(self.top_k, -1)
            elif kind == "repeated":
                i, j = rng.choice(self.top_k, size=2, replace=False)
                row[j] = row[i]
            elif kind == "partial":
                row[rng.choice(self.top_k, size=rng.integers(1, self.top_k), replace=False)] = -1
            rows[t] = row
        return rows

    def replayed_rows(self) -> torch.Tensor:
        """(n,) bool: rows whose record the router must return (the others keep its own output)."""
        return torch.tensor([kind == "recorded" for kind in self.kinds])

    @property
    def faulty_rows(self) -> int:
        return sum(kind in MEGATRON_FAULTY_KINDS for kind in self.kinds)


@st.composite
def megatron_router_cases(draw, max_tokens: int = 12, dtypes=MEGATRON_ROUTER_DTYPES) -> MegatronRouterCase:
    """Every branch of Megatron's ``topk_routing_with_score_function``: softmax after / before top-k
    (top-1 only before, as TransformerConfig requires), sigmoid with or without expert bias, with
    or without a scale, grouped (group-limited top-k) or not, in each router dtype; rows of every
    MEGATRON_ROW_KINDS kind the top-k can express."""
    score_function = draw(st.sampled_from(("softmax", "sigmoid")))
    num_experts = draw(st.sampled_from((4, 6, 8, 16)))
    top_k = draw(st.integers(1, min(4, num_experts - 1)))
    pre_softmax = top_k == 1 or draw(st.booleans()) if score_function == "softmax" else draw(st.booleans())
    expert_bias = score_function == "sigmoid" and draw(st.booleans())
    scaling = draw(st.sampled_from((None, 2.5)))
    num_groups = group_topk = None
    divisors = [g for g in range(2, num_experts + 1) if num_experts % g == 0]
    if draw(st.booleans()):
        g = draw(st.sampled_from(divisors))
        size = num_experts // g
        # group_limited_topk takes top_k // group_topk experts per group and top_k from the kept groups
        options = [t for t in range(1, g + 1) if t <= top_k and top_k // t <= size and top_k <= t * size]
        if options:
            num_groups, group_topk = g, draw(st.sampled_from(options))
    router_dtype = draw(st.sampled_from(dtypes))
    seq_len, batch = draw(st.integers(1, max_tokens)), draw(st.integers(1, 2))
    allowed = ["recorded", "live"] + (["repeated", "partial"] if top_k >= 2 else [])
    kinds = draw(st.lists(st.sampled_from(allowed), min_size=seq_len * batch, max_size=seq_len * batch))
    return MegatronRouterCase(
        score_function,
        pre_softmax,
        top_k,
        num_experts,
        scaling,
        expert_bias,
        num_groups,
        group_topk,
        router_dtype,
        seq_len,
        batch,
        kinds,
        draw(st.integers(0, 2**32 - 1)),
    )


# ---------------------------------------------------------------------------------------------------
# NeMo-RL's routed-experts envelope (format="nemo_rl"): envelopes built by NeMo-RL's rules, and hostile
# ones
# ---------------------------------------------------------------------------------------------------

import base64  # noqa: E402 - this section is appended; the imports above are the earlier sections'

# NeMo-RL's dtype names by item size (nemo_rl/utils/routed_experts_codec.py, _NP_DTYPES)
NEMO_RL_NAMES = {1: "int8", 2: "int16", 4: "int32"}
NEMO_RL_NP_DTYPES = (np.int8, np.int16, np.int32)


def nemo_rl_envelope(array: np.ndarray) -> str:
    """The text NeMo-RL's ``encode_routed_experts`` writes for a 3-D int8 / int16 / int32 ``array``,
    by its rules (not moe-ops' code): ``"nrlre1:" + dtype name + ":" + "SxLxK" + ":"`` and the
    standard base64 of the C-order bytes, little-endian (the order of every host NeMo-RL runs on)."""
    little = array.dtype.newbyteorder("<")
    data = np.ascontiguousarray(array, dtype=little).tobytes()
    tokens, layers, top_k = array.shape
    name = NEMO_RL_NAMES[array.dtype.itemsize]
    return f"nrlre1:{name}:{tokens}x{layers}x{top_k}:" + base64.b64encode(data).decode("ascii")


@st.composite
def nemo_rl_arrays(draw, max_rows: int = 6) -> np.ndarray:
    """A (tokens, layers, top_k) int8 / int16 / int32 array with values over the dtype's whole range
    (-1 rows among them), any byte order and memory order (C, Fortran, strided); sizes from 0."""
    dtype = np.dtype(draw(st.sampled_from(NEMO_RL_NP_DTYPES)))
    shape = (draw(st.integers(0, max_rows)), draw(st.integers(0, 4)), draw(st.integers(0, 4)))
    info = np.iinfo(dtype)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    array = rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    if shape[0] and draw(st.booleans()):
        array[rng.integers(0, shape[0])] = -1  # a row with no route captured
    if draw(st.booleans()):
        array = array.astype(dtype.newbyteorder(">"))
    layout = draw(st.sampled_from(["C", "F", "strided"]))
    if layout == "F":
        array = np.asfortranarray(array)
    elif layout == "strided":
        array = np.repeat(array, 2, axis=0)[::2]
    return array


# sizes as text: what NeMo-RL's writer writes, then what only its int() reader takes, then junk
NEMO_RL_SIZE_TEXTS = (
    "0", "1", "2", "3", "07", "+3", " 3", "3 ", "3_0", "-1", "\u0663", "", "0x3", "3.0", "1e3",
)  # fmt: skip
NEMO_RL_DTYPE_TEXTS = ("int8", "int16", "int32", "uint16", "uint8", "int64", "float32", "INT16", " int16", "")


@st.composite
def nemo_rl_hostile_envelopes(draw) -> str:
    """An envelope with every field drawn: the magic (right or near), the dtype name, 1-4 sizes
    (small, huge up to 2**70, or text only NeMo-RL's int() reads), the separators, and a payload of
    the announced size or not, sometimes with characters outside the base64 alphabet spliced in."""
    magic = draw(st.sampled_from(["nrlre1"] * 6 + ["nrlre2", "NRLRE1", "nrlre", "", "nrlre1 "]))
    name = draw(st.sampled_from(NEMO_RL_DTYPE_TEXTS[:3] * 3 + NEMO_RL_DTYPE_TEXTS))
    count = draw(st.sampled_from([3] * 6 + [1, 2, 4]))
    sizes = draw(
        st.lists(
            st.one_of(
                st.integers(0, 4).map(str),
                st.integers(0, 4).map(str),
                st.integers(0, 2**70).map(str),
                st.sampled_from(NEMO_RL_SIZE_TEXTS),
            ),
            min_size=count,
            max_size=count,
        )
    )
    sep = draw(st.sampled_from(["x"] * 6 + ["X", "*", ","]))
    itemsize = {"int8": 1, "int16": 2, "int32": 4}.get(name, 2)
    try:
        size = math.prod(int(d) for d in sizes) * itemsize
    except ValueError:
        size = None
    if size is not None and 0 <= size <= 256 and draw(st.integers(0, 3)):
        payload = base64.b64encode(draw(st.binary(min_size=size, max_size=size))).decode()
    else:
        payload = base64.b64encode(draw(st.binary(max_size=48))).decode()
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):
        at = draw(st.integers(0, len(payload)))
        junk = draw(st.sampled_from(["\n", " ", "-", "_", "=", "\u00c4", ":", "A"]))
        payload = payload[:at] + junk + payload[at:]
    colons = draw(st.sampled_from([":"] * 8 + ["", "::"]))
    return f"{magic}:{name}:{sep.join(sizes)}{colons}{payload}"
