"""Transfer path costs: bytes per step, D2H bandwidth, compute slowdown, store and wire throughput.

Each number is a ratio against a floor or peer measured in the same run:

- bytes per step of 8192 tokens x 61 layers x 8 ids: int32 vs the narrow dtype (uint8 for 256
  experts); with the weights channel on (always measured: a float16 channel beside the
  ids in the ring, bfloat16 on moe-ops' wire, float32 in vLLM's ``routed_expert_weights``), the
  bytes of ids + weights per step on the ring and on each wire.
- D2H with the weights channel (CUDA): the snapshot pipeline carrying narrow ids + float16 weights
  (from a bfloat16 router buffer) against plain pinned copies of the same narrow bytes, and against
  the ids-only pipeline (``weights_cost``: its time over the ids-only time, against the bytes
  ratio: 2.0 with uint16 ids at 256 experts, 3.0 with uint8).
- D2H bandwidth of the snapshot pipeline (narrow on the device + pinned copy, ring of 4) against a
  plain ``pinned.copy_(device, non_blocking=True)`` of the same narrow bytes (peer), with the
  narrowing graphs (default) and without (``graphs=False``). Targets: >= 0.5 of the peer at 1,024
  tokens (0.5 MB, where the host cost of ``snapshot()`` bounds the rate: 0.15 before the graphs),
  >= 0.8 from 8,192 tokens (an H200 copies about 54 GB/s device-to-pinned-host).
- ``snapshot()`` host time: median ``time.perf_counter`` us per call at 1, 64, 1024, 8192 and 32768
  tokens, with and without layer stamps, for three pipelines: graphs with the runtime copy (the
  default: ``cudaMemcpyAsync`` / ``cudaEventRecord`` and, where torch hands out the graph exec,
  ``cudaGraphLaunch`` through ctypes: ``narrow_path`` "graph_launch"), graphs with torch's
  ``copy_`` ("graph_replay"), the direct launch with ``copy_`` ("kernel"); each row names its
  ``narrow_path``. ``idle_us`` times a call with nothing queued (the
  host's own cost; target <= 20 us at any size, 72 us at 1,024 tokens before the graphs),
  ``queued_us`` calls back to back behind the previous calls' copies, ``host_wait_us`` their
  difference (the host waiting for the device while it enqueues). Neither waits for a ring slot.
  On CPU the same table times the synchronous copy (context, no target). With the pipelines'
  construction time (the graphs are captured there).
- ``snapshot()`` host time by the host's state (CUDA): the default pipeline's ``idle_us`` at 1,024
  and 32,768 tokens when the call follows ``synchronize()`` (as above), polling the previous
  handle until it is ready, or a 16 MB write to host memory (what the previous 32,768-token step's
  copy does to the CPU caches); beside it, the same condition's time of a host-only reference (a
  Python loop over 256 small objects, no CUDA call). Where both grow by the same factor, the
  growth is the host's state, not work that ``snapshot()`` does per byte.
- Compute-loop slowdown: a loop of GEMM "steps" with ``set_step`` each step, with and without a
  snapshot per step consumed one step later. Target <= 1.02x. Blocks of 25 steps, timed on the
  device, alternate A B / B A; the paired slowdown is the median over trials of (snapshot block /
  baseline block of the same trial), with its interquartile range. Context row: the blocking
  ``.cpu()`` per step that engines used first.
- The narrowing cast on its own (it is the snapshot's share of the compute stream's critical
  path): ``moe_ops.transfer.narrow`` against ``copy_``.
- Store ``write`` (8192 tokens at engine-like slots) and ``read`` (a 32768-token request, block size
  16): GB/s of routing rows. Target >= 2 GB/s. CPU.
- ``encode_routing`` + ``decode_routing`` of a 32768-token request: GB/s of routing bytes. Target
  >= 1 GB/s. CPU.
- ``RoutingLedger`` lock cost: median us per ``schedule`` / ``land`` / ``finish`` / ``collect`` call
  of a decode loop (64 requests, 1 token each per step, rows landing one step late), against the
  same ledger with its lock swapped for a no-op (floor), and with ``land`` on a second thread (the
  engine's output thread). CPU.

    python benchmarks/bench_transfer.py [--csv out.csv] [--quick] [--d2h-sizes 1024,8192,32768]
    python -m benchmarks transfer --quick

Without a GPU only the CPU sections run.
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import queue
import statistics
import sys
import threading
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.cases import BENCH_CASES, BENCH_SIZES
from benchmarks.harness import Table, device_us_per_call
from benchmarks.registry import benchmark, main, sizes_option
from moe_ops import (
    RoutingCapturer,
    RoutingLedger,
    RoutingShape,
    SlotStore,
    TransferPipeline,
    decode_routing,
    decode_routing_bytes,
    decode_routing_weights,
    encode_routing,
    encode_routing_bytes,
    encode_routing_weights,
)
from moe_ops.capture.capturer import weights_channel
from moe_ops.channels import IDS
from moe_ops.wire import HAS_PYBASE64

LAYERS, TOP_K, EXPERTS, STEP_TOKENS, REQUEST_TOKENS = 61, 8, 256, 8192, 32768
SHAPE = RoutingShape(num_layers=LAYERS, num_experts=EXPERTS, top_k=TOP_K)
D2H_TARGET, SLOWDOWN_TARGET, STORE_TARGET_GBS, WIRE_TARGET_GBS = 0.8, 1.02, 2.0, 1.0
# below 8192 tokens the host cost of snapshot() bounds the pipeline's rate: a lower ratio target
D2H_SMALL_TARGETS = {1024: 0.5}
SNAPSHOT_HOST_TARGET_US = 20.0
SNAPSHOT_SIZES = [1, 64, 1024, STEP_TOKENS, REQUEST_TOKENS]


def _median_s(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# the weights channel the benchmark carries beside the ids: RoutingCapturer(weights_dtype=bfloat16)'s,
# the bfloat16 buffer's 16 bits in a uint16 channel (2 bytes an entry in the ring, the store and
# moe-ops' wire; no cast on the device: the pipeline stages the int16 view)
WEIGHTS = weights_channel(LAYERS, TOP_K, torch.bfloat16)


def weights_source(weights: torch.Tensor) -> torch.Tensor:
    """What the capturer hands the pipeline for a bfloat16 weights buffer: its bits (int16 view)."""
    return weights.view(torch.int16)


def bf16_bits(weights: torch.Tensor) -> np.ndarray:
    """A bfloat16 tensor's bits as the uint16 array the channel delivers."""
    return weights.cpu().view(torch.int16).numpy().view(np.uint16)


