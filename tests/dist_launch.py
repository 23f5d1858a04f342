"""Multi-process test launcher: a pool of torch.distributed ranks that runs tasks, with deadlines.

Starting a process and importing torch costs seconds, so a test module starts one :class:`RankPool`
per world size and runs many tasks on it (every hypothesis example is one task): a task is a
module-level function, called on every rank with the same arguments, whose per-rank return values
come back to the test process. The ranks rendezvous through a file (``init_method="file://..."``).

A hang fails a test instead of CI:

* every gloo collective has a timeout (``init_process_group(timeout=collective_timeout)``): a rank
  waiting for a peer that never comes raises, and its task reports the error;
* every task has a deadline: ranks that have not answered by then are killed, the pool is marked
  broken (:attr:`RankPool.broken`; the next :func:`pool_for` call starts a new one), and the test
  fails naming the ranks that hung;
* a rank that dies (a crash, a kill) is noticed at once, not at the deadline.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp

__all__ = ["RankFailure", "RankPool", "close_pools", "pool_for"]

# seconds: process start + import torch + init_process_group, four processes on two cores
START_TIMEOUT = 180.0
# seconds a gloo collective waits for its peers before it raises
COLLECTIVE_TIMEOUT = 60.0
# seconds one task may take on every rank (collective timeout + margin to report it)
TASK_TIMEOUT = COLLECTIVE_TIMEOUT + 30.0


@dataclass(frozen=True)
class RankFailure:
    """What a rank's task raised (returned by :meth:`RankPool.run` with ``allow_errors``)."""

    # global rank that raised
    rank: int
    # the exception's class name, e.g. "ValueError"
    type_name: str
    # str() of the exception
    message: str
    # the rank's formatted traceback
    traceback: str


def _serve(rank: int, world: int, backend: str, init_file: str, conn, collective_timeout: float) -> None:
    """A rank's loop: join the group, then run ``(fn, args)`` tasks until told to stop (None)."""
    import torch.distributed as dist

    # several ranks share two cores: OpenMP workers would only spin against each other
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=collective_timeout),
    )
    conn.send(("ready", None))
    try:
        while True:
            task = conn.recv()
            if task is None:
                break
            fn, args = task
            try:
                conn.send(("ok", fn(*args)))
            except BaseException as exc:
                conn.send(("error", RankFailure(rank, type(exc).__name__, str(exc), traceback.format_exc())))
    finally:
        dist.destroy_process_group()


class RankPool:
    """``world`` spawned ranks of one torch.distributed group (``backend`` "gloo" or "nccl"; NCCL
    puts rank ``r`` on GPU ``r``).

    Thread safety: one test thread drives a pool; tasks run one at a time.
    """

    def __init__(self, world: int, backend: str = "gloo", *, collective_timeout: float = COLLECTIVE_TIMEOUT):
        self.world = world
        self.backend = backend
        self.broken = False
        self._dir = tempfile.TemporaryDirectory(prefix="moe_ops_dist_")
        init_file = os.path.join(self._dir.name, "rendezvous")
        ctx = mp.get_context("spawn")
        self._conns = []
        self._procs = []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_serve,
                args=(rank, world, backend, init_file, child, collective_timeout),
                daemon=True,
                name=f"moe_ops-rank{rank}",
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        answers = self._collect(START_TIMEOUT, "start")
        not_ready = [r for r, a in enumerate(answers) if a[0] != "ready"]
        if not_ready:
            self.close()
            raise RuntimeError(f"ranks {not_ready} of {world} did not start: {answers}")

    def _collect(self, timeout: float, what: str) -> list[tuple[str, Any]]:
        """One answer per rank, or kill everything and fail naming the ranks that hung or died."""
        deadline = time.monotonic() + timeout
        answers: list[tuple[str, Any] | None] = [None] * self.world
        while any(a is None for a in answers):
            for rank, conn in enumerate(self._conns):
                if answers[rank] is not None:
                    continue
                if conn.poll():
                    try:
                        answers[rank] = conn.recv()
                    except EOFError:
                        answers[rank] = ("died", f"exit code {self._procs[rank].exitcode}")
                elif not self._procs[rank].is_alive():
                    answers[rank] = ("died", f"exit code {self._procs[rank].exitcode}")
            if any(a is None for a in answers):
                if time.monotonic() > deadline:
                    hung = [r for r, a in enumerate(answers) if a is None]
                    self._kill()
                    raise AssertionError(
                        f"{what}: ranks {hung} of {self.world} did not answer within {timeout:.0f} s "
                        f"(hung in a collective?); they were killed. Answers of the others: {answers}"
                    )
                time.sleep(0.002)
        died = [r for r, a in enumerate(answers) if a[0] == "died"]
        if died:
            self._kill()
            raise AssertionError(f"{what}: ranks {died} of {self.world} died: {answers}")
        return answers

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float = TASK_TIMEOUT, allow_errors: bool = False
    ) -> list[Any]:
        """Calls ``fn(*args)`` on every rank; returns the per-rank results, rank order.

        A rank whose call raised fails the test with its traceback (and breaks the pool: the ranks
        may be at different points of their collective sequence), unless ``allow_errors``: then
        its entry is a :class:`RankFailure` and the pool stays up. A rank that does not answer
        within ``timeout`` seconds (or dies) fails the test and breaks the pool.
        """
        if self.broken:
            raise RuntimeError("this pool was broken by an earlier hang: get a new one from pool_for")
        for conn in self._conns:
            conn.send((fn, args))
        answers = self._collect(timeout, getattr(fn, "__name__", "task"))
        results = [value for _, value in answers]
        failures = [v for status, v in answers if status == "error"]
        if failures and not allow_errors:
            # the ranks may now be at different points of their collective sequence: start afresh
            self._kill()
            text = "\n".join(
                f"--- rank {f.rank}: {f.type_name}: {f.message}\n{f.traceback}" for f in failures
            )
            raise AssertionError(f"{len(failures)} of {self.world} ranks raised:\n{text}")
        return results

    def _kill(self) -> None:
        self.broken = True
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=10)

    def close(self) -> None:
        """Stops every rank (killed if it does not exit within 30 s) and removes the rendezvous file."""
        if not self.broken:
            for conn in self._conns:
                with contextlib.suppress(BrokenPipeError, OSError):
                    conn.send(None)
            for proc in self._procs:
                proc.join(timeout=30)
        self._kill()
        self._dir.cleanup()


_POOLS: dict[tuple[int, str, float], RankPool] = {}


def pool_for(
    world: int, backend: str = "gloo", *, collective_timeout: float = COLLECTIVE_TIMEOUT
) -> RankPool:
    """The running pool of ``world`` ranks on ``backend`` whose collectives time out after
    ``collective_timeout`` seconds, started (or restarted after a hang or a close) on demand."""
    key = (world, backend, collective_timeout)
    pool = _POOLS.get(key)
    if pool is None or pool.broken:
        if pool is not None:
            pool.close()
        pool = _POOLS[key] = RankPool(world, backend, collective_timeout=collective_timeout)
    return pool


def close_pools() -> None:
    """Stops every pool :func:`pool_for` started."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.close()
