"""The snapshot's D2H copy and event records as CUDA runtime calls (moe_ops._runtime.cudart).

CPU tests: the ``/proc/self/maps`` scan (a fabricated maps text and this process's real one), the
path decision of ``TransferPipeline(cudart=...)``, and, where a libcudart file exists on the
machine, the real library's bindings and error path (without a GPU every call fails, and the
failure must come back as RuntimeError carrying ``cudaGetErrorString``). GPU tests compare every
byte the runtime path delivers with the source (many row counts incl. 0, 1, bucket edges and
``max_rows``; three widths; stamps), check that host rows past ``n`` stay poisoned, that two
threads get their own rows, that a failed call leaves torch usable, and that a dropped pipeline
waits for its copies before its pinned memory goes back.
"""

from __future__ import annotations

import ctypes
import gc
import glob
import os
import re

import numpy as np
import pytest
import torch
from gpu_helpers import sleep_ms
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import bucket_row_counts
from threads import run_threads

from moe_ops import TransferPipeline
from moe_ops._runtime.cudart import CudaRuntime, find_loaded_libraries, find_loaded_library, load_cudart
from moe_ops.transfer.paths import COPY_PATHS, choose_copy_path

POISON = 0x5A  # neither a source id below 200 nor the stale fill

MAPS = """\
7f00a000-7f00b000 r--p 00000000 08:01 11 /venv/nvidia/cuda_runtime/lib/libcudart.so.12
7f00b000-7f00c000 r-xp 00001000 08:01 11 /venv/nvidia/cuda_runtime/lib/libcudart.so.12
7f00c000-7f00d000 r--p 00000000 08:01 12 /venv/tilelang/lib/libcudart_stub.so
7f00d000-7f00e000 r--p 00000000 08:01 13 /venv/cuda/bindings/_internal/runtime.cpython-311-x86_64-linux-gnu.so
7f00e000-7f00f000 r--p 00000000 08:01 14 /opt/my libs/cupy.libs/libcudart-1a2b3c4d.so.12.4.127
7f00f000-7f010000 rw-p 00000000 00:00 0
7f010000-7f011000 rw-p 00000000 00:00 0 [heap]
7f011000-7f012000 r--p 00000000 08:01 15 /usr/lib/libcudart.so.notanumber
7f012000-7f013000 r--p 00000000 08:01 16 /usr/lib/libcudart.so
"""


def test_maps_scan_takes_exactly_the_runtime_files_each_once():
    assert find_loaded_libraries("libcudart", MAPS) == [
        "/venv/nvidia/cuda_runtime/lib/libcudart.so.12",
        "/opt/my libs/cupy.libs/libcudart-1a2b3c4d.so.12.4.127",  # a path with a space
        "/usr/lib/libcudart.so",
    ]
    assert find_loaded_library("libcudart", MAPS) == "/venv/nvidia/cuda_runtime/lib/libcudart.so.12"
    assert find_loaded_library("libcudart", "") is None
    assert find_loaded_library("libcudart_stub", MAPS) == "/venv/tilelang/lib/libcudart_stub.so"
    # a name is matched whole: "libcuda" is not libcudart, and no line maps a libcuda file
    assert find_loaded_library("libcuda", MAPS) is None


def test_maps_scan_of_this_process_finds_the_libc_it_runs_on():
    path = find_loaded_library("libc")
    assert path is not None and os.path.isfile(path)
    assert ctypes.CDLL(path).getpid() == os.getpid()  # the loaded instance itself
    assert find_loaded_library("libmoe_ops_no_such_library") is None


@pytest.mark.parametrize(
    "cuda, cudart, loaded, want",
    [
        (True, None, True, "cudaMemcpyAsync"),
        (True, True, True, "cudaMemcpyAsync"),
        (True, False, True, "copy_"),
        (True, None, False, "copy_"),  # statically linked runtime: the fallback
        (True, False, False, "copy_"),
        (False, None, False, "cpu"),
        (False, False, False, "cpu"),
        (False, None, True, "cpu"),
    ],
)
def test_copy_path_decision(cuda, cudart, loaded, want):
    assert choose_copy_path(cuda, cudart, loaded) == want
    assert want in COPY_PATHS


