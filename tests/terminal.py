"""A command run on a real pseudo-terminal, read until a text appears: what a person at a terminal
sees first (the status lines draw on terminals only)."""

from __future__ import annotations

import os
import select
import subprocess
import time


def on_a_terminal(argv: list[str], until: str, *, cwd, env=None, timeout: float = 300) -> str:
    """Runs ``argv`` with stdin, stdout and stderr on one pseudo-terminal and returns what it wrote
    up to the first ``until`` (all of it if the command ends first); then ends the command. The
    timeout is a hang guard."""
    master, slave = os.openpty()
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env, close_fds=True)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while until.encode() not in out and time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the command ended and closed the terminal
                break
            if not chunk:
                break
            out += chunk
    finally:
        proc.kill()
        proc.wait()
        os.close(master)
    return out.decode(errors="replace")


def frames(text: str) -> list[str]:
    """Each line drawn, in order: the status line redraws with carriage returns."""
    return [f.strip() for f in text.replace("\n", "\r").split("\r") if f.strip()]
