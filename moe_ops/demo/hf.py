"""``moe-ops demo --hf ARCH``: a tiny Hugging Face transformers model instead of the reference model.

Eager, captured with :func:`moe_ops.integrations.hf.attach_capture`, through the same snapshot
pipeline, ledger and slot store; verified against the same forwards re-run alone. transformers is
imported by :func:`main_demo_hf` only, when ``--hf`` is given.

``--indexer`` (DeepSeek-V4): the tiny model's attention layers alternate compressed sparse
attention (its lightning indexer picks ``index_topk`` compressed entries per query) with sliding
attention, and the indexer's choices are recorded beside the routing
(:func:`moe_ops.integrations.hf.indexer.attach_indexer_capture`), moved as the channel
``"indexer"`` of every snapshot, held by the slot store, handed out by the ledger per request,
verified row by row like the routing, and written as SGLang's int32 layout and moe-ops' compact
format (``request_<id>/indexer.compact``), whose bytes the demo reports.
"""

from __future__ import annotations

import base64
import contextlib
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..capture.capturer import RoutingCapturer
from ..channels import IDS, Channel
from ..cli_args import UsageError
from ..shapes import resolve_routing_shape
from ..store import RoutingLedger, SlotStore
from ..transfer import TransferPipeline
from .files import write_routing
from .serve import ServeResult, synthetic_requests

__all__ = ["kv_cache_argument", "main_demo_hf", "serve_hf"]


def main_demo_hf(args: Any, device: torch.device) -> int:
    """``moe-ops demo --hf ARCH``: a tiny transformers model, eager, captured with attach_capture.
    Without the integration, or for an ARCH it does not support: :class:`moe_ops.cli_args.UsageError`
    (the command's usage error, exit 2)."""
    try:
        from ..integrations import hf
    except ImportError as exc:
        raise UsageError(
            f"--hf needs the transformers integration (moe_ops.integrations.hf) and transformers "
            f"(pip install 'moe-ops[hf]'): {exc}"
        ) from None
    arch = args.hf.strip().lower().replace("-", "_")  # transformers' model_type: "Qwen3-MoE" -> qwen3_moe
    if arch not in hf.SUPPORTED_ARCHITECTURES:
        raise UsageError(
            f"--hf {args.hf!r} is not supported; supported: " + ", ".join(sorted(hf.SUPPORTED_ARCHITECTURES))
        )
    if getattr(args, "indexer", False) and arch not in INDEXER_ARCHS:
        raise UsageError(
            f"--indexer records a sparse-attention indexer: --hf {' or '.join(INDEXER_ARCHS)}, "
            f"got {args.hf!r}"
        )
    return serve_hf(hf, arch, args, device)


# the architectures whose tiny model gets an indexer with --indexer, and the overrides that give it
# one: DeepSeek-V4's compressed sparse attention (entries of 4 tokens) on every other layer
INDEXER_ARCHS = ("deepseek_v4",)
_INDEXER_LAYER_TYPES = ("compressed_sparse_attention", "sliding_attention")
# the longest sequence a demo request reaches (max_seq_len below)
_MAX_SEQ = 64


