"""infer_layout: picks the layout from shapes, and refuses to guess when shapes are ambiguous."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import POISON, LayoutBatch, layout_batches, layout_queries

from moe_ops import BatchLayout, capture_routing, infer_layout
from moe_ops.capture.errors import FAULT_SLOTS
from moe_ops.capture.kernels import capture_rows_torch
from moe_ops.capture.target import CaptureTarget


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
        (
            dict(num_rows=3, token_counts=[1, 2], dp_rank=0, local_sizes=[1, 2, 3]),
            "positive multiple of dp_size=2",
        ),
        (dict(num_rows=3, token_counts=[1, 2], dp_rank=0, local_sizes=[]), r"positive multiple .*got 0"),
        (dict(num_rows=3, token_counts=[1, 2], dp_rank=0, local_sizes=[1, -1, 2, 2]), "non-negative"),
        (
            dict(num_rows=8, token_counts=[3, 2], dp_rank=0, local_sizes=[1, 1, 2, 2], tp_size=2),
            r"DP rank 0's 2 shards local_sizes\[0:2\]=\[1, 1\] sum to 2, smaller than token_counts\[0\]=3",
        ),
        (
            dict(num_rows=9, token_counts=[3, 2], dp_rank=0, local_sizes=[1, 1, 1, 2, 2, 2], tp_size=2),
            "3 shards per DP rank .* tp_size=2 does not divide",
        ),
        (
            dict(num_rows=8, token_counts=[3, 2], dp_rank=0, local_sizes=[2, 2, 2, 2], tp_size=4),
            "2 shards per DP rank .* tp_size=4 does not divide",
        ),
        (dict(num_rows=3, token_counts=[1.5, 2], dp_rank=0), "token_counts must hold ints, got 1.5"),
        (dict(num_rows=3, token_counts=torch.tensor([1.0, 2.0]), dp_rank=0), "must have an integer dtype"),
        (
            dict(num_rows=3, token_counts=[1, 2], dp_rank=0, local_sizes=[True, 2]),
            "local_sizes must hold ints",
        ),
        (dict(num_rows=3.0, token_counts=[1, 2], dp_rank=0), "num_rows must be an int, got 3.0"),
        (dict(num_rows=3, token_counts=[1, 2], dp_rank=0, tp_size=2.0), "tp_size must be an int"),
        (dict(num_rows=3, token_counts=[1, 2], dp_rank=True), "dp_rank must be an int"),
        (dict(num_rows=3, token_counts=[4, 2], dp_rank=0, local_sizes=[3, 2]), "smaller than token_counts"),
        (dict(num_rows=-1, token_counts=[4, 2], dp_rank=0), "num_rows must be >= 0"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        infer_layout(**kwargs)


# ---------------------------------------------------------------------------------------------------
# local_sizes of dp_size * shards_per_rank entries (vLLM's dp_metadata.local_sizes)
# ---------------------------------------------------------------------------------------------------


def caller_shard_sizes(layout, num_rows, counts, local_sizes, tp):
    """The shard_sizes infer_layout's docstring says to pass to capture_routing with ``layout``."""
    if layout in (BatchLayout.LOCAL, BatchLayout.SEQUENCE_PARALLEL):
        return None
    shards = list(counts) if local_sizes is None else list(local_sizes)
    spr = len(shards) // len(counts)
    if num_rows == sum(shards):
        # the docstring's claim: GATHERED is only returned here with one size per rank, SHARDED
        # only with several (otherwise GATHERED comes first)
        assert (spr == 1) == (layout == BatchLayout.GATHERED)
        return shards
    if layout == BatchLayout.GATHERED:
        return None
    padded = [sum(shards[i * spr : (i + 1) * spr]) for i in range(len(counts))]
    xs = counts if num_rows == sum(tp * math.ceil(c / tp) for c in counts) else padded
    return [math.ceil(x / tp) for x in xs for _ in range(tp)]


