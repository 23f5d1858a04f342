"""RoutingReplayer (the persistent replay buffer), replay_batch (the batch builder) and
replay_router_output (what every wrapped router computes), without a model.

Expected buffers and batches are built from the definitions in tests/strategies/replayer.py (a request's
T - 1 rows, a -1 row for its last token, -1 padding), not from the library's code.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch._dynamo.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import distinct_rows, replay_batch_sequences, replay_requests
from threads import run_threads

import moe_ops
from moe_ops import RoutingMethod, RoutingReplayer, RoutingShape, replay_batch, route
from moe_ops.attach.replaying import ReplayRule, replay_router_output
from moe_ops.replay import ReplayFaultError, check_replay_errors
from moe_ops.replay.kernels import REPLAY_FAULT_ROW_COUNT

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
    stored = r._device_rows("routing", rows, SHAPE.num_layers)
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
    batch = distinct_rows(np.random.default_rng(2), 5, SHAPE, live_fraction=0.2)
    r.set_batch(batch)
    for column, layer in enumerate(SHAPE.moe_layers):
        ids = r.layer_ids(layer, 5)
        assert ids.shape == (5, 2) and ids.dtype == torch.int32
        assert (
            ids._base is r.buffer or ids.untyped_storage().data_ptr() == r.buffer.untyped_storage().data_ptr()
        )
        assert torch.equal(ids, torch.from_numpy(batch[:, column]).to(torch.int32))
    with pytest.raises(ValueError, match="dense"):
        r.layer_ids(3, 5)
    with pytest.raises(IndexError):
        r.layer_ids(5, 5)
    with pytest.raises(ValueError, match="more than the replayer's max_num_tokens=6"):
        r.layer_ids(1, 7)
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        r.layer_ids(1, -2)
    with pytest.raises(ValueError, match="kind must be one of"):
        r.layer_ids(1, 5, kind="dense")


def test_a_router_must_read_exactly_the_batchs_rows():
    """The issue's reproducer: 20 rows set, a router asking for 16 got the first 16 silently."""
    shape = RoutingShape(num_layers=1, num_experts=8, top_k=2, moe_layers=(0,), num_model_layers=1)
    rep = RoutingReplayer(shape, max_num_tokens=20, device="cpu")
    rep.set_batch(np.tile(np.array([[[0, 1]]], np.int32), (20, 1, 1)))
    with pytest.raises(ValueError, match=r"layer 0 has 16 rows but the batch set for slot 0 has 20"):
        rep.layer_ids(0, 16)
    assert tuple(rep.layer_ids(0, 20).shape) == (20, 2)
    rep.set_batch(np.zeros((0, 1, 2), np.int32))
    assert tuple(rep.layer_ids(0, 0).shape) == (0, 2)
    with pytest.raises(ValueError, match="has 20 rows but the batch set for slot 0 has 0"):
        rep.layer_ids(0, 20)


def test_a_forward_without_a_batch_is_refused():
    """Without set_batch every router would route live: identical to no replay, silently."""
    rep = RoutingReplayer(SHAPE, 6, "cpu")
    with pytest.raises(ValueError, match=r"no batch was set for slot 0: call replayer.set_batch"):
        rep.layer_ids(1, 4)


def test_compiled_routers_count_a_row_mismatch_on_the_device():
    """Under torch.compile (a dynamic row dimension) the host count is not part of the graph: a
    mismatch is one faulty call per router for check_replay_errors, no graph break, and new batch
    sizes recompile nothing."""
    torch._dynamo.reset()
    rep = RoutingReplayer(SHAPE, 12, "cpu")
    counts = torch._dynamo.testing.CompileCounter()

    @torch.compile(backend=counts, fullgraph=True, dynamic=True)
    def read(x):
        return sum(rep.layer_ids(layer, x.shape[0]).sum() for layer in SHAPE.moe_layers)

    check_replay_errors("cpu", raise_error=False)
    rng = np.random.default_rng(5)
    for n in (5, 7, 9):
        batch = distinct_rows(rng, n, SHAPE)
        rep.set_batch(batch)
        assert int(read(torch.zeros(n))) == int(batch.sum())
        assert check_replay_errors("cpu", raise_error=False) == 0
    read(torch.zeros(4))  # 4 rows against a batch of 9: three routers read the wrong rows
    with pytest.raises(ReplayFaultError, match="row count differed") as err:
        check_replay_errors("cpu")
    assert err.value.rows == 3 and err.value.flags == REPLAY_FAULT_ROW_COUNT
    assert counts.frame_count == 1, "a new batch size recompiled"


