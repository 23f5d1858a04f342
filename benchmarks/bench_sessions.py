"""Multi-turn sessions: bytes per new token delivered, with deltas (``add_request(session=)``) and
with a full re-send every turn, in each client's wire format as it is.

A 4-turn session: a 2048-token prompt, 512 tokens generated a turn, and a 64-token user message
before each later turn; each later turn hits the prefix cache on the previous turn's whole blocks
(block size 16). The ledger serves it twice - with the session view and without - and each turn's
rows are encoded as vLLM's ``.npy`` (uint8 / uint16 by the expert count), SGLang's int32 base64,
NeMo-RL's envelope and moe-ops' raw ``MOER`` bytes (what a client gets that skips base64, as
prime-rl moves raw arrays). Reported: bytes per new token over the session, and the last turn's
delta against its full re-send (target <= 10%).

Host cost: CPU seconds of the ledger (with its slot store) and of the wire per 1M delivered tokens
in a serving loop of 64 running requests.

Per-rank delivery: a batch written as one framed file (``write_framed``), read by one of 8 trainer
ranks (its requests only) against reading the whole batch; peak host memory by tracemalloc.

    python -m benchmarks sessions [--rank-batch 1024,8192,8]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.cases import BENCH_CASES
from benchmarks.harness import Table
from benchmarks.registry import benchmark, main, option, table
from moe_ops import RoutingLedger, SlotStore
from moe_ops.wire import FramedReader, encode_routing, encode_routing_bytes, write_framed

PROMPT, NEW, USER, TURNS, BLOCK = 2048, 512, 64, 4, 16
TARGET = 0.10


def _formats(shape):
    """format label -> bytes of one request's rows as that client receives them."""
    narrow = np.uint8 if shape.num_experts <= 256 else np.uint16
    return {
        "vLLM npy": lambda rows: len(encode_routing(rows.astype(narrow), format="npy")),
        "SGLang int32": lambda rows: len(encode_routing(rows.astype(np.int32), format="sglang")),
        "NeMo-RL": lambda rows: len(encode_routing(rows.astype(np.int16), format="nemo_rl")),
        "raw MOER": lambda rows: len(encode_routing_bytes(rows.astype(narrow))),
    }


