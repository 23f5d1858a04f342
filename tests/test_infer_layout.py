"""infer_layout: picks the layout from shapes, and refuses to guess when shapes are ambiguous."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import layout_queries

from moe_ops import BatchLayout, infer_layout


def oracle(counts, local_sizes, dp_rank, tp):
    """Every (layout, rows, selection) the definitions allow; selection = (start, needs TP gather)."""
    forms = [counts] + ([local_sizes] if local_sizes is not None else [])
    out = []
    for xs in forms:
        out.append((BatchLayout.LOCAL, xs[dp_rank], (0, False)))
        if len(counts) > 1:
            out.append((BatchLayout.GATHERED, sum(xs), (sum(xs[:dp_rank]), False)))
        if tp > 1:
            shards = [tp * math.ceil(x / tp) for x in xs]
            if len(counts) > 1:
                out.append((BatchLayout.SHARDED, sum(shards), (sum(shards[:dp_rank]), False)))
            out.append((BatchLayout.SEQUENCE_PARALLEL, math.ceil(xs[dp_rank] / tp), (0, True)))
    return out


@settings(max_examples=3000)
@given(query=layout_queries(), pick=st.integers(0, 100), offset=st.sampled_from([0, 0, 0, 1, -1, 7]))
def test_infer_layout_agrees_with_definitions(query, pick, offset):
    counts, local_sizes, dp_rank, tp = query
    table = oracle(counts, local_sizes, dp_rank, tp)
    num_rows = max(0, table[pick % len(table)][1] + offset)
    c = counts[dp_rank]
    if len(counts) == 1 and tp == 1:
        if num_rows >= c:
            assert infer_layout(num_rows, counts, dp_rank, local_sizes=local_sizes) == BatchLayout.LOCAL
        else:
            with pytest.raises(ValueError, match="smaller than this rank's token count"):
                infer_layout(num_rows, counts, dp_rank, local_sizes=local_sizes)
        return
    fits = [(layout, sel) for layout, rows, sel in table if rows == num_rows]
    selections = {sel for _, sel in fits}
    if not fits:
        with pytest.raises(ValueError, match="matches no batch layout") as err:
            infer_layout(num_rows, counts, dp_rank, local_sizes=local_sizes, tp_size=tp)
        for layout, rows, _ in table:  # the message names every expected size
            assert f"{layout.name}={rows}" in str(err.value)
    elif len(selections) > 1 and c > 0:
        with pytest.raises(ValueError, match="ambiguous batch layout"):
            infer_layout(num_rows, counts, dp_rank, local_sizes=local_sizes, tp_size=tp)
    else:
        got = infer_layout(num_rows, counts, dp_rank, local_sizes=local_sizes, tp_size=tp)
        assert got in {layout for layout, _ in fits}


def test_padded_local_equal_to_unpadded_total_is_ambiguous():
    # Two DP ranks with 2 real tokens each, both padded to a CUDA-graph size of 4: rank 1 sees
    # 4 rows. That is its padded LOCAL batch (rows 0..1) or the unpadded gather (rows 2..3).
    with pytest.raises(ValueError, match="ambiguous") as err:
        infer_layout(4, [2, 2], 1, local_sizes=[4, 4])
    assert "LOCAL" in str(err.value) and "GATHERED" in str(err.value)


def test_padded_local_equal_to_gather_of_three_ranks_is_ambiguous():
    # counts [3, 1, 2]: the unpadded gather is 6 rows (rank 2 at rows 4..5), and rank 2 running
    # at CUDA-graph size 6 also sees 6 rows (its tokens at rows 0..1).
    with pytest.raises(ValueError, match="ambiguous"):
        infer_layout(6, [3, 1, 2], 2, local_sizes=[3, 1, 6])


def test_sequence_parallel_single_row_is_ambiguous():
    # One real token, tp=2: a 1-row batch is LOCAL (row 0 here) or this TP rank's SP shard.
    with pytest.raises(ValueError, match="after a TP all-gather"):
        infer_layout(1, [1, 5], 0, tp_size=2)


def test_unambiguous_cases():
    assert infer_layout(7, [3, 4], 1) == BatchLayout.GATHERED
    assert infer_layout(4, [3, 4], 1) == BatchLayout.LOCAL
    assert infer_layout(8, [3, 4], 1, local_sizes=[4, 4]) == BatchLayout.GATHERED
    assert infer_layout(2, [3, 4], 1, tp_size=2) == BatchLayout.SEQUENCE_PARALLEL
    assert infer_layout(8, [3, 4], 1, tp_size=2) == BatchLayout.SHARDED
    # rank 0 of a gather starts at row 0: LOCAL and GATHERED select the same rows, no error
    assert infer_layout(3, [3, 0], 0) == BatchLayout.LOCAL
    # nothing to capture: any fitting layout selects nothing
    assert infer_layout(4, [0, 4], 0, local_sizes=[4, 4]) == BatchLayout.LOCAL
    assert infer_layout(10, [5], 0) == BatchLayout.LOCAL


def test_no_fit_lists_every_expected_size():
    with pytest.raises(ValueError, match=r"expected one of: LOCAL=4, GATHERED=7"):
        infer_layout(5, [3, 4], 1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_rows=3, token_counts=[], dp_rank=0), "one entry per DP rank"),
        (dict(num_rows=3, token_counts=[1, 2], dp_rank=2), r"dp_rank must be in \[0, 2\)"),
        (dict(num_rows=3, token_counts=[1, 2], dp_rank=0, tp_size=0), "tp_size must be >= 1"),
        (dict(num_rows=3, token_counts=[1, -2], dp_rank=0), "non-negative"),
        (dict(num_rows=3, token_counts=[1, 2], dp_rank=0, local_sizes=[1]), "local_sizes must have"),
        (dict(num_rows=3, token_counts=[4, 2], dp_rank=0, local_sizes=[3, 2]), "smaller than token_counts"),
        (dict(num_rows=-1, token_counts=[4, 2], dp_rank=0), "num_rows must be >= 0"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        infer_layout(**kwargs)
