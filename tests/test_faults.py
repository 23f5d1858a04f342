"""The package's one fault counter (``moe_ops._runtime.faults``): the capture, replay and
distributed ops record into counters of one registry, under one CPU lock, and a read subtracts what
it read, so no increment is lost to a concurrent reset (real threads)."""

from __future__ import annotations

import threading

import pytest
import torch
from threads import run_threads
from torch.utils._python_dispatch import TorchDispatchMode

import moe_ops.distributed  # noqa: F401 - registers moe_ops::clamp_counts_
from moe_ops import (
    CaptureFaultError,
    FaultsError,
    NonFiniteRowsError,
    RoutingCapturer,
    RoutingMethod,
    RoutingShape,
    capture_routing,
    check_faults,
    replay_routing,
    route,
)
from moe_ops._runtime import faults
from moe_ops.capture.errors import FAULT_SLOT, FAULT_SOURCE_SHORT, FaultCounter, device_fault_counter
from moe_ops.replay import check_replay_errors, replay_fault_counter
from moe_ops.replay.kernels import REPLAY_FAULT_OUT_OF_RANGE, REPLAY_FAULT_REPEATED, REPLAY_FAULT_ROW_COUNT
from moe_ops.replay.op import ReplayFaultError
from moe_ops.router.hash import HashFaultError

CPU = torch.device("cpu")


def test_capture_and_replay_counters_live_in_one_registry():
    capture = device_fault_counter("cpu")
    replay = replay_fault_counter("cpu")
    assert faults.existing_counter("capture", CPU) is capture
    assert faults.existing_counter("replay", CPU).tensor is replay
    assert isinstance(capture, faults.DeviceCounter) and capture.tensor.shape == (8,)
    assert replay.shape == (2,) and replay.dtype == torch.int32
    # None is the current CUDA device, else the CPU: the same key
    if not torch.cuda.is_available():
        assert replay_fault_counter(None) is replay and device_fault_counter(None) is capture


def test_a_device_nothing_recorded_on_has_no_counter():
    assert faults.existing_counter("replay", "meta") is None
    assert check_replay_errors("meta") == 0