# ---------------------------------------------------------------------------------------------------
# replay_batch
# ---------------------------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(case=replay_requests())
def test_replay_batch_packs_and_pads_requests(case):
    kwargs = dict(
        layer_axis=case.layer_axis,
        pad_to=case.pad_to,
        num_tokens=case.num_tokens(),
        no_record=case.no_record,
        missing=case.masks(),
    )
    out = replay_batch(case.arrays(), case.shape, **kwargs)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, case.expected())
    # the same from CPU tensors
    tensors = (
        [torch.from_numpy(a.astype(np.int64)) for a in case.arrays()] if case.dtype.kind != "u" else None
    )
    if tensors is not None:
        again = replay_batch(tensors, case.shape, **kwargs)
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
            r"requests\[0\].*\(rows, 5, 2\).*layer_axis='moe'",
        ),
        (dict(requests=[np.full((1, 3, 2), 9, np.int64)]), r"requests\[0\].*num_experts=8"),
        (dict(requests=[np.full((1, 3, 2), 200, np.uint8)]), r"200"),
        (dict(requests=[ok, ok], pad_to=2), r"requests\[0\] has 3 tokens \(2 rows\), more than pad_to=2"),
        (dict(requests=[ok], num_tokens=[2, 2]), r"num_tokens must have one entry per request \(1\), got 2"),
        (dict(requests=[ok], num_tokens=[0]), r"num_tokens\[0\] must be an int >= 1"),
        (dict(requests=[ok], no_record=5), "no_record must be -1"),
        (dict(requests=[ok], missing=[np.zeros(3, bool)]), r"missing\[0\] must be a \(2,\) bool array"),
        (dict(requests=[ok], missing=[np.zeros(2, np.int8)]), r"missing\[0\] must be a \(2,\) bool"),
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


# ---------------------------------------------------------------------------------------------------
# replay_batch: token counts, no-record markers, missing rows
# ---------------------------------------------------------------------------------------------------


def test_replay_batch_checks_each_requests_length_against_its_tokens():
    """The issue's reproducer: two 4-token samples with 2 and 3 rows gave 7 rows for 8 tokens,
    shifting the second request by one row. With the token counts, the short one is refused."""
    shape = RoutingShape(num_layers=1, num_experts=8, top_k=2)
    short = np.array([[[0, 1]], [[2, 3]]], np.int32)
    full = np.array([[[4, 5]], [[6, 7]], [[1, 2]]], np.int32)
    assert replay_batch([short, full], shape).shape == (7, 1, 2)  # unchecked without the counts
    with pytest.raises(
        ValueError, match=r"requests\[0\] has 2 rows for num_tokens\[0\]=4 tokens: expected 3"
    ):
        replay_batch([short, full], shape, num_tokens=[4, 4])
    with pytest.raises(ValueError, match=r"requests\[1\] has 3 rows for num_tokens\[1\]=2"):
        replay_batch([short, full], shape, num_tokens=[3, 2])
    # T - 1 rows (vLLM, SGLang, the ledger) and T rows (aligned, verl) are both the right length
    out = replay_batch([short, full], shape, num_tokens=[3, 3])
    assert out[:, 0].tolist() == [[0, 1], [2, 3], [-1, -1], [4, 5], [6, 7], [1, 2]]
    padded = replay_batch([short, full], shape, num_tokens=[3, 3], pad_to=4)
    assert padded[:, 0].tolist() == [[0, 1], [2, 3], [-1, -1], [-1, -1], [4, 5], [6, 7], [1, 2], [-1, -1]]