def op_reads(layout, shard_sizes, views, counts, dp_rank, *, public_op=False):
    """What the capture op writes for this rank, on every TP rank: a list of (c, top_k) arrays.

    SEQUENCE_PARALLEL all-gathers the TP ranks' rows first (TP-rank order, as
    ``_gather_sequence_parallel`` does) and then reads LOCAL, exactly what ``capture_routing``
    does with a tp_group; the gather itself is simulated by concatenating the views.
    """
    layout = BatchLayout(layout)
    if layout == BatchLayout.SEQUENCE_PARALLEL:
        views, layout = [np.concatenate(views)], BatchLayout.LOCAL
    c = counts[dp_rank]
    token_counts = torch.tensor(counts, dtype=torch.int32)
    sizes = None if shard_sizes is None else torch.tensor(shard_sizes, dtype=torch.int32)
    out = []
    for view in views:
        topk_ids = torch.from_numpy(view).to(torch.int32)
        buffer = torch.full((max(view.shape[0], c, 1), 1, 1), POISON, dtype=torch.int32)
        if public_op:
            capture_routing(
                buffer,
                topk_ids,
                0,
                token_counts=token_counts,
                dp_rank=dp_rank,
                layout=layout,
                shard_sizes=sizes,
            )
        else:
            # capture_routing minus the dispatch: its checks, then its CPU twin (the Triton kernel
            # is interpreted here and far too slow for a property test of this size)
            target = CaptureTarget(
                buffer, 0, token_counts=token_counts, dp_rank=dp_rank, layout=layout, shard_sizes=sizes
            )
            target.check_ids(topk_ids)
            errors = torch.zeros(FAULT_SLOTS, dtype=torch.int32)
            empty = torch.empty(0, dtype=torch.int32)
            none = torch.empty(0, dtype=torch.float32)  # no weights
            capture_rows_torch(
                buffer,
                topk_ids,
                none,
                none,
                token_counts,
                target.sizes,
                errors,
                empty,
                empty,
                target.spec.expert_map,
                0,
                dp_rank,
                target.n_first,
                0,
            )
            assert not errors.any(), f"the op recorded faults: {errors.tolist()}"
        assert (buffer[c:] == POISON).all()
        out.append(buffer[:c, 0].numpy())
    return out


def infer(case: LayoutBatch, num_rows: int):
    return infer_layout(
        num_rows, case.counts, case.dp_rank, local_sizes=case.local_sizes, tp_size=case.tp_size
    )


@settings(max_examples=1000)
@given(case=layout_batches())
def test_inferred_layout_makes_the_op_read_the_true_rows(case):
    views = case.views(case.truth)
    num_rows = views[0].shape[0]
    fitting = [h for h in case.hypotheses() if case.views(h)[0].shape[0] == num_rows]
    assert case.truth in fitting
    if case.c > 0 and len({case.selection(h) for h in fitting}) > 1:
        # real ambiguity: two arrangements of these shapes put this rank's tokens elsewhere
        with pytest.raises(ValueError, match="ambiguous batch layout"):
            infer(case, num_rows)
        return
    layout = infer(case, num_rows)
    assert layout in {h[0] for h in fitting}
    sizes = caller_shard_sizes(layout, num_rows, case.counts, case.local_sizes, case.tp_size)
    for tp_rank, got in enumerate(op_reads(layout, sizes, views, case.counts, case.dp_rank)):
        assert np.array_equal(got, case.real_ids()), (tp_rank, layout, sizes)


