"""The async device-to-host pipeline: ring slots, handles, narrowing, ordering, no host sync.

CPU tests run the same pipeline with synchronous copies (no stream); the GPU tests run it with a
real copy stream and check that the forward stream is never waited on by the host.
"""

from __future__ import annotations

import gc
import math
import threading
import time
import warnings

import numpy as np
import pytest
import torch
from gpu_helpers import sleep_ms
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import routing_shapes

from moe_ops import RingFullError, RoutingShape, TransferPipeline
from moe_ops.transfer.pipeline import DroppedSnapshotWarning

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


def test_every_public_name_stays_where_it_was_imported_from():
    """The transfer room is split by concern (paths, ring, handle, pipeline); ``moe_ops``,
    ``moe_ops.transfer`` and ``moe_ops.transfer.pipeline`` still hand out each name, as the object
    its own module defines."""
    import moe_ops
    from moe_ops import transfer
    from moe_ops.transfer import handle, paths, pipeline, ring

    homes = {
        "DroppedSnapshotWarning": ring,
        "RingFullError": ring,
        "SnapshotHandle": handle,
        "TransferPipeline": pipeline,
        "COPY_PATHS": paths,
        "NARROW_PATHS": paths,
        "choose_copy_path": paths,
        "choose_narrow_path": paths,
        "graph_bucket": paths,
        "graph_buckets": paths,
        "staging_dtype": paths,
    }
    assert set(pipeline.__all__) == set(homes)
    for name, home in homes.items():
        assert getattr(pipeline, name) is getattr(home, name), name
    for name in transfer.__all__:
        assert getattr(transfer, name) is getattr(pipeline, name), name
    for name in ("RingFullError", "SnapshotHandle", "TransferPipeline"):
        assert getattr(moe_ops, name) is getattr(pipeline, name), name


def test_uint16_travels_as_int16_bits_and_reads_back_unsigned():
    source = torch.tensor([0, 1, 32767, 32768, 40000, 65535], dtype=torch.int32).view(6, 1, 1)
    pipe = TransferPipeline(source, np.uint16)
    with pipe.snapshot(6) as handle:
        out = handle.result()
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
    h = pipe.snapshot(3, timeout=120.0)
    # woken by the release (0.05 s after the call here), not by the timeout: the bound is a hang
    # guard far above that, which a busy machine's scheduling delays cannot reach
    assert time.monotonic() - start < 60.0
    assert held.released and h.num_rows == 3
    h.release()
    held2 = pipe.snapshot(1)
    with pytest.raises(RingFullError):
        pipe.snapshot(1, timeout=0.02)  # bounded wait, then the error
    held2.release()


def _collected_warnings(action) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
        gc.collect()
    return [w for w in caught if issubclass(w.category, DroppedSnapshotWarning)]


def test_lost_handles_give_their_slots_back_and_warn_once():
    """Two handles dropped unreleased with depth=2 used to make every later snapshot() raise
    RingFullError; now their slots return (after their copy, done at once on CPU)."""
    shape = RoutingShape(2, 16, 2)
    source = _source(shape, 8, "cpu", 3)
    pipe = TransferPipeline(source, np.uint8, depth=2)

    def drop_two():
        for n in (3, 5):
            assert pipe.snapshot(n).result().shape == (n, 2, 2)  # handle dropped right here

    caught = _collected_warnings(drop_two)
    assert len(caught) == 1 and "snapshot 0 was garbage collected" in str(caught[0].message)
    assert pipe.in_flight == 0
    source.fill_(11)
    with pipe.snapshot(8) as a, pipe.snapshot(2) as b:  # both slots are free again
        assert (a.result() == 11).all() and (b.result() == 11).all()
        assert (a.seq, b.seq) == (2, 3)
        with pytest.raises(RingFullError, match=r"seq \[2, 3\]"):
            pipe.snapshot(1)
    assert _collected_warnings(lambda: pipe.snapshot(1)) == [], "the warning repeats"
    assert pipe.in_flight == 0


def test_released_or_context_managed_handles_never_warn():
    pipe = TransferPipeline(torch.zeros(4, 1, 1, dtype=torch.int32), np.uint8, depth=1)

    def use():
        h = pipe.snapshot(4)
        h.result()
        h.release()
        with pipe.snapshot(2) as h2:
            h2.result()

    assert _collected_warnings(use) == []


def test_a_copy_false_view_keeps_its_handle_and_slot_alive():
    source = torch.arange(8, dtype=torch.int32).view(8, 1, 1)
    pipe = TransferPipeline(source, np.uint8, depth=1)
    views = []
    # a view of the view, the handle not kept: collecting must not drop the handle
    assert _collected_warnings(lambda: views.append(pipe.snapshot(8).result(copy=False)[2:])) == []
    with pytest.raises(RingFullError):
        pipe.snapshot(1)  # the slot still backs the view
    source.fill_(99)
    assert views[0].reshape(-1).tolist() == [2, 3, 4, 5, 6, 7] and not views[0].flags.writeable
    assert len(_collected_warnings(views.clear)) == 1  # the last view gone: now the handle is lost
    with pipe.snapshot(3) as h:
        assert (h.result() == 99).all()


