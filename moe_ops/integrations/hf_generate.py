"""``generate_with_routing``: one routing array per request from a batched transformers ``generate``.

The RL engineer's rollout on a plain transformers model (no serving engine): a batch of
left-padded prompts, sampled with ``model.generate``; each request needs the routing of its own
tokens, in the layout a rollout engine returns and :func:`moe_ops.replay_batch` takes - rows for
its tokens ``0 .. T-2`` (prompt + generated up to its end), the padding, the tokens after its EOS and
its last token left out::

    processed positions (left-padded prompt of P, then G - 1 decode steps)
      request 0:  pad pad  p0 p1 p2 | g0 g1 EOS pad pad          T0 = 3 + 3 = 6 -> rows p0 .. g1
      request 1:  p0  p1   p2 p3 p4 | g0 g1 g2  g3  g4           T1 = 5 + 5 = 10 -> rows p0 .. g3

The routers are wrapped with ``attach_capture`` for the call and every router call's ids are kept
on the device (no host read while generating); the split into requests runs once at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ..layout import BatchLayout
from ..shapes import RoutingShape, resolve_routing_shape

__all__ = ["GeneratedRouting", "generate_with_routing"]

# generate() arguments whose forwards are not one prefill then one token per step per sequence
_REFUSED = {
    "num_beams": "beam search reorders and prunes sequences between steps",
    "assistant_model": "assisted generation runs a draft model and verifies several tokens a step",
    "prompt_lookup_num_tokens": "prompt-lookup decoding verifies several tokens a step",
    "num_assistant_tokens": "assisted generation verifies several tokens a step",
}


@dataclass(frozen=True)
class GeneratedRouting:
    """What :func:`generate_with_routing` returns."""

    # (batch, prompt_len + new) int64: generate()'s output, padding and all
    sequences: torch.Tensor
    # per request: (T - 1, shape.num_layers, top_k) int32 on the MoE-only axis, row j = the experts
    # token j of tokens[i] went to; what replay_batch takes (with num_tokens=[len(t) for t in tokens])
    routing: list[np.ndarray]
    # per request: (T,) int64, its tokens without padding: prompt, then generated up to and with
    # its first EOS (or every generated token when it has none)
    tokens: list[np.ndarray]
    # the model's routing shape (the layer axis of every routing array)
    shape: RoutingShape

    @property
    def num_tokens(self) -> list[int]:
        """Each request's T."""
        return [int(t.shape[0]) for t in self.tokens]


class _CallRecorder:
    """A capturer for ``attach_capture`` that keeps every router call's ids on the device."""

    def __init__(self, shape: RoutingShape):
        self.shape = shape
        self.calls: dict[int, list[torch.Tensor]] = {layer: [] for layer in shape.moe_layers}

    def capture(self, layer_id: int, topk_ids: torch.Tensor, layout: Any = BatchLayout.LOCAL) -> None:
        self.calls[layer_id].append(topk_ids.detach().to(torch.int32, copy=True))


def _eos_ids(model: nn.Module, generate_kwargs: dict) -> set[int]:
    eos = generate_kwargs.get("eos_token_id")
    if eos is None:
        config = generate_kwargs.get("generation_config") or getattr(model, "generation_config", None)
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple, Sequence)) else [eos])}