def test_copy_path_decision_rejects_what_cannot_run():
    with pytest.raises(ValueError, match=r"cudart=True needs the CUDA runtime library \(libcudart\)"):
        choose_copy_path(True, True, False)
    with pytest.raises(ValueError, match="cudart=True needs a CUDA source, got a CPU one"):
        choose_copy_path(False, True, True)
    with pytest.raises(TypeError, match="cudart must be None, True or False, got int"):
        choose_copy_path(True, 1, True)


def test_cpu_pipeline_says_cpu_and_refuses_cudart_true():
    source = torch.arange(24, dtype=torch.int32).view(4, 3, 2)
    for cudart in (None, False):
        pipe = TransferPipeline(source, np.uint8, cudart=cudart)
        assert pipe.copy_path == "cpu"
        with pipe.snapshot(3) as h:
            assert np.array_equal(h.result(), source[:3].numpy().astype(np.uint8))
    with pytest.raises(ValueError, match="cudart=True needs a CUDA source"):
        TransferPipeline(source, np.uint8, cudart=True)
    with pytest.raises(TypeError, match="cudart must be None, True or False, got str"):
        TransferPipeline(source, np.uint8, cudart="yes")


def _runtime_files() -> list[str]:
    found = find_loaded_libraries("libcudart")
    for pattern in ("/usr/local/cuda*/lib*/libcudart.so*", "/usr/lib/x86_64-linux-gnu/libcudart.so*"):
        found += [
            p for p in sorted(glob.glob(pattern)) if re.fullmatch(r"libcudart\.so(\.\d+)*", p.split("/")[-1])
        ]
    return found


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU twin below checks the calls on a device")
def test_runtime_bindings_report_failures_with_the_runtime_message():
    """The real library without a GPU (or driver): every call fails, and says why."""
    files = _runtime_files()
    if not files:
        pytest.skip("no libcudart file on this machine")
    runtime = CudaRuntime(files[0])
    calls = {
        "cudaMemcpyAsync": lambda: runtime.memcpy_d2h_async(0, 0, 16, 0),
        "cudaEventRecord": lambda: runtime.event_record(0, 0),
        "cudaStreamWaitEvent": lambda: runtime.stream_wait_event(0, 0),
        "cudaGraphLaunch": lambda: runtime.graph_launch(0, 0),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError) as err:
            call()
        match = re.fullmatch(rf"{name} failed with cudaError (\d+): (.+)", str(err.value))
        assert match, str(err.value)
        code = int(match.group(1))
        assert code != 0 and match.group(2) == runtime.error_string(code)
    assert runtime.error_string(1) != runtime.error_string(2), "the messages come from the library"


# ----------------------------------------------------------------------------------------------- GPU

MAX_ROWS, LAYERS, TOP_K = 300, 5, 3  # max_rows not a power of two: the last bucket is capped


def _edge_rows(max_rows: int) -> list[int]:
    rows = {0, 1, max_rows - 1, max_rows}
    for k in range(max_rows.bit_length()):
        rows |= {2**k - 1, 2**k, 2**k + 1}
    return sorted(r for r in rows if 0 <= r <= max_rows)


def _pipeline(device, out_dtype=np.uint8, *, stamped=False, graphs=None, cudart=None, depth=2):
    g = torch.Generator().manual_seed(1)
    source = torch.randint(-1, 200, (MAX_ROWS, LAYERS, TOP_K), generator=g, dtype=torch.int32).to(device)
    stamps = step = None
    if stamped:
        stamps = torch.tensor([4, 3, 4, 1, 4], dtype=torch.int32, device=device)  # layers 1, 3 stale
        step = torch.tensor([4], dtype=torch.int32, device=device)
    return TransferPipeline(
        source, out_dtype, depth=depth, layer_stamps=stamps, step_tensor=step, graphs=graphs, cudart=cudart
    )


def _expected(pipe: TransferPipeline, n: int) -> np.ndarray:
    rows = pipe.source[:n].cpu().numpy().copy()
    if pipe.layer_stamps is not None:
        rows[:, (pipe.layer_stamps != pipe.step_tensor).cpu().numpy()] = -1
    return rows.astype(pipe.out_dtype)  # numpy's integer cast wraps like the device's