def bytes_per_step(weights: bool = True) -> Table:
    """Bytes of one step's rows; with ``weights``, the weights channel's bytes beside the ids (ring:
    the channel's dtype; wire: bfloat16 in moe-ops' own, float32 in vLLM's field), counted from the
    arrays the pipeline and the wire produce for a small step (scaled per entry), not from a
    formula alone."""
    table = Table(
        f"bytes per step ({STEP_TOKENS} tokens x {LAYERS} layers x {TOP_K} ids, {EXPERTS} experts)",
        ["payload", "bytes", "MiB", "ratio_vs_int32", "ratio_vs_ids"],
    )
    entries = STEP_TOKENS * LAYERS * TOP_K
    narrow = SHAPE.id_dtype.itemsize
    for name, size in (("ids int32", 4), (f"ids {SHAPE.id_dtype}", narrow)):
        table.add(name, entries * size, entries * size / 2**20, size / 4, size / narrow)
    if not weights:
        return table
    # one small step through the real objects: the ring's per-entry bytes, and the wire's
    n = 4
    ids = torch.randint(0, EXPERTS, (n, LAYERS, TOP_K), dtype=torch.int32)
    src = torch.rand(n, LAYERS, TOP_K).to(torch.bfloat16)
    pipe = TransferPipeline(ids, SHAPE.id_dtype, extra_channels=[(WEIGHTS, weights_source(src))])
    with pipe.snapshot(n) as handle:
        rows = handle.results()
    assert np.array_equal(rows["weights"], bf16_bits(src)), "weights rows wrong"
    ring = sum(a.nbytes for a in rows.values()) / (n * LAYERS * TOP_K)
    table.add(
        "ring: ids + bfloat16 weights (uint16 bits)",
        entries * ring,
        entries * ring / 2**20,
        ring / 4,
        ring / narrow,
    )
    for dtype in ("bfloat16", "float32"):
        raw = np.load(io.BytesIO(base64.b64decode(encode_routing_weights(rows["weights"], dtype=dtype))))
        per = narrow + raw.nbytes / raw.size
        table.add(f"wire: ids + {dtype} weights", entries * per, entries * per / 2**20, per / 4, per / narrow)
    return table


