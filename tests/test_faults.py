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
from moe_ops import RoutingMethod, capture_routing, replay_routing
from moe_ops._runtime import faults
from moe_ops.capture.errors import FAULT_SLOT, FAULT_SOURCE_SHORT, FaultCounter, device_fault_counter
from moe_ops.replay import check_replay_errors, replay_fault_counter
from moe_ops.replay.kernels import REPLAY_FAULT_OUT_OF_RANGE, REPLAY_FAULT_REPEATED, REPLAY_FAULT_ROW_COUNT

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
        replay_rows_torch(logits, recorded, None, weights, ids, errors, 1, 1, 1, 1.0, row_count)
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