def test_read_subtracts_what_it_read_under_real_threads():
    """Writers add under the CPU lock while a reader reads and resets in a loop: the reads add up
    to every increment (a reset that zeroed would drop those that land between read and reset)."""
    counter = faults.DeviceCounter(2, "cpu")
    writers, adds = 4, 400
    seen = [0, 0]
    done = threading.Event()

    def worker(seed: int) -> None:
        if seed == writers:  # the reader
            while not done.is_set():
                a, b = counter.read(reset=True)
                seen[0] += a
                seen[1] |= b
            return
        for _ in range(adds):
            with faults.cpu_counter_lock(CPU):
                counter.tensor[0] += 1
                counter.tensor[1] |= 1 << seed

    def run(seed: int) -> None:
        try:
            worker(seed)
        finally:
            if seed == 0:
                done.set()

    # writer 0 sets `done` when it ends; the others may still be writing: read what is left after
    run_threads(run, writers + 1)
    a, b = counter.read(reset=True)
    assert seen[0] + a == writers * adds
    assert seen[1] | b == (1 << writers) - 1
    assert counter.tensor.tolist() == [0, 0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_overlapping_reads_report_each_count_once(device):
    """Two checks at once: the first read pauses between its copy and its subtraction while the
    second reads. Each count is reported by one of them and the counter ends at zero (reads that
    did not take turns off the CPU both reported [5, 4] and left the counter at [-5, -4])."""
    counter = faults.DeviceCounter(2, device)
    counter.tensor.copy_(torch.tensor([5, 4], dtype=torch.int32))
    copy = torch.Tensor.tolist
    first_copied, second_done = threading.Event(), threading.Event()

    def first_pauses() -> list[int]:
        values = copy(counter.tensor)
        if not first_copied.is_set():  # the first read's copy: let the second read run now
            first_copied.set()
            # a second read that takes turns is blocked until this one subtracted: it cannot end here
            second_done.wait(timeout=1.0)
        return values

    counter.tensor.tolist = first_pauses  # the instance's copy (read() calls self.tensor.tolist())
    got: dict[int, list[int]] = {}

    def worker(seed: int) -> None:
        if seed == 0:
            got[0] = counter.read(reset=True)
        else:
            first_copied.wait(timeout=60)
            got[1] = counter.read(reset=True)
            second_done.set()

    run_threads(worker, 2)
    assert sorted(got) == [0, 1]
    assert got[0][0] + got[1][0] == 5
    assert got[0][1] + got[1][1] == 4  # the bit reported once
    assert copy(counter.tensor) == [0, 0]


class _CountSlotWrites(TorchDispatchMode):
    """Records the in-place ops that write a view of ``counter`` starting at its count slot (0)."""

    def __init__(self, counter: torch.Tensor):
        super().__init__()
        self.storage = counter.untyped_storage().data_ptr()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = func._schema.arguments[0] if func._schema.arguments else None
        written = first is not None and first.alias_info is not None and first.alias_info.is_write
        t = args[0] if args else None
        mine = isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == self.storage
        if written and mine and t.storage_offset() == 0:
            self.ops.append(func.__name__)
        return out


def test_replay_updates_add_the_count_atomically():
    """The replay twin and the replayer's row-count check add to the count slot with index_add_,
    an atomic add on CUDA as the kernels' atomic_add (a read-modify-write such as ``add_`` on a
    view of slot 0 would write back over a check's subtraction or another stream's increment that
    lands between its load and its store)."""
    from moe_ops.replay.kernels import replay_rows_torch
    from moe_ops.replay.replayer import _check_rows

    errors = torch.zeros(2, dtype=torch.int32)
    logits = torch.randn(3, 8)
    recorded = torch.tensor([[0, 9], [1, 2], [3, 3]], dtype=torch.int32)  # 2 faulty rows
    weights = torch.empty(3, 2)
    ids = torch.empty(3, 2, dtype=torch.int32)
    row_count = torch.tensor([4], dtype=torch.int32)  # 3 rows read of a batch of 4: one more
    with _CountSlotWrites(errors) as seen:
        replay_rows_torch(
            router_logits=logits, recorded_ids=recorded, weights=weights, ids=ids, errors=errors,
            nonfinite=None, row_count=row_count, bias=None, hash_table=None, token_ids=None,
            method=1, n_group=1, topk_group=1, routed_scaling_factor=1.0, unnormalized=False, group_top=2,
        )  # fmt: skip
        _check_rows(row_count, 3, errors)
    assert errors.tolist() == [4, REPLAY_FAULT_OUT_OF_RANGE | REPLAY_FAULT_REPEATED | REPLAY_FAULT_ROW_COUNT]
    assert seen.ops and set(seen.ops) == {"index_add_.default"}, seen.ops


def test_a_held_cpu_lock_holds_every_stage_update():
    """One lock discipline: while a thread holds the CPU counters' lock, a replay twin, the
    replayer's row-count check, a capture and the distributed count clamp all wait for it (no
    update can interleave with a read-and-subtract), and land once it is released."""
    check_replay_errors("cpu", raise_error=False)
    capture = FaultCounter("cpu")
    logits = torch.randn(3, 8)
    recorded = torch.tensor([[0, 9], [1, 2], [3, 3]], dtype=torch.int32)  # 9: out of range; 3 twice
    buffer = torch.full((4, 2, 2), -7, dtype=torch.int32)
    counts = torch.tensor([5], dtype=torch.int32)  # 5 rows claimed, 3 there: one clamped call

    calls = {
        "replay twin": lambda: replay_routing(logits, recorded, RoutingMethod.RENORMALIZE, backend="torch"),
        "replay row check": lambda: torch.ops.moe_ops.replay_check_rows_(
            torch.tensor([4], dtype=torch.int32), 3, replay_fault_counter("cpu")
        ),
        "capture": lambda: capture_routing(buffer, recorded, 1, token_counts=counts, fault_counter=capture),
        "clamp counts": lambda: torch.ops.moe_ops.clamp_counts_(
            torch.tensor([9], dtype=torch.int32),
            torch.tensor([4], dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32),
            capture.tensor,
            0,
        ),
    }
    finished: dict[str, threading.Event] = {name: threading.Event() for name in calls}
    lock = faults.cpu_counter_lock(CPU)
    with lock:
        threads = [
            threading.Thread(target=lambda n=n, f=f: (f(), finished[n].set())) for n, f in calls.items()
        ]
        for t in threads:
            t.start()
        # each call takes a few ms unblocked; a second without one finishing is the lock holding them
        early = [n for n, e in finished.items() if e.wait(timeout=1.0 / len(calls))]
        replay_before = replay_fault_counter("cpu").tolist()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a call did not finish after the lock was released"
    assert early == [], f"updated the counters while the CPU counters' lock was held: {early}"
    assert replay_before == [0, 0]
    # landed after the release: 2 faulty rows + 1 wrong row count; capture's clamps
    assert check_replay_errors("cpu", raise_error=False) == 3
    report = capture.read_and_reset()
    assert report.flags & FAULT_SOURCE_SHORT and report.calls == 2
    assert capture.tensor[FAULT_SLOT[FAULT_SOURCE_SHORT]].item() == 0


def test_replay_checks_lose_no_fault_while_replays_run():
    """Real threads: replays of faulty rows (the twin; and the interpreted Triton kernel where it
    runs on the CPU) while another thread checks in a loop: the checks add up to every faulty row."""
    from moe_ops._runtime.triton import triton_runs_on

    backends = ["torch", "triton"] if triton_runs_on(CPU) else ["torch"]
    check_replay_errors("cpu", raise_error=False)
    logits = torch.randn(4, 8)
    recorded = torch.tensor([[0, 8], [1, 2], [3, 3], [-1, -1]], dtype=torch.int32)  # 2 faulty rows
    per_backend = {"torch": 30, "triton": 3}
    writers = 2 * len(backends)
    seen = []
    stop = threading.Event()
    finished = threading.Semaphore(0)

    def worker(seed: int) -> None:
        if seed == writers:
            while not stop.is_set():
                seen.append(check_replay_errors("cpu", raise_error=False))
            return
        backend = backends[seed % len(backends)]
        try:
            for _ in range(per_backend[backend]):
                replay_routing(logits, recorded, RoutingMethod.RENORMALIZE, backend=backend)
        finally:
            finished.release()

    def watch() -> None:
        for _ in range(writers):
            finished.acquire(timeout=300)
        stop.set()

    watcher = threading.Thread(target=watch)
    watcher.start()
    run_threads(worker, writers + 1, timeout=600)
    watcher.join(timeout=60)
    expected = 2 * sum(per_backend[backends[s % len(backends)]] for s in range(writers))
    assert sum(seen) + check_replay_errors("cpu", raise_error=False) == expected
    assert replay_fault_counter("cpu").tolist() == [0, 0]


# ---------------------------------------------------------------------------------------------------
# check_faults: every kind in one report
# ---------------------------------------------------------------------------------------------------


def _record_one_fault_of_each_kind(capturer: RoutingCapturer) -> None:
    """One call per kind on the CPU, each counting a known number of faults."""
    logits = torch.randn(3, 8)
    # replay: 2 faulty rows (9 out of range, 3 twice), routed live
    recorded = torch.tensor([[0, 9], [1, 2], [3, 3]], dtype=torch.int32)
    replay_routing(logits, recorded, RoutingMethod.RENORMALIZE, backend="torch")
    # hash: a token id outside the table's vocabulary (rows 1 and 2)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    route(logits, 2, hash_table=table, token_ids=torch.tensor([0, 5, -1]), backend="torch")
    # non-finite rows: one row whose chosen logits include a NaN
    bad = logits.clone()
    bad[1] = float("nan")
    route(bad, 2, backend="torch")
    # capture, device-wide counter: 5 rows claimed where 3 are: one clamped call
    buffer = torch.full((8, 2, 2), -1, dtype=torch.int32)
    capture_routing(buffer, recorded, 0, token_counts=torch.tensor([5], dtype=torch.int32))
    # capture, the capturer's own counter: an id that does not fit int16 (one id refused)
    capturer.set_step([1])
    capturer.capture(0, torch.tensor([[0, 40000]], dtype=torch.int32))


def test_check_faults_reports_every_kind_once_and_resets_them():
    check_faults("cpu", raise_error=False)  # what earlier tests left
    capturer = RoutingCapturer(RoutingShape(num_layers=2, num_experts=8, top_k=2), 4, "cpu", torch.int16)
    _record_one_fault_of_each_kind(capturer)
    with pytest.raises(FaultsError) as caught:
        check_faults("cpu", capturers=[capturer])
    summary = caught.value.summary
    assert summary.device == CPU
    assert (summary.replay_rows, summary.replay_flags) == (
        2,
        REPLAY_FAULT_OUT_OF_RANGE | REPLAY_FAULT_REPEATED,
    )
    assert summary.hash_rows == 2 and summary.hash_flags
    assert summary.nonfinite_rows == 1
    assert (summary.capture.calls, summary.capture.flags) == (1, FAULT_SOURCE_SHORT)
    assert len(summary.capturers) == 1 and summary.capturers[0].bad_ids == 1
    assert summary.total == 2 + 2 + 1 + 1 + 1
    kinds = [type(e) for e in caught.value.errors]
    assert kinds == [
        CaptureFaultError,
        CaptureFaultError,
        ReplayFaultError,
        HashFaultError,
        NonFiniteRowsError,
    ]
    assert str(caught.value) == "\n".join(str(e) for e in caught.value.errors)
    # read and reset: nothing left for the next check nor for the per-kind views
    assert check_faults("cpu", capturers=[capturer]).total == 0
    assert check_replay_errors("cpu") == 0 and capturer.check_errors() == 0


def test_check_faults_without_raising_and_on_a_device_nothing_ran_on():
    capturer = RoutingCapturer(RoutingShape(num_layers=2, num_experts=8, top_k=2), 4, "cpu", torch.int16)
    _record_one_fault_of_each_kind(capturer)
    summary = check_faults("cpu", capturers=[capturer], raise_error=False)
    assert summary.total == 7
    # a device nothing ran on (no counter allocated), and meta, whose counters hold no values
    empty = check_faults("cuda:7")
    assert empty.total == 0 and empty.device == torch.device("cuda", 7)
    meta = faults.DeviceCounter(2, "meta")
    assert meta.read() == [0, 0]
    assert check_faults("meta").total == 0
    with pytest.raises(TypeError, match="capturers must hold capturers with a fault_counter"):
        check_faults("cpu", capturers=[object()])


def test_the_per_kind_checks_are_views_of_check_faults_counters():
    """A per-kind check reads and resets its kind only: check_faults then reports the others."""
    from moe_ops.router.hash import check_hash_errors

    check_faults("cpu", raise_error=False)
    capturer = RoutingCapturer(RoutingShape(num_layers=2, num_experts=8, top_k=2), 4, "cpu", torch.int16)
    _record_one_fault_of_each_kind(capturer)
    assert check_hash_errors("cpu", raise_error=False) == 2
    summary = check_faults("cpu", raise_error=False)
    assert summary.hash_rows == 0 and summary.replay_rows == 2 and summary.nonfinite_rows == 1


def test_check_faults_loses_no_fault_under_real_threads():
    """Threads recording replay and non-finite faults while another calls check_faults in a loop:
    the reports add up to every fault recorded."""
    check_faults("cpu", raise_error=False)
    logits = torch.randn(4, 8)
    logits[3] = float("nan")  # one non-finite row per call (the live row)
    recorded = torch.tensor([[0, 8], [1, 2], [3, 3], [-1, -1]], dtype=torch.int32)  # 2 faulty rows
    writers, calls = 3, 20
    seen = {"replay": 0, "nonfinite": 0}
    stop = threading.Event()
    done = threading.Semaphore(0)

    def worker(seed: int) -> None:
        if seed == writers:
            while not stop.is_set():
                summary = check_faults("cpu", raise_error=False)
                seen["replay"] += summary.replay_rows
                seen["nonfinite"] += summary.nonfinite_rows
            return
        try:
            for _ in range(calls):
                replay_routing(logits, recorded, RoutingMethod.RENORMALIZE, backend="torch")
        finally:
            done.release()

    def watch() -> None:
        for _ in range(writers):
            done.acquire(timeout=300)
        stop.set()

    watcher = threading.Thread(target=watch)
    watcher.start()
    run_threads(worker, writers + 1, timeout=600)
    watcher.join(timeout=60)
    last = check_faults("cpu", raise_error=False)
    assert seen["replay"] + last.replay_rows == 2 * writers * calls
    assert seen["nonfinite"] + last.nonfinite_rows == writers * calls
