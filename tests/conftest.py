"""Test setup: Triton interpretation on CPU-only machines, the `gpu` marker, hypothesis profiles, the
repository root on ``sys.path``, and the run's progress and skip summary (``suite_report.py``).

TRITON_INTERPRET must be set before any kernel module is imported (Triton decides at decoration
time), so it is set when collection starts, before the test modules import moe_ops. torch is
imported there too, not when this file loads: importing it takes 1.5 s warm and several cold, and
nothing can be printed before this file has loaded (pytest captures its output), so importing it
here kept the first line of the run that long. Hypothesis too (below).
"""

import os
import sys
from pathlib import Path

# Scalar C++ from inductor, in this process and in every process a test starts (they inherit it);
# set before torch loads its inductor config, which reads it once. A CI run (torch 2.13, CPU only)
# failed 29 compile tests with `at::vec has not been declared`: inductor generated vector code and
# then built it without the ISA flags, its ISA choice differing between code generation and build
# (not reproduced on the 2-core development machine; the choice rests on a compile-and-dlopen probe
# per process). The tests check moe-ops' ops under torch.compile, not inductor's CPU vectoriser;
# scalar code needs no probe and builds faster (the demo: 27 s of CPU instead of 42). A value the
# caller set is kept.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")


def _compile_cache_dir() -> str:
    """A torch.compile cache of this source tree's own. inductor's FX-graph cache keys a graph by its
    post-functionalization form, where a custom op's arguments are named, not ordered: code
    generated for an op's earlier schema (another checkout, an earlier commit) would be handed back
    with its arguments in the old order (seen: route_reference_'s `nonfinite` given the ids after
    the routing arguments were reordered). Keyed by the package's source; a value the caller set is
    kept."""
    import hashlib
    import tempfile

    digest = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for path in sorted((*root.glob("moe_ops/**/*.py"), *root.glob("graphs/*.py"))):
        digest.update(path.read_bytes())
    return os.path.join(tempfile.gettempdir(), f"torchinductor_moe_ops_{digest.hexdigest()[:16]}")


os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", _compile_cache_dir())

import pytest  # noqa: E402 - after the environment inductor reads at import

pytest_plugins = ["suite_report"]

# the tests that check the benchmarks' shapes import them from benchmarks/cases.py; `python -m pytest`
# has the working directory on sys.path, `pytest` does not. Appended: an installed package keeps its
# name. Spawned ranks inherit sys.path.
ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.append(ROOT)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _hypothesis_profiles() -> None:
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "default",
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        derandomize=False,
        print_blob=True,
    )
    settings.register_profile("quick", parent=settings.get_profile("default"), max_examples=20)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_collection(session):
    """Before the first test module is imported (suite_report's line about collection comes first:
    it is tryfirst): the hypothesis profiles (a test module's ``settings(...)`` inherit the profile
    loaded when it is imported), torch, and Triton interpreted where there is no CUDA device.
    Importing hypothesis here, not when this file loads: pytest rewrites the asserts of its 108
    modules (it is a pytest plugin's package), 1.1 s of the 1.2 s before the run's first line,
    measured with PYTHONDONTWRITEBYTECODE=1 (every run rewrites them then)."""
    _hypothesis_profiles()
    if not _has_cuda():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none found: torch.cuda.is_available() is False)")
    has_cuda = _has_cuda()
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture
def cuda_device():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny CPU ops: OpenMP workers only spin on a shared 2-core machine (see moe_ops/demo.py).
    Modules of tiny models use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