def test_verl_style_zero_rows_are_no_record_on_request():
    """verl pads a missing route with an all-zero row (its aligned placeholder): with no_record=0
    those rows are routed live and never counted; with the default they are faults (expert 0
    twice), as before."""
    shape = RoutingShape(num_layers=2, num_experts=8, top_k=2)
    rows = np.array([[[3, 1], [0, 5]], [[0, 0], [2, 0]], [[0, 0], [0, 0]]], np.int64)  # 3 tokens, aligned
    out = replay_batch([rows], shape, num_tokens=[3], no_record=0)
    assert out.tolist() == [[[3, 1], [0, 5]], [[-1, -1], [2, 0]], [[-1, -1], [-1, -1]]]
    assert replay_batch([rows], shape, num_tokens=[3])[2].tolist() == [[0, 0], [0, 0]]

    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    for no_record, faults in ((0, 0), (-1, 3)):
        rep = RoutingReplayer(shape, 3, "cpu", no_record=no_record)
        rep.set_batch(rows)  # raw, unconverted: the replayer applies its own marker
        check_replay_errors("cpu", raise_error=False)
        for layer in range(2):
            _, ids = moe_ops.replay_routing(logits, rep.layer_ids(layer, 3), RoutingMethod.RENORMALIZE)
        assert check_replay_errors("cpu", raise_error=False) == faults
        live = route(logits, 2, RoutingMethod.RENORMALIZE)[1]
        if no_record == 0:
            assert torch.equal(ids[2], live[2]), "an all-zero row must be routed live"
    # the same conversion for a batch already on the device (no host read)
    rep = RoutingReplayer(shape, 3, "cpu", no_record=0)
    rep.set_batch(rows.astype(np.int32))
    assert rep.buffer.tolist() == out.tolist()
    assert rep._device_rows("routing", torch.from_numpy(rows), 2).tolist() == out.tolist()


def test_no_record_zero_needs_top_k_two():
    shape = RoutingShape(num_layers=1, num_experts=8, top_k=1)
    with pytest.raises(
        ValueError, match=r"no_record=0 needs top_k >= 2: with top_k == 1 the row \[0\] is expert 0"
    ):
        replay_batch([np.zeros((2, 1, 1), np.int32)], shape, no_record=0)
    with pytest.raises(ValueError, match="no_record=0 needs top_k >= 2"):
        RoutingReplayer(shape, 4, "cpu", no_record=0)
    for bad in (1, -2, True, 0.0, "0"):
        with pytest.raises(ValueError, match="no_record must be -1"):
            RoutingReplayer(SHAPE, 4, "cpu", no_record=bad)


def test_a_dropped_step_at_256_experts_is_not_expert_255():
    """The ledger's dropped step fills its rows with the store's fill value; at 256 experts in
    uint8 that is 255, a valid expert. Its missing mask makes the rows no record (routed live)."""
    shape = RoutingShape(num_layers=2, num_experts=256, top_k=1)
    routing = np.array([[[7], [9]], [[3], [4]], [[255], [255]]], np.uint8)
    missing = np.array([False, False, True])
    out = replay_batch([routing], shape, missing=[missing])
    assert out[:, :, 0].tolist() == [[7, 9], [3, 4], [-1, -1], [-1, -1]]
    assert replay_batch([routing], shape)[2, :, 0].tolist() == [255, 255]  # without the mask: an id


# ---------------------------------------------------------------------------------------------------
# Micro-batch slots
# ---------------------------------------------------------------------------------------------------