def _session(shape, with_session: bool, rng):
    """The rows each turn delivers (a list of arrays): one ledger serving the 4 turns."""
    tokens = PROMPT + TURNS * (NEW + USER) + 64
    ledger = RoutingLedger(SlotStore(-(-tokens // BLOCK) * BLOCK * 2, shape), BLOCK)
    next_block, blocks, known, out = 0, [], PROMPT, []
    for turn in range(TURNS):
        prompt = known + (USER if turn else 0)
        hit = ((known - 1) // BLOCK) * BLOCK if turn else 0
        req = f"turn-{turn}"
        cached = blocks[: hit // BLOCK]
        kwargs = {"session": "s"} if with_session else {}
        ledger.add_request(req, cached, hit, prompt_len=prompt, **kwargs)
        need = -(-(prompt + NEW) // BLOCK) - len(cached)
        fresh = list(range(next_block, next_block + need))
        next_block += need
        ledger.append_blocks(req, fresh)
        for n in [prompt - hit] + [1] * (NEW - 1):  # the prompt's uncached part, then decode
            rows = rng.integers(0, shape.num_experts, (n, shape.num_layers, shape.top_k)).astype(
                shape.id_dtype
            )
            ledger.land(ledger.schedule([(req, n)]).seq, rows)
        ledger.finish(req)
        (done,) = ledger.collect()
        out.append(done.routing)
        blocks = cached + fresh
        known = prompt + NEW
    return out


def _host_table(shape, requests: int = 256, prompt: int = 1024, new: int = 256, batch: int = 64) -> Table:
    """Host time of delivery per 1M delivered tokens: the ledger (schedule, land, finish, collect)
    with its slot store, and the wire (vLLM's npy text of each finished request), for a serving
    loop of ``batch`` concurrent requests (a prefill step each, then decode steps of every running
    request); the rows are made before the clock starts."""
    t = Table(
        f"host cost per 1M delivered tokens ({shape.num_layers}x{shape.top_k} rows, {batch} running, "
        f"prompt {prompt}, {new} new tokens): CPU seconds",
        ["ledger + store s", "wire s", "total s", "tokens"],
    )
    bs = 16
    per_request = -(-(prompt + new) // bs)
    ledger = RoutingLedger(SlotStore(batch * per_request * bs, shape), bs)
    rng = np.random.default_rng(2)
    prompt_rows = rng.integers(0, shape.num_experts, (prompt, shape.num_layers, shape.top_k)).astype(
        shape.id_dtype
    )
    decode_rows = rng.integers(0, shape.num_experts, (batch, shape.num_layers, shape.top_k)).astype(
        shape.id_dtype
    )
    free = list(range(batch * per_request))
    ledger_s = wire_s = 0.0
    delivered = 0
    for wave in range(requests // batch):
        t0 = time.process_time()
        ids = [f"{wave}-{i}" for i in range(batch)]
        tables = {}
        for rid in ids:
            ledger.add_request(rid, prompt_len=prompt)
            tables[rid] = [free.pop() for _ in range(per_request)]
            ledger.append_blocks(rid, tables[rid])
            ledger.land(ledger.schedule([(rid, prompt)]).seq, prompt_rows)
        for _ in range(new - 1):
            ledger.land(ledger.schedule([(rid, 1) for rid in ids]).seq, decode_rows)
        for rid in ids:
            ledger.finish(rid)
        done = ledger.collect()
        ledger_s += time.process_time() - t0
        t0 = time.process_time()
        for d in done:
            encode_routing(d.routing, format="npy")
        wire_s += time.process_time() - t0
        delivered += sum(d.routing.shape[0] for d in done)
        for rid in ids:
            free += tables[rid]
    scale = 1e6 / delivered
    t.add(ledger_s * scale, wire_s * scale, (ledger_s + wire_s) * scale, delivered)
    return t


def _rank_table(shape, requests: int, tokens: int, ranks: int) -> Table:
    """Peak host memory (tracemalloc) of one trainer rank reading its requests' rows from a framed
    file (``FramedReader`` over a path: reads with seeks) against decoding the whole batch once."""
    t = Table(
        f"per-rank delivery: {requests} requests x {tokens} tokens of {shape.num_layers}x{shape.top_k} "
        f"uint8 rows to {ranks} ranks, peak host MB",
        ["batch MB", "whole batch MB", "one rank MB", "one rank / batch", "read s"],
    )
    rng = np.random.default_rng(1)
    row = rng.integers(0, shape.num_experts, (tokens, shape.num_layers, shape.top_k)).astype(np.uint8)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "batch.moef")
        write_framed(path, ((i, row) for i in range(requests)))  # one request at a time
        peaks = {}
        for label, mine in (("whole", range(requests)), ("rank", range(0, requests, ranks))):
            tracemalloc.start()
            t0 = time.perf_counter()
            with FramedReader(path) as reader:
                held = [reader.read(i) for i in mine]
            seconds = time.perf_counter() - t0
            peaks[label] = (tracemalloc.get_traced_memory()[1] / 1e6, seconds)
            tracemalloc.stop()
            assert all(np.array_equal(h, row) for h in held[:2])
            del held
    batch = requests * row.nbytes / 1e6
    t.add(batch, peaks["whole"][0], peaks["rank"][0], peaks["rank"][0] / peaks["whole"][0], peaks["rank"][1])
    return t


@benchmark(
    "sessions",
    cases=BENCH_CASES["sessions"],
    needs="cpu",
    options=[
        option("--rank-batch", "1024,1024,8", help="requests,tokens,ranks of the per-rank delivery table")
    ],
    tables=[
        table("multi-turn bytes per new token, deltas vs full re-sends", needs="cpu"),
        table("host cost of delivery per 1M tokens: ledger, store, wire", needs="cpu"),
        table("per-rank delivery: one rank's peak host memory against the whole batch", needs="cpu"),
    ],
)
def sessions(cases, run) -> list[Table]:
    """Bytes per new token of a 4-turn session, deltas vs full re-sends, per client format (CPU)."""
    t = Table(
        f"multi-turn bytes per new token: {TURNS} turns, prompt {PROMPT}, "
        f"{NEW} new + {USER} user tokens a turn",
        [
            "model",
            "format",
            "full B/token",
            "delta B/token",
            "delta/full",
            "last turn delta/full",
            "target",
            "met",
        ],
    )
    for case in cases:
        rng = np.random.default_rng(0)
        full = _session(case.shape, False, rng)
        delta = _session(case.shape, True, rng)
        new_tokens = TURNS * NEW
        for name, size in _formats(case.shape).items():
            full_b = sum(size(r) for r in full)
            delta_b = sum(size(r) for r in delta)
            last = size(delta[-1]) / size(full[-1])
            t.add(
                case.name, name, full_b / new_tokens, delta_b / new_tokens, delta_b / full_b, last,
                f"last turn <= {TARGET}", "met" if last <= TARGET else "missed",
            )  # fmt: skip
    requests, tokens, ranks = (int(v) for v in run.rank_batch.split(","))
    # the per-rank and host tables use DeepSeek-V3's rows, whichever cases were chosen
    deepseek = next(c.shape for c in BENCH_CASES["sessions"] if c.name == "deepseek-v3")
    return [t, _host_table(deepseek), _rank_table(deepseek, requests, tokens, ranks)]


if __name__ == "__main__":
    sys.exit(main(["sessions", *sys.argv[1:]]))
