"""The indexer of a tiny transformers DeepSeek-V3.2 (built from the real config class): recorded
with masked keys as -1, and forced in another model's forward."""

from __future__ import annotations

import pytest
import torch

from moe_ops.capture.errors import FaultCounter
from moe_ops.indexer import indexer_shape

transformers = pytest.importorskip("transformers", reason="the model is transformers' DeepSeek-V3.2")
if not hasattr(transformers, "DeepseekV32Config"):
    pytest.skip("this transformers has no DeepSeek-V3.2", allow_module_level=True)

from moe_ops.integrations.hf.indexer import attach_indexer_capture, attach_indexer_replay, find_indexers  # noqa: E402

K = 4


def _model(seed):
    cfg = transformers.DeepseekV32Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        index_topk=K,
        index_n_heads=2,
        index_head_dim=16,
        first_k_dense_replace=1,
        max_position_embeddings=64,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.DeepseekV32ForCausalLM(cfg).eval()


def _seen(model):
    """What each indexer returned in the last forward (a hook outside the attachment's wrapper)."""
    seen = {}
    for layer, _, module in find_indexers(model):
        module.register_forward_hook(lambda mod, args, out, layer=layer: seen.__setitem__(layer, out.clone()))
    return seen


def test_capture_records_the_choices_with_masked_keys_as_minus_one():
    model = _model(0)
    seen = _seen(model)
    b, s = 2, 7
    ids = torch.randint(0, 64, (b, s), generator=torch.Generator().manual_seed(1))
    shape = indexer_shape(model.config)
    buffer = torch.full((16, shape.num_indexer_layers, K), -7, dtype=torch.int32)
    counter = FaultCounter("cpu")
    handle = attach_indexer_capture(
        model, buffer, token_counts=torch.tensor([b * s], dtype=torch.int32), fault_counter=counter
    )
    model(ids)
    assert counter.read_and_reset().total == 0
    for layer, rec_layer in handle.layers.items():
        out = seen[layer].reshape(b * s, K)
        query = torch.arange(s).repeat(b)[:, None]  # causal, no padding: keys [0, query]
        want = torch.where(out <= query, out, -1)
        assert torch.equal(buffer[: b * s, rec_layer], want)
        assert (buffer[: b * s, rec_layer, 0] >= 0).all()
        assert (buffer[0, rec_layer] >= 0).sum() == 1  # the first query sees one key
    assert (buffer[b * s :] == -7).all()
    handle.detach()
    assert "forward" not in vars(find_indexers(model)[0][2])


def test_replay_forces_the_record_and_falls_back_live():
    b, s = 2, 7
    ids = torch.randint(0, 64, (b, s), generator=torch.Generator().manual_seed(2))
    rollout = _model(0)
    shape = indexer_shape(rollout.config)
    record = torch.full((b * s, shape.num_indexer_layers, K), -7, dtype=torch.int32)
    attach_indexer_capture(rollout, record, token_counts=torch.tensor([b * s], dtype=torch.int32))
    rollout(ids)

    trainer = _model(5)  # other weights: its live choices differ
    seen = _seen(trainer)
    trainer(ids)
    live = {layer: out.reshape(b * s, K).clone() for layer, out in seen.items()}
    recorded = torch.empty(16, shape.num_indexer_layers, K, dtype=torch.int32)
    handle = attach_indexer_replay(trainer, recorded)
    batch = record.clone()
    batch[3] = -1  # a token without a record: the live choice
    handle.set_batch(batch)
    out = trainer(ids)
    out.logits.sum().backward()  # the replayed forward is differentiable
    differ = 0
    for layer, rec_layer in handle.layers.items():
        got = seen[layer].reshape(b * s, K)
        for row in range(b * s):
            want = batch[row, rec_layer]
            if row == 3:
                assert torch.equal(got[row], live[layer][row])
                continue
            chosen = set(want[want >= 0].tolist())
            assert set(got[row].tolist()) == chosen, (layer, row)
            differ += chosen != set(x for x in live[layer][row].tolist() if x <= row % s)
    assert differ > 0, "the trainer's own indexer chose otherwise somewhere: the test forces something"
    handle.set_batch(batch[:5])
    with pytest.raises(ValueError, match="set_batch gave 5"):
        trainer(ids)
    handle.detach()


def test_attachments_undo_in_reverse_order():
    model = _model(0)
    shape = indexer_shape(model.config)
    module = find_indexers(model)[0][2]
    buffer = torch.zeros(16, shape.num_indexer_layers, K, dtype=torch.int32)
    capture = attach_indexer_capture(model, buffer, token_counts=torch.tensor([1], dtype=torch.int32))
    wrapped = vars(module)["forward"]
    replay = attach_indexer_replay(model, torch.zeros(16, shape.num_indexer_layers, K, dtype=torch.int32))
    with pytest.raises(ValueError, match="detach it first"):
        capture.detach()
    replay.detach()
    assert vars(module)["forward"] is wrapped  # the capture still attached
    capture.detach()
    assert "forward" not in vars(module)


def test_replay_refuses_attention_paths_that_read_indices():
    model = _model(0)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="eager and SDPA"):
        attach_indexer_replay(model, torch.zeros(4, 3, K, dtype=torch.int32))


