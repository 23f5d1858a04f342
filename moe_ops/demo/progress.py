"""The demo's progress: one status line on stderr, redrawn in place from the first second of a phase.

A phase that blocks the main thread for tens of seconds (inductor compiling the step on a cold cache:
43 s measured on 2 busy cores, in which a bar updated after each step drew nothing) still shows its
name and a running clock: a daemon thread redraws the line every ``interval`` seconds. The line is
drawn on a terminal only (``stream.isatty()``); elsewhere the class does nothing, so logs and pipes
get the tables alone. Host cost: one wake-up and one short write per interval, off the timed steps'
critical path (the steps hold the GIL; the redraw waits for a switch).
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

__all__ = ["StatusLine"]


class StatusLine:
    """One line of progress on ``stream`` (stderr by default), a terminal only.

    ``phase(text)`` starts a phase and draws it at once with its clock at 0 s; ``update(detail)``
    sets the text after it (a bar, a count); the clock keeps running between updates.
    ``with status.paused():`` clears the line and holds the redraws, to print a table. ``close()``
    (or leaving the ``with`` block) stops the thread and clears the line.
    """

    def __init__(self, enabled: bool = True, stream: TextIO | None = None, interval: float = 0.5):
        if not interval > 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval!r}")
        self.stream = sys.stderr if stream is None else stream
        isatty = getattr(self.stream, "isatty", None)
        # a line redrawn with carriage returns only makes sense on a terminal
        self.enabled = bool(enabled) and callable(isatty) and bool(isatty())
        self.interval = interval
        self.text = ""
        self.detail = ""
        self.started = time.perf_counter()
        self._lock = threading.Lock()
        self._held = 0
        # the first draw pads over the whole line: the command may have written there before
        self._width = shutil.get_terminal_size((100, 24)).columns - 1 if self.enabled else 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------- the phases

    def phase(self, text: str, detail: str = "") -> None:
        """Starts a phase: its text, drawn now, and a clock from 0 s."""
        with self._lock:
            self.text, self.detail, self.started = text, detail, time.perf_counter()
            self._draw()
        self._start_thread()

    def update(self, detail: str) -> None:
        """Sets the text after the phase's (drawn now)."""
        with self._lock:
            self.detail = detail
            self._draw()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Clears the line and holds every redraw inside the block (print a table there)."""
        with self._lock:
            self._clear()
            self._held += 1
        try:
            yield
        finally:
            with self._lock:
                self._held -= 1
                self._draw()

    def close(self) -> None:
        """Stops the redraws and clears the line; the status line can start again with phase()."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            self._clear()
            self.text = self.detail = ""
        self._stop.clear()

    def __enter__(self) -> StatusLine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------- internals

    def line(self) -> str:
        """The text drawn now: the phase's clock (first, so that a narrow terminal never cuts it
        off), its text and its detail."""
        elapsed = time.perf_counter() - self.started
        return f"  {elapsed:3.0f} s  {self.text}{' ' + self.detail if self.detail else ''}"

    def _start_thread(self) -> None:
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._tick, name="moe-ops-status", daemon=True)
            self._thread.start()

    def _tick(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                self._draw()

    def _draw(self) -> None:  # the lock is held
        if not self.enabled or self._held or not self.text:
            return
        columns = shutil.get_terminal_size((100, 24)).columns - 1
        text = self.line()[:columns]
        # pad over what the previous, longer line left
        self.stream.write("\r" + text + " " * max(0, self._width - len(text)))
        self.stream.flush()
        self._width = len(text)

    def _clear(self) -> None:  # the lock is held
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0
