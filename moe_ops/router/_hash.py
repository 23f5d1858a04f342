"""Hash routing's lookup, ``ids = hash_table[token_ids]``, checked: the rule the hash router kernel,
the replay kernel's live rows and their PyTorch twins share (private: import the launchers).

A row is **faulty** when its token id is outside ``[0, vocab)`` or one of its ``top_k`` table
entries is outside ``[0, num_experts)``. A faulty row's ids are all ``-1`` (and the callers weigh it
0); nothing is read at a faulty address: the table row of a bad token id is never loaded, and the
logits at a bad entry are never gathered. Each caller counts faulty rows in its fault counter with
these bits. An entry twice in one row is the table's choice, not a fault (the model's own router
gathers it twice as well).
"""

from __future__ import annotations

import torch

from .._runtime.triton import HAS_TRITON

__all__ = ["HASH_FAULT_ENTRY", "HASH_FAULT_TOKEN_ID", "hash_ids_torch"]

HASH_FAULT_TOKEN_ID = 1  # a token id outside [0, vocab): its table row is not read
HASH_FAULT_ENTRY = 2  # a table entry outside [0, num_experts): the row's logits are not gathered


# reference
def hash_ids_torch(
    hash_table: torch.Tensor, token_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, faulty, flags) of every row.

    hash_table: (vocab, top_k) integer, vocab >= 1 - the expert ids of every token id
    token_ids: (n,) integer - each row's token id
    Returns ``ids`` (n, top_k) int64 (-1 on faulty rows), ``faulty`` (n,) bool and ``flags`` a 0-d
    int64 tensor, the OR of the HASH_FAULT_* bits seen. No host reads.
    """
    vocab = hash_table.shape[0]
    tok = token_ids.to(torch.int64)
    token_bad = (tok < 0) | (tok >= vocab)
    # a bad token id reads row 0 instead (never out of bounds); the row is faulty anyway
    rows = hash_table[torch.where(token_bad, 0, tok)].to(torch.int64)
    entry_bad = ((rows < 0) | (rows >= num_experts)).any(1) & ~token_bad
    faulty = token_bad | entry_bad
    ids = torch.where(faulty[:, None], -1, rows)
    flags = torch.where(token_bad.any(), HASH_FAULT_TOKEN_ID, 0) | torch.where(
        entry_bad.any(), HASH_FAULT_ENTRY, 0
    )
    return ids, faulty, flags


if HAS_TRITON:
    import triton
    import triton.language as tl

    _TOKEN_ID = tl.constexpr(HASH_FAULT_TOKEN_ID)
    _ENTRY = tl.constexpr(HASH_FAULT_ENTRY)

    @triton.jit
    def hash_ids(
        table_ptr, tok_ptr, rows64, row_ok, kcol, k_ok, vocab, num_experts, stride_t, stride_hv, stride_hk,
    ):  # fmt: skip
        """(ids, faulty, flags) of a (BLOCK_M, K_PAD) tile whose per-row values repeat over the
        columns (``rows64``, ``row_ok``: each row's index and validity in every column; ``kcol``
        (1, K_PAD), ``k_ok`` its columns below top_k): ``ids`` int32 (-1 on faulty rows and masked
        cells), ``faulty`` bool (per row, repeated), ``flags`` the OR of the fault bits of the
        tile's valid rows (a scalar)."""
        tok = tl.load(tok_ptr + rows64 * stride_t, mask=row_ok, other=0).to(tl.int64)
        token_bad = row_ok & ((tok < 0) | (tok >= vocab))
        out_ok = row_ok & k_ok
        read = out_ok & ~token_bad  # a bad token id's row is never an address
        entry = tl.load(table_ptr + tok * stride_hv + kcol * stride_hk, mask=read, other=0).to(tl.int64)
        bad_entry = read & ((entry < 0) | (entry >= num_experts))
        entry_bad = tl.max(bad_entry.to(tl.int32), axis=1, keep_dims=True) > 0
        faulty = token_bad | entry_bad
        ids = tl.where(out_ok & ~faulty, entry, -1).to(tl.int32)
        flags = tl.where(tl.max(token_bad.to(tl.int32)) > 0, _TOKEN_ID, 0)
        flags |= tl.where(tl.max(entry_bad.to(tl.int32)) > 0, _ENTRY, 0)
        return ids, faulty, flags

    __all__ += ["hash_ids"]
