"""Replay under pipeline schedules: 1F1B and interleaved 1F1B with activation checkpointing.

One rank's view of a pipeline, on a real transformers model (a tiny Qwen3-MoE of 4 decoder
layers): the rank runs forwards and backwards of its model chunks in the order Megatron-LM's
schedules give it (``schedule_order`` below, written from Megatron's definitions and checked
against ``megatron.core.pipeline_parallel.schedules.get_schedule_table`` where megatron-core is
installed). Every decoder layer is checkpointed (``torch.utils.checkpoint``, reentrant and not), so
the backward of a micro-batch recomputes its layers' forward - after other micro-batches' forwards
ran. A forward pre-hook on each layer's ``experts`` module (transformers' own, independent of the
library) records the ids the experts received in every call, tagged with the schedule step that
made it; every call must have received its own micro-batch's recorded ids.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from strategies import distinct_rows
from torch.utils.checkpoint import checkpoint

from moe_ops import RoutingReplayer, resolve_routing_shape

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("moe_ops.integrations.hf")

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_LAYERS = 4
SEQ_LENS = (5, 7, 6, 4, 7, 5, 6, 4)  # one micro-batch of batch 1 each: their router row counts


def schedule_order(num_microbatches: int, num_stages: int, stage: int, num_chunks: int = 1):
    """This rank's ``("F" | "B", microbatch, chunk)`` steps in Megatron-LM's 1F1B schedule
    (``num_chunks == 1``: forward_backward_pipelining_without_interleaving) or its interleaved
    schedule (forward_backward_pipelining_with_interleaving, microbatch_group_size_per_vp_stage =
    num_stages): ``warmup`` forwards, then one forward and one backward per step, then the
    remaining backwards. Virtual micro-batch ``k`` is ``table[k]`` going forward; a backward runs
    the chunks in reverse order."""
    group = num_stages
    table = []  # (microbatch, chunk) of each virtual micro-batch, as get_schedule_table builds it
    for first in range(0, num_microbatches, group):
        members = range(first, min(first + group, num_microbatches))
        table += [(m, c) for c in range(num_chunks) for m in members]
    total = num_microbatches * num_chunks
    if num_chunks == 1:
        warmup = num_stages - stage - 1
    else:
        warmup = (num_stages - stage - 1) * 2 + (num_chunks - 1) * group
    warmup = min(warmup, total)
    forward = [("F", m, c) for m, c in table]
    backward = [("B", m, num_chunks - 1 - c) for m, c in table]
    order = forward[:warmup]
    for k in range(total - warmup):
        order += [forward[warmup + k], backward[k]]
    return order + backward[total - warmup :]


@pytest.mark.parametrize(("stages", "stage", "chunks"), [(4, 0, 1), (2, 0, 2), (2, 1, 2)])
def test_schedule_order_is_megatrons(stages, stage, chunks):
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    order = schedule_order(8, stages, stage, chunks)
    if chunks > 1:
        table = schedules.get_schedule_table(8, chunks, stages)
        assert [(m, c) for kind, m, c in order if kind == "F"] == [tuple(t) for t in table]
    # every (microbatch, chunk) once each way, a backward after its forward
    done = set()
    for kind, m, c in order:
        if kind == "B":
            assert ("F", m, c) in done
        done.add((kind, m, c))
    assert len(done) == len(order) == 2 * 8 * chunks


class ExpertRecorder:
    """The ids each decoder layer's experts received, per call, tagged with the running step."""

    def __init__(self, model):
        self.step = None
        self.calls = []  # (step, layer, ids)
        self.hooks = []
        for i, layer in enumerate(model.model.layers):
            record = functools.partial(self._record, i)
            self.hooks.append(layer.mlp.experts.register_forward_pre_hook(record, with_kwargs=True))

    def _record(self, layer, module, args, kwargs):
        ids = args[1] if len(args) > 1 else kwargs["top_k_index"]
        self.calls.append((self.step, layer, ids.detach().clone()))


def chunk_layers(chunk: int, num_chunks: int) -> range:
    per = NUM_LAYERS // num_chunks
    return range(chunk * per, (chunk + 1) * per)


