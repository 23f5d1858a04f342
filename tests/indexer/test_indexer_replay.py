"""The trainer's side of indexer records: replay_indexer's row choice and fault counting,
indexer_mask against a dense oracle (and transformers' own scatter), indexer_mismatch against Python
sets; all three under torch.compile(fullgraph=True)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moe_ops
from moe_ops.indexer import indexer_mask, indexer_mismatch, replay_indexer
from moe_ops.replay.kernels import REPLAY_FAULT_OUT_OF_RANGE, REPLAY_FAULT_REPEATED

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _rows(rng, n, k, context, fill=1.0):
    out = np.full((n, k), -1, dtype=np.int64)
    for i in range(n):
        m = min(k, context) if rng.random() < fill else int(rng.integers(0, min(k, context) + 1))
        out[i, :m] = rng.choice(context, size=m, replace=False)
        rng.shuffle(out[i])
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_replay_indexer_chooses_rows_and_counts_faults(device):
    moe_ops.check_faults(device, raise_error=False)
    live = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11], [1, 2, 3]], device=device)
    recorded = torch.tensor(
        [[5, -1, 2], [-1, -1, -1], [1, 1, 0], [0, 1, 40], [0, -2, 1]], dtype=torch.int32, device=device
    )
    kv_lens = torch.tensor([6, 6, 6, 12, 6], device=device)
    out = replay_indexer(live, recorded, kv_lens=kv_lens)
    assert out.dtype == torch.int32
    # row 0 replayed (its -1 kept: fewer than k keys); row 1 no record -> live; row 2 repeated, row 3
    # beyond its 12 keys, row 4 below -1 -> live and counted
    assert out.tolist() == [[5, -1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11], [1, 2, 3]]
    summary = moe_ops.check_faults(device, raise_error=False)
    assert summary.replay_rows == 3
    assert summary.replay_flags == REPLAY_FAULT_OUT_OF_RANGE | REPLAY_FAULT_REPEATED
    assert moe_ops.check_faults(device).total == 0


def test_replay_indexer_refuses_bad_arguments():
    a = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="live must have recorded's shape"):
        replay_indexer(a[:, :2], a)
    with pytest.raises(ValueError, match="recorded must be int32 or int64"):
        replay_indexer(a, a.float())
    with pytest.raises(TypeError, match=r"live must be a torch\.Tensor"):
        replay_indexer([[0]], a)
    with pytest.raises(ValueError, match=r"kv_lens must be \(2,\)"):
        replay_indexer(a, a, kv_lens=torch.zeros(3, dtype=torch.int32))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 6),
    k=st.sampled_from([1, 4, 16]),
    keys=st.integers(1, 40),
)
def test_indexer_mask_is_the_dense_oracle(seed, n, k, keys):
    rng = np.random.default_rng(seed)
    rows = _rows(rng, n, k, keys, fill=0.5)
    mask = indexer_mask(torch.from_numpy(rows), keys)
    want = np.zeros((n, keys), dtype=bool)
    for i, row in enumerate(rows):
        want[i, row[row >= 0]] = True
    assert mask.dtype == torch.bool and np.array_equal(mask.numpy(), want)
    full = rows[(rows >= 0).all(1)]
    if full.size:  # transformers' own scatter (eager/SDPA DSA path), for rows without -1
        t = torch.from_numpy(full)
        theirs = t.new_ones((t.shape[0], keys), dtype=torch.bool).scatter(-1, t, False)
        assert torch.equal(~theirs, indexer_mask(t, keys))


def test_indexer_mask_selects_nothing_outside_the_keys():
    mask = indexer_mask(torch.tensor([[[0, 5, -1, -7]]]), 4)
    assert mask.shape == (1, 1, 4) and mask.tolist() == [[[True, False, False, False]]]
    with pytest.raises(ValueError, match="num_keys must be an int >= 1"):
        indexer_mask(torch.tensor([[0]]), 0)


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 7),
    layers=st.integers(1, 3),
    k=st.sampled_from([1, 3, 8]),
)
def test_indexer_mismatch_is_the_set_oracle(seed, n, layers, k):
    rng = np.random.default_rng(seed)
    context = 12
    live = (
        np.stack([_rows(rng, n, k, context) for _ in range(layers)], 1)
        if n
        else np.zeros((0, layers, k), np.int64)
    )
    rec = live.copy()
    for i in range(n):
        for j in range(layers):
            r = rng.random()
            if r < 0.25:
                rec[i, j] = -1  # no record
            elif r < 0.7:
                rec[i, j] = _rows(rng, 1, k, context, fill=0.5)[0]
    valid = rng.random(n) < 0.8
    got = indexer_mismatch(rec, live, valid=torch.from_numpy(valid))
    for j in range(layers):
        counted = [i for i in range(n) if valid[i] and (rec[i, j] >= 0).any()]
        if not counted:
            assert torch.isnan(got.differ[j]) and torch.isnan(got.changed[j])
            assert got.num_tokens[j] == 0
            continue
        sets = [
            (set(rec[i, j][rec[i, j] >= 0].tolist()), set(live[i, j][live[i, j] >= 0].tolist()))
            for i in counted
        ]
        differ = sum(len(r - lv) for r, lv in sets) / sum(len(r) for r, _ in sets)
        changed = sum(r != lv for r, lv in sets) / len(sets)
        assert got.num_tokens[j] == len(counted)
        assert abs(float(got.differ[j]) - differ) < 1e-6 and abs(float(got.changed[j]) - changed) < 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_the_trainer_side_compiles_without_graph_breaks(device):
    from moe_ops.graphs import CompileCounters

    def step(live, recorded, kv_lens):
        positions = replay_indexer(live, recorded, kv_lens=kv_lens)
        return indexer_mask(positions, 16), indexer_mismatch(recorded, live).differ

    rng = np.random.default_rng(0)
    live = torch.from_numpy(_rows(rng, 5, 4, 16)).to(device)
    recorded = torch.from_numpy(_rows(rng, 5, 4, 16)).to(device)
    recorded[1] = -1
    kv_lens = torch.full((5,), 16, device=device)
    compiled = torch.compile(step, fullgraph=True)
    with CompileCounters() as cc:
        got = compiled(live, recorded, kv_lens)
    want = step(live, recorded, kv_lens)
    assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1])
    assert cc.graph_breaks == 0
