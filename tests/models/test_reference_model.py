"""The reference MoE model: config checks, KV-cache correctness, padding rows, capture, compile."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import POISON

from moe_ops import RoutingCapturer, RoutingMethod
from moe_ops.graphs import count_graph_breaks
from moe_ops.models import PRESETS, ReferenceMoEModel, reference_config

# 3 layers (1 dense), 16 experts: small enough for many eager examples
SMALL = reference_config("tiny", num_layers=3, max_requests=4, max_seq_len=24)
# One float64 computation run with other GEMM shapes (3 vs 5 rows, prefill vs decode rows) or
# another expert path rounds differently, and how depends on the BLAS kernels: MKL's AVX-512 ones
# happen to give the padding test's 3- and 5-row steps bit-identical values, its AVX2 ones (what AMD
# CPUs get; MKL_ENABLE_INSTRUCTIONS=AVX2 selects them on Intel) do not. Measured with both: up to
# 4.4e-15 on these logits and KV entries (300 random workloads; magnitudes <= 5, so ~5 ulp). 1e-12
# leaves 200x that and is 1e9 below what a real fault moves them by (a wrong cache cell, a flipped
# expert).
F64_TOL = 1e-12
# Router ids stay exact across those runs: the router chooses on float32 roundings of the float64
# logits, which change only where a logit lies within ~4e-15 of a float32 rounding boundary (a few
# in 1e8 logits), and then by one float32 ulp, which flips a choice only at a float32 near-tie.


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return ReferenceMoEModel(SMALL)


def _assert_f64_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=F64_TOL, atol=F64_TOL, msg=lambda m: f"{what}: {m}")


def _rows(tokens, positions, slots):
    return (
        torch.tensor(tokens, dtype=torch.int64),
        torch.tensor(positions, dtype=torch.int64),
        torch.tensor(slots, dtype=torch.int64),
    )


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(hidden_size=30, num_heads=4), "hidden_size must be a multiple of num_heads=4"),
        (dict(first_k_dense=4, num_layers=4), r"first_k_dense must be an int in \[0, num_layers=4\)"),
        (dict(top_k=17), "top_k must be <= num_experts=16"),
        (dict(routing_method=RoutingMethod.RENORMALIZE), "router_bias=True needs a biased routing method"),
        (
            dict(routed_scaling_factor=float("nan")),
            "routed_scaling_factor must be finite",
        ),
        (dict(n_group=3), "n_group=3 must divide num_experts=16"),
        (dict(dtype=torch.int32), "dtype must be float64, float32, bfloat16 or float16"),
        (dict(expert_impl="fast"), "expert_impl must be one of dense, gathered, auto"),
        (dict(max_seq_len=1), "max_seq_len must be an int >= 2"),
        (dict(router_backend="cuda"), "router_backend must be one of 'auto', 'triton', 'torch'"),
        (dict(vocab_size=True), "vocab_size must be an int >= 2"),
    ],
)
def test_config_rejects_bad_fields(overrides, match):
    with pytest.raises(ValueError, match=match):
        reference_config("tiny", **overrides)


def test_presets_and_routing_shape():
    assert set(PRESETS) == {"tiny", "deepseek_small"}
    ds = PRESETS["deepseek_small"]
    assert (ds.num_moe_layers, ds.num_experts, ds.top_k, ds.n_group, ds.topk_group, ds.hidden_size) == (
        8,
        256,
        8,
        8,
        4,
        2048,
    )
    assert ds.dtype == torch.bfloat16 and ds.routing_method == RoutingMethod.DEEPSEEK_V3
    shape = SMALL.routing_shape()
    assert shape.moe_layers == (1, 2) and shape.num_model_layers == 3 and shape.top_k == SMALL.top_k
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        reference_config("huge")
    with pytest.raises(TypeError, match="config must be a ReferenceMoEConfig"):
        ReferenceMoEModel({"hidden_size": 8})


def test_same_seed_same_weights_other_seed_other_weights():
    a, b = ReferenceMoEModel(SMALL), ReferenceMoEModel(SMALL)
    c = ReferenceMoEModel(reference_config("tiny", num_layers=3, max_requests=4, max_seq_len=24, seed=1))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.embed, c.embed)


@settings(max_examples=25)
@given(
    lengths=st.lists(st.integers(2, 12), min_size=1, max_size=3),
    prefill=st.lists(st.integers(1, 11), min_size=3, max_size=3),
    pad=st.integers(0, 3),
    seed=st.integers(0, 2**31),
)
def test_incremental_steps_equal_one_prefill(model, lengths, prefill, pad, seed):
    """Requests served in mixed steps (prefill chunk, then one decode row per step, all requests in
    one batch, padding rows at the dummy slot) get the logits and router ids of one prefill each."""
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(1, SMALL.vocab_size, size=n).tolist() for n in lengths]
    done = [min(p, n) for p, n in zip(prefill, lengths)]
    got_ids = [[None] * n for n in lengths]
    got_logits = [[None] * n for n in lengths]
    first = True
    while first or any(d < n for d, n in zip(done, lengths)):
        tokens, positions, slots, owners = [], [], [], []
        for r, seq in enumerate(seqs):
            start = 0 if first else done[r]
            stop = done[r] if first else min(done[r] + 1, lengths[r])
            for t in range(start, stop):
                tokens.append(seq[t])
                positions.append(t)
                slots.append(r)
                owners.append((r, t))
            if not first:
                done[r] = stop
        first = False
        tokens += [0] * pad
        positions += [0] * pad
        slots += [SMALL.dummy_slot] * pad
        logits, ids = model(*_rows(tokens, positions, slots), return_router_ids=True)
        for row, (r, t) in enumerate(owners):
            got_ids[r][t] = ids[row]
            got_logits[r][t] = logits[row]
    for r, seq in enumerate(seqs):
        ref_logits, ref_ids = model(*_rows(seq, range(len(seq)), [3] * len(seq)), return_router_ids=True)
        assert torch.equal(torch.stack(got_ids[r]), ref_ids), f"request {r}: router ids differ"
        _assert_f64_close(torch.stack(got_logits[r]), ref_logits, f"request {r}: logits")


def test_padding_rows_touch_only_the_dummy_slot(model):
    """Padding rows at the dummy slot write only their own cells of it and change no real row.

    Structure is exact: every KV cell that no row of the step points at is bit-identical to before
    (not written), the padding rows' cells of the dummy slot are written, the real rows' router ids
    are the 3-row step's. The real rows' logits and their rewritten KV cells are the same values
    computed with 5-row GEMMs instead of 3-row ones, so they agree within F64_TOL.
    """
    model.reset_cache()  # the dummy slot holds zeros, not what earlier tests' padding rows wrote
    ref, ref_ids = model(*_rows([5, 6, 7], [0, 1, 0], [0, 0, 1]), return_router_ids=True)
    before = [(layer.attn.cache_k.clone(), layer.attn.cache_v.clone()) for layer in model.layers]
    # padding rows with distinctive tokens and positions, all at the dummy slot
    dummy = SMALL.dummy_slot
    tokens, positions, slots = _rows([5, 6, 7, 99, 98], [0, 1, 0, 5, 0], [0, 0, 1, dummy, dummy])
    padded, padded_ids = model(tokens, positions, slots, return_router_ids=True)
    assert torch.equal(padded_ids[:3], ref_ids), "padding rows changed the real rows' router ids"
    _assert_f64_close(padded[:3], ref, "real rows' logits")

    written = torch.zeros(SMALL.max_requests + 1, SMALL.max_seq_len, dtype=torch.bool)
    written[slots, positions] = True  # (slot, position) cells the 5-row step writes
    real_written, pad_written = written.clone(), torch.zeros_like(written)
    real_written[dummy], pad_written[dummy] = False, written[dummy]
    for i, (layer, old_kv) in enumerate(zip(model.layers, before)):
        for name, old in zip(("cache_k", "cache_v"), old_kv):
            new = getattr(layer.attn, name)
            assert torch.equal(new[~written], old[~written]), f"layer {i} {name}: an unwritten cell changed"
            assert (new[pad_written] != 0).all(), f"layer {i} {name}: a padding row's cell was not written"
            _assert_f64_close(new[real_written], old[real_written], f"layer {i} {name}, real rows' cells")


def test_capture_records_the_returned_router_ids_and_no_padding(model):
    capturer = RoutingCapturer(SMALL.routing_shape(), 8, "cpu")
    capturer.buffer.fill_(POISON)
    capturer.set_step([3])
    rows = _rows([5, 6, 7, 0, 0], [0, 1, 0, 0, 0], [0, 0, 1, SMALL.dummy_slot, SMALL.dummy_slot])
    logits, ids = model(*rows, capturer=capturer, return_router_ids=True)
    assert torch.equal(capturer.buffer[:3], ids[:3])
    assert (capturer.buffer[3:] == POISON).all(), "padding rows reached the capture buffer"
    # bit-identical: the same rows again, so the same kernels on the same shapes and one thread;
    # the capture only copies ids
    torch.testing.assert_close(logits, model(*rows), rtol=0, atol=0)
    assert ids.shape == (5, SMALL.num_moe_layers, SMALL.top_k) and ids.dtype == torch.int32


def test_gathered_and_dense_experts_agree():
    torch.manual_seed(0)
    outs = {}
    for impl in ("dense", "gathered"):
        m = ReferenceMoEModel(reference_config("tiny", num_layers=2, expert_impl=impl))
        rows = _rows([3, 4, 5, 6, 7], [0, 1, 2, 0, 1], [0, 0, 0, 1, 1])
        outs[impl] = m(*rows, return_router_ids=True)
    # other einsums sum in another order (measured <= 1.1e-15); ids exact for the reason at F64_TOL
    _assert_f64_close(outs["dense"][0], outs["gathered"][0], "dense vs gathered logits")
    assert torch.equal(outs["dense"][1], outs["gathered"][1])


def test_auto_experts_switch_on_the_row_count():
    """16 experts, top 4: "auto" gathers below 4 rows (bit-identical to "gathered"), else runs dense."""
    blocks = {
        impl: ReferenceMoEModel(reference_config("tiny", num_layers=2, expert_impl=impl)).layers[1].mlp
        for impl in ("auto", "gathered", "dense")
    }
    g = torch.Generator().manual_seed(0)
    for n, same_as in ((1, "gathered"), (3, "gathered"), (4, "dense"), (9, "dense")):
        x = torch.randn(n, SMALL.hidden_size, dtype=torch.float64, generator=g)
        auto, _ = blocks["auto"](x)
        # exact on purpose: equal weights (one seed), the same input and path and one thread run the
        # same kernels; the other path differs in the last bits (here by up to 4.4e-16)
        assert torch.equal(auto, blocks[same_as](x)[0]), f"{n} rows should run {same_as}"


def test_forward_compiles_without_graph_breaks(model):
    capturer = RoutingCapturer(SMALL.routing_shape(), 8, "cpu")
    capturer.set_step([4])
    rows = _rows([1, 2, 3, 4], [0, 1, 2, 3], [0, 0, 0, 0])
    assert count_graph_breaks(lambda *r: model(*r, capturer=capturer), *rows) == 0


def test_moe_blocks_are_the_moe_layers_in_order():
    """moe_blocks(): (model layer, block) of each MoE layer, the blocks replay_routers lists; the
    gate is each block's router weight (what the demo perturbs and reads gradients of)."""
    model = ReferenceMoEModel(reference_config("tiny", num_layers=4, first_k_dense=2))
    blocks = model.moe_blocks()
    assert [layer for layer, _ in blocks] == [2, 3] == list(model.config.moe_layers)
    assert all(block is model.layers[layer].mlp for layer, block in blocks)
    assert [(r[0], r[1], r[2], r[3]) for r in model.replay_routers()] == [
        (layer, f"layers.{layer}.mlp", block, "router") for layer, block in blocks
    ]
    assert all(
        block.gate.shape == (model.config.hidden_size, model.config.num_experts) for _, block in blocks
    )
