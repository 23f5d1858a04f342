"""What the RL loop needs around the replay on a transformers model: generate_with_routing (a
batched, left-padded, sampled generate() split into one routing array per request, against each
request's routing computed on its own: an unpadded, uncached forward of its tokens, read by plain
forward hooks on transformers' own router modules) and the live ids of a replayed forward
(RoutingReplayer(record_live=True))."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moe_ops
from moe_ops import RoutingReplayer, replay_batch

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("moe_ops.integrations.hf")
from moe_ops.integrations.hf_generate import generate_with_routing  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def own_routing(model, tokens: np.ndarray) -> np.ndarray:
    """(T, L, K) ids of every token of one request, from one unpadded forward without a cache;
    read from the routers' outputs with plain forward hooks."""
    _, routers = hf.find_routers(model)
    seen = {}
    hooks = [
        module.register_forward_hook(
            lambda mod, args, out, layer=layer: seen.__setitem__(
                layer, next(t for t in out if not t.dtype.is_floating_point)
            )
        )
        for layer, _, module in routers
    ]
    try:
        with torch.no_grad():
            model(torch.from_numpy(tokens)[None], use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return np.stack([seen[layer].reshape(len(tokens), -1).numpy() for layer, _, _ in routers], axis=1)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_each_request_gets_its_own_rows(arch):
    # float64: the batched, cached and padded forwards agree with the unpadded one to ~1e-15, so the
    # chosen experts are the same (a near-tie that close does not occur in these tiny models)
    model = hf.build_tiny_model(arch, dtype=torch.float64, experts_implementation="eager")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen) for n in (5, 2, 4)]
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros_like(input_ids)
    for b, p in enumerate(prompts):
        input_ids[b, width - len(p) :] = p
        mask[b, width - len(p) :] = 1
    # an EOS that request 1 samples at its third step: its tokens stop there, the others run on
    torch.manual_seed(1)
    probe = model.generate(input_ids, attention_mask=mask, max_new_tokens=7, do_sample=True, eos_token_id=[])
    eos = int(probe[1, width + 2])
    torch.manual_seed(1)
    out = generate_with_routing(
        model, input_ids, attention_mask=mask, max_new_tokens=7, do_sample=True, eos_token_id=eos
    )
    assert torch.equal(out.sequences[:, : width + 3], probe[:, : width + 3])
    shape = out.shape
    for b, p in enumerate(prompts):
        generated = out.sequences[b, width:].tolist()
        kept = generated.index(eos) + 1 if eos in generated else len(generated)
        expected_tokens = np.array(p.tolist() + generated[:kept])
        np.testing.assert_array_equal(out.tokens[b], expected_tokens)
        assert out.routing[b].shape == (len(expected_tokens) - 1, shape.num_layers, shape.top_k)
        assert out.routing[b].dtype == np.int32
        np.testing.assert_array_equal(out.routing[b], own_routing(model, expected_tokens)[:-1])
    assert out.num_tokens[1] == len(prompts[1]) + 3  # cut after its EOS
    # straight into the trainer's batch: lengths checked, rows in place
    batch = replay_batch(out.routing, shape, num_tokens=out.num_tokens)
    replayer = RoutingReplayer(shape, batch.shape[0], "cpu")
    replayer.set_batch(batch)


def test_refused_generation_modes():
    model = hf.build_tiny_model("qwen3_moe")
    ids = torch.ones(2, 3, dtype=torch.int64) * 5
    with pytest.raises(ValueError, match="num_beams=2: beam search"):
        generate_with_routing(model, ids, max_new_tokens=2, num_beams=2)
    with pytest.raises(ValueError, match="use_cache=True"):
        generate_with_routing(model, ids, max_new_tokens=2, use_cache=False)
    right = torch.tensor([[1, 1, 0], [1, 1, 1]])
    with pytest.raises(ValueError, match="attention_mask row 0 is not left padding"):
        generate_with_routing(model, ids, attention_mask=right, max_new_tokens=2)
    with pytest.raises(ValueError, match="input_ids must be a"):
        generate_with_routing(model, ids[0], max_new_tokens=2)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_a_replayed_forward_records_what_each_router_chose_live(arch):
    """record_live: the live ids of a replayed forward, without a second forward. The oracle runs
    each router's own class forward on the hidden states it received in the replayed forward (a
    forward pre-hook), independent of the wrapper."""
    model = hf.build_tiny_model(arch)
    shape = moe_ops.resolve_routing_shape(model.config)
    _, routers = hf.find_routers(model)
    n = 7
    rng = np.random.default_rng(4)
    routing = np.stack(
        [
            np.stack([rng.permutation(shape.num_experts)[: shape.top_k] for _ in range(shape.num_layers)])
            for _ in range(n)
        ]
    )
    replayer = RoutingReplayer(shape, n, "cpu", record_live=True)
    inputs = {}
    hooks = [
        module.register_forward_pre_hook(
            lambda mod, args, layer=layer: inputs.__setitem__(layer, args[0].detach())
        )
        for layer, _, module in routers
    ]
    with torch.no_grad(), hf.attach_replay(model, replayer):
        replayer.set_batch(routing)
        model(torch.randint(3, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0)))
    for h in hooks:
        h.remove()
    for column, (layer, _, module) in enumerate(routers):
        with torch.no_grad():
            output = type(module).forward(module, inputs[layer])
        own = next(t for t in output if not t.dtype.is_floating_point)
        assert torch.equal(replayer.live_buffer[:n, column], own.reshape(n, -1).to(torch.int32))
    m = moe_ops.routing_mismatch(replayer.buffer[:n], replayer.live_buffer[:n])
    assert float(m.changed.min()) > 0  # random records: the live routers chose otherwise
    assert RoutingReplayer(shape, n, "cpu").live_buffer is None  # off by default