def test_slots_hold_each_micro_batch_and_select_switches_what_routers_read():
    """The issue's reproducer: with one buffer, setting micro-batch B replaced A before A's
    backward recompute read it. With slots, each micro-batch keeps its rows."""
    shape = RoutingShape(num_layers=1, num_experts=8, top_k=2)
    mb_a = np.array([[[0, 1]], [[2, 3]]], np.int32)
    mb_b = np.array([[[4, 5]], [[6, 7]], [[1, 0]]], np.int32)
    rep = RoutingReplayer(shape, 4, "cpu", num_slots=2)
    address = rep.buffer.data_ptr()
    rep.set_batch(mb_a, slot=0)
    rep.select(0)
    fwd_a = rep.layer_ids(0, 2).clone()
    rep.set_batch(mb_b, slot=1)
    rep.select(1)
    assert rep.layer_ids(0, 3).tolist() == mb_b[:, 0].tolist()
    rep.select(0)  # A's backward: its recompute reads A's ids again
    assert rep.layer_ids(0, 2).tolist() == fwd_a.tolist() == mb_a[:, 0].tolist()
    assert (rep.buffer[2:] == -1).all() and rep.num_tokens == 2 and int(rep.row_count[0]) == 2
    assert rep.buffer.data_ptr() == address
    assert (rep.slot_tokens(0), rep.slot_tokens(1)) == (2, 3)
    for bad in (2, -1, 1.0, True):
        with pytest.raises(ValueError, match=r"slot must be an int in \[0, num_slots=2\)"):
            rep.select(bad)
        with pytest.raises(ValueError, match="slot must be an int"):
            rep.set_batch(mb_a, slot=bad)
    with pytest.raises(ValueError, match="num_slots must be an int >= 1"):
        RoutingReplayer(shape, 4, "cpu", num_slots=0)
    # bounded before anything is allocated (2**40 slots would raise a bare MemoryError)
    with pytest.raises(ValueError, match="num_slots must be at most 65536"):
        RoutingReplayer(shape, 4, "cpu", num_slots=2**40)


class SlotModel:
    """What set_batch / select must leave behind, from the definition: per slot its batch; the
    routers read the selected one, -1 past its rows."""

    def __init__(self, num_slots: int):
        self.batches = [None] * num_slots
        self.selected = 0

    def expect(self, r: RoutingReplayer) -> None:
        batch = self.batches[self.selected]
        if batch is None:
            assert (r.buffer == -1).all() and r.num_tokens == 0 and int(r.row_count[0]) == 0
        else:
            assert_holds(r, batch)
        assert r.slot == self.selected


@settings(max_examples=60, deadline=None)
@given(case=replay_batch_sequences(max_batches=8), data=st.data())
def test_slots_against_their_definition(case, data):
    num_slots = data.draw(st.integers(1, 4))
    r = RoutingReplayer(case.shape, case.max_num_tokens, "cpu", num_slots=num_slots)
    model = SlotModel(num_slots)
    for i, batch in enumerate(case.batches):
        slot = data.draw(st.integers(0, num_slots - 1))
        r.set_batch(case.passed(i), slot=slot)
        model.batches[slot] = batch
        model.expect(r)
        selected = data.draw(st.integers(0, num_slots - 1))
        r.select(selected)
        model.selected = selected
        model.expect(r)
        for s in range(num_slots):
            expected = 0 if model.batches[s] is None else model.batches[s].shape[0]
            assert r.slot_tokens(s) == expected


def test_select_in_backward_reselects_when_the_backward_reaches_the_output():
    shape = RoutingShape(num_layers=1, num_experts=8, top_k=2)
    rep = RoutingReplayer(shape, 4, "cpu", num_slots=3)
    for slot in range(3):
        rep.set_batch(np.full((slot + 1, 1, 2), [slot, slot + 1], np.int32), slot=slot)
    x = torch.ones(3, requires_grad=True)
    rep.select(1)
    out = rep.select_in_backward(x * 2, 1)
    rep.select(2)  # another micro-batch's forward in between
    seen = []
    out.grad_fn.register_prehook(lambda grad: seen.append(rep.slot))  # runs after the tensor hook
    out.sum().backward()
    assert seen == [1] and rep.slot == 1 and rep.num_tokens == 2
    plain = torch.ones(2)
    assert rep.select_in_backward(plain, 0) is plain  # nothing to hook without a gradient
    with pytest.raises(ValueError, match="slot must be an int"):
        rep.select_in_backward(x * 2, 3)


