"""The async device-to-host pipeline: ring slots, handles, narrowing, ordering, no host sync.

CPU tests run the same pipeline with synchronous copies (no stream); the GPU tests run it with a
real copy stream and check that the forward stream is never waited on by the host.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from gpu_helpers import sleep_ms
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import routing_shapes

from moe_ops import RingFullError, RoutingShape, TransferPipeline

POISON = -7


def _source(shape: RoutingShape, max_rows: int, device, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, shape.num_experts, (max_rows, shape.num_layers, shape.top_k), generator=g)
    return ids.to(device=device, dtype=torch.int32)


@settings(max_examples=150)
@given(shape=routing_shapes(), max_rows=st.integers(1, 40), data=st.data())
def test_snapshot_narrows_exactly_and_copies_only_the_leading_rows(shape, max_rows, data):
    source = _source(shape, max_rows, "cpu", data.draw(st.integers(0, 2**31)))
    pipe = TransferPipeline(source, shape.id_dtype, depth=2)
    n = data.draw(st.integers(0, max_rows))
    handle = pipe.snapshot(n)
    out = handle.result()
    assert out.dtype == shape.id_dtype and out.shape == (n, shape.num_layers, shape.top_k)
    assert np.array_equal(out.astype(np.int64), source[:n].numpy().astype(np.int64))
    handle.release()


def test_uint16_travels_as_int16_bits_and_reads_back_unsigned():
    source = torch.tensor([0, 1, 32767, 32768, 40000, 65535], dtype=torch.int32).view(6, 1, 1)
    pipe = TransferPipeline(source, np.uint16)
    out = pipe.snapshot(6).result()
    assert out.dtype == np.uint16
    assert out.reshape(-1).tolist() == [0, 1, 32767, 32768, 40000, 65535]


def test_ring_never_reuses_a_held_slot_and_names_the_holders():
    shape = RoutingShape(2, 16, 2)
    source = _source(shape, 8, "cpu", 0)
    pipe = TransferPipeline(source, np.uint8, depth=3)
    handles = [pipe.snapshot(i + 1) for i in range(3)]
    expected = [source[: i + 1].numpy().copy() for i in range(3)]
    assert pipe.in_flight == 3
    with pytest.raises(RingFullError, match=r"all 3 ring slots.*seq \[0, 1, 2\]"):
        pipe.snapshot(1)
    assert pipe.in_flight == 3, "a refused snapshot must not take a slot"
    handles[1].release()
    source.fill_(POISON)  # later rows must not leak into earlier, still-held snapshots
    h3 = pipe.snapshot(4)
    assert (h3.result() == np.uint8(POISON & 0xFF)).all()
    for i in (0, 2):
        assert np.array_equal(handles[i].result(), expected[i]), f"held snapshot {i} was overwritten"
    with pytest.raises(RuntimeError, match="snapshot 1 was released"):
        handles[1].result()
    handles[1].release()  # idempotent
    for h in (handles[0], handles[2], h3):
        h.release()
    assert pipe.in_flight == 0


def test_result_copy_is_owned_and_view_is_read_only_until_release():
    shape = RoutingShape(1, 8, 1)
    source = _source(shape, 4, "cpu", 1)
    pipe = TransferPipeline(source, np.uint8, depth=1)
    with pipe.snapshot(4) as h:
        owned = h.result()
        view = h.result(copy=False)
        assert not view.flags.writeable
        owned[:] = 0  # the owned copy is the caller's
        assert np.array_equal(view, source.numpy())
    assert h.released
    h2 = pipe.snapshot(0)
    assert h2.result().shape == (0, 1, 1)
    h2.release()


def test_wait_for_a_slot_released_by_another_thread():
    shape = RoutingShape(1, 8, 1)
    pipe = TransferPipeline(_source(shape, 4, "cpu", 2), np.uint8, depth=1)
    held = pipe.snapshot(2)
    releaser = threading.Timer(0.05, held.release)
    releaser.start()
    start = time.monotonic()
    h = pipe.snapshot(3, timeout=5.0)
    assert time.monotonic() - start < 4.0
    assert held.released and h.num_rows == 3
    h.release()
    held2 = pipe.snapshot(1)
    with pytest.raises(RingFullError):
        pipe.snapshot(1, timeout=0.02)  # bounded wait, then the error
    held2.release()


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda s: TransferPipeline(s.float(), np.uint8), "integer dtype"),
        (lambda s: TransferPipeline(s[0], np.uint8), "3-D"),
        (lambda s: TransferPipeline(s.transpose(0, 1), np.uint8), "contiguous"),
        (lambda s: TransferPipeline(s, np.uint8, depth=0), "depth must be an int >= 1"),
        (lambda s: TransferPipeline(s, np.float32), "out_dtype must be one of"),
        (lambda s: TransferPipeline(s, np.uint8).snapshot(9), r"num_rows must be in \[0, 8\]"),
        (lambda s: TransferPipeline(s, np.uint8).snapshot(-1), r"num_rows must be in \[0, 8\]"),
    ],
)
def test_bad_input_raises(make, match):
    source = torch.zeros(8, 2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        make(source)


def _run_in_flight_schedule(device, depth, ops, seed):
    """Steps write fresh rows and snapshot them; up to ``depth`` in flight, consumed in ``ops`` order."""
    rng = np.random.default_rng(seed)
    shape = RoutingShape(3, 300, 2)  # uint16 ids
    source = torch.full((32, 3, 2), POISON, dtype=torch.int32, device=device)
    pipe = TransferPipeline(source, shape.id_dtype, depth=depth)
    pending = []  # (handle, expected rows)
    for op in ops:
        if op == "step" and len(pending) < depth:
            n = int(rng.integers(0, 33))
            rows = rng.integers(0, shape.num_experts, size=(n, 3, 2), dtype=np.int32)
            pipe.guard_source()  # the next writes wait until queued snapshots read the source
            source[:n] = torch.from_numpy(rows).to(device, non_blocking=False)
            source[n:] = POISON
            pending.append((pipe.snapshot(n), rows))
        elif pending:
            idx = int(rng.integers(0, len(pending)))  # any order, not only the oldest
            handle, rows = pending.pop(idx)
            out = handle.result(copy=bool(rng.integers(0, 2)))
            assert out.dtype == np.uint16
            assert np.array_equal(out.astype(np.int32), rows), f"snapshot {handle.seq} returned wrong rows"
            handle.release()
    for handle, rows in pending:
        assert np.array_equal(handle.result().astype(np.int32), rows)
        handle.release()
    assert pipe.in_flight == 0


@settings(max_examples=60)
@given(
    depth=st.integers(1, 4),
    ops=st.lists(st.sampled_from(["step", "step", "consume"]), max_size=30),
    seed=st.integers(0, 2**32 - 1),
)
def test_one_to_four_in_flight_consumed_out_of_order_cpu(depth, ops, seed):
    _run_in_flight_schedule("cpu", depth, ops, seed)


# ----------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@settings(max_examples=40)
@given(
    depth=st.integers(1, 4),
    ops=st.lists(st.sampled_from(["step", "step", "consume"]), max_size=30),
    seed=st.integers(0, 2**32 - 1),
)
def test_one_to_four_in_flight_consumed_out_of_order_gpu(depth, ops, seed):
    _run_in_flight_schedule("cuda", depth, ops, seed)


@pytest.mark.gpu
def test_snapshot_does_not_synchronise_the_forward_stream(cuda_device):
    """A long kernel queued before the rows are written: snapshot() must return while it still runs,
    and the copy must still see the rows written after it (the copy stream waits on an event)."""
    source = torch.full((64, 4, 2), POISON, dtype=torch.int32, device=cuda_device)
    pipe = TransferPipeline(source, np.uint8, depth=2)
    rows = torch.randint(0, 200, (64, 4, 2), dtype=torch.int32, device=cuda_device)
    with pipe.snapshot(64) as warm:  # load every kernel first: lazy module loading may synchronise
        warm.result()
    source.copy_(rows)
    source.fill_(POISON)
    torch.cuda.synchronize()
    after_sleep = torch.cuda.Event()
    sleep_ms(200)  # on the forward stream
    source.copy_(rows)  # the forward's writes, queued behind the sleep
    after_sleep.record()
    start = time.perf_counter()
    handle = pipe.snapshot(64)
    elapsed = time.perf_counter() - start
    assert not after_sleep.query(), "the test kernel finished before snapshot returned: it cannot tell"
    assert not handle.ready(), "the copy completed before the forward's writes: no event ordering"
    assert elapsed < 0.1, f"snapshot took {elapsed * 1e3:.1f} ms: it waited for the forward stream"
    assert np.array_equal(handle.result(), rows.cpu().numpy().astype(np.uint8))
    handle.release()


@pytest.mark.gpu
def test_guard_source_keeps_a_delayed_snapshot_from_seeing_the_next_step(cuda_device):
    """Hold the copy stream back, then overwrite the source on the forward stream after
    guard_source(): the snapshot must still copy the old rows."""
    source = torch.full((128, 2, 4), 1, dtype=torch.int32, device=cuda_device)
    pipe = TransferPipeline(source, np.uint8, depth=2)
    with pipe.snapshot(128) as warm:  # load every kernel first: lazy module loading may synchronise
        warm.result()
    source.fill_(1)
    sleep_ms(1)
    torch.cuda.synchronize()
    with torch.cuda.stream(pipe.copy_stream):
        sleep_ms(100)  # the copy stream is busy with an earlier transfer
    handle = pipe.snapshot(128)
    start = time.perf_counter()
    pipe.guard_source()
    source.fill_(2)  # the next step's writes
    assert time.perf_counter() - start < 0.05, "guard_source waited on the host"
    assert (handle.result() == 1).all(), "the next step overwrote rows a queued snapshot had not read"
    handle.release()
    torch.cuda.synchronize()
    assert (source == 2).all()
