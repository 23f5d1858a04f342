"""Running a test's worker on real threads (the thread-safety tests of the host-side objects)."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["run_threads"]


def run_threads(worker: Callable[[int], None], count: int, timeout: float = 120.0) -> None:
    """Runs ``worker(seed)`` for seeds ``0 .. count-1`` on ``count`` threads at once and joins them;
    AssertionError if one is still running after ``timeout`` seconds. A worker reports failures by
    appending to a list the test then checks (an exception in a thread would not fail the test)."""
    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "a worker thread did not finish in time"
