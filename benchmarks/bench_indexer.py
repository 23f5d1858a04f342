"""Indexer records: the compact wire's size and speed (CPU), the capture against a same-bytes copy and
the fused selection against itself without capture and against ``torch.topk`` (GPU).

Wire (runs on the CPU): bytes per (token, indexer layer) of the compact format on (a) random k-sets
of the context (the floor is log2 C(context, k) bits: the ratio to it is reported) and (b) decode
traces whose adjacent rows share 95% of their positions (target <= 512 bytes at k = 2048, 128K
context; int32 takes 8 KiB), and encode / decode throughput in MB/s of int32-equivalent input on
one core (target >= 1000), with the codec that ran (the C loops, or the numpy twin and why). The
rows are handed over shuffled, as SGLang's indexer lists them (by score): the encoder sorts them.

Capture (CUDA): ``capture_indexer`` per call inside a CUDA graph (repeats checked, and not) against
``buffer[:n, layer] = positions`` (target <= 1.1x). Selection (CUDA): ``select_indexer_topk``
with a capture target against the same selection without one (target <= 1.02x) and against
``torch.topk`` of the same scores (reported; beat it), median of CUDA-graph replays.

Cases and sizes: ``BENCH_CASES["indexer"]``, ``BENCH_SIZES["indexer"]`` (query rows).

    python -m benchmarks indexer [--indexer-sizes 1,128,4096] [--indexer-tables wire,capture,select]
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.cases import BENCH_CASES, BENCH_SIZES
from benchmarks.harness import Table, graph_calls_us
from benchmarks.registry import benchmark, main, option, sizes_option, table
from moe_ops.capture.target import CaptureTarget
from moe_ops.indexer import capture_indexer, select_indexer_topk
from moe_ops.indexer.wire import (
    canonical_positions,
    codec,
    decode_positions_bytes,
    encode_positions_bytes,
    set_bound_bits,
)

WIRE_TOKENS, WIRE_LAYERS, SHARE = 64, 2, 0.95
WIRE_BYTES_TARGET, WIRE_SPEED_TARGET = 512, 1000.0
CAPTURE_TARGET, FUSED_TARGET = 1.1, 1.02
TABLES = ("wire", "capture", "select")


def random_sets(rng, n: int, layers: int, k: int, context: int) -> np.ndarray:
    """(n, layers, k) int32: independent random k-subsets of the context."""
    out = np.empty((n, layers, k), dtype=np.int32)
    for i in range(n):
        for j in range(layers):
            out[i, j] = rng.choice(context, size=k, replace=False)
    return out


def decode_trace(rng, n: int, layers: int, k: int, context: int, share: float) -> np.ndarray:
    """(n, layers, k) int32: each row keeps ``share`` of the previous row's positions (per layer),
    the rest drawn anew from positions the row does not hold; listed in a shuffled order."""
    out = np.empty((n, layers, k), dtype=np.int32)
    drop = k - round(k * share)
    for j in range(layers):
        cur = rng.choice(context, size=k, replace=False)
        member = np.zeros(context, dtype=bool)
        member[cur] = True
        for i in range(n):
            if i and drop:
                gone = rng.choice(k, size=drop, replace=False)
                member[cur[gone]] = False
                fresh = []
                while len(fresh) < drop:
                    cand = rng.integers(0, context, size=2 * drop)
                    cand = np.unique(cand[~member[cand]])
                    take = cand[: drop - len(fresh)]
                    member[take] = True
                    fresh.extend(take.tolist())
                cur[gone] = fresh
            out[i, j] = rng.permutation(cur)
    return out


def _best_s(fn, trials: int) -> float:
    """Median wall seconds of ``fn`` over ``trials`` calls (one core: numpy's codec is single-threaded)."""
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def wire_table(cases, quick: bool) -> Table:
    t = Table(
        "indexer wire: compact bytes per (token, layer), encode/decode MB/s of int32 input (1 CPU core)",
        [
            "case",
            "workload",
            "int32 B",
            "compact B",
            "floor B",
            "ratio to floor",
            "encode MB/s",
            "decode MB/s",
            "codec",
            "target",
            "met",
        ],
    )
    # "native": the C loops (codec.c); else why the numpy twin runs
    which = codec()
    rng = np.random.default_rng(0)
    n = 16 if quick else WIRE_TOKENS
    for case in cases:
        if case.context not in (8192, 131072):
            continue
        for workload in ("random", "shared 95%"):
            if workload == "random":
                rows = random_sets(rng, n, WIRE_LAYERS, case.k, case.context)
            else:
                rows = decode_trace(rng, n, WIRE_LAYERS, case.k, case.context, SHARE)
            data = encode_positions_bytes(rows, context=case.context)
            assert np.array_equal(decode_positions_bytes(data), canonical_positions(rows)), "round trip"
            per_row = len(data) / (n * WIRE_LAYERS)
            floor = set_bound_bits(case.k, case.context) / 8
            mb = rows.nbytes / 1e6
            trials = 2 if quick else 5
            enc = mb / _best_s(lambda: encode_positions_bytes(rows, context=case.context), trials)
            dec = mb / _best_s(lambda: decode_positions_bytes(data), trials)
            if workload == "random":
                target, met = f">= {WIRE_SPEED_TARGET:.0f} MB/s", min(enc, dec) >= WIRE_SPEED_TARGET
            else:
                big = case.k == 2048 and case.context == 131072
                target = (
                    f"<= {WIRE_BYTES_TARGET} B, >= {WIRE_SPEED_TARGET:.0f} MB/s"
                    if big
                    else f">= {WIRE_SPEED_TARGET:.0f} MB/s"
                )
                met = (per_row <= WIRE_BYTES_TARGET or not big) and min(enc, dec) >= WIRE_SPEED_TARGET
            t.add(
                case.name,
                workload,
                4 * case.k,
                per_row,
                floor if workload == "random" else "",
                per_row / floor if workload == "random" else "",
                enc,
                dec,
                which,
                target,
                "met" if met else "missed",
            )
    return t


def capture_table(cases, sizes) -> Table:
    t = Table(
        "indexer capture per call in a CUDA graph (us): checked copy and repeat check vs a same-bytes copy",
        [
            "k",
            "n",
            "copy",
            "capture",
            "capture+repeats",
            "capture/copy",
            "capture+repeats/copy",
            "target",
            "met",
        ],
    )
    dev = torch.device("cuda")
    for k in sorted({c.k for c in cases}):
        context = max(c.context for c in cases if c.k == k)
        for n in sizes:
            positions = torch.stack([torch.randperm(context, device=dev)[:k] for _ in range(min(n, 64))])
            positions = positions.repeat((n + 63) // 64, 1)[:n].to(torch.int32)
            buffer = torch.zeros(max(sizes), 2, k, dtype=torch.int32, device=dev)
            counts = torch.tensor([n], dtype=torch.int32, device=dev)
            lens = torch.full((n,), context, dtype=torch.int32, device=dev)
            steps = {
                "copy": lambda: buffer[:n, 1].copy_(positions),
                "capture": lambda: capture_indexer(
                    buffer, positions, 1, token_counts=counts, kv_lens=lens, check_duplicates=False
                ),
                "repeats": lambda: capture_indexer(buffer, positions, 1, token_counts=counts, kv_lens=lens),
            }
            us = graph_calls_us(steps, calls=10, replays=20)
            ratio = us["capture"] / us["copy"]
            t.add(
                k,
                n,
                us["copy"],
                us["capture"],
                us["repeats"],
                ratio,
                us["repeats"] / us["copy"],
                f"<= {CAPTURE_TARGET}",
                "met" if ratio <= CAPTURE_TARGET else "missed",
            )
            assert torch.equal(buffer[:n, 1], positions), "benchmark capture wrote wrong rows"
    return t


def select_table(cases, sizes) -> Table:
    t = Table(
        "indexer selection per call in a CUDA graph (us): fused select+capture vs select vs torch.topk",
        [
            "case",
            "n",
            "torch.topk",
            "select",
            "select+capture",
            "fused/select",
            "select/topk",
            "target",
            "met",
        ],
    )
    dev = torch.device("cuda")
    for case in cases:
        for n in sizes:
            if n * case.context > (1 << 31):  # 8 GiB of float32 scores: beyond what one case should hold
                continue
            scores = torch.randn(n, case.context, device=dev)
            out = torch.empty(n, case.k, dtype=torch.int32, device=dev)
            buffer = torch.zeros(n, 1, case.k, dtype=torch.int32, device=dev)
            target = CaptureTarget(buffer, 0, token_counts=torch.tensor([n], dtype=torch.int32, device=dev))
            steps = {
                "topk": lambda: scores.topk(case.k, dim=-1),
                "select": lambda: select_indexer_topk(scores, case.k, out=out),
                "fused": lambda: select_indexer_topk(scores, case.k, out=out, target=target),
            }
            us = graph_calls_us(steps, calls=1, replays=10)
            want = scores.topk(case.k, dim=-1).indices.sort(dim=-1).values.to(torch.int32)
            assert torch.equal(out, want) and torch.equal(buffer[:, 0], out), "benchmark selection is wrong"
            fused = us["fused"] / us["select"]
            t.add(
                case.name,
                n,
                us["topk"],
                us["select"],
                us["fused"],
                fused,
                us["select"] / us["topk"],
                f"fused <= {FUSED_TARGET}, select < topk",
                "met" if fused <= FUSED_TARGET and us["select"] < us["topk"] else "missed",
            )
    return t


@benchmark(
    "indexer",
    cases=BENCH_CASES["indexer"],
    needs="cpu",
    options=[
        sizes_option("--indexer-sizes", BENCH_SIZES["indexer"], help="query rows (default 1,128,4096)"),
        option("--indexer-tables", ",".join(TABLES), help=f"comma-separated subset of {','.join(TABLES)}"),
    ],
    tables=[
        table("indexer wire: compact bytes and encode/decode speed", needs="cpu"),
        table("indexer capture in a CUDA graph vs a same-bytes copy", needs="cuda"),
        table("indexer fused selection vs selection vs torch.topk", needs="cuda"),
    ],
)
def indexer(cases, run) -> list[Table]:
    """Indexer records: compact wire bytes and speed (CPU); capture and fused selection (GPU)."""
    chosen = [name for name in run.indexer_tables.split(",") if name]
    unknown = sorted(set(chosen) - set(TABLES))
    if unknown:
        raise ValueError(f"--indexer-tables takes names from {TABLES}, got {unknown}")
    tables = []
    if "wire" in chosen:
        tables.append(wire_table(cases, run.quick))
    if torch.cuda.is_available():
        if "capture" in chosen:
            tables.append(capture_table(cases, run.indexer_sizes))
        if "select" in chosen:
            tables.append(select_table(cases, run.indexer_sizes))
    elif {"capture", "select"} & set(chosen):
        print("indexer: the capture and selection tables need a CUDA GPU; measured the wire only")
    return tables


if __name__ == "__main__":
    sys.exit(main(["indexer", *sys.argv[1:]]))