def kv_cache_argument(model: Any) -> str:
    """The name under which ``model.forward`` takes the KV cache and its output returns it:
    ``past_key_values`` up to transformers 5.17 (the oldest release tried that lacks ``cache``),
    ``cache`` in 5.24, which still takes ``past_key_values`` with a FutureWarning that it goes in
    5.40. Read from the signature, so that every release of the supported range gets its own
    argument. (transformers' deprecation wrapper keeps the wrapped signature, ``functools.wraps``.)"""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def serve_hf(hf: Any, arch: str, args: Any, device: torch.device) -> int:
    """Eager serving of a tiny transformers model, one request per forward (prefill, then one decode
    row per forward, with the model's own KV cache), interleaved round-robin so that requests start
    and finish at different steps, through the snapshot pipeline, ledger and slot store.

    Reference: each request's same forwards re-run alone, the ids read straight from the capture
    buffer after each forward (no interleaving, pipeline, ledger or store). The forwards have the
    same shapes as in the served run, so the model computes the same values bit for bit (a
    one-prefill reference would not: float32 sums in another order can flip a near-tie). That
    ``attach_capture`` records what the unmodified router picks is the integration's own test.
    """
    with_indexer = bool(getattr(args, "indexer", False))
    overrides = {}
    if with_indexer:
        layers = int(hf.tiny_config(arch).num_hidden_layers)
        overrides["layer_types"] = [_INDEXER_LAYER_TYPES[i % 2] for i in range(layers)]
    # transformers' grouped expert GEMM (torch._grouped_mm) takes float32/bf16/fp16, not float64
    model = hf.build_tiny_model(arch, seed=args.seed, dtype=torch.float32, **overrides).to(device).eval()
    shape = resolve_routing_shape(model.config)
    requests = synthetic_requests(
        args.requests,
        vocab_size=int(model.config.vocab_size),
        max_seq_len=_MAX_SEQ,
        seed=args.seed,
        new_tokens=(1, 12),
    )
    print(
        f"moe-ops demo --hf {arch}: {shape.num_layers} MoE layers, {shape.num_experts} experts, "
        f"top-{shape.top_k} on {device} (eager, float32); {len(requests)} requests"
    )
    capturer = RoutingCapturer(shape, _MAX_SEQ, device, ring_depth=2)
    cache_name = kv_cache_argument(model)
    indexer = _IndexerStep(model, device) if with_indexer else None

    def forward(tokens: Sequence[int], cache: Any, start: int) -> tuple[int, Any]:
        ids = torch.tensor([list(tokens)], dtype=torch.int64, device=device)
        positions = torch.arange(start, start + len(tokens), device=device)[None]
        capturer.set_step([len(tokens)])
        if indexer is not None:
            indexer.counts.fill_(len(tokens))
        out = model(input_ids=ids, position_ids=positions, use_cache=True, **{cache_name: cache})
        return int(out.logits[0, -1].argmax()), getattr(out, cache_name)

    extra = [indexer.channel] if indexer is not None else []
    ledger = RoutingLedger(SlotStore(len(requests) * _MAX_SEQ, shape, extra_channels=extra), _MAX_SEQ)
    sequences: dict[int, list[int]] = {}
    mismatched = 0
    with contextlib.ExitStack() as attached:
        attached.enter_context(torch.no_grad())
        attached.enter_context(hf.attach_capture(model, capturer))
        if indexer is not None:
            attached.callback(indexer.attach().detach)
        live = [[r, list(r.prompt), None, 0] for r in requests]  # request, tokens, cache, computed
        for block, (req, *_rest) in enumerate(live):
            ledger.add_request(req.req_id, prompt_len=len(req.prompt))
            ledger.append_blocks(req.req_id, [block])
        while live:
            for entry in list(live):
                req, tokens, cache, computed = entry
                new = tokens[computed:]
                seq = ledger.schedule([(req.req_id, len(new))]).seq
                nxt, entry[2] = forward(new, cache, computed)
                with capturer.snapshot() as snap:
                    if indexer is None:
                        ledger.land(seq, snap.result(copy=False))
                    else:  # the indexer's snapshot of the same step beside the ids
                        with indexer.pipeline.snapshot(len(new)) as idx:
                            ledger.land(
                                seq, {IDS: snap.result(copy=False), "indexer": idx.result(copy=False)}
                            )
                entry[3] = len(tokens)
                tokens.append(nxt)
                if len(tokens) - len(req.prompt) == req.max_new_tokens:
                    ledger.finish(req.req_id)
                    sequences[req.req_id] = tokens
                    live.remove(entry)
        finished = list(ledger.collect())
        captured = {done.req_id: done.routing for done in finished}
        chosen = {done.req_id: done.channels.get("indexer") for done in finished}
        prompt_len = {r.req_id: len(r.prompt) for r in requests}
        index_mismatched = 0
        for req_id, tokens in sorted(sequences.items()):
            cache, start, rows, index_rows = None, 0, [], []
            for stop in range(prompt_len[req_id], len(tokens)):
                _, cache = forward(tokens[start:stop], cache, start)
                # host read (reference only); a copy: on CPU .numpy() would view the live buffer
                rows.append(capturer.buffer[: stop - start].cpu().numpy().copy())
                if indexer is not None:
                    index_rows.append(indexer.buffer[: stop - start].cpu().numpy().copy())
                start = stop
            expected = np.concatenate(rows)
            got = captured.get(req_id)
            if got is None or got.shape != expected.shape:
                mismatched += len(tokens) - 1
            else:
                mismatched += int((got.astype(np.int64) != expected).any(axis=(1, 2)).sum())
            if indexer is not None:
                want, have = np.concatenate(index_rows), chosen.get(req_id)
                if have is None or have.shape != want.shape:
                    index_mismatched += len(tokens) - 1
                else:
                    index_mismatched += int((have != want).any(axis=(1, 2)).sum())
    print(f"{'mode':<8} {'requests':>8} {'mismatched rows':>15}  result")
    print(f"{'eager':<8} {len(sequences):>8} {mismatched:>15}  {'PASS' if not mismatched else 'FAIL'}")
    os.makedirs(args.out, exist_ok=True)
    result = ServeResult("eager", True, sequences=sequences, routing=captured)
    written = write_routing(args.out, result, shape, requests)
    print(f"wrote {written} x request_<id>/routing.npz to {args.out}")
    if indexer is not None:
        index_mismatched += indexer.report(chosen, args.out, index_mismatched)
    return 1 if mismatched or index_mismatched else 0