def run_chunk(model, chunk: int, num_chunks: int, x: torch.Tensor, reentrant: bool) -> torch.Tensor:
    """Chunk ``chunk`` of the model: embedding first, then its decoder layers (each checkpointed),
    then the final norm and head on the last chunk."""
    inner = model.model
    h = inner.embed_tokens(x) if chunk == 0 else x
    position_ids = torch.arange(h.shape[1]).unsqueeze(0)
    position_embeddings = inner.rotary_emb(h, position_ids=position_ids)
    for i in chunk_layers(chunk, num_chunks):
        layer = functools.partial(
            inner.layers[i], position_ids=position_ids, position_embeddings=position_embeddings
        )
        h = checkpoint(layer, h, use_reentrant=reentrant)
    if chunk == num_chunks - 1:
        h = model.lm_head(inner.norm(h))
    return h


def run_schedule(order, num_chunks: int, *, reentrant: bool, reselect: bool, seq_lens=SEQ_LENS):
    """Runs ``order`` on a tiny Qwen3-MoE with replay attached; returns the recorder, the recorded
    routing of each micro-batch and the number of slots used."""
    model = hf.build_tiny_model("qwen3_moe", num_hidden_layers=NUM_LAYERS).train()
    shape = resolve_routing_shape(model.config)
    num_microbatches = len(seq_lens)
    # slots: the most micro-batches in flight (first forward run, last backward not yet)
    live, slots = set(), 0
    for kind, m, c in order:
        if kind == "F" and c == 0:
            live.add(m)
        slots = max(slots, len(live))
        if kind == "B" and c == 0:
            live.discard(m)
    replayer = RoutingReplayer(shape, max(seq_lens), "cpu", num_slots=slots)
    rng = np.random.default_rng(7)
    routing = [distinct_rows(rng, n, shape) for n in seq_lens]
    gen = torch.Generator().manual_seed(3)
    inputs = {
        (m, c): (
            torch.randint(3, model.config.vocab_size, (1, n), generator=gen)
            if c == 0
            else torch.randn(1, n, model.config.hidden_size, generator=gen).requires_grad_()
        )
        for m, n in enumerate(seq_lens)
        for c in range(num_chunks)
    }
    outputs = {}
    recorder = ExpertRecorder(model)
    with hf.attach_replay(model, replayer):
        for kind, m, c in order:
            slot = m % slots
            recorder.step = (kind, m, c)
            if kind == "F":
                if c == 0:
                    replayer.set_batch(routing[m], slot=slot)
                replayer.select(slot)
                out = run_chunk(model, c, num_chunks, inputs[m, c], reentrant)
                outputs[m, c] = replayer.select_in_backward(out, slot) if reselect else out
            else:
                out = outputs.pop((m, c))
                grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(m * 10 + c))
                torch.autograd.backward(out, grad)
    assert not outputs and num_microbatches * num_chunks * 2 == len(order)
    return recorder, routing, slots


SCHEDULES = {
    "1f1b-stage0-of-4": (schedule_order(len(SEQ_LENS), 4, 0), 1),
    "1f1b-stage2-of-4": (schedule_order(len(SEQ_LENS), 4, 2), 1),
    "interleaved-stage0-of-2": (schedule_order(len(SEQ_LENS), 2, 0, 2), 2),
    "interleaved-stage1-of-2": (schedule_order(len(SEQ_LENS), 2, 1, 2), 2),
}


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_forward_and_recompute_reads_its_own_micro_batch(name, reentrant):
    order, num_chunks = SCHEDULES[name]
    recorder, routing, slots = run_schedule(order, num_chunks, reentrant=reentrant, reselect=True)
    assert slots > 1, "the schedule must keep several micro-batches in flight"
    seen = {}
    for (kind, m, c), layer, ids in recorder.calls:
        assert layer in chunk_layers(c, num_chunks)
        expected = torch.from_numpy(routing[m][:, layer]).to(ids.dtype)
        assert torch.equal(ids, expected), f"{kind}{m} chunk {c} layer {layer} received other ids"
        seen[kind, m, layer] = seen.get((kind, m, layer), 0) + 1
    # each layer ran once per forward and once more, recomputed, in its backward
    for m in range(len(SEQ_LENS)):
        for layer in range(NUM_LAYERS):
            assert seen[("F", m, layer)] == 1 and seen[("B", m, layer)] == 1


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("seq_lens", [SEQ_LENS, (6,) * len(SEQ_LENS)], ids=["sizes-differ", "equal-sizes"])
def test_without_reselecting_each_recompute_still_reads_its_own_micro_batch(seq_lens, reentrant):
    """Selecting only before each forward (no select_in_backward): the recompute in a backward
    reads the batch its own forward read, found from the autograd node that runs it, even though
    another micro-batch is selected then - also with equal micro-batch sizes, where reading the
    selected batch would give no error and the wrong ids."""
    order, num_chunks = SCHEDULES["1f1b-stage0-of-4"]
    recorder, routing, slots = run_schedule(
        order, num_chunks, reentrant=reentrant, reselect=False, seq_lens=seq_lens
    )
    assert slots > 1
    recomputes = 0
    for (kind, m, c), layer, ids in recorder.calls:
        expected = torch.from_numpy(routing[m][:, layer]).to(ids.dtype)
        assert torch.equal(ids, expected), f"{kind}{m} chunk {c} layer {layer} received other ids"
        recomputes += kind == "B"
    assert recomputes == len(seq_lens) * NUM_LAYERS


