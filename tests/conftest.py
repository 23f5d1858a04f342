"""Test setup: Triton interpretation on CPU-only machines, the `gpu` marker, hypothesis profiles, the
repository root on ``sys.path``.

TRITON_INTERPRET must be set before any kernel module is imported (Triton decides at decoration
time), so it is set here, before the test modules import moe_ops.
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

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from hypothesis import HealthCheck, settings

# the tests that check the benchmarks' shapes import them from benchmarks/cases.py; `python -m pytest`
# has the working directory on sys.path, `pytest` does not. Appended: an installed package keeps its
# name. Spawned ranks inherit sys.path.
ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.append(ROOT)

HAS_CUDA = torch.cuda.is_available()

settings.register_profile(
    "default",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=False,
    print_blob=True,
)
settings.register_profile("quick", parent=settings.get_profile("default"), max_examples=20)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none found: torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture
def cuda_device():
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny CPU ops: OpenMP workers only spin on a shared 2-core machine (see moe_ops/demo.py).
    Modules of tiny models use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
