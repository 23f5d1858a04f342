"""The package's one device-side fault counter: what the capture, replay and distributed ops record
into when a fault only shows on the device (a count larger than its rows, an id out of range) and
raising would need a host sync.

A counter is a persistent (slots,) int32 tensor on one device that kernels only ever add to (or OR
bits into); each stage gives its slots a meaning and its own report and error (``capture.errors``:
:class:`~moe_ops.capture.errors.FaultCounter`, per capturer or device-wide; ``replay.op``: the
device-wide replay counter, ``[faulty rows, OR of REPLAY_FAULT_* bits]``). What is shared, here:

* :func:`normalise_device` - ``None`` is the current CUDA device (else the CPU), ``"cuda"`` gets
  its index, so one device has one key;
* :func:`cpu_counter_lock` - the one lock discipline. On the CPU the counters are updated by Python
  code (the PyTorch twins, the Triton interpreter, small torch ops): every update and every read
  holds this one re-entrant lock, so each is atomic with respect to the others. On CUDA the
  kernels update with atomics and the host's reset is an atomic ``index_add_``: no lock for the
  updates; reads of one counter still take turns (its own lock), each waiting for its subtraction
  before the next reads, or two checks at once would both report the same counts and drive the
  counter negative;
* :class:`DeviceCounter` - the tensor (allocated once, a static address for CUDA graphs and
  inductor's graph trees) and :meth:`DeviceCounter.read`, which copies the slots to the host and
  then SUBTRACTS what it read: an increment that lands between the read and the reset stays for the
  next read instead of being zeroed. A slot of OR-ed bits is subtracted too, which clears the bits
  read and keeps a bit set since (a bit OR-ed again while it was already set was reported by this
  read: its count, if it lands after the read, is reported by the next read, possibly without it);
* :func:`device_counter` - the device-wide registry, one counter per (device, kind), allocated on
  first use and then fixed for the process (thread-safe: concurrent first calls get one counter).

Thread safety: reads, resets and the ops' updates may run on any threads at once; every count is
reported by exactly one read.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = [
    "DeviceCounter",
    "cpu_counter_lock",
    "device_counter",
    "existing_counter",
    "normalise_device",
]

# CPU counters: every update and every read-and-subtract holds it. Re-entrant: a launcher that holds
# it may call a twin that takes it again.
_cpu_lock = threading.RLock()
_no_lock = contextlib.nullcontext()


def cpu_counter_lock(device: torch.device) -> contextlib.AbstractContextManager:
    """The lock an update of a counter on ``device`` holds: the one CPU lock, a no-op off the CPU
    (where kernels update counters with atomics)."""
    return _cpu_lock if device.type == "cpu" else _no_lock


def normalise_device(device: torch.device | str | int | None) -> torch.device:
    """``device`` as a registry key: None is the current CUDA device (the CPU without CUDA), and a
    CUDA device without an index gets the current one."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class DeviceCounter:
    """A persistent (slots,) int32 counter on one device (see the module docstring).

    Args:
        slots: how many int32 slots.
        device: where the counter lives (see :func:`normalise_device`).

    Attributes:
        tensor: (slots,) int32 on ``device`` - what the kernels add to; never reallocated and
            marked as a static address (CUDA graphs and inductor's graph trees bake it).
    """

    def __init__(self, slots: int, device: torch.device | str | int | None = None):
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {slots!r}")
        self.device = normalise_device(device)
        self.tensor = torch.zeros(slots, dtype=torch.int32, device=self.device)
        torch._dynamo.mark_static_address(self.tensor)
        self._slots = torch.arange(slots, device=self.device)
        # off the CPU, reads of this counter take turns (on the CPU, cpu_counter_lock serialises them)
        self._read_lock = threading.Lock()

    def read(self, *, reset: bool = True) -> list[int]:
        """The slots' values; with ``reset``, subtracts them from the counter, losing no increment
        that lands meanwhile (an atomic ``index_add_`` on CUDA, under :func:`cpu_counter_lock` on
        the CPU). Concurrent reads take turns: each count is reported by one of them.

        HOST SYNC: copies the slots from the device, which waits for the work queued before it on
        the current stream, and, where it subtracts on CUDA, waits for the subtraction (a read on
        another stream must not see the counts again). Call it where the host already
        synchronises, never inside a captured or compiled step.
        """
        cpu = self.device.type == "cpu"
        with cpu_counter_lock(self.device) if cpu else self._read_lock:
            values = self.tensor.tolist()
            if reset and any(values):
                delta = torch.tensor([-v for v in values], dtype=torch.int32, device=self.device)
                # atomic on CUDA, so kernels on other streams that add meanwhile are not lost
                self.tensor.index_add_(0, self._slots, delta)
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()
        return values

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device}, slots={self.tensor.numel()})"


C = TypeVar("C", bound=DeviceCounter)

_registry_lock = threading.Lock()
# (device, kind) -> the device-wide counter of that kind
_registry: dict[tuple[torch.device, str], DeviceCounter] = {}


def device_counter(
    kind: str, device: torch.device | str | int | None, make: Callable[[torch.device], C]
) -> C:
    """The device-wide counter of ``kind`` (``"capture"``, ``"replay"``) on ``device``: ``make(device)``
    on first use, then the same object for the process."""
    key = (normalise_device(device), kind)
    counter = _registry.get(key)
    if counter is None:
        with _registry_lock:
            counter = _registry.get(key)
            if counter is None:
                counter = make(key[0])
                _registry[key] = counter
    return counter  # type: ignore[return-value]


def existing_counter(kind: str, device: torch.device | str | int | None) -> DeviceCounter | None:
    """The device-wide counter of ``kind`` on ``device`` if one was allocated, else None (a check
    of a device nothing recorded on allocates nothing)."""
    return _registry.get((normalise_device(device), kind))


def check_counter(
    kind: str,
    device: torch.device | str | int | None,
    error: Callable[..., Exception],
    raise_error: bool,
) -> int:
    """Reads and resets the device-wide counter of ``kind`` on ``device`` (slot 0: rows counted) and
    returns slot 0 since the last read (0 where the counter was never allocated); with
    ``raise_error``, a nonzero slot 0 raises ``error(device, *slots)`` after the reset. The one
    body of the device-wide checks (``check_replay_errors``, ``check_hash_errors``,
    ``check_nonfinite_rows``), which keep their own docstrings and errors.

    HOST SYNC: :meth:`DeviceCounter.read` copies the slots from the device.
    """
    counter = existing_counter(kind, device)
    if counter is None:
        return 0
    slots = counter.read(reset=True)
    if raise_error and slots[0]:
        raise error(counter.device, *slots)
    return slots[0]


def counter_or_stand_in(
    like: torch.Tensor, slots: int, counter: Callable[[torch.device], torch.Tensor]
) -> torch.Tensor:
    """The counter an op on ``like`` adds to: ``counter(like.device)``, or a fresh (``slots``,)
    int32 stand-in where ``like`` is fake (traced outside dynamo: FakeTensorMode, make_fx), which
    has no device counter to hand out."""
    if isinstance(like, FakeTensor):
        return torch.empty(slots, dtype=torch.int32, device=like.device)
    return counter(like.device)