def _poison(pipe: TransferPipeline) -> None:
    for slot in pipe._ring.slots:
        slot.staging.fill_(POISON)
        slot.host.fill_(POISON)
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_a_cuda_pipeline_takes_the_runtime_path_where_torch_loaded_it(cuda_device):
    runtime = load_cudart()
    assert runtime is not None, "a CUDA build of torch maps libcudart (this test's premise)"
    assert runtime.path in find_loaded_libraries("libcudart")
    assert _pipeline(cuda_device).copy_path == "cudaMemcpyAsync"
    assert _pipeline(cuda_device, cudart=True).copy_path == "cudaMemcpyAsync"
    assert _pipeline(cuda_device, cudart=False).copy_path == "copy_"


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [np.uint8, np.uint16, np.int32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "direct"])
@pytest.mark.parametrize("stamped", [False, True], ids=["plain", "stamps"])
def test_runtime_copy_delivers_every_byte_and_nothing_past_n(cuda_device, out_dtype, graphs, stamped):
    pipe = _pipeline(cuda_device, out_dtype, stamped=stamped, graphs=graphs, cudart=True)
    peer = _pipeline(cuda_device, out_dtype, stamped=stamped, graphs=graphs, cudart=False)
    assert (pipe.copy_path, peer.copy_path) == ("cudaMemcpyAsync", "copy_")
    for n in _edge_rows(MAX_ROWS):
        _poison(pipe)
        want = _expected(pipe, n)
        with pipe.snapshot(n) as h, peer.snapshot(n) as p:
            got = h.result()
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), f"{n} rows"
            assert p.result().tobytes() == want.tobytes(), f"copy_ peer, {n} rows"
            assert (h._slot.host[n:] == POISON).all(), f"rows past {n} reached the host"


@pytest.mark.gpu
@settings(max_examples=30)
@given(data=st.data())
def test_runtime_copy_follows_the_source_at_any_row_count(data):
    pipe = _pipeline("cuda", stamped=True, depth=3)
    for _ in range(3):
        n = data.draw(bucket_row_counts(MAX_ROWS))
        pipe.guard_source()
        pipe.source.random_(0, 200)
        want = _expected(pipe, n)
        _poison(pipe)
        with pipe.snapshot(n) as h:
            assert np.array_equal(h.result(), want)
            assert (h._slot.host_np[n:] == POISON).all()


@pytest.mark.gpu
def test_two_threads_on_the_runtime_path_get_their_own_rows(cuda_device):
    pipe = _pipeline(cuda_device, stamped=True, depth=4, cudart=True)
    expected = _expected(pipe, MAX_ROWS)
    torch.cuda.synchronize()
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for _ in range(60):
                n = int(rng.choice(_edge_rows(MAX_ROWS)))
                h = pipe.snapshot(n, timeout=30.0)
                if not np.array_equal(h.result(), expected[:n]):
                    errors.append(f"snapshot {h.seq} ({n} rows) returned wrong rows")
                h.release()

    run_threads(worker, 2)
    assert errors == []
    assert pipe.in_flight == 0


@pytest.mark.gpu
def test_a_failed_runtime_call_raises_its_message_and_leaves_torch_usable(cuda_device):
    runtime = load_cudart()
    src = torch.zeros(16, dtype=torch.uint8, device=cuda_device)
    dst = torch.empty(16, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.current_stream().cuda_stream
    with pytest.raises(RuntimeError, match=r"cudaMemcpyAsync failed with cudaError \d+: .+"):
        runtime.memcpy_async(dst.data_ptr(), src.data_ptr(), 16, 99, stream)  # no such kind
    # the error was cleared: torch's next launch check does not report it
    assert torch.ones(4, device=cuda_device).sum().item() == 4


@pytest.mark.gpu
def test_snapshot_checks_its_stream_argument(cuda_device):
    pipe = _pipeline(cuda_device)
    with pytest.raises(TypeError, match=r"stream must be a torch\.cuda\.Stream or None, got str"):
        pipe.snapshot(3, stream="default")
    assert pipe.in_flight == 0


@pytest.mark.gpu
def test_a_dropped_pipeline_waits_for_its_copies_before_freeing_pinned_memory(cuda_device):
    pipe = _pipeline(cuda_device, cudart=True)
    done = pipe._ring.slots[0].copy_done
    with torch.cuda.stream(pipe.copy_stream):
        sleep_ms(200)  # the snapshot's copy runs after it
    pipe.snapshot(MAX_ROWS).release()
    assert not done.query()
    del pipe
    gc.collect()
    assert done.query(), "the pinned buffers went back while their copy was queued"
