"""Recording and forcing the sparse-attention indexer of a transformers model (DeepSeek-V3.2, and the
models built on its ``Indexer`` module: GLM-5's ``GlmMoeDsa``; DeepSeek-V4's compressed-entry
indexer), beside the router.

transformers' indexer (``DeepseekV32Indexer.forward``) returns the ``[B, S, topk]`` int32 positions
of ``index_scores.topk(min(index_topk, T))``, and its eager/SDPA attention scatters them into the
mask. A query that sees fewer than ``index_topk`` keys still gets ``index_topk`` positions: the
rest are masked keys (future tokens, padding) whose score is the mask's minimum. Those are not a
choice, so the record stores -1 in their place (the DSA rule: positions beyond the sequence are
never chosen), found on the device from the attention mask the indexer was given.

* :func:`attach_indexer_capture` - each indexer layer's positions into a ``(max_tokens,
  num_indexer_layers, k)`` int32 buffer (:func:`moe_ops.indexer.capture_indexer`; rows are the
  batch's ``B * S`` query tokens, row-major);
* :func:`attach_indexer_replay` - the attention reads the recorded positions
  (:func:`moe_ops.indexer.replay_indexer`: a row without a record, or a faulty one, reads the live
  indexer's; faulty rows are counted). -1 entries of a replayed row are handed to the attention as a
  repeat of a chosen position (the eager/SDPA path scatters them; a repeat changes nothing there).

DeepSeek-V4 (``DeepseekV4Indexer``, inside each compressed-sparse-attention layer's compressor)
chooses among compressed entries of ``compress_rate`` tokens, and marks a choice a query may not
read yet (an entry past ``(position + 1) // compress_rate``) with -1 itself: the record keeps its
-1, the capture checks each position against that bound, and a replayed row hands its -1 to the
compressor as the indexer's own "no entry" (valid positions first, as many columns as the live
call returned).

Both return a handle whose ``detach()`` restores the modules' own ``forward``. The layer axis is
:func:`moe_ops.indexer.indexer_shape`'s: the indexer layers that run, in model order.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ...indexer import capture_indexer, indexer_shape, replay_indexer

__all__ = ["IndexerAttachment", "attach_indexer_capture", "attach_indexer_replay", "find_indexers"]


_LAYER_IN_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def find_indexers(model: nn.Module) -> list[tuple[int, str, nn.Module]]:
    """(model layer, module name, module) of every indexer of ``model`` (modules with
    ``index_topk`` whose class name ends in ``Indexer``; the layer is the module's ``layer_idx``,
    else the ``layers.<i>.`` of its name - DeepSeek-V4's indexer is handed its layer per call), in
    layer order."""
    found = []
    for name, module in model.named_modules():
        if not (type(module).__name__.endswith("Indexer") and hasattr(module, "index_topk")):
            continue
        if hasattr(module, "layer_idx"):
            found.append((int(module.layer_idx), name, module))
        elif (match := _LAYER_IN_NAME.search(name)) is not None:
            found.append((int(match.group(1)), name, module))
    return sorted(found, key=lambda item: item[0])


def _compressed(module: nn.Module) -> bool:
    """DeepSeek-V4's indexer: it chooses compressed entries and marks unreadable ones -1 itself."""
    return hasattr(module, "compress_rate")


def _entry_bounds(module: nn.Module, args: tuple, kwargs: dict, shape) -> torch.Tensor:
    """(B * S,) int32: the compressed entries each query may read, ``(position + 1) //
    compress_rate`` (DeepseekV4Indexer.forward(hidden_states, q_residual, position_ids, ...))."""
    position_ids = kwargs.get("position_ids", args[2] if len(args) > 2 else None)
    if not isinstance(position_ids, torch.Tensor):
        raise ValueError("the DeepSeek-V4 indexer was called without its position_ids")
    bound = (position_ids + 1) // int(module.compress_rate)
    return bound.expand(shape[0], shape[1]).reshape(-1).to(torch.int32)


def _padded(positions: torch.Tensor, k: int) -> torch.Tensor:
    """[..., k] int32: ``positions`` with -1 columns after them (a call over fewer entries than k)."""
    out = positions.to(torch.int32)
    if out.shape[-1] < k:
        out = torch.cat([out, out.new_full((*out.shape[:-1], k - out.shape[-1]), -1)], dim=-1)
    return out


def _record_layers(model: nn.Module) -> tuple[dict[int, int], int]:
    """(model layer -> record layer, k) for ``model``'s indexers; ValueError when its config has no
    indexer or its indexers disagree with the config."""
    config = getattr(model, "config", None)
    shape = indexer_shape(config) if config is not None else None
    if shape is None:
        raise ValueError(
            "model.config describes no sparse-attention indexer (see moe_ops.indexer.indexer_shape)"
        )
    indexers = find_indexers(model)
    layers = {layer for layer, _, _ in indexers}
    if not indexers or not layers <= set(shape.layers):
        raise ValueError(
            f"the model's indexer modules sit at layers {sorted(layers)}, its config records "
            f"{list(shape.layers)}"
        )
    return {layer: i for i, layer in enumerate(shape.layers)}, shape.k


def _allowed(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, S, T] bool: the keys each query may read, from the indexer's 3-D mask (bool, or additive
    with 0 where allowed)."""
    if attention_mask.dtype == torch.bool:
        return attention_mask
    return attention_mask > torch.finfo(attention_mask.dtype).min / 2


def _chosen(positions: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """[B, S, k] int32: ``positions`` with -1 where the key is masked (not a choice) and in the
    columns past ``T`` (a sequence shorter than k gets fewer positions from transformers)."""
    allowed_here = allowed.expand(positions.shape[0], positions.shape[1], allowed.shape[-1])
    ok = allowed_here.gather(-1, positions.long())
    out = torch.where(ok, positions, -1).to(torch.int32)
    if out.shape[-1] < k:
        pad = out.new_full((*out.shape[:-1], k - out.shape[-1]), -1)
        out = torch.cat([out, pad], dim=-1)
    return out


def _mask_of(args: tuple, kwargs: dict) -> torch.Tensor:
    # DeepseekV32Indexer.forward(hidden_states, q_resid, position_embeddings, attention_mask, ...)
    mask = kwargs.get("attention_mask", args[3] if len(args) > 3 else None)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 3:
        raise ValueError("the indexer was called without its 3-D [B, S, T] attention_mask")
    return mask


@dataclass
class IndexerAttachment:
    """What :func:`attach_indexer_capture` / :func:`attach_indexer_replay` attached.

    Not thread-safe: one model's forward at a time, as transformers' modules are."""

    # model layer -> record layer
    layers: dict[int, int]
    # positions per row
    k: int
    # the replay's record (max_tokens, num_indexer_layers, k) int32, and the rows of this batch
    recorded: torch.Tensor | None = None
    num_rows: int | None = None
    # (module, the forward set, the forward it replaced or None) per wrapped indexer
    _restore: list[tuple[nn.Module, Callable, Callable | None]] = field(default_factory=list, repr=False)

    def set_batch(self, positions: torch.Tensor) -> None:
        """The record of the next forward's ``B * S`` query tokens: (n, num_indexer_layers, k)
        integer on the record's device (copied into it; rows in the batch's row-major order)."""
        if self.recorded is None:
            raise ValueError("set_batch is for an attach_indexer_replay handle")
        if (
            not isinstance(positions, torch.Tensor)
            or positions.dim() != 3
            or positions.shape[1:] != self.recorded.shape[1:]
        ):
            raise ValueError(
                f"positions must be (n, {self.recorded.shape[1]}, {self.recorded.shape[2]}), got "
                f"{getattr(positions, 'shape', type(positions).__name__)}"
            )
        if positions.shape[0] > self.recorded.shape[0]:
            raise ValueError(
                f"positions has {positions.shape[0]} rows, the record holds {self.recorded.shape[0]}"
            )
        self.recorded[: positions.shape[0]].copy_(positions)
        self.num_rows = positions.shape[0]

    def detach(self) -> None:
        """Restores the forward each indexer had before this attachment. Attachments are undone in
        reverse order: where a later attachment still wraps an indexer, ValueError and nothing
        changes."""
        if any(vars(module).get("forward") is not mine for module, mine, _ in self._restore):
            raise ValueError(
                "another attachment wraps this model's indexers: detach it first (attachments are "
                "undone in reverse order)"
            )
        while self._restore:
            module, _, before = self._restore.pop()
            if before is None:
                del module.forward  # the class's forward again
            else:
                module.forward = before


def _wrap(module: nn.Module, forward: Callable) -> tuple[nn.Module, Callable, Callable | None]:
    """Sets ``module.forward`` to ``forward``; returns (module, forward, the forward it replaced:
    an attachment made before, or None for the class's)."""
    before = vars(module).get("forward")
    module.forward = forward
    return module, forward, before


def attach_indexer_capture(
    model: nn.Module,
    buffer: torch.Tensor,
    *,
    token_counts: torch.Tensor,
    fault_counter=None,
) -> IndexerAttachment:
    """Records every indexer layer's choice into ``buffer`` (max_tokens, num_indexer_layers, k)
    int32 on the model's device, rows ``[0, token_counts[0])`` (LOCAL layout: the batch's ``B * S``
    query tokens, row-major). Masked keys are stored as -1 (see the module docstring); the capture
    checks each position against its query's keys and repeats (:func:`moe_ops.indexer.capture_indexer`)."""
    layers, k = _record_layers(model)
    handle = IndexerAttachment(layers, k)
    for layer, _, module in find_indexers(model):
        orig = module.forward

        def forward(*args, _orig=orig, _layer=layers[layer], _module=module, **kwargs):
            out = _orig(*args, **kwargs)
            if _compressed(_module):  # its own -1 for an entry the query may not read yet
                rows = _padded(out, k).reshape(-1, k)
                kv_lens = _entry_bounds(_module, args, kwargs, out.shape)
            else:
                allowed = _allowed(_mask_of(args, kwargs))
                rows = _chosen(out, allowed, k).reshape(-1, k)
                kv_lens = (allowed * torch.arange(1, allowed.shape[-1] + 1, device=allowed.device)).amax(-1)
                kv_lens = kv_lens.expand(out.shape[0], out.shape[1]).reshape(-1).to(torch.int32)
            capture_indexer(
                buffer,
                rows,
                _layer,
                token_counts=token_counts,
                fault_counter=fault_counter,
                kv_lens=kv_lens,
                check_duplicates=False,  # a top-k cannot repeat
            )
            return out

        handle._restore.append(_wrap(module, forward))
    return handle


def attach_indexer_replay(model: nn.Module, recorded: torch.Tensor) -> IndexerAttachment:
    """Makes every indexer layer return the recorded positions of its query rows: ``recorded``
    (max_tokens, num_indexer_layers, k) int32 on the model's device holds them (fill it with the
    handle's ``set_batch`` before each forward; a forward of another row count is a ValueError).
    Rows without a record or with a faulty one (a position beyond the query's keys, a repeat) read
    the live indexer's choice; faulty rows are counted (:func:`moe_ops.check_faults`)."""
    layers, k = _record_layers(model)
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in ("eager", "sdpa"):
        raise ValueError(
            f"attach_indexer_replay supports the eager and SDPA attention paths (transformers scatters "
            f"the positions into the mask, where a repeated position changes nothing); "
            f"_attn_implementation={impl!r} reads them as kernel indices"
        )
    if (
        not isinstance(recorded, torch.Tensor)
        or recorded.dim() != 3
        or recorded.dtype != torch.int32
        or recorded.shape[1:] != (len(layers), k)
    ):
        raise ValueError(
            f"recorded must be a (max_tokens, {len(layers)}, {k}) int32 tensor, got "
            f"{getattr(recorded, 'dtype', type(recorded).__name__)} {tuple(getattr(recorded, 'shape', ()))}"
        )
    handle = IndexerAttachment(layers, k, recorded=recorded)
    for layer, _, module in find_indexers(model):
        orig = module.forward

        def forward(*args, _orig=orig, _layer=layers[layer], _module=module, **kwargs):
            live = _orig(*args, **kwargs)
            n = live.shape[0] * live.shape[1]
            if handle.num_rows != n:
                raise ValueError(
                    f"the indexer reads {n} query rows but set_batch gave {handle.num_rows}: set the "
                    "batch's record before the forward"
                )
            if _compressed(_module):
                kv_lens = _entry_bounds(_module, args, kwargs, live.shape)
                rows = replay_indexer(_padded(live, k).reshape(n, k), recorded[:n, _layer], kv_lens=kv_lens)
                # its valid entries first, -1 (the indexer's own "none") after them, in the live
                # call's columns: a query reads at most min(k, entries) of them
                key = torch.where(rows >= 0, rows, torch.iinfo(torch.int32).max).sort(dim=-1).values
                rows = torch.where(key == torch.iinfo(torch.int32).max, -1, key)[:, : live.shape[-1]]
                return rows.reshape(live.shape).to(live.dtype)
            allowed = _allowed(_mask_of(args, kwargs))
            kv_lens = (allowed * torch.arange(1, allowed.shape[-1] + 1, device=allowed.device)).amax(-1)
            kv_lens = kv_lens.expand(live.shape[0], live.shape[1]).reshape(-1)
            width = live.shape[-1]
            rec = recorded[:n, _layer]
            live_rows = _chosen(live, allowed, k).reshape(n, k)
            rows = replay_indexer(live_rows, rec, kv_lens=kv_lens)
            # -1 becomes a repeat of the row's largest chosen position (every row chose one: a
            # query reads at least itself); the attention's scatter sees only chosen keys
            # (a fully masked query, a padding row, chose none: key 0, which its mask hides anyway)
            rows = torch.where(rows >= 0, rows, rows.amax(-1, keepdim=True).clamp(min=0))
            return rows[:, :width].reshape(live.shape) if width == k else _narrow(rows, width, live.shape)

        handle._restore.append(_wrap(module, forward))
    return handle


def _narrow(rows: torch.Tensor, width: int, shape) -> torch.Tensor:
    """A sequence shorter than k: transformers' indexer returns ``width = T`` positions; the T
    chosen ones of a row (at most T distinct) sorted, with repeats after them, fit in T columns."""
    ordered = rows.sort(dim=-1).values
    top = ordered[:, -1:]
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    # repeats sort after every distinct position, then become the row's largest position again
    key = torch.where(first, ordered, top + 1 + torch.arange(rows.shape[-1], device=rows.device))
    out = key.sort(dim=-1).values[:, :width]
    return torch.where(out <= top, out, top).reshape(shape).to(torch.int32)
