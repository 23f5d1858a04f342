"""``moe-ops demo --hf ARCH``: a tiny Hugging Face transformers model instead of the reference model.

Eager, captured with :func:`moe_ops.integrations.hf.attach_capture`, through the same snapshot
pipeline, ledger and slot store; verified against the same forwards re-run alone. transformers is
imported by :func:`main_demo_hf` only, when ``--hf`` is given.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..capture.capturer import RoutingCapturer
from ..cli_args import UsageError
from ..shapes import resolve_routing_shape
from ..store import RoutingLedger, SlotStore
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
    return serve_hf(hf, arch, args, device)


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
    # transformers' grouped expert GEMM (torch._grouped_mm) takes float32/bf16/fp16, not float64
    model = hf.build_tiny_model(arch, seed=args.seed, dtype=torch.float32).to(device).eval()
    shape = resolve_routing_shape(model.config)
    requests = synthetic_requests(
        args.requests,
        vocab_size=int(model.config.vocab_size),
        max_seq_len=64,
        seed=args.seed,
        new_tokens=(1, 12),
    )
    print(
        f"moe-ops demo --hf {arch}: {shape.num_layers} MoE layers, {shape.num_experts} experts, "
        f"top-{shape.top_k} on {device} (eager, float32); {len(requests)} requests"
    )
    capturer = RoutingCapturer(shape, 64, device, ring_depth=2)
    cache_name = kv_cache_argument(model)

    def forward(tokens: Sequence[int], cache: Any, start: int) -> tuple[int, Any]:
        ids = torch.tensor([list(tokens)], dtype=torch.int64, device=device)
        positions = torch.arange(start, start + len(tokens), device=device)[None]
        capturer.set_step([len(tokens)])
        out = model(input_ids=ids, position_ids=positions, use_cache=True, **{cache_name: cache})
        return int(out.logits[0, -1].argmax()), getattr(out, cache_name)

    ledger = RoutingLedger(SlotStore(len(requests) * 64, shape), 64)
    sequences: dict[int, list[int]] = {}
    mismatched = 0
    with torch.no_grad(), hf.attach_capture(model, capturer):
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
                    ledger.land(seq, snap.result(copy=False))
                entry[3] = len(tokens)
                tokens.append(nxt)
                if len(tokens) - len(req.prompt) == req.max_new_tokens:
                    ledger.finish(req.req_id)
                    sequences[req.req_id] = tokens
                    live.remove(entry)
        captured = {done.req_id: done.routing for done in ledger.collect()}
        prompt_len = {r.req_id: len(r.prompt) for r in requests}
        for req_id, tokens in sorted(sequences.items()):
            cache, start, rows = None, 0, []
            for stop in range(prompt_len[req_id], len(tokens)):
                _, cache = forward(tokens[start:stop], cache, start)
                # host read (reference only); a copy: on CPU .numpy() would view the live buffer
                rows.append(capturer.buffer[: stop - start].cpu().numpy().copy())
                start = stop
            expected = np.concatenate(rows)
            got = captured.get(req_id)
            if got is None or got.shape != expected.shape:
                mismatched += len(tokens) - 1
                continue
            mismatched += int((got.astype(np.int64) != expected).any(axis=(1, 2)).sum())
    print(f"{'mode':<8} {'requests':>8} {'mismatched rows':>15}  result")
    print(f"{'eager':<8} {len(sequences):>8} {mismatched:>15}  {'PASS' if not mismatched else 'FAIL'}")
    os.makedirs(args.out, exist_ok=True)
    result = ServeResult("eager", True, sequences=sequences, routing=captured)
    written = write_routing(args.out, result, shape, requests)
    print(f"wrote {written} x request_<id>/routing.npz to {args.out}")
    return 1 if mismatched else 0
