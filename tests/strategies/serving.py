"""Serving workloads for the runner and the end-to-end tests."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

__all__ = [
    "serving_requests",
    "step_row_counts",
]


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
