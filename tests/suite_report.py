"""A pytest plugin (loaded by tests/conftest.py): progress from the first second, skips summed by reason.

Progress. Collecting the suite imports torch, Triton, transformers, Megatron-Core and FlashInfer
through 80-odd test modules: 19-25 s on the 2-core development machine with warm caches, minutes on
a fresh clone, in which pytest prints nothing (``-q``, or any run whose output is not a terminal).
So a line says when collection starts, and while it runs a line every ``COLLECT_EVERY_S`` seconds
gives the files and tests collected so far (off a terminal, and with ``-q``; a terminal without
``-q`` has pytest's own live count). Then pytest's own progress: a line per test file ending with
the percentage done. Off a terminal Python buffers stdout in 8 KiB blocks (unless PYTHONUNBUFFERED
is set), so a log could get minutes of that progress at once: the terminal is flushed after every
test.

Skips. The suite skips 744 tests on a CPU-only machine (GPU tests, and checks of devices or packages
that are absent), for 14 reasons; ``-ra`` listed them by location, 182 ``SKIPPED`` lines before the
result (a full run on the 2-core machine). Here they are summed by reason, most frequent first, each
with its count and its files (``-rs`` still lists every location). Failures and errors stay listed
one by one (``-rfE`` in pyproject.toml).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

# seconds between two progress lines while collecting (off a terminal, or with -q)
COLLECT_EVERY_S = 5.0
# a reason's files are named when there are at most this many; more: "N files"
MAX_FILES_NAMED = 3
# from this many test files on, the first line says how long collecting the whole suite takes
WHOLE_SUITE_FILES = 40


class SuiteReport:
    def __init__(self, config: pytest.Config):
        self.config = config
        self.started = 0.0
        self.last_line = 0.0
        self.files_total = 0
        self.files_done = 0
        self.tests = 0

    @property
    def terminal(self):
        return self.config.pluginmanager.get_plugin("terminalreporter")

    def _line(self, text: str) -> None:
        tr = self.terminal
        if tr is not None:
            tr.write_line(text)
            _flush(tr)

    # ----------------------------------------------------------------------------------- progress

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection(self, session: pytest.Session) -> None:
        self.started = self.last_line = time.perf_counter()
        self.files_total = _count_test_files(self.config)
        whole = (
            "; the whole suite takes about 20 s on 2 cores with warm caches, minutes on a fresh install"
            if self.files_total >= WHOLE_SUITE_FILES
            else ""
        )
        files = f"{self.files_total} file{'s' * (self.files_total != 1)}"
        self._line(
            f"collecting the tests of {files} (their imports: torch, Triton, transformers, "
            f"Megatron-Core, FlashInfer{whole}) ..."
        )

    def pytest_itemcollected(self, item: pytest.Item) -> None:
        self.tests += 1

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if not report.nodeid.endswith(".py"):
            return
        self.files_done += 1
        now = time.perf_counter()
        tr = self.terminal
        # pytest's own live count: on a terminal, without -q (isatty: a bool before pytest 8)
        live = tr is not None and bool(tr.isatty) and self.config.getoption("verbose") >= 0
        if live or now - self.last_line < COLLECT_EVERY_S:
            return
        self.last_line = now
        self._line(
            f"collecting: {self.files_done}/{self.files_total} files, {self.tests} tests, "
            f"{now - self.started:.0f} s"
        )

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        tr = self.terminal
        if tr is not None:
            _flush(tr)  # after the terminal reporter wrote this test's letter (trylast)

    # ------------------------------------------------------------------------------------- skips

    def pytest_terminal_summary(self, terminalreporter, exitstatus: int, config: pytest.Config) -> None:
        lines = skip_summary(terminalreporter.stats.get("skipped", []), config.rootpath)
        if not lines:
            return
        total = len(terminalreporter.stats.get("skipped", []))
        terminalreporter.write_sep("=", f"{total} skipped, by reason")
        for line in lines:
            terminalreporter.write_line(line)
        terminalreporter.write_line("(every skip with its file and line: add -rs)")


def _flush(tr) -> None:
    """Flushes the terminal reporter's stream, where the installed pytest's reporter has flush()."""
    flush = getattr(tr, "flush", None)
    if callable(flush):
        flush()


def _count_test_files(config: pytest.Config) -> int:
    """Test files under the paths pytest was given (testpaths when none): what collection imports."""
    patterns = config.getini("python_files") or ["test_*.py"]
    files = set()
    for arg in config.args:
        path = Path(str(arg).split("::")[0])
        if path.is_file():
            files.add(path.resolve())
        elif path.is_dir():
            for pattern in patterns:
                files.update(p.resolve() for p in path.rglob(pattern))
    return len(files)


def skip_reason(report, root: Path) -> tuple[str, str]:
    """(reason, file relative to ``root`` where it lies below it) of a skipped test or collector."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        path, _, reason = longrepr
    else:  # a skip reported another way: its text
        path, reason = report.fspath, str(longrepr)
    reason = str(reason)
    if reason.startswith("Skipped: "):
        reason = reason[len("Skipped: ") :]
    path = Path(str(path))
    if path.is_absolute() and path.is_relative_to(root):
        path = path.relative_to(root)
    return reason, path.as_posix()


def skip_summary(reports, root: Path) -> list[str]:
    """One line per skip reason: count, reason, files; most frequent first, then by reason."""
    counts: Counter[str] = Counter()
    files: dict[str, set[str]] = defaultdict(set)
    for report in reports:
        reason, path = skip_reason(report, root)
        counts[reason] += 1
        files[reason].add(path)
    width = len(str(max(counts.values()))) if counts else 1
    lines = []
    for reason, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        where = sorted(files[reason])
        named = ", ".join(where) if len(where) <= MAX_FILES_NAMED else f"{len(where)} files"
        lines.append(f"{count:>{width}}  {reason}  [{named}]")
    return lines


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SuiteReport(config), "moe-ops-suite-report")
