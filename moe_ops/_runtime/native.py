"""C helpers of the package, compiled at first use with the system C compiler and loaded by ctypes.

A loop that numpy cannot vectorise (the compact indexer codec walks each row against the one before
it) runs 10-50x faster in C. The package ships the C source beside its Python twin and compiles it
the first time a caller asks (about 0.3 s), as Triton compiles its launchers: no build step, no
platform wheel, nothing at import. Without a compiler, with ``MOE_OPS_NATIVE=0`` or when the build
fails, :func:`load` returns None and says why in :func:`status`: the caller runs its numpy twin,
which writes the same bytes.

The library lands in ``MOE_OPS_CACHE_DIR`` (default ``$XDG_CACHE_HOME/moe_ops`` or
``~/.cache/moe_ops``; a per-user folder of the temp dir when that is not writable), named by a hash
of the source, the compiler and its flags; it is built under a temporary name and renamed, so
processes that build it at once never load a half-written file. Thread-safe: one build per source
per process, under a lock.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading

__all__ = ["load", "status"]

_FLAGS = ("-O3", "-std=c99", "-shared", "-fPIC")
# a hang guard: the codec builds in about 0.3 s on a 2-core machine
_BUILD_TIMEOUT_S = 120
_lock = threading.Lock()
# source path -> the loaded library, or None when it could not be built
_loaded: dict[str, ctypes.CDLL | None] = {}
# source path -> why it is not loaded (absent when it is)
_why: dict[str, str] = {}


def _cache_dir() -> str:
    root = os.environ.get("MOE_OPS_CACHE_DIR")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "moe_ops")
    try:
        os.makedirs(root, exist_ok=True)
        if os.access(root, os.W_OK):
            return root
    except OSError:
        pass
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    root = os.path.join(tempfile.gettempdir(), f"moe_ops-{uid}")
    os.makedirs(root, exist_ok=True)
    return root


def _build(source: str) -> ctypes.CDLL:
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise OSError(f"no C compiler: {compiler!r} is not on PATH (set CC)")
    with open(source, "rb") as f:
        text = f.read()
    digest = hashlib.sha256(text + repr((compiler, _FLAGS)).encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(source))[0]
    folder = _cache_dir()
    target = os.path.join(folder, f"{stem}-{digest}.so")
    if not os.path.exists(target):
        fd, partial = tempfile.mkstemp(prefix=f".{stem}-", suffix=".so", dir=folder)
        os.close(fd)
        try:
            run = subprocess.run(
                [compiler, *_FLAGS, "-o", partial, source],
                capture_output=True,
                text=True,
                timeout=_BUILD_TIMEOUT_S,
            )
            if run.returncode != 0:
                raise OSError(f"{compiler} failed on {os.path.basename(source)}: {run.stderr.strip()[-400:]}")
            os.replace(partial, target)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    return ctypes.CDLL(target)


def load(source: str) -> ctypes.CDLL | None:
    """The library built from the C file ``source`` (an absolute path), or None: disabled
    (``MOE_OPS_NATIVE=0``), no compiler, or the build failed (:func:`status` says which). Built once
    per process; later calls return the same object."""
    lib = _loaded.get(source, False)
    if lib is not False:
        return lib
    with _lock:
        if source in _loaded:
            return _loaded[source]
        if os.environ.get("MOE_OPS_NATIVE", "1") == "0":
            _why[source] = "disabled by MOE_OPS_NATIVE=0"
            lib = None
        else:
            try:
                lib = _build(source)
            except (OSError, subprocess.SubprocessError) as exc:
                _why[source] = f"{type(exc).__name__}: {exc}"
                lib = None
        _loaded[source] = lib
        return lib


def status(source: str) -> str:
    """ "native" when ``source`` is loaded, else why not ("not built yet" before the first load)."""
    if _loaded.get(source) is not None:
        return "native"
    return _why.get(source, "not built yet")
