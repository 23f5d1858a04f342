"""Replayed routing (moe_ops.replay_routing): recorded routings of every row kind, routing-mismatch
metrics, and the replay forward and backward kernels against their twins and autograd."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import strategies as st

from .layouts import BACKWARD_GRAD_LAYOUTS, BACKWARD_ROW_LAYOUTS, strided_rows
from .router import LOGIT_DTYPES, REPLAY_LOGIT_DTYPES, RouterCase, router_cases, router_configs

__all__ = [
    "FAULTY_KINDS",
    "RECORDED_KINDS",
    "BackwardCase",
    "ForwardCase",
    "MismatchCase",
    "RecordedCase",
    "backward_cases",
    "forward_cases",
    "mismatch_cases",
    "recorded_cases",
]


# ---------------------------------------------------------------------------------------------------
# Recorded routings and routing-mismatch metrics
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
# The replay kernels (moe_ops.replay.kernels) against their twins and autograd
# ---------------------------------------------------------------------------------------------------


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