def test_vllm_local_sizes_issue_example():
    # 2 DP ranks x TP 2, sequence-parallel shards gathered over the EP group: GATHERED (per-rank
    # sums 8, 2) and SHARDED (local_sizes) both select rows [0, 8) for rank 0 and [8, 10) for rank 1
    counts, local_sizes = [8, 2], [4, 4, 1, 1]
    case = LayoutBatch(counts, local_sizes, 0, 2, truth=(BatchLayout.SHARDED, "shards"))
    for dp_rank, rows in ((0, range(8)), (1, range(8, 10))):
        case.dp_rank = dp_rank
        layout = infer_layout(10, counts, dp_rank, local_sizes=local_sizes, tp_size=2)
        assert layout == BatchLayout.SHARDED
        view = case.views(case.truth)[0]
        assert np.array_equal(view[list(rows)], case.real_ids())
        sizes = caller_shard_sizes(layout, 10, counts, local_sizes, 2)
        assert sizes == local_sizes
        (got,) = op_reads(layout, sizes, [view], counts, dp_rank, public_op=True)
        assert np.array_equal(got, case.real_ids())


def test_vllm_cuda_graph_padded_shards():
    # vLLM under CUDA graphs pads every DP rank to one size (num_tokens_across_dp = [8, 8]) and
    # sp_local_sizes(2) cuts each into ceil(8 / 2) = 4: local_sizes = [4, 4, 4, 4]. Real counts
    # [5, 2]: rank 1's tokens sit at rows [8, 10) of the 16 gathered rows.
    case = LayoutBatch([5, 2], [4, 4, 4, 4], 1, 2, truth=(BatchLayout.SHARDED, "shards"))
    assert (
        infer_layout(16, [5, 2], 1, local_sizes=torch.tensor([4, 4, 4, 4]), tp_size=2) == BatchLayout.SHARDED
    )
    (got,) = op_reads(
        BatchLayout.SHARDED, [4, 4, 4, 4], case.views(case.truth)[:1], [5, 2], 1, public_op=True
    )
    assert np.array_equal(got, case.real_ids())
    # the same counts as vLLM's own (padded) num_tokens_across_dp also work: rows [8, 16)
    assert infer_layout(16, [8, 8], 1, local_sizes=[4, 4, 4, 4], tp_size=2) == BatchLayout.SHARDED


def test_shard_groups_that_select_different_rows_still_raise():
    # counts [3, 2], local_sizes [2, 1 | 1, 2], tp 2, 6 rows: the given shards put rank 1 at row 3
    # (SHARDED over local_sizes, and GATHERED over the sums [3, 3]), the unpadded ceil-div shards
    # [2, 2 | 1, 1] at row 4
    with pytest.raises(ValueError, match="ambiguous") as err:
        infer_layout(6, [3, 2], 1, local_sizes=[2, 1, 1, 2], tp_size=2)
    assert "SHARDED (rows from 3)" in str(err.value) and "SHARDED (rows from 4)" in str(err.value)
    # rank 0 starts at row 0 in all of them: no error
    assert infer_layout(6, [3, 2], 0, local_sizes=[2, 1, 1, 2], tp_size=2) == BatchLayout.SHARDED


def test_shards_per_rank_with_context_parallel_replicas():
    # 4 shards per DP rank with tp 2 (two replicas of each TP shard, e.g. context parallelism)
    counts, local_sizes = [3, 4], [1, 1, 1, 1, 1, 1, 1, 1]
    assert infer_layout(8, counts, 1, local_sizes=local_sizes, tp_size=2) == BatchLayout.SHARDED
    # with tp 1 the shard sizes alone decide
    assert infer_layout(8, counts, 1, local_sizes=local_sizes) == BatchLayout.SHARDED


def test_given_shards_are_not_replaced_by_a_ceil_div_guess():
    # counts [2, 2], shards [2, 1 | 2, 1] (padded sizes [3, 3]), tp 2. One size per rank would
    # make ceil-div shards [2, 2 | 2, 2] (8 rows) a candidate; with the shards given exactly the
    # gather had 6 rows, so 8 rows fit nothing.
    with pytest.raises(ValueError, match="matches no batch layout") as err:
        infer_layout(8, [2, 2], 1, local_sizes=[2, 1, 2, 1], tp_size=2)
    assert "SHARDED=6" in str(err.value) and "SHARDED=8" not in str(err.value)
    assert infer_layout(8, [2, 2], 1, local_sizes=[3, 3], tp_size=2) == BatchLayout.SHARDED
