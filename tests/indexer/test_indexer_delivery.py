"""An indexer record rides the routing's delivery path as a channel: captured on the device beside
the ids, moved by the snapshot ring, held by the slot store, handed out by the ledger per request,
and encoded for the client (SGLang's layout and the compact format) exactly."""

from __future__ import annotations

import numpy as np
import torch

from moe_ops import RoutingLedger, RoutingShape, SlotStore, TransferPipeline, capture_routing
from moe_ops.channels import IDS, Channel
from moe_ops.indexer import capture_indexer, decode_positions, encode_positions
from moe_ops.indexer.wire import canonical_positions

SHAPE = RoutingShape(num_layers=3, num_experts=64, top_k=2)
IDX_LAYERS, K, CONTEXT = 2, 8, 40


def test_indexer_positions_ride_the_ring_the_store_and_the_ledger():
    rng = np.random.default_rng(0)
    max_rows = 16
    ids_buf = torch.full((max_rows, SHAPE.num_layers, SHAPE.top_k), -1, dtype=torch.int32)
    idx_buf = torch.full((max_rows, IDX_LAYERS, K), -1, dtype=torch.int32)
    pipe = TransferPipeline(ids_buf, np.uint8, extra_channels=[(Channel("indexer", np.int32), idx_buf)])
    store = SlotStore(12, SHAPE, extra_channels=[Channel("indexer", np.int32, (IDX_LAYERS, K))])
    ledger = RoutingLedger(store, 4)
    for req, block in (("a", 0), ("b", 1)):
        ledger.add_request(req)
        ledger.append_blocks(req, [block])
    step = ledger.schedule([("a", 3), ("b", 2)])
    n = 5
    counts = torch.tensor([n], dtype=torch.int32)
    routed = torch.from_numpy(rng.integers(0, 64, size=(SHAPE.num_layers, n, SHAPE.top_k))).to(torch.int32)
    chosen = np.full((n, IDX_LAYERS, K), -1, dtype=np.int64)
    for layer in range(SHAPE.num_layers):
        capture_routing(ids_buf, routed[layer], layer, token_counts=counts)
    for layer in range(IDX_LAYERS):
        for row in range(n):
            m = int(rng.integers(1, K + 1))
            chosen[row, layer, :m] = rng.choice(CONTEXT, size=m, replace=False)
        capture_indexer(idx_buf, torch.from_numpy(chosen[:, layer]), layer, token_counts=counts)
    with pipe.snapshot(n) as handle:
        rows = handle.results()
    assert np.array_equal(rows["indexer"], chosen.astype(np.int32))
    ledger.land(step.seq, rows)
    ledger.finish("a")
    ledger.finish("b")
    done = {f.req_id: f for f in ledger.collect()}
    assert np.array_equal(done["a"].channels["indexer"], chosen[:3])
    assert np.array_equal(done["b"].channels["indexer"], chosen[3:5])
    assert np.array_equal(done["b"].routing, routed.permute(1, 0, 2)[3:5].numpy().astype(np.uint8))
    # to the client
    a = done["a"].channels["indexer"]
    text = encode_positions(a, format="sglang")
    assert np.array_equal(decode_positions(text, format="sglang", num_layers=IDX_LAYERS, k=K), a)
    text = encode_positions(a, format="compact", context=CONTEXT)
    assert np.array_equal(decode_positions(text), canonical_positions(a))
    assert list(rows) == [IDS, "indexer"]