def test_concurrent_select_and_set_batch_leave_the_selected_slot_whole():
    """Threads fill slots and select them (the backward hook selects from autograd's thread):
    afterwards, and at every check under the lock, buffer / num_tokens / row_count are exactly the
    selected slot's batch."""
    r = RoutingReplayer(SHAPE, 16, "cpu", num_slots=4)
    batches = [np.full((n, 3, 2), v, dtype=np.int32) for v, n in enumerate([16, 1, 9, 4])]
    for v, b in enumerate(batches):
        b[:, :, 1] = (v + 1) % 8
    errors = []
    start = threading.Barrier(9)

    def filler(slot):
        start.wait()
        for _ in range(30):
            r.set_batch(batches[slot], slot=slot)

    def selector(seed):
        start.wait()
        rng = np.random.default_rng(seed)
        for _ in range(60):
            r.select(int(rng.integers(4)))

    def checker():
        start.wait()
        for _ in range(150):
            with r._lock:
                slot, n, count = r.slot, r.num_tokens, int(r.row_count[0])
                state = r.buffer.clone()
                filled = r._slot_tokens[slot]
            if n != filled or count != n:
                errors.append(("counts", slot, n, count))
            elif n and not (state[:n] == torch.from_numpy(batches[slot])).all():
                errors.append(("rows", slot, n))
            elif not (state[n:] == -1).all():
                errors.append(("past", slot, n))

    def worker(seed: int) -> None:
        if seed < 4:
            filler(seed)
        elif seed < 8:
            selector(seed)
        else:
            checker()

    run_threads(worker, 9)
    assert not errors, errors[:5]
    assert_holds(r, batches[r.slot])


# ---------------------------------------------------------------------------------------------------
# MTP layers
# ---------------------------------------------------------------------------------------------------


def test_mtp_layers_read_their_own_columns_and_route_live_without_them():
    """Megatron numbers MTP layers from 0 like decoder layers: MTP layer 1 read decoder layer 1's
    rows (NeMo-RL #3903). Keyed by kind, an MTP layer never reads a decoder column."""
    shape = RoutingShape(num_layers=2, num_experts=8, top_k=2, moe_layers=(0, 1))
    rep = RoutingReplayer(shape, 3, "cpu", num_mtp_layers=2)
    decoder = np.array([[[0, 1], [2, 3]]] * 3, np.int32)
    mtp = np.array([[[4, 5], [6, 7]]] * 3, np.int32)
    rep.set_batch(decoder, mtp_routing=mtp)
    assert rep.layer_ids(1, 3).tolist() == [[2, 3]] * 3
    assert rep.layer_ids(1, 3, kind="mtp").tolist() == [[6, 7]] * 3
    assert rep.layer_ids(0, 3, kind="mtp").tolist() == [[4, 5]] * 3
    rep.set_batch(decoder)  # no MTP rows: the MTP layers route live
    assert (rep.layer_ids(1, 3, kind="mtp") == -1).all() and (rep.mtp_buffer == -1).all()
    with pytest.raises(IndexError, match=r"MTP layer index must be an int in \[0, num_mtp_layers=2\)"):
        rep.layer_ids(2, 3, kind="mtp")
    with pytest.raises(ValueError, match=r"mtp_routing must have routing's 3 rows, got 2"):
        rep.set_batch(decoder, mtp_routing=mtp[:2])
    with pytest.raises(ValueError, match=r"mtp_routing must have shape \(num_tokens, 2, 2\) on the MTP"):
        rep.set_batch(decoder, mtp_routing=decoder[:, :1])
    plain = RoutingReplayer(shape, 3, "cpu")
    with pytest.raises(ValueError, match="num_mtp_layers=0"):
        plain.set_batch(decoder, mtp_routing=mtp)
    with pytest.raises(IndexError, match="num_mtp_layers=0"):
        plain.layer_ids(0, 0, kind="mtp")
    # slots carry the MTP rows too
    slots = RoutingReplayer(shape, 3, "cpu", num_slots=2, num_mtp_layers=2)
    slots.set_batch(decoder, mtp_routing=mtp, slot=1)
    slots.set_batch(decoder[:2], slot=0)
    slots.select(1)
    assert slots.layer_ids(0, 3, kind="mtp").tolist() == [[4, 5]] * 3
    slots.select(0)
    assert (slots.mtp_buffer == -1).all() and slots.layer_ids(0, 2).tolist() == [[0, 1]] * 2