def d2h_with_weights(sizes: list[int], reps: int, trials: int) -> Table:
    """The snapshot pipeline with the weights channel on (narrow ids + a bfloat16 buffer's bits, as
    ``RoutingCapturer(weights_dtype=torch.bfloat16)`` carries them) against plain pinned copies of
    the same narrow bytes (two copies, one per channel: the peer), and against the ids-only
    pipeline (``weights_cost``: its time over the ids-only time, beside ``bytes_ratio``)."""
    dev = torch.device("cuda")
    table = Table(
        "D2H with the weights channel: snapshot pipeline vs plain pinned copies (GB/s of narrow bytes)",
        [
            "tokens",
            "MB/step",
            "peer_GBps",
            "pipeline_GBps",
            "ratio",
            "ids_only_GBps",
            "weights_cost",
            "bytes_ratio",
            "target",
        ],
    )
    max_tokens = max(sizes)
    source = torch.randint(0, EXPERTS, (max_tokens, LAYERS, TOP_K), dtype=torch.int32, device=dev)
    weights = torch.rand(max_tokens, LAYERS, TOP_K, device=dev).to(torch.bfloat16)
    pipe = TransferPipeline(
        source, SHAPE.id_dtype, depth=4, extra_channels=[(WEIGHTS, weights_source(weights))]
    )
    ids_only = TransferPipeline(source, SHAPE.id_dtype, depth=4)
    # the peer copies the same bytes: the id dtype's width as a signed torch dtype (torch's uint16
    # has few kernels); values < 256 read the same in either
    id_width = SHAPE.id_dtype.itemsize
    peer_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[id_width]
    narrow_dev, half_dev = source.to(peer_dtype), weights_source(weights)
    narrow_host = torch.empty(narrow_dev.shape, dtype=peer_dtype, pin_memory=True)
    half_host = torch.empty(half_dev.shape, dtype=torch.int16, pin_memory=True)
    copy_stream = torch.cuda.Stream()
    for n in sizes:
        ids_bytes = n * LAYERS * TOP_K * id_width
        nbytes = ids_bytes + n * LAYERS * TOP_K * 2

        def plain():
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.cuda.stream(copy_stream):
                for _ in range(reps):
                    narrow_host[:n].copy_(narrow_dev[:n], non_blocking=True)
                    half_host[:n].copy_(half_dev[:n], non_blocking=True)
            copy_stream.synchronize()
            return time.perf_counter() - start

        def pipeline(p):
            torch.cuda.synchronize()
            start = time.perf_counter()
            held = []
            for _ in range(reps):
                if len(held) == p.depth:
                    held.pop(0).release()
                held.append(p.snapshot(n))
            p.synchronize()
            for h in held:
                h.release()
            return time.perf_counter() - start

        peer = statistics.median(plain() for _ in range(trials))
        ours = statistics.median(pipeline(pipe) for _ in range(trials))
        alone = statistics.median(pipeline(ids_only) for _ in range(trials))
        with pipe.snapshot(n) as h:
            got = h.results(copy=False)
            assert np.array_equal(got[IDS], source[:n].cpu().numpy()), "snapshot ids wrong"
            assert np.array_equal(got["weights"], bf16_bits(weights[:n])), "snapshot weights wrong"
        peer_gbs, ours_gbs = nbytes * reps / peer / 1e9, nbytes * reps / ours / 1e9
        table.add(
            n,
            nbytes / 1e6,
            peer_gbs,
            ours_gbs,
            ours_gbs / peer_gbs,
            ids_bytes * reps / alone / 1e9,
            ours / alone,
            nbytes / ids_bytes,
            f">= {D2H_SMALL_TARGETS.get(n, D2H_TARGET)}",
        )
    return table