class _IndexerStep:
    """The indexer half of ``--indexer``: a capture buffer the attachment writes, a transfer
    pipeline that snapshots it beside the capturer's ids (the channel ``"indexer"``), and the
    report: rows checked, bytes as int32 and compact, the compact text written per request."""

    def __init__(self, model: Any, device: torch.device):
        from ..indexer import indexer_shape

        shape = indexer_shape(model.config)
        self.model = model
        self.shape = shape
        # the positions a query may read: compressed entries of the longest demo sequence
        self.context = max(1, _MAX_SEQ // shape.tokens_per_position)
        self.buffer = torch.full(
            (_MAX_SEQ, shape.num_indexer_layers, shape.k), -1, dtype=torch.int32, device=device
        )
        self.counts = torch.zeros(1, dtype=torch.int32, device=device)
        self.channel = Channel("indexer", np.int32, (shape.num_indexer_layers, shape.k))
        # the positions' own ring (the capturer's snapshots carry its channels only): a step's two
        # snapshots land together as one mapping of channels
        self.pipeline = TransferPipeline(self.buffer, np.int32, depth=2)

    def attach(self) -> Any:
        from ..integrations.hf.indexer import attach_indexer_capture

        return attach_indexer_capture(self.model, self.buffer, token_counts=self.counts)

    def report(self, chosen: dict[int, np.ndarray | None], out: str, mismatched: int) -> int:
        """Prints the indexer's check (``mismatched`` rows, counted by the caller) and bytes, writes
        ``request_<id>/indexer.compact``; returns the requests whose record is missing."""
        from ..indexer import encode_positions
        from ..indexer.wire import codec

        missing, int32_bytes, compact_bytes, rows = 0, 0, 0, 0
        for req_id, positions in sorted(chosen.items()):
            if positions is None:
                missing += 1
                continue
            text = encode_positions(positions, format="compact", context=self.context)
            folder = os.path.join(out, f"request_{req_id:03d}")  # beside its routing.npz
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "indexer.compact"), "w") as f:
                f.write(text)
            rows += positions.shape[0]
            int32_bytes += positions.size * 4
            compact_bytes += len(base64.b64decode(text))
        s = self.shape
        bad = mismatched + missing
        print(
            f"indexer: {s.num_indexer_layers} layers (model layers {list(s.layers)}), top-{s.k} per query, "
            f"a position is a {s.unit} of {s.tokens_per_position} tokens; {rows} rows against the "
            f"reference forwards: {mismatched} mismatched, {missing} requests without a record "
            f"{'PASS' if not bad else 'FAIL'}"
        )
        print(
            f"indexer: {int32_bytes} B as int32 (SGLang's layout), {compact_bytes} B compact "
            f"({codec()} codec); wrote {len(chosen) - missing} x request_<id>/indexer.compact"
        )
        return missing
