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
  first use and then fixed for the process (thread-safe: concurrent first calls get one counter);
* :func:`routing_counters` / :func:`counters_for` - the routing ops' counters of one device
  (``"replay"``, ``"hash"``, ``"nonfinite"``: :data:`ROUTING_KINDS`), resolved together on the
  device's first use and kept: an op finds all of them with one dict lookup on its tensor's device.

Every device-wide kind, with its slots: ``"capture"`` (8, ``moe_ops.capture.errors``), ``"replay"``
(2), ``"hash"`` (2), ``"nonfinite"`` (1); ``moe_ops.check_faults`` reads them all in one report.

Thread safety: reads, resets and the ops' updates may run on any threads at once; every count is
reported by exactly one read.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = [
    "ROUTING_KINDS",
    "DeviceCounter",
    "RoutingCounters",
    "check_counter",
    "counters_for",
    "cpu_counter_lock",
    "device_counter",
    "existing_counter",
    "normalise_device",
    "read_counter",
    "routing_counters",
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
        if self.device.type == "meta":  # a counter of shapes only (fake tracing on meta): no count
            return [0] * self.tensor.numel()
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


def read_counter(
    kind: str, device: torch.device | str | int | None, *, reset: bool = True
) -> list[int] | None:
    """The slots of the device-wide counter of ``kind`` on ``device`` since the last reset (and,
    with ``reset``, subtracted from it), or None where it was never allocated (nothing recorded
    there). The one read behind every check (``moe_ops.check_faults`` and the per-kind views).

    HOST SYNC: :meth:`DeviceCounter.read` copies the slots from the device.
    """
    counter = existing_counter(kind, device)
    return None if counter is None else counter.read(reset=reset)


def check_counter(
    kind: str,
    device: torch.device | str | int | None,
    error: Callable[..., Exception],
    raise_error: bool,
) -> int:
    """Reads and resets the device-wide counter of ``kind`` on ``device`` (slot 0: rows counted) and
    returns slot 0 since the last read (0 where the counter was never allocated); with
    ``raise_error``, a nonzero slot 0 raises ``error(device, *slots)`` after the reset. The body of
    the per-kind views (``check_replay_errors``, ``check_hash_errors``, ``check_nonfinite_rows``),
    which keep their own docstrings and errors.

    HOST SYNC: :meth:`DeviceCounter.read` copies the slots from the device.
    """
    slots = read_counter(kind, device)
    if slots is None:
        return 0
    if raise_error and slots[0]:
        raise error(normalise_device(device), *slots)
    return slots[0]


# ---------------------------------------------------------------------------------------------------
# The routing ops' counters of one device, resolved once
# ---------------------------------------------------------------------------------------------------

# kind -> slots of the device-wide counters the routing ops add to
ROUTING_KINDS = {"replay": 2, "hash": 2, "nonfinite": 1}


class RoutingCounters(NamedTuple):
    """The device-wide counters the routing ops add to, of one device (each a persistent int32
    tensor, a static address)."""

    # (2,) [faulty replayed rows, OR of REPLAY_FAULT_* bits] (moe_ops.replay.op)
    replay: torch.Tensor
    # (2,) [faulty hash rows, OR of HASH_FAULT_* bits] (moe_ops.router.hash)
    hash: torch.Tensor
    # (1,) [rows whose weights were zeroed: not all finite] (moe_ops.router.nonfinite)
    nonfinite: torch.Tensor


_resolved_lock = threading.Lock()
# a tensor's device (already normalised: CUDA tensors carry their index) -> its counters
_resolved: dict[torch.device, RoutingCounters] = {}


def _resolve(device: torch.device) -> RoutingCounters:
    key = normalise_device(device)
    with _resolved_lock:
        counters = _resolved.get(key)
        if counters is None:
            counters = RoutingCounters(
                *(device_counter(kind, key, lambda d, n=n: DeviceCounter(n, d)).tensor
                  for kind, n in ROUTING_KINDS.items())
            )  # fmt: skip
            _resolved[key] = counters
        _resolved[device] = counters
    return counters


# Under torch.compile this runs at trace time, as plain Python, and the graph holds the counters as
# constants (a lock or an allocation traced by dynamo would break the graph).
@torch._dynamo.assume_constant_result
def routing_counters(device: torch.device | str | int | None = None) -> RoutingCounters:
    """The routing ops' device-wide counters of ``device``: allocated together on the device's
    first use, then the same tensors for the process (thread-safe). One dict lookup per call."""
    counters = _resolved.get(device) if isinstance(device, torch.device) else None
    return counters if counters is not None else _resolve(normalise_device(device))


def counters_for(like: torch.Tensor) -> RoutingCounters:
    """The counters an op on ``like`` adds to: :func:`routing_counters` of its device, or fresh
    stand-ins where ``like`` is fake (traced outside dynamo: FakeTensorMode, make_fx), which has no
    device counter to hand out."""
    if isinstance(like, FakeTensor):
        return RoutingCounters(
            *(torch.empty(n, dtype=torch.int32, device=like.device) for n in ROUTING_KINDS.values())
        )
    return routing_counters(like.device)