def d2h_bandwidth(sizes: list[int], reps: int, trials: int) -> Table:
    """Snapshot pipeline vs a plain pinned copy of the same narrow bytes, both timed the same way."""
    dev = torch.device("cuda")
    table = Table(
        "D2H bandwidth: snapshot pipeline vs plain pinned copy (GB/s of narrow ids)",
        [
            "tokens",
            "MB/step",
            "peer_GBps",
            "pipeline_GBps",
            "ratio",
            "direct_ratio",
            "int32_copy_GBps",
            "ids_speedup",
            "target",
        ],
    )
    max_tokens = max(sizes)
    source = torch.randint(0, EXPERTS, (max_tokens, LAYERS, TOP_K), dtype=torch.int32, device=dev)
    pipe = TransferPipeline(source, SHAPE.id_dtype, depth=4)
    direct = TransferPipeline(source, SHAPE.id_dtype, depth=4, graphs=False)
    # the peer copies as many bytes as the pipeline: the id dtype's width (uint16 at 256 experts,
    # whose fill is no id) as a signed torch dtype; values < 256 read the same in either
    id_width = SHAPE.id_dtype.itemsize
    peer_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[id_width]
    narrow_dev = source.to(peer_dtype)
    narrow_host = torch.empty(narrow_dev.shape, dtype=peer_dtype, pin_memory=True)
    wide_host = torch.empty(source.shape, dtype=torch.int32, pin_memory=True)
    copy_stream = torch.cuda.Stream()
    for n in sizes:
        nbytes = n * LAYERS * TOP_K * id_width

        def plain(dst, src):
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.cuda.stream(copy_stream):
                for _ in range(reps):
                    dst[:n].copy_(src[:n], non_blocking=True)
            copy_stream.synchronize()
            return time.perf_counter() - start

        def pipeline(pipe=pipe):
            torch.cuda.synchronize()
            start = time.perf_counter()
            held = []
            for _ in range(reps):
                if len(held) == pipe.depth:
                    held.pop(0).release()  # release never waits: the ring stays full of copies
                held.append(pipe.snapshot(n))
            pipe.synchronize()
            for h in held:
                h.release()
            return time.perf_counter() - start

        peer = statistics.median(plain(narrow_host, narrow_dev) for _ in range(trials))
        ours = statistics.median(pipeline() for _ in range(trials))
        theirs = statistics.median(pipeline(direct) for _ in range(trials))
        wide = statistics.median(plain(wide_host, source) for _ in range(trials))
        for p in (pipe, direct):
            with p.snapshot(n) as h:
                assert np.array_equal(h.result(copy=False), narrow_dev[:n].cpu().numpy()), (
                    "snapshot rows wrong"
                )
        peer_gbs, ours_gbs = nbytes * reps / peer / 1e9, nbytes * reps / ours / 1e9
        table.add(
            n,
            nbytes / 1e6,
            peer_gbs,
            ours_gbs,
            ours_gbs / peer_gbs,
            peer / theirs,
            4 * n * LAYERS * TOP_K * reps / wide / 1e9,
            wide / ours,
            f">= {D2H_SMALL_TARGETS.get(n, D2H_TARGET)}",
        )
    return table


def snapshot_host_time(device: torch.device, sizes: list[int], reps: int) -> list[Table]:
    """Host time of one ``snapshot()`` call (perf_counter around it), per pipeline variant.

    Two numbers per size, neither of which waits on the ring (every slot is free at every timed
    call; ``RingFullError`` would be raised, not waited for, with the default ``timeout=0``):

    - ``idle_us``: nothing queued on either stream when the call starts (the copy stream
      synchronized and the handle released outside the timed region before each call). The
      host's own cost: the target applies to it.
    - ``queued_us``: ``depth`` calls back to back (timed one by one; synchronize and release after
      the group, untimed), so the 2nd..4th call finds the earlier copies still running
      (``in_flight`` is the mean number of earlier copies of the group not finished when a call
      started). ``host_wait_us = queued_us - idle_us``: what the host spends waiting for the device
      while enqueuing behind running copies (the large-step, stamped rows of the previous table
      measured this way only).

    Every pipeline's rows are checked once per size.
    """
    cuda = device.type == "cuda"
    host = Table(
        f"snapshot() host time ({LAYERS}x{TOP_K} int32 -> {SHAPE.id_dtype}, ring 4, median us per call, "
        f"{device.type})",
        [
            "tokens",
            "stamps",
            "pipeline",
            "narrow_path",
            "idle_us",
            "queued_us",
            "host_wait_us",
            "in_flight",
            "target",
        ],
    )
    build = Table(
        f"TransferPipeline construction ({max(sizes)} rows, ring 4, {device.type})",
        ["stamps", "pipeline", "narrow_path", "copy_path", "cuda_graphs", "ms"],
    )
    max_tokens = max(sizes)
    source = torch.randint(0, EXPERTS, (max_tokens, LAYERS, TOP_K), dtype=torch.int32, device=device)
    stamps = torch.zeros(LAYERS, dtype=torch.int32, device=device)
    stamps[::3] = 1  # every third layer stale: the stamped kernel does its masking
    step = torch.zeros(1, dtype=torch.int32, device=device)
    want = source.cpu().numpy().astype(SHAPE.id_dtype)
    want_stamped = want.copy()
    want_stamped[:, (stamps != step).cpu().numpy()] = np.iinfo(SHAPE.id_dtype).max
    # name -> TransferPipeline kwargs: graphs with the runtime copy (the default: narrow_path
    # "graph_launch" where torch has CUDAGraph.raw_cuda_graph_exec), graphs with torch's copy_
    # ("graph_replay"), the direct launch with torch's copy_ ("kernel", before graphs)
    variants = (
        {
            "graphs+cudart": {},
            "graphs+copy_": {"cudart": False},
            "direct+copy_": {"graphs": False, "cudart": False},
        }
        if cuda
        else {"cpu": {}}
    )
    pipes = {}
    for stamped in (False, True):
        kwargs = {"layer_stamps": stamps, "step_tensor": step} if stamped else {}
        for name, variant in variants.items():
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            pipe = TransferPipeline(source, SHAPE.id_dtype, depth=4, **variant, **kwargs)
            if cuda:
                torch.cuda.synchronize()
            ms = (time.perf_counter() - start) * 1e3
            build.add(
                stamped,
                name,
                pipe.narrow_path,
                pipe.copy_path,
                sum(len(s.graphs) for s in pipe._ring.slots),
                ms,
            )
            pipes[stamped, name] = pipe

    def idle_us(pipe: TransferPipeline, n: int) -> float:
        times = []
        for _ in range(reps * pipe.depth):
            pipe.synchronize()
            start = time.perf_counter()
            handle = pipe.snapshot(n)
            times.append(time.perf_counter() - start)
            handle.release()
        return statistics.median(times) * 1e6

    def queued_us(pipe: TransferPipeline, n: int) -> tuple[float, float]:
        times, running = [], []
        for _ in range(reps):
            held = []
            for _ in range(pipe.depth):
                running.append(sum(not h.ready() for h in held))  # untimed: before the clock starts
                start = time.perf_counter()
                held.append(pipe.snapshot(n))
                times.append(time.perf_counter() - start)
            pipe.synchronize()
            for h in held:
                h.release()
        return statistics.median(times) * 1e6, statistics.mean(running)

    for n in sizes:
        for stamped in (False, True):
            for name in variants:
                pipe = pipes[stamped, name]
                with pipe.snapshot(n) as h:
                    expected = (want_stamped if stamped else want)[:n]
                    assert np.array_equal(h.result(copy=False), expected), (
                        f"snapshot rows wrong ({n}, {name})"
                    )
                queued_us(pipe, n)  # warm-up: caches, clocks
                idle = idle_us(pipe, n)
                queued, in_flight = queued_us(pipe, n)
                host.add(
                    n,
                    stamped,
                    name,
                    pipe.narrow_path,
                    idle,
                    queued,
                    queued - idle,
                    in_flight,
                    f"idle <= {SNAPSHOT_HOST_TARGET_US}" if cuda else "context (sync copy)",
                )
    return [host, build]


