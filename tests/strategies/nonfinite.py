"""Non-finite logits (tests/router/test_nonfinite.py): every kernel path against its twin on NaN,
+-inf, -0.0."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from hypothesis import strategies as st

from moe_ops import RoutingMethod
from moe_ops.router.methods import METHODS

from .router import LOGIT_DTYPES, RouterConfig, router_configs

__all__ = [
    "NONFINITE_BIAS",
    "NONFINITE_GRID",
    "NONFINITE_ROW_KINDS",
    "NONFINITE_SPECIALS",
    "NONFINITE_TINY",
    "NonFiniteCase",
    "nonfinite_cases",
]


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
    if METHODS[config.method].top_k is None and draw(st.booleans()):
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