def test_handles_dropped_and_released_from_many_threads_share_the_ring_safely():
    """Four threads take snapshots through a depth-2 ring, each dropping about half of its handles
    unreleased: every snapshot gets a slot no live handle holds, its rows are right, and every slot
    comes back."""
    shape = RoutingShape(2, 64, 2)
    source = _source(shape, 16, "cpu", 4)
    expected = source.numpy().astype(np.uint8)
    pipe = TransferPipeline(source, np.uint8, depth=2)
    live: set[int] = set()  # slot indices held by live handles
    lock = threading.Lock()
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(40):
            n = int(rng.integers(0, 17))
            h = pipe.snapshot(n, timeout=10.0)
            with lock:
                if h._slot.index in live:
                    errors.append(f"slot {h._slot.index} handed out twice")
                live.add(h._slot.index)
            if not np.array_equal(h.result(), expected[:n]):
                errors.append(f"snapshot {h.seq} returned wrong rows")
            with lock:
                live.discard(h._slot.index)
            if rng.integers(0, 2):
                h.release()
            del h  # dropped: reclaimed by a later snapshot()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DroppedSnapshotWarning)
        threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        gc.collect()
    assert not any(t.is_alive() for t in threads), "a snapshot() never got a slot back"
    assert errors == []
    assert pipe.in_flight == 0


def test_wait_and_result_timeouts():
    pipe = TransferPipeline(torch.ones(4, 1, 1, dtype=torch.int32), np.uint8, depth=1)
    with pipe.snapshot(4) as h:
        for timeout in (None, math.inf, 0, 0.0, 2.5, np.float32(1)):
            h.wait(timeout)  # CPU copies are done when snapshot() returns
            assert h.result(timeout=timeout).shape == (4, 1, 1)
        for bad, error, match in [
            (-1, ValueError, r"timeout must be None or seconds >= 0.*got -1"),
            (math.nan, ValueError, "timeout must be None or seconds >= 0"),
            (-math.inf, ValueError, "timeout must be None or seconds >= 0"),
            ("1", TypeError, "timeout must be None or a number of seconds, got str"),
            (True, TypeError, "got bool"),
        ]:
            with pytest.raises(error, match=match):
                h.wait(bad)
            with pytest.raises(error, match=match):
                h.result(timeout=bad)


def test_snapshot_timeout_none_and_inf_wait_for_a_release_and_bad_ones_take_no_slot():
    pipe = TransferPipeline(torch.zeros(4, 1, 1, dtype=torch.int32), np.uint8, depth=1)
    for forever in (None, math.inf):
        held = pipe.snapshot(1)
        threading.Timer(0.05, held.release).start()
        with pipe.snapshot(2, timeout=forever) as h:
            assert held.released and h.num_rows == 2
    for bad, error in [(-0.5, ValueError), (math.nan, ValueError), ("inf", TypeError)]:
        with pytest.raises(error, match="timeout must be None"):
            pipe.snapshot(1, timeout=bad)
        assert pipe.in_flight == 0
    with pipe.snapshot(1):  # the refused calls left the ring as it was
        assert pipe.in_flight == 1


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
def test_a_lost_handle_slot_is_reused_only_after_its_copy_gpu(cuda_device):
    """A handle dropped while its copy waits behind a busy copy stream: its slot stays out of the
    ring (no host sync in __del__ or in snapshot) until copy_done, then the next snapshot gets it."""
    source = torch.full((64, 2, 2), 5, dtype=torch.int32, device=cuda_device)
    pipe = TransferPipeline(source, np.uint8, depth=1)
    with pipe.snapshot(64) as warm:  # load every kernel first: lazy module loading may synchronise
        warm.result()
    sleep_ms(1)  # calibrates the sleep outside the timed part (the calibration synchronises)
    torch.cuda.synchronize()
    with torch.cuda.stream(pipe.copy_stream):
        # The copy stream is busy with an earlier transfer. Long, and no gc.collect() below: in a
        # full GPU-suite process a collection took long enough for a 300 ms sleep to end first.
        sleep_ms(3000)
        busy = torch.cuda.Event()
        busy.record()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DroppedSnapshotWarning)
        pipe.snapshot(64)  # dropped at once (its last reference), its copy queued behind the sleep
        start = time.perf_counter()
        with pytest.raises(RingFullError, match=r"lost handles seq \[1\] still copying"):
            pipe.snapshot(8)
        assert time.perf_counter() - start < 0.1, "snapshot(timeout=0) waited on the device"
        assert not busy.query(), "the sleep ended before the check: the test could not tell"
        source.fill_(7)
        with pipe.snapshot(8, timeout=10.0) as h:  # waits for the lost copy, then takes its slot
            assert (h.result() == 7).all()
    assert pipe.in_flight == 0


@pytest.mark.gpu
def test_wait_with_a_finite_timeout_raises_while_the_copy_is_in_flight_gpu(cuda_device):
    source = torch.full((32, 2, 2), 3, dtype=torch.int32, device=cuda_device)
    pipe = TransferPipeline(source, np.uint8, depth=1)
    with pipe.snapshot(32) as warm:
        warm.result()
    torch.cuda.synchronize()
    with torch.cuda.stream(pipe.copy_stream):
        sleep_ms(300)
    with pipe.snapshot(32) as h:
        start = time.perf_counter()
        with pytest.raises(TimeoutError, match=r"snapshot 1 \(32 rows\).*timeout=0.02 s"):
            h.wait(timeout=0.02)
        assert time.perf_counter() - start < 0.2
        with pytest.raises(TimeoutError, match="snapshot 1"):
            h.result(timeout=0)
        assert (h.result(timeout=math.inf) == 3).all()  # the handle stays usable


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