def compute_slowdown(steps: int, trials: int, gemms: int) -> Table:
    """A GEMM loop with set_step each step; + a snapshot per step consumed one step later.

    Blocks of ``steps`` steps per mode, interleaved and rotated over ``trials`` rounds; each block
    is timed on the device. A step is 8 bf16 4096^3 GEMMs (about 1.6 ms on an H200).
    """
    dev = torch.device("cuda")
    table = Table(
        f"compute-loop slowdown with snapshots ({STEP_TOKENS} tokens/step, ring 4, consumed 1 step later)",
        ["mode", "ms/step", "slowdown", "paired_slowdown", "paired_iqr", "target"],
    )
    capturer = RoutingCapturer(SHAPE, STEP_TOKENS, dev, ring_depth=4)
    capturer.buffer.random_(0, EXPERTS)
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(a)

    def forward():
        for _ in range(gemms):
            torch.mm(a, b, out=out)

    def loop(mode: str) -> float:
        """ms per step of one block of ``steps`` steps, timed on the compute stream (CUDA events
        around the block: the guard waits and any idle gap the host leaves are inside)."""
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        pending = None
        for _ in range(steps):
            capturer.set_step([STEP_TOKENS])
            forward()
            if mode == "snapshot":
                handle = capturer.snapshot()
                if pending is not None:  # the engine reads step k-1 while step k runs
                    pending.result(copy=False)
                    pending.release()
                pending = handle
            elif mode == "blocking .cpu()":
                capturer.buffer[:STEP_TOKENS].to(torch.uint8).cpu()
        end.record()
        if pending is not None:  # the last step's rows, read after the block's clock stopped
            pending.result(copy=False)
            pending.release()
        end.synchronize()
        return start.elapsed_time(end) / steps

    modes = ["baseline", "snapshot"]
    for m in modes:  # warm-up: clocks, cuBLAS heuristics, pinned pools
        loop(m)
    results = {m: [] for m in modes}
    for trial in range(trials):
        # interleaved A B, B A, A B, ...: drift hits both modes alike and each follows the other
        # equally often
        for m in modes if trial % 2 == 0 else modes[::-1]:
            results[m].append(loop(m))
    # context, measured apart: the GPU idles during a blocking copy and runs cooler in the next
    # block, which would flatter whichever mode followed it
    results["blocking .cpu()"] = [loop("blocking .cpu()") for _ in range(max(3, trials // 8))]
    base = statistics.median(results["baseline"])
    for m in results:
        if m == "blocking .cpu()":  # not interleaved: no paired ratio
            paired, iqr = "", ""
        else:
            # a trial's ratio divides by the baseline block of the same trial (milliseconds apart),
            # which cancels the slow drift of a GEMM loop's clocks (its ms/step wanders by ~5%)
            ratios = sorted(t / b for t, b in zip(results[m], results["baseline"]))
            paired = statistics.median(ratios)
            iqr = f"{ratios[len(ratios) // 4]:.3f}-{ratios[(3 * len(ratios)) // 4]:.3f}"
        table.add(
            m,
            statistics.median(results[m]),
            statistics.median(results[m]) / base,
            paired,
            iqr,
            f"<= {SLOWDOWN_TARGET}" if m == "snapshot" else "context",
        )
    return table


def narrow_kernel() -> Table:
    """The snapshot's narrowing cast (16 MB of int32 ids to 4 MB of uint8): ours vs ``copy_``."""
    from moe_ops.transfer.narrow import narrow_rows_torch, narrow_rows_triton

    dev = torch.device("cuda")
    table = Table(
        f"narrowing cast, {STEP_TOKENS} tokens (kernel us)", ["impl", "device_us", "ratio_vs_copy_"]
    )
    src = torch.randint(0, EXPERTS, (STEP_TOKENS, LAYERS, TOP_K), dtype=torch.int32, device=dev)
    dst = torch.empty(src.shape, dtype=torch.uint8, device=dev)
    times = {}
    for name, fn in (("torch copy_", narrow_rows_torch), ("triton", narrow_rows_triton)):
        dst.fill_(7)
        fn(dst, src, STEP_TOKENS)
        assert torch.equal(dst, src.to(torch.uint8)), name
        times[name] = device_us_per_call(lambda fn=fn: fn(dst, src, STEP_TOKENS))
    for name, t in times.items():
        table.add(name, t, t / times["torch copy_"])
    return table


def store_throughput(reps: int) -> Table:
    table = Table(
        f"SlotStore throughput ({LAYERS}x{TOP_K} uint8 rows, block size 16)",
        ["op", "tokens", "MB", "GBps", "target"],
    )
    block_size, num_blocks = 16, 8192
    store = SlotStore(num_blocks * block_size, SHAPE)
    rng = np.random.default_rng(0)
    # engine-like slot mapping: 512 requests' next 16 tokens, each in one of its blocks
    blocks = rng.permutation(num_blocks)[: STEP_TOKENS // block_size]
    slots = (blocks[:, None] * block_size + np.arange(block_size)).reshape(-1)
    rows = rng.integers(0, EXPERTS, size=(STEP_TOKENS, LAYERS, TOP_K), dtype=np.uint8)
    t = _median_s(lambda: store.write(slots, rows), reps)
    table.add("write", STEP_TOKENS, rows.nbytes / 1e6, rows.nbytes / t / 1e9, f">= {STORE_TARGET_GBS}")
    request_blocks = rng.permutation(num_blocks)[: REQUEST_TOKENS // block_size]
    out = store.read(request_blocks, REQUEST_TOKENS, block_size)
    assert out.shape == (REQUEST_TOKENS, LAYERS, TOP_K)
    t = _median_s(lambda: store.read(request_blocks, REQUEST_TOKENS, block_size), reps)
    table.add("read", REQUEST_TOKENS, out.nbytes / 1e6, out.nbytes / t / 1e9, f">= {STORE_TARGET_GBS}")
    return table


def wire_throughput(reps: int) -> Table:
    table = Table(
        f"wire encode+decode of a {REQUEST_TOKENS}-token request (pybase64: {HAS_PYBASE64})",
        ["format", "MB", "encode_ms", "decode_ms", "GBps", "target"],
    )
    rows = np.random.default_rng(1).integers(0, EXPERTS, size=(REQUEST_TOKENS, LAYERS, TOP_K), dtype=np.uint8)
    for name, enc, dec in (
        ("base64 .npy", encode_routing, decode_routing),
        ("raw bytes", encode_routing_bytes, decode_routing_bytes),
    ):
        payload = enc(rows)
        assert np.array_equal(dec(payload), rows)
        t_enc = _median_s(lambda: enc(rows), reps)
        t_dec = _median_s(lambda: dec(payload), reps)
        gbs = rows.nbytes / (t_enc + t_dec) / 1e9
        table.add(name, rows.nbytes / 1e6, t_enc * 1e3, t_dec * 1e3, gbs, f">= {WIRE_TARGET_GBS}")
    return table


def ledger_lock_cost(steps: int) -> Table:
    """Per-call cost of RoutingLedger's lock in a decode loop, with and without a second thread.

    64 running requests decode one token per step (a 64-row step of 61 x 8 uint8 ids); each step's
    rows land one step later (async scheduling); a request finishes after 64..191 tokens and a new
    one takes its place (its blocks come back to the pool at once). Modes: the ledger with its lock
    replaced by a no-op context (floor: the bookkeeping alone), the real lock on one thread, and
    the real lock with ``land`` on an output thread while the scheduler thread schedules, finishes
    and collects (each thread times its own calls, so lock waits and GIL hand-overs are inside).
    """
    table = Table(
        f"RoutingLedger calls in a decode loop (64 requests x 1 token, {LAYERS}x{TOP_K} uint8 rows, "
        f"{steps} steps)",
        ["mode", "op", "calls", "median_us", "p90_us", "ratio_vs_floor"],
    )
    block_size, running, num_blocks = 16, 64, 64 * 16
    rows = np.random.default_rng(2).integers(0, EXPERTS, size=(running, LAYERS, TOP_K), dtype=np.uint8)

    def run(mode: str) -> dict[str, list[float]]:
        ledger = RoutingLedger(SlotStore(num_blocks * block_size, SHAPE), block_size)
        if mode == "no lock (floor)":
            ledger._lock = contextlib.nullcontext()  # the bookkeeping without the lock around it
        rng = np.random.default_rng(3)
        free = list(range(num_blocks))
        live = {}  # req_id -> [tokens scheduled, tokens to generate, blocks]
        times = {op: [] for op in ("schedule", "land", "finish", "collect")}
        landing: queue.Queue = queue.Queue()
        clock = time.perf_counter

        def timed(op, fn, *args):
            t = clock()
            out = fn(*args)
            times[op].append(clock() - t)
            return out

        def output_thread():
            while (item := landing.get()) is not None:
                timed("land", ledger.land, *item)

        worker = threading.Thread(target=output_thread) if mode == "lock, land on a 2nd thread" else None
        if worker is not None:
            worker.start()
        next_id, previous = 0, None
        for _ in range(steps):
            while len(live) < running:
                ledger.add_request(next_id)
                live[next_id] = [0, int(rng.integers(64, 192)), []]
                next_id += 1
            for rid, state in live.items():
                if state[0] == len(state[2]) * block_size:
                    state[2].append(free.pop())
                    ledger.append_blocks(rid, state[2][-1:])
            step = timed("schedule", ledger.schedule, [(rid, 1) for rid in live])
            if previous is not None:  # the previous step's rows arrive while this one runs
                if worker is not None:
                    landing.put(previous)
                else:
                    timed("land", ledger.land, *previous)
            previous = (step.seq, rows)
            for rid in [rid for rid, state in live.items() if state[0] + 1 == state[1]]:
                timed("finish", ledger.finish, rid)
                free.extend(live.pop(rid)[2])
            for state in live.values():
                state[0] += 1
            timed("collect", ledger.collect)
        if worker is not None:
            landing.put(previous)
            landing.put(None)
            worker.join()
        else:
            ledger.land(*previous)
        ledger.collect()
        assert ledger.in_flight == [], "steps left in flight"
        return times

    modes = ["no lock (floor)", "lock, 1 thread", "lock, land on a 2nd thread"]
    run(modes[0])  # warm-up
    results = {m: run(m) for m in modes}
    for op in ("schedule", "land", "finish", "collect"):
        floor = statistics.median(results[modes[0]][op])
        for m in modes:
            t = sorted(results[m][op])
            med = statistics.median(t)
            table.add(m, op, len(t), med * 1e6, t[int(0.9 * (len(t) - 1))] * 1e6, med / floor)
    return table


class _HostObject:
    __slots__ = ("x",)

    def __init__(self):
        self.x = 0


def snapshot_host_state(sizes: list[int], reps: int) -> Table:
    """The default pipeline's ``snapshot()`` host time (and a host-only reference's) after each of
    three host states; see the module docstring. Rows are checked once per size."""
    table = Table(
        f"snapshot() host time by host state ({LAYERS}x{TOP_K} int32 -> {SHAPE.id_dtype}, default pipeline, "
        "median us per call)",
        ["tokens", "before the call", "snapshot_us", "host_only_ref_us"],
    )
    source = torch.randint(0, EXPERTS, (max(sizes), LAYERS, TOP_K), dtype=torch.int32, device="cuda")
    pipe = TransferPipeline(source, SHAPE.id_dtype, depth=4)
    polluter = np.zeros(16 << 20, np.uint8)
    objects = [_HostObject() for _ in range(256)]

    def host_only():
        for o in objects:
            o.x += 1

    def prepare(state: str, previous):
        if state == "polled previous handle":
            while not previous.ready():
                pass
            previous.release()
            return
        previous.release()
        pipe.synchronize()
        if state == "synchronize + 16 MB host write":
            polluter.fill(1)

    clock = time.perf_counter
    for n in sizes:
        with pipe.snapshot(n) as h:
            assert np.array_equal(h.result(copy=False), source[:n].cpu().numpy().astype(SHAPE.id_dtype))
        for state in ("synchronize", "polled previous handle", "synchronize + 16 MB host write"):
            snap, ref = [], []
            previous = pipe.snapshot(n)
            for _ in range(reps):
                prepare(state, previous)
                start = clock()
                previous = pipe.snapshot(n)
                snap.append(clock() - start)
            for _ in range(reps):
                prepare(state, previous)
                start = clock()
                host_only()
                ref.append(clock() - start)
                previous = pipe.snapshot(n)  # the next round finds the same copy landing
            previous.release()
            pipe.synchronize()
            table.add(n, state, statistics.median(snap) * 1e6, statistics.median(ref) * 1e6)
    return table


def dry_run(cases, run) -> list[Table]:
    """The bytes table with the weights channel through a real CPU ring and the wire (tiny,
    untimed, rows checked), and one snapshot of ids + weights landed in a ledger and encoded."""
    tables = [bytes_per_step(weights=True)]
    table = Table("bench_transfer dry run (cpu, ids + weights, not timed)", ["tokens", "checked"])
    for n in (1, 5):
        ids = torch.randint(0, EXPERTS, (8, LAYERS, TOP_K), dtype=torch.int32)
        w = torch.rand(8, LAYERS, TOP_K).to(torch.bfloat16)
        pipe = TransferPipeline(ids, SHAPE.id_dtype, extra_channels=[(WEIGHTS, weights_source(w))])
        ledger = RoutingLedger(SlotStore(16, SHAPE, extra_channels=[WEIGHTS]), 16)
        ledger.add_request("r")
        ledger.append_blocks("r", [0])
        step = ledger.schedule([("r", n)])
        with pipe.snapshot(n) as handle:
            ledger.land(step.seq, handle.results())
        ledger.finish("r")
        (done,) = ledger.collect()
        assert np.array_equal(
            decode_routing(encode_routing(done.routing)), ids[:n].numpy().astype(SHAPE.id_dtype)
        )
        back = decode_routing_weights(encode_routing_weights(done.channels["weights"], dtype="float32"))
        assert np.array_equal(back, w[:n].float().numpy()), "weights through the host path wrong"
        table.add(n, "ids exact, weights exact")
    tables.append(table)
    return tables


@benchmark(
    "transfer",
    cases=BENCH_CASES["transfer"],
    needs="cpu",
    options=[sizes_option("--d2h-sizes", BENCH_SIZES["transfer"], "D2H copy sizes in tokens")],
    dry_run=dry_run,
)
def transfer(cases, run) -> list[Table]:
    """Bytes per step (ids, and ids + weights), D2H bandwidth (ids, and ids + weights), snapshot()
    host time, compute slowdown, store, wire, ledger."""
    for case in cases:  # the module's constants are the measured shape: the case's test covers it
        if case.shape != SHAPE:
            raise ValueError(f"case {case.name}: shape {case.shape} is not the benchmark's {SHAPE}")
    reps = 5 if run.quick else 20
    tables = [bytes_per_step()]
    if torch.cuda.is_available():
        tables.append(d2h_bandwidth(list(run.d2h_sizes), reps=reps, trials=5 if run.quick else 9))
        tables.append(d2h_with_weights(list(run.d2h_sizes), reps=reps, trials=5 if run.quick else 9))
        tables.extend(snapshot_host_time(torch.device("cuda"), SNAPSHOT_SIZES, reps=25 if run.quick else 100))
        tables.append(snapshot_host_state([1024, REQUEST_TOKENS], reps=100 if run.quick else 400))
        tables.append(narrow_kernel())
        tables.append(compute_slowdown(steps=25, trials=8 if run.quick else 41, gemms=8))
    else:
        print("no CUDA GPU: D2H bandwidth, narrowing kernel and compute slowdown not measured")
        tables.extend(snapshot_host_time(torch.device("cpu"), SNAPSHOT_SIZES, reps=5 if run.quick else 25))
    tables.append(store_throughput(reps))
    tables.append(wire_throughput(reps))
    tables.append(ledger_lock_cost(steps=500 if run.quick else 3000))
    return tables


if __name__ == "__main__":
    sys.exit(main(["transfer", *sys.argv[1:]]))