def generate_with_routing(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    **generate_kwargs: Any,
) -> GeneratedRouting:
    """Runs ``model.generate(input_ids, attention_mask=..., **generate_kwargs)`` and returns each
    request's routing beside the sequences.

    Args:
        model: a transformers causal LM of a supported architecture (``attach_capture``'s).
        input_ids: (batch, P) integer - the prompts, LEFT-padded (what decoder-only generation
            needs; right padding is refused).
        attention_mask: (batch, P) 0/1 - 0 on the padding; None: no padding.
        generate_kwargs: passed to ``generate`` (``max_new_tokens``, ``do_sample``, ...). Beam
            search and assisted/prompt-lookup decoding are refused (their forwards are not one
            prefill and one token a step per sequence), and so is ``use_cache=False`` (each step
            would run every position again).

    Returns a :class:`GeneratedRouting`: per request its routing ``(T - 1, num_layers, top_k)``
    and its ``T`` tokens (padding cut, generation cut after its first EOS - the generation config's
    ``eos_token_id``, or the argument). Feed the batch to the trainer with
    ``replay_batch(out.routing, out.shape, num_tokens=out.num_tokens, ...)``.

    Host syncs: the split at the end reads the sequences, the mask and the ids on the host once
    (nothing during generation). ValueError for refused arguments, right padding, or a model whose
    forwards did not follow one prefill and one token a step.
    """
    from .hf import attach_capture

    for name, why in _REFUSED.items():
        value = generate_kwargs.get(name)
        if value is not None and not (name == "num_beams" and value == 1):
            raise ValueError(f"generate_with_routing does not support {name}={value!r}: {why}")
    if generate_kwargs.get("use_cache") is False:
        raise ValueError(
            "generate_with_routing needs use_cache=True: without a cache every step reruns all rows"
        )
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids must be a (batch, prompt_len) tensor, got {getattr(input_ids, 'shape', input_ids)}"
        )
    batch, prompt_len = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (batch, prompt_len):
        raise ValueError(f"attention_mask must be a ({batch}, {prompt_len}) tensor like input_ids")
    mask = attention_mask.detach().to("cpu", torch.int64).numpy()
    pads = prompt_len - mask.sum(1)
    for b in range(batch):
        if not (mask[b, : pads[b]] == 0).all() or not (mask[b, pads[b] :] == 1).all():
            raise ValueError(
                f"attention_mask row {b} is not left padding (zeros, then ones): generate_with_routing "
                "needs left-padded prompts (tokenizer.padding_side = 'left')"
            )
    shape = resolve_routing_shape(model.config)
    recorder = _CallRecorder(shape)
    with attach_capture(model, recorder, layout=BatchLayout.LOCAL):
        sequences = model.generate(input_ids, attention_mask=attention_mask, **generate_kwargs)
    rows_out, num_out = sequences.shape
    if rows_out % batch:
        raise ValueError(f"generate returned {rows_out} sequences for a batch of {batch}")
    repeat = rows_out // batch  # num_return_sequences
    pads = np.repeat(pads, repeat)
    processed = num_out - 1  # every position but the last one ran through the model
    per_layer = []
    for layer in shape.moe_layers:
        calls = recorder.calls[layer]
        steps = [c.reshape(rows_out, -1, shape.top_k) for c in calls]
        ids = torch.cat(steps, dim=1) if steps else torch.empty(rows_out, 0, shape.top_k, dtype=torch.int32)
        if ids.shape[1] != processed:
            raise ValueError(
                f"the routers of layer {layer} ran {ids.shape[1]} positions per sequence for {num_out} "
                f"tokens (expected {processed}: one prefill of the prompt, then one token a step)"
            )
        per_layer.append(ids)
    stacked = torch.stack(per_layer, dim=2).cpu().numpy()  # (rows, processed, L, K): one host copy
    seqs = sequences.detach().cpu().numpy()
    eos = _eos_ids(model, generate_kwargs)
    routing, tokens = [], []
    for b in range(rows_out):
        generated = seqs[b, prompt_len:]
        ends = [j for j, t in enumerate(generated.tolist()) if t in eos]
        kept = ends[0] + 1 if ends else generated.shape[0]
        seq = np.concatenate([seqs[b, pads[b] : prompt_len], generated[:kept]])
        t = seq.shape[0]
        tokens.append(seq.astype(np.int64))
        routing.append(np.ascontiguousarray(stacked[b, pads[b] : pads[b] + t - 1]).astype(np.int32))
    return GeneratedRouting(sequences, routing, tokens, shape)