def test_a_recompute_whose_batch_was_replaced_raises():
    """A micro-batch's slot filled again before its backward: the recompute cannot read the batch
    its forward read, and raises instead of replaying the new batch's ids (one slot, equal sizes)."""
    model = hf.build_tiny_model("qwen3_moe", num_hidden_layers=NUM_LAYERS).train()
    shape = resolve_routing_shape(model.config)
    replayer = RoutingReplayer(shape, 6, "cpu")
    rng = np.random.default_rng(1)
    x = torch.randint(3, model.config.vocab_size, (1, 6))
    with hf.attach_replay(model, replayer):
        replayer.set_batch(distinct_rows(rng, 6, shape))
        out = run_chunk(model, 0, 1, x, reentrant=False)
        replayer.set_batch(distinct_rows(rng, 6, shape))  # the next micro-batch, too early
        with pytest.raises(ValueError, match=r"filled again .* before this backward"):
            out.sum().backward()


@pytest.mark.filterwarnings("ignore:.*gradient_checkpointing_enable.*:FutureWarning")  # 5.2x renamed it
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gradient_checkpointing_recomputes_each_equal_micro_batch_with_its_own_rows(reentrant):
    """transformers' own gradient checkpointing (``gradient_checkpointing_enable``): two micro-batches
    of equal size run their forwards, then their backwards; each recompute reads its own rows with
    nothing selected in backward, and the routers' gradients equal those of each micro-batch run on
    its own (forward then backward, nothing in between)."""
    model = hf.build_tiny_model("qwen3_moe", num_hidden_layers=NUM_LAYERS).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.enable_input_require_grads()  # reentrant checkpoints need an input that requires grad
    shape = resolve_routing_shape(model.config)
    rng = np.random.default_rng(11)
    routing = [distinct_rows(rng, 6, shape) for _ in range(2)]
    gen = torch.Generator().manual_seed(5)
    inputs = [torch.randint(3, model.config.vocab_size, (1, 6), generator=gen) for _ in range(2)]
    gates = [layer.mlp.gate.weight for layer in model.model.layers]

    def gate_grads(interleaved: bool) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        replayer = RoutingReplayer(shape, 6, "cpu", num_slots=2)
        for slot in range(2):
            replayer.set_batch(routing[slot], slot=slot)
        recorder = ExpertRecorder(model)
        with hf.attach_replay(model, replayer):
            if interleaved:  # F0 F1 B0 B1: micro-batch 1 is selected during 0's backward
                outs = []
                for mb in range(2):
                    replayer.select(mb)
                    recorder.step = ("F", mb, 0)
                    outs.append(model(inputs[mb]).logits)
                for mb in range(2):
                    recorder.step = ("B", mb, 0)
                    outs[mb].float().pow(2).mean().backward()
            else:  # F0 B0 F1 B1
                for mb in range(2):
                    replayer.select(mb)
                    recorder.step = ("F", mb, 0)
                    out = model(inputs[mb]).logits
                    recorder.step = ("B", mb, 0)
                    out.float().pow(2).mean().backward()
        for hook in recorder.hooks:
            hook.remove()
        recomputes = 0
        for (kind, m, _), layer, ids in recorder.calls:
            expected = torch.from_numpy(routing[m][:, layer]).to(ids.dtype)
            assert torch.equal(ids, expected), f"{kind}{m} layer {layer} received other ids"
            recomputes += kind == "B"
        assert recomputes == 2 * NUM_LAYERS, "every checkpointed layer recomputes in backward"
        return [g.grad.clone() for g in gates]

    alone, interleaved = gate_grads(False), gate_grads(True)
    for a, b in zip(alone, interleaved):
        # the same sums of the same float32 products, in the same order: equal to rounding
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
