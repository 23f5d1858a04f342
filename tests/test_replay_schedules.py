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


def test_without_reselecting_a_recompute_reads_another_micro_batch():
    """The control: selecting only in forwards, the recompute in a backward reads whatever
    micro-batch's forward ran last. With other row counts that is refused; with equal ones the
    experts silently receive another micro-batch's ids, which the recorder sees."""
    order, num_chunks = SCHEDULES["1f1b-stage0-of-4"]
    with pytest.raises(ValueError, match="rows but the batch set for slot"):
        run_schedule(order, num_chunks, reentrant=False, reselect=False)
    equal = (6,) * len(SEQ_LENS)
    recorder, routing, _ = run_schedule(order, num_chunks, reentrant=False, reselect=False, seq_lens=equal)
    wrong = [
        (kind, m, layer)
        for (kind, m, _), layer, ids in recorder.calls
        if not torch.equal(ids, torch.from_numpy(routing[m][:, layer]).to(ids.dtype))
    ]
    assert wrong and all(kind == "B" for kind, _, _ in wrong), "only recomputes can read another batch"