@pytest.mark.gpu
def test_gpu_slots_and_row_checks_inside_a_cuda_graph(cuda_device):
    """select() and set_batch() of any slot enqueue device copies only (no sync); a CUDA graph
    captured at one row count reads the selected slot at every replay and counts a replay whose
    batch has another row count as a fault."""
    r = RoutingReplayer(SHAPE, 8, cuda_device, num_slots=3)
    rng = np.random.default_rng(3)
    batches = [distinct_rows(rng, 4, SHAPE) for _ in range(3)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for slot, b in enumerate(batches):
            r.set_batch(b, slot=slot)
        r.select(1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = torch.full((4, SHAPE.num_layers, SHAPE.top_k), -7, dtype=torch.int32, device=cuda_device)

    def step():
        for column, layer in enumerate(SHAPE.moe_layers):
            out[:, column].copy_(r.layer_ids(layer, 4))

    step()  # warm up outside the capture
    check_replay_errors(cuda_device, raise_error=False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for slot in (2, 0, 1):
        r.select(slot)
        out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), torch.from_numpy(batches[slot]).to(torch.int32))
    assert check_replay_errors(cuda_device, raise_error=False) == 0
    r.set_batch(distinct_rows(rng, 6, SHAPE), slot=1)  # the selected slot now has 6 rows
    graph.replay()
    with pytest.raises(ReplayFaultError, match="row count differed") as err:
        check_replay_errors(cuda_device)
    assert err.value.rows == SHAPE.num_layers and err.value.flags == REPLAY_FAULT_ROW_COUNT


def test_the_issues_dropped_step_reaches_the_trainer_as_no_record():
    """The issue's reproducer, end to end: at 256 experts a dropped step went through the wire and
    replay_batch as expert 255 (uint8's fill). The store's dtype now keeps a fill that is no id
    (uint16 at 256 experts), so the row arrives as no record with or without the mask."""
    from moe_ops import RoutingLedger, SlotStore, decode_routing, encode_routing

    sh = RoutingShape(num_layers=2, num_experts=256, top_k=1)
    store = SlotStore(8, sh)
    led = RoutingLedger(store, 4)
    led.add_request("r")
    led.append_blocks("r", [0])
    a = led.schedule([("r", 2)])
    b = led.schedule([("r", 1)])
    led.land(a.seq, np.zeros((2, 2, 1), np.uint8))
    led.drop(b.seq)
    led.finish("r")
    done = led.collect()[0]
    assert done.missing.tolist() == [False, False, True]
    received = decode_routing(encode_routing(done.routing))
    assert received.dtype == np.uint16 and received[2].ravel().tolist() == [65535, 65535]
    for kwargs in ({}, {"missing": [done.missing]}):
        batch = replay_batch([received], sh, **kwargs)
        assert batch[:, :, 0].tolist() == [[0, 0], [0, 0], [-1, -1], [-1, -1]]
    # and top_k = 8: the row is no record, not a "repeated" fault that check_replay_errors raises
    sh8 = RoutingShape(num_layers=1, num_experts=256, top_k=8)
    rows = np.full((2, 1, 8), 65535, np.uint16)
    rows[0, 0] = np.arange(8)
    rep = RoutingReplayer(sh8, 3, "cpu")
    rep.set_batch(replay_batch([rows], sh8))
    check_replay_errors("cpu", raise_error=False)
    moe_ops.replay_routing(torch.randn(3, 256), rep.layer_ids(0, 3), RoutingMethod.RENORMALIZE)
    assert check_replay_errors("cpu", raise_error=False) == 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_replay_routing_checks_the_row_count_in_its_forward(backend):
    """What attach_replay passes: the replayer's row_count, checked inside replay_routing's
    forward kernel (one faulty call when the call's rows differ), no op of its own."""
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    rec = torch.tensor([[0, 1]] * 5, dtype=torch.int32)
    for held, faults in ((5, 0), (4, 1), (0, 1), (6, 1)):
        check_replay_errors("cpu", raise_error=False)
        count = torch.tensor([held], dtype=torch.int32)
        _, ids = moe_ops.replay_routing(x, rec, RoutingMethod.RENORMALIZE, backend=backend, row_count=count)
        assert torch.equal(ids, rec)  # the rows themselves are replayed as given
        if faults:
            with pytest.raises(ReplayFaultError, match="1 router call") as err:
                check_replay_errors("cpu")
            assert err.value.flags == REPLAY_FAULT_ROW_COUNT
        else:
            assert check_replay_errors("cpu", raise_error=False) == 0
    # a call of 0 rows against a batch of 3 is counted too
    check_replay_errors("cpu", raise_error=False)
    three = torch.tensor([3], dtype=torch.int32)
    moe_ops.replay_routing(x[:0], rec[:0], RoutingMethod.RENORMALIZE, backend=backend, row_count=three)
    assert check_replay_errors("cpu", raise_error=False) == 1
    for bad, exc in (
        (torch.tensor([3]), ValueError),
        (torch.tensor([[3]], dtype=torch.int32), ValueError),
        (3, TypeError),
    ):
        with pytest.raises(exc, match="row_count must be"):
            moe_ops.replay_routing(x, rec, RoutingMethod.RENORMALIZE, backend=backend, row_count=bad)


def test_compiled_replay_with_the_fused_check_counts_once_per_router():
    """layer_ids(device_check=False) leaves the check to replay_routing(row_count=...): compiled,
    one fault per call whose rows differ, none otherwise, and no recompile across batch sizes."""
    torch._dynamo.reset()
    rep = RoutingReplayer(SHAPE, 12, "cpu")
    counts = torch._dynamo.testing.CompileCounter()

    @torch.compile(backend=counts, fullgraph=True, dynamic=True)
    def step(logits):
        out = []
        for layer in SHAPE.moe_layers:
            recorded = rep.layer_ids(layer, logits.shape[0], device_check=False)
            out.append(
                moe_ops.replay_routing(logits, recorded, RoutingMethod.RENORMALIZE, row_count=rep.row_count)[
                    1
                ]
            )
        return out

    rng = np.random.default_rng(6)
    check_replay_errors("cpu", raise_error=False)
    for n in (5, 9):
        batch = distinct_rows(rng, n, SHAPE)
        rep.set_batch(batch)
        ids = step(torch.randn(n, SHAPE.num_experts))
        assert all(torch.equal(i, torch.from_numpy(batch[:, c]).to(torch.int32)) for c, i in enumerate(ids))
        assert check_replay_errors("cpu", raise_error=False) == 0
    step(torch.randn(4, SHAPE.num_experts))  # 4 rows against a batch of 9
    assert check_replay_errors("cpu", raise_error=False) == SHAPE.num_layers
    assert counts.frame_count == 1


@pytest.mark.gpu
def test_gpu_the_fused_row_check_inside_a_cuda_graph(cuda_device):
    """attach_replay's read path in a CUDA graph: layer_ids(device_check=False) and
    replay_routing(row_count=...) adds no op of its own, replays each selected slot, and counts a
    replay whose batch has another row count."""
    r = RoutingReplayer(SHAPE, 8, cuda_device, num_slots=2)
    rng = np.random.default_rng(9)
    batches = [distinct_rows(rng, 4, SHAPE) for _ in range(2)]
    for slot, b in enumerate(batches):
        r.set_batch(b, slot=slot)
    logits = torch.randn(4, SHAPE.num_experts, device=cuda_device)
    out = torch.full((4, SHAPE.num_layers, SHAPE.top_k), -7, dtype=torch.int32, device=cuda_device)

    def step():
        for column, layer in enumerate(SHAPE.moe_layers):
            recorded = r.layer_ids(layer, 4, device_check=False)
            _, ids = moe_ops.replay_routing(
                logits, recorded, RoutingMethod.RENORMALIZE, row_count=r.row_count
            )
            out[:, column].copy_(ids)

    step()
    torch.cuda.synchronize()
    check_replay_errors(cuda_device, raise_error=False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for slot in (1, 0):
        r.select(slot)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), torch.from_numpy(batches[slot]).to(torch.int32))
    assert check_replay_errors(cuda_device, raise_error=False) == 0
    r.set_batch(distinct_rows(rng, 6, SHAPE), slot=0)
    graph.replay()
    assert check_replay_errors(cuda_device, raise_error=False) == SHAPE.num_layers
