"""RoutingReplayer (the persistent replay buffer), replay_batch (the batch builder) and
replay_router_output (what every wrapped router computes), without a model.

Expected buffers and batches are built from the definitions in tests/strategies.py (a request's
T - 1 rows, a -1 row for its last token, -1 padding), not from the library's code.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from strategies import distinct_rows, replay_batch_sequences, replay_requests

from moe_ops import RoutingMethod, RoutingReplayer, RoutingShape, replay_batch, route
from moe_ops.replay import check_replay_errors
from moe_ops.replay.attach import ReplayRule, replay_router_output

# model layers 0..4, layer 0 and 3 dense: the MoE-only axis has 3 columns
SHAPE = RoutingShape(num_layers=3, num_experts=8, top_k=2, moe_layers=(1, 2, 4), num_model_layers=5)


def replayer_state(r: RoutingReplayer) -> tuple[torch.Tensor, int, int]:
    return r.buffer.clone(), r.num_tokens, int(r.row_count[0])


def assert_holds(r: RoutingReplayer, batch: np.ndarray) -> None:
    """Rows [0, n) hold ``batch``, every row past it is -1, and both counts say n."""
    n = batch.shape[0]
    buffer = r.buffer.cpu()
    assert torch.equal(buffer[:n], torch.from_numpy(batch.astype(np.int64)).to(torch.int32))
    assert (buffer[n:] == -1).all(), "rows past the batch must read as -1 (routed live)"
    assert r.num_tokens == n and int(r.row_count[0]) == n


# ---------------------------------------------------------------------------------------------------
# set_batch
# ---------------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(case=replay_batch_sequences())
def test_set_batch_copies_in_place_and_rows_past_the_batch_read_minus_one(case):
    r = RoutingReplayer(case.shape, case.max_num_tokens, "cpu")
    address = r.buffer.data_ptr()
    for i, batch in enumerate(case.batches):
        r.set_batch(case.passed(i))
        assert_holds(r, batch)
        assert r.buffer.data_ptr() == address, "the buffer was reallocated (graphs hold its address)"


def test_a_fresh_replayer_is_all_minus_one():
    r = RoutingReplayer(SHAPE, 6, "cpu")
    assert r.buffer.shape == (6, 3, 2) and r.buffer.dtype == torch.int32
    assert (r.buffer == -1).all() and r.num_tokens == 0 and int(r.row_count[0]) == 0
    assert "max_num_tokens=6" in repr(r)


BAD_BATCHES = [
    (np.zeros((4, 5, 2), np.int32), r"shape \(num_tokens, 3, 2\).*layer_axis='model'"),
    (np.zeros((4, 3), np.int32), r"shape \(num_tokens, 3, 2\)"),
    (np.zeros((4, 3, 4), np.int32), r"shape \(num_tokens, 3, 2\)"),
    (np.zeros((7, 3, 2), np.int32), "more than max_num_tokens=6"),
    (np.zeros((2, 3, 2), np.float32), "integer expert ids"),
    (np.zeros((2, 3, 2), np.bool_), "integer expert ids"),
    (torch.zeros(2, 3, 2), "integer expert ids"),
    (np.full((2, 3, 2), 8, np.int64), r"\[0, num_experts=8\).*\[0, 0, 0\]"),
    (np.full((2, 3, 2), -2, np.int16), r"12 id\(s\)"),
    # an int64 id that would wrap into range as int32 (2**32 + 3 -> 3) is refused, not narrowed
    (np.full((1, 3, 2), 2**32 + 3, np.int64), "4294967299"),
    (np.full((1, 3, 2), 255, np.uint8), "255"),
]


@pytest.mark.parametrize(("routing", "match"), BAD_BATCHES)
def test_set_batch_refuses_bad_input_and_changes_nothing(routing, match):
    r = RoutingReplayer(SHAPE, 6, "cpu")
    first = distinct_rows(np.random.default_rng(0), 5, SHAPE)
    r.set_batch(first)
    before = replayer_state(r)
    with pytest.raises(ValueError, match=match):
        r.set_batch(routing)
    after = replayer_state(r)
    assert torch.equal(before[0], after[0]) and before[1:] == after[1:]


def test_set_batch_type_errors():
    r = RoutingReplayer(SHAPE, 6, "cpu")
    for bad in ("AAAA", [[[1, 2]] * 3], None):
        with pytest.raises(TypeError):
            r.set_batch(bad)


def test_constructor_errors():
    with pytest.raises(TypeError, match="RoutingShape"):
        RoutingReplayer((3, 8, 2), 4, "cpu")
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="max_num_tokens must be an int >= 1"):
            RoutingReplayer(SHAPE, bad, "cpu")


def test_device_rows_store_out_of_range_ids_as_num_experts():
    """A device tensor is not read on the host: its ids outside [-1, num_experts) are stored as
    num_experts (a faulty row for replay_routing), never wrapped into range. The rule itself, run
    on the CPU (the GPU test runs it through set_batch)."""
    r = RoutingReplayer(SHAPE, 4, "cpu")
    rows = torch.tensor([[[0, 7], [-1, -1], [2**32 + 3, 1]], [[-5, 3], [8, 2], [4, 300]]], dtype=torch.int64)
    stored = r._device_rows(rows)
    expected = torch.tensor([[[0, 7], [-1, -1], [8, 1]], [[8, 3], [8, 2], [4, 8]]], dtype=torch.int32)
    assert torch.equal(stored, expected)


@pytest.mark.gpu
def test_gpu_set_batch_from_host_and_device_without_syncs(cuda_device):
    r = RoutingReplayer(SHAPE, 6, cuda_device)
    rng = np.random.default_rng(1)
    first = distinct_rows(rng, 5, SHAPE, 0.3)
    second = torch.from_numpy(distinct_rows(rng, 2, SHAPE)).to(cuda_device)
    bad = torch.tensor([[[0, 9], [2**40, 1], [-1, -1]]], device=cuda_device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        r.set_batch(first)
        r.set_batch(second)
        r.set_batch(bad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert r.buffer[0].tolist() == [[0, 8], [8, 1], [-1, -1]]
    assert (r.buffer[1:] == -1).all() and r.num_tokens == 1 and int(r.row_count[0]) == 1
    r.set_batch(second)
    assert_holds(r, second.cpu().numpy())
    with pytest.raises(ValueError, match="device"):
        RoutingReplayer(SHAPE, 6, "cpu").set_batch(bad)


def test_concurrent_set_batch_never_mixes_batches():
    """Eight threads set batches of different sizes and values at once: afterwards (and at every
    check in between, under the same lock) the buffer holds exactly one of them."""
    r = RoutingReplayer(SHAPE, 16, "cpu")
    batches = [np.full((n, 3, 2), v, dtype=np.int32) for v, n in enumerate([16, 1, 9, 4, 12, 7, 2, 15])]
    for b, v in zip(batches, range(8)):
        b[:, :, 1] = (v + 1) % 8  # two distinct ids per row
    empty = np.zeros((0, 3, 2), dtype=np.int32)
    errors = []
    start = threading.Barrier(9)

    def setter(batch):
        start.wait()
        for _ in range(40):
            r.set_batch(batch)

    def checker():
        start.wait()
        for _ in range(200):
            with r._lock:
                n = r.num_tokens
                state = r.buffer.clone()
            # before any setter ran: the fresh, empty state
            match = [
                b for b in [*batches, empty] if b.shape[0] == n and (state[:n] == torch.from_numpy(b)).all()
            ]
            if not match or not (state[n:] == -1).all():
                errors.append(n)

    threads = [threading.Thread(target=setter, args=(b,)) for b in batches] + [
        threading.Thread(target=checker)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, f"the buffer mixed batches (row counts seen: {errors[:5]})"
    assert any(b.shape[0] == r.num_tokens for b in batches)
    assert_holds(r, next(b for b in batches if b.shape[0] == r.num_tokens))


# ---------------------------------------------------------------------------------------------------
# layer_ids
# ---------------------------------------------------------------------------------------------------


def test_layer_ids_is_a_view_of_the_layers_column():
    r = RoutingReplayer(SHAPE, 6, "cpu")
    batch = distinct_rows(np.random.default_rng(2), 4, SHAPE)
    r.set_batch(batch)
    for column, layer in enumerate(SHAPE.moe_layers):
        ids = r.layer_ids(layer, 5)
        assert ids.shape == (5, 2) and ids.dtype == torch.int32
        assert (
            ids._base is r.buffer or ids.untyped_storage().data_ptr() == r.buffer.untyped_storage().data_ptr()
        )
        assert torch.equal(ids[:4], torch.from_numpy(batch[:, column]).to(torch.int32))
        assert (ids[4:] == -1).all()
    with pytest.raises(ValueError, match="dense"):
        r.layer_ids(3, 2)
    with pytest.raises(IndexError):
        r.layer_ids(5, 2)
    with pytest.raises(ValueError, match="more than the replayer's max_num_tokens=6"):
        r.layer_ids(1, 7)


# ---------------------------------------------------------------------------------------------------
# replay_batch
# ---------------------------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(case=replay_requests())
def test_replay_batch_packs_and_pads_requests(case):
    out = replay_batch(case.arrays(), case.shape, layer_axis=case.layer_axis, pad_to=case.pad_to)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, case.expected())
    # the same from CPU tensors
    tensors = (
        [torch.from_numpy(a.astype(np.int64)) for a in case.arrays()] if case.dtype.kind != "u" else None
    )
    if tensors is not None:
        again = replay_batch(tensors, case.shape, layer_axis=case.layer_axis, pad_to=case.pad_to)
        np.testing.assert_array_equal(again, out)


def test_replay_batch_a_worked_example():
    """Two requests of T = 4 and 3 tokens (3 and 2 routing rows), as in the docstring."""
    shape = RoutingShape(num_layers=1, num_experts=8, top_k=1)
    r = np.array([[[1]], [[2]], [[3]]], np.uint8)
    s = np.array([[[4]], [[5]]], np.uint8)
    packed = replay_batch([r, s], shape)
    assert packed[:, 0, 0].tolist() == [1, 2, 3, -1, 4, 5, -1]
    padded = replay_batch([r, s], shape, pad_to=5)
    assert padded[:, 0, 0].tolist() == [1, 2, 3, -1, -1, 4, 5, -1, -1, -1]
    assert replay_batch([], shape).shape == (0, 1, 1)
    # a 1-token request has no rows: its one token routes live
    assert replay_batch([np.zeros((0, 1, 1), np.uint8)], shape).tolist() == [[[-1]]]
    # uint8 with 256 experts: 255 is an id, not the missing-row fill
    wide = RoutingShape(num_layers=1, num_experts=256, top_k=1)
    assert replay_batch([np.array([[[255]]], np.uint8)], wide)[:, 0, 0].tolist() == [255, -1]


def test_replay_batch_refuses_bad_requests():
    ok = np.zeros((2, 3, 2), np.int32)
    ok[:, :, 1] = 1
    cases = [
        (dict(requests=[ok, np.zeros((2, 5, 2), np.int32)]), r"requests\[1\].*layer_axis='model'"),
        (
            dict(requests=[ok], layer_axis="model"),
            r"requests\[0\].*\(num_tokens - 1, 5, 2\).*layer_axis='moe'",
        ),
        (dict(requests=[np.full((1, 3, 2), 9, np.int64)]), r"requests\[0\].*num_experts=8"),
        (dict(requests=[np.full((1, 3, 2), 200, np.uint8)]), r"200"),
        (dict(requests=[ok, ok], pad_to=2), r"requests\[0\] has 2 rows, so 3 tokens.*pad_to=2"),
        (dict(requests=[ok], pad_to=0), "pad_to must be an int >= 1"),
        (dict(requests=[ok], layer_axis="decoder"), "layer_axis must be 'moe' or 'model'"),
        (dict(requests=[ok.astype(np.float32)]), "integer expert ids"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            replay_batch(shape=SHAPE, **kwargs)
    with pytest.raises(TypeError, match="decode_routing"):
        replay_batch(["k05VTVBZAQB2AHsnZGVzY3InOiAnfHUxJywg"], SHAPE)
    with pytest.raises(TypeError, match="sequence of per-request arrays"):
        replay_batch(ok, SHAPE)
    with pytest.raises(TypeError, match="RoutingShape"):
        replay_batch([ok], (3, 8, 2))


# ---------------------------------------------------------------------------------------------------
# replay_router_output
# ---------------------------------------------------------------------------------------------------


def test_router_output_rows_of_minus_one_keep_the_routers_own_output():
    """-1 rows: the router's weights and ids unchanged (bit for bit, dtypes kept); recorded rows:
    the recorded ids with the method's weights; faulty rows: routed live and counted."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 8, generator=gen).to(torch.bfloat16).requires_grad_()
    live_w, live_ids = route(logits.detach().float(), 2, RoutingMethod.RENORMALIZE)
    live_w = live_w.to(torch.bfloat16) + 1e-3  # a router's own weights: any values, kept as they are
    live_ids = torch.flip(live_ids, dims=[1]).to(torch.int64)  # its own column order, kept as well
    recorded = torch.tensor([[-1, -1], [3, 5], [-1, -1], [0, 0], [9, 1], [7, 6]], dtype=torch.int32)
    check_replay_errors(raise_error=False)
    weights, ids = replay_router_output(
        logits, live_w, live_ids, recorded, ReplayRule(RoutingMethod.RENORMALIZE)
    )
    assert weights.dtype == torch.bfloat16 and ids.dtype == torch.int64
    for row in (0, 2):
        assert torch.equal(ids[row], live_ids[row]) and torch.equal(weights[row], live_w[row])
    for row in (1, 5):
        assert torch.equal(ids[row], recorded[row].long())
        expected = torch.softmax(logits.detach().float()[row, recorded[row].long()], -1).to(torch.bfloat16)
        assert torch.equal(weights[row], expected)
    for row in (3, 4):  # an expert twice, an id out of range: the op's live routing
        assert torch.equal(
            ids[row], route(logits.detach().float()[row : row + 1], 2, RoutingMethod.RENORMALIZE)[1][0].long()
        )
    assert check_replay_errors(raise_error=False) == 2
    # weights of a row sum to 1 under RENORMALIZE: weigh the columns differently for a gradient
    (weights.float() * torch.tensor([1.0, 3.0])).sum().backward()
    assert logits.grad[1].abs().sum() > 0, "no gradient reached a recorded row's logits"
    assert (logits.grad[0] == 0).all(), "a -1 row takes the router's own (here detached) weights"