def test_refusals():
    model = _model(0)
    with pytest.raises(ValueError, match="recorded must be a"):
        attach_indexer_replay(model, torch.zeros(4, 2, K, dtype=torch.int64))
    qwen = transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=16,
            moe_intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_experts=4,
            num_experts_per_tok=2,
        )
    )
    with pytest.raises(ValueError, match="describes no sparse-attention indexer"):
        attach_indexer_capture(
            qwen, torch.zeros(4, 1, K, dtype=torch.int32), token_counts=torch.tensor([1], dtype=torch.int32)
        )


# ---------------------------------------------------------------------------------------------------
# DeepSeek-V4: the compressed-entry indexer of each compressed-sparse-attention layer
# ---------------------------------------------------------------------------------------------------

V4_LAYERS = ["compressed_sparse_attention", "sliding_attention", "compressed_sparse_attention"]


def _v4(seed):
    if not hasattr(transformers, "DeepseekV4Config"):
        pytest.skip("this transformers has no DeepSeek-V4 (5.24 and later)")
    from moe_ops.integrations.hf import build_tiny_model

    return build_tiny_model("deepseek_v4", seed=seed, layer_types=V4_LAYERS)


def test_v4_capture_records_entries_with_its_own_minus_one():
    """Entries of 4 tokens: query t may read entries below (t + 1) // 4; the indexer marks the rest
    -1 itself and returns min(index_topk, entries) columns (3 for 13 tokens): the record keeps its
    choices, -1 after them."""
    model = _v4(0)
    seen = _seen(model)
    b, s = 2, 13
    ids = torch.randint(0, 128, (b, s), generator=torch.Generator().manual_seed(1))
    shape = indexer_shape(model.config)
    assert shape.layers == (0, 2) and shape.unit == "compressed entry"
    k = shape.k
    buffer = torch.full((32, shape.num_indexer_layers, k), -7, dtype=torch.int32)
    counter = FaultCounter("cpu")
    handle = attach_indexer_capture(
        model, buffer, token_counts=torch.tensor([b * s], dtype=torch.int32), fault_counter=counter
    )
    model(ids)
    assert counter.read_and_reset().total == 0
    bound = (torch.arange(s) + 1) // 4
    for layer, rec_layer in handle.layers.items():
        out = seen[layer].reshape(b * s, -1)
        assert out.shape[1] == 3 < k
        rows = buffer[: b * s, rec_layer]
        assert torch.equal(rows[:, :3], out.to(torch.int32)) and (rows[:, 3:] == -1).all()
        chosen = (rows >= 0).sum(-1).reshape(b, s)
        assert torch.equal(chosen, bound.clamp(max=3).expand(b, s))  # every readable entry, up to 3
    assert (buffer[b * s :] == -7).all()
    handle.detach()


def test_v4_replay_forces_the_record_counts_faults_and_falls_back_live():
    """33 tokens: up to 8 entries to choose 4 from, so another model's indexer chooses otherwise.
    Forced: the record's entries (valid first, in the live call's columns), a row without a record
    and a faulty row (an entry past its query's bound, counted) read the live choice."""
    b, s = 2, 33
    ids = torch.randint(0, 128, (b, s), generator=torch.Generator().manual_seed(2))
    rollout = _v4(0)
    shape = indexer_shape(rollout.config)
    k = shape.k
    record = torch.full((b * s, shape.num_indexer_layers, k), -7, dtype=torch.int32)
    attach_indexer_capture(rollout, record, token_counts=torch.tensor([b * s], dtype=torch.int32))
    rollout(ids)

    trainer = _v4(3)
    seen = _seen(trainer)
    trainer(ids)
    live = {layer: out.reshape(b * s, -1).clone() for layer, out in seen.items()}
    batch = record.clone()
    batch[32, 0] = torch.tensor([7, 0, 3, 5], dtype=torch.int32)  # query 32 reads entries 0..7: any 4
    batch[32, 1] = -1  # no record: the live choice
    batch[20, 0] = torch.tensor([0, 2, 6, -1], dtype=torch.int32)  # entry 6 is past query 20's 5: a fault
    recorded = torch.empty(80, shape.num_indexer_layers, k, dtype=torch.int32)
    handle = attach_indexer_replay(trainer, recorded)
    handle.set_batch(batch)
    from moe_ops import check_faults

    check_faults("cpu", raise_error=False)  # counters from earlier calls: zero them
    out = trainer(ids)
    out.logits.sum().backward()
    assert check_faults("cpu", raise_error=False).total == 1
    differ = 0
    for layer, rec_layer in handle.layers.items():
        got = seen[layer].reshape(b * s, -1)
        assert got.shape[1] == k and got.dtype == torch.int64
        for row in range(b * s):
            want = batch[row, rec_layer]
            if (row, rec_layer) in ((32, 1), (20, 0)):
                want = live[layer][row]
            assert set(got[row].tolist()) - {-1} == set(want.tolist()) - {-1}, (layer, row)
            valid = got[row][got[row] >= 0]
            assert torch.equal(got[row][: valid.numel()], valid.sort().values)  # valid first
            differ += set(want.tolist()) - {-1} != set(live[layer][row].tolist()) - {-1}
    assert differ > 0, "the trainer's own indexer chose otherwise somewhere: the test forces something"
    handle.detach()
    assert "forward" not in vars(find_indexers(trainer)[0][2])
