"""Shared hypothesis strategies: batches in every layout, with padding, and their expected rows.

The expected rows are computed here from first principles (which block of the concatenated batch
belongs to the rank), independently of the library's offset code, so the tests check the library
against the layout definitions rather than against itself.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def c(self) -> int:
        return self.counts[self.dp_rank]

    @property
    def top_k(self) -> int:
        return self.rows.shape[1]

    def tensors(self, device):
        """(buffer poisoned, topk_ids, token_counts, shard_sizes or None) on ``device``."""
        buffer = torch.full(
            (self.max_tokens, self.num_layers, self.top_k), POISON, dtype=self.buffer_dtype, device=device
        )
        topk_ids = torch.from_numpy(self.rows).to(device=device, dtype=self.ids_dtype)
        counts = torch.tensor(self.counts, dtype=torch.int32, device=device)
        sizes = None
        if self.shard_sizes is not None:
            sizes = torch.tensor(self.shard_sizes, dtype=torch.int32, device=device)
        return buffer, topk_ids, counts, sizes

    def expected(self, buffer_before: torch.Tensor) -> torch.Tensor:
        out = buffer_before.clone()
        block = torch.from_numpy(self.rows[self.start : self.start + self.c]).to(out.dtype)
        out[: self.c, self.layer_id] = block.to(out.device)
        return out


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
):
    """A batch in one of ``layouts`` (SEQUENCE_PARALLEL here means tp_size 1, i.e. no group).

    On a GPU each distinct (dtype, top_k) pair is a Triton compile, so GPU tests narrow
    ``top_ks`` and the dtypes; the CPU tests (reference and interpreted Triton) take them all.
    """
    layout = draw(st.sampled_from(layouts))
    single_dp = layout in (BatchLayout.LOCAL, BatchLayout.SEQUENCE_PARALLEL) and draw(st.booleans())
    dp_size = 1 if single_dp else draw(st.integers(1, 8))
    dp_rank = draw(st.integers(0, dp_size - 1))
    counts = draw(st.lists(st.integers(0, max_count), min_size=dp_size, max_size=dp_size))
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
# FlashInfer monolithic capture contract (issue 4): the batch a monolithic kernel sees and the
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
# Issue 5: routing shapes and routing arrays (capturer, transfer, store, wire)
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
# Issue 6 (a): batches a transformers model runs with attach_capture (moe_ops.integrations.hf)
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
# Issue 6: serving workloads for the runner and the end-to-end tests
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
# Issue 5: the snapshot's narrowing cast
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
# text spliced into a header: the " } (" (numpy's reader retried it through Python 2 token
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
