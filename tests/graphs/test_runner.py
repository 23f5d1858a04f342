"""StepRunner: padding to capture sizes, live counts, eager fallback, bounded compiles, CUDA graphs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from strategies import POISON, step_row_counts

from moe_ops import RoutingCapturer, RoutingShape
from moe_ops.capture import StepCapturer
from moe_ops.graphs import CompileCounters, RunnerMode, StepInput, StepRunner

SHAPE = RoutingShape(num_layers=2, num_experts=64, top_k=3, moe_layers=(0, 2), num_model_layers=3)
SIZES = (1, 2, 4, 8, 16)
STATE_SLOTS = 6  # slots 0..4 are real, 5 is the dummy slot of padding rows
DUMMY = STATE_SLOTS - 1
PAD_TOKEN = -1000  # distinctive: must never show up in an output or the capture buffer
INPUTS = (StepInput("token_ids", torch.int64, PAD_TOKEN), StepInput("slot_ids", torch.int64, DUMMY))


pytestmark = pytest.mark.usefixtures("one_thread")


class ToyStep(torch.nn.Module):
    """A step shaped like a model's: per-row state writes (a KV cache stand-in indexed by slot, a
    module buffer like a real model's cache, so its address is static for inductor's CUDA graphs),
    two "MoE layers" whose ids derive from the tokens, outputs per row."""

    def __init__(self, capturer, state):
        super().__init__()
        self.capturer = capturer
        self.register_buffer("state", state)

    def forward(self, token_ids, slot_ids):
        self.state.index_put_((slot_ids,), token_ids)
        for j, layer in enumerate(SHAPE.moe_layers):
            ids = torch.stack(
                [(token_ids * 7 + 5 * j + k) % SHAPE.num_experts for k in range(SHAPE.top_k)], 1
            )
            self.capturer.capture(layer, ids)
        return token_ids * 2 + slot_ids, self.state[slot_ids]


def toy_step(capturer, state):
    return ToyStep(capturer, state)


def expected_ids(tokens: torch.Tensor) -> torch.Tensor:
    cols = [
        torch.stack([(tokens * 7 + 5 * j + k) % SHAPE.num_experts for k in range(SHAPE.top_k)], 1)
        for j in range(SHAPE.num_layers)
    ]
    return torch.stack(cols, 1).to(torch.int32)


def make_runner(mode, device, sizes=SIZES):
    capturer = RoutingCapturer(SHAPE, 48, device)
    state = torch.zeros(STATE_SLOTS, dtype=torch.int64, device=device)
    runner = StepRunner(
        toy_step(capturer, state), INPUTS, mode=mode, capture_sizes=sizes, device=device, capturer=capturer
    )
    return runner, capturer, state


def run_steps(runner, capturer, state, row_counts, device):
    """Runs steps of the given row counts; checks outputs, capture rows and padding isolation."""
    g = torch.Generator().manual_seed(sum(row_counts))
    for n in row_counts:
        tokens = torch.randint(0, 10_000, (n,), generator=g)
        slots = torch.randint(0, DUMMY, (n,), generator=g)
        capturer.buffer.fill_(POISON)
        out, seen = runner.step(tokens, slots)
        assert out.shape == (n,) and seen.shape == (n,), "outputs must have exactly the real rows"
        assert torch.equal(out.cpu(), tokens * 2 + slots)
        assert not (seen == PAD_TOKEN).any(), "a real row read state written by a padding row"
        assert torch.equal(capturer.buffer[:n].cpu(), expected_ids(tokens))
        assert (capturer.buffer[n:] == POISON).all(), f"rows past the live count {n} were written"
        assert not (state[:DUMMY] == PAD_TOKEN).any(), "a padding row wrote a real slot"
        assert capturer.num_tokens == n


def test_padded_size_is_the_smallest_capture_size_that_holds_the_batch():
    runner, _, _ = make_runner(RunnerMode.COMPILED, "cpu", sizes=(8, 1, 4, 2, 4))
    assert runner.capture_sizes == (1, 2, 4, 8)
    assert [runner.padded_size(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    eager, _, _ = make_runner(RunnerMode.EAGER, "cpu")
    assert eager.padded_size(37) == 37


@settings(max_examples=25)
@given(row_counts=step_row_counts)
def test_eager_steps_run_unpadded(row_counts):
    runner, capturer, state = make_runner(RunnerMode.EAGER, "cpu")
    run_steps(runner, capturer, state, row_counts, "cpu")
    assert runner.stats.padded_rows == 0 and runner.stats.eager_fallbacks == 0
    assert runner.stats.steps == len(row_counts) and runner.stats.rows == sum(row_counts)


@settings(max_examples=15)
@given(row_counts=step_row_counts)
def test_compiled_steps_pad_and_fall_back_without_recompiling(row_counts):
    runner, capturer, state = make_runner(RunnerMode.COMPILED, "cpu")
    runner.warm_up()  # compiles: size 1 (static) and one dynamic graph for 2..16
    with CompileCounters() as cc:
        run_steps(runner, capturer, state, row_counts, "cpu")
    assert cc.graphs == 0 and cc.graph_breaks == 0, cc.recompile_reasons
    padded = [runner.padded_size(n) for n in row_counts]
    assert runner.stats.eager_fallbacks == sum(p is None for p in padded)
    assert runner.stats.padded_rows == sum(p - n for p, n in zip(padded, row_counts) if p is not None)


def test_warm_up_compiles_at_most_two_graphs_and_records_nothing():
    torch._dynamo.reset()  # count this test's compiles whatever ran before
    runner, capturer, state = make_runner(RunnerMode.COMPILED, "cpu", sizes=(1, 2, 3, 5, 8, 13))
    capturer.buffer.fill_(POISON)
    with CompileCounters() as cc:
        runner.warm_up()
    assert cc.graphs <= 2, f"one graph per capture size is a recompile: {cc.recompile_reasons}"
    assert (capturer.buffer == POISON).all(), "warm-up recorded padding rows"
    assert (state[:DUMMY] == 0).all(), "warm-up wrote a real slot"


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(mode="cuda-graph"), ValueError, "mode 'cuda-graph' needs a CUDA device"),
        (dict(mode="fast"), ValueError, "mode must be one of 'eager', 'compiled'"),
        (dict(capture_sizes=()), ValueError, "capture_sizes must be a non-empty sequence of ints >= 1"),
        (dict(capture_sizes=(0, 4)), ValueError, "capture_sizes must be a non-empty sequence of ints >= 1"),
        (dict(capture_sizes=(True,)), ValueError, "capture_sizes must be a non-empty sequence of ints >= 1"),
        (
            dict(mode="compiled", capture_sizes=(8, 64)),
            ValueError,
            "capture_sizes go up to 64 rows, but the capturer's buffer holds max_num_tokens=48",
        ),
        (dict(inputs=()), TypeError, "inputs must be a non-empty sequence of StepInput"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, exc, match):
    capturer = RoutingCapturer(SHAPE, 48, "cpu")
    args = dict(inputs=INPUTS, mode="eager", capture_sizes=SIZES, device="cpu", capturer=capturer) | kwargs
    with pytest.raises(exc, match=match):
        StepRunner(lambda *x: x[0], args.pop("inputs"), **args)


@pytest.mark.parametrize(
    "inputs, kwargs, exc, match",
    [
        (
            (torch.zeros(3, dtype=torch.int64),),
            {},
            ValueError,
            r"step takes 2 inputs \(token_ids, slot_ids\)",
        ),
        ((torch.zeros(3), torch.zeros(3, dtype=torch.int64)), {}, ValueError, "token_ids must have dtype"),
        ((torch.zeros(3, 1, dtype=torch.int64),) * 2, {}, ValueError, r"token_ids must have shape \(n,\)"),
        (
            (torch.zeros(3, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)),
            {},
            ValueError,
            "token_ids has 3, slot_ids has 4",
        ),
        ((torch.zeros(0, dtype=torch.int64),) * 2, {}, ValueError, "at least one row"),
        (([1, 2], torch.zeros(2, dtype=torch.int64)), {}, TypeError, "token_ids must be a torch.Tensor"),
        ((torch.zeros(49, dtype=torch.int64),) * 2, {}, ValueError, "exceeds max_num_tokens=48"),
    ],
)
def test_bad_step_input_leaves_counts_and_stats_untouched(inputs, kwargs, exc, match):
    runner, capturer, _ = make_runner(RunnerMode.COMPILED, "cpu")
    capturer.set_step([5])
    with pytest.raises(exc, match=match):
        runner.step(*inputs, **kwargs)
    assert capturer.token_counts.tolist() == [5] and runner.stats.steps == 0


def test_token_counts_need_a_capturer_and_dp_ranks_need_counts():
    plain = StepRunner(lambda t, s: t, INPUTS, mode="eager")
    rows = (torch.zeros(2, dtype=torch.int64),) * 2
    with pytest.raises(ValueError, match="token_counts given but the runner has no capturer"):
        plain.step(*rows, token_counts=[2])
    two_ranks = RoutingCapturer(SHAPE, 8, "cpu", dp_size=2)
    runner = StepRunner(lambda t, s: t, INPUTS, mode="eager", capturer=two_ranks)
    with pytest.raises(ValueError, match="token_counts is required: the capturer has dp_size=2 ranks"):
        runner.step(*rows)
    runner.step(*rows, token_counts=[1, 2])
    assert two_ranks.token_counts.tolist() == [1, 2]


# ------------------------------------------------------------------------------------------- GPU

GRAPH_MODES = [RunnerMode.CUDA_GRAPH, RunnerMode.COMPILED_CUDA_GRAPH, RunnerMode.REDUCE_OVERHEAD]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", GRAPH_MODES, ids=lambda m: m.value)
def test_graph_modes_replay_with_live_counts(cuda_device, mode):
    runner, capturer, state = make_runner(mode, cuda_device)
    counts_ptr, buffer_ptr = capturer.token_counts.data_ptr(), capturer.buffer.data_ptr()
    with CompileCounters() as warm:
        runner.warm_up()
    with CompileCounters() as cc:
        # every capture size, sizes between them, above the largest (eager), and back
        run_steps(runner, capturer, state, [1, 3, 16, 9, 2, 17, 40, 5, 1, 16, 7], cuda_device)
    assert cc.graphs == 0, f"recompiled after warm-up: {cc.recompile_reasons}"
    assert warm.graphs <= 2 and warm.cudagraph_skips == 0 and cc.cudagraph_skips == 0
    assert runner.stats.eager_fallbacks == 2
    if mode.manual_graphs:
        assert runner.graph_sizes == SIZES and runner.stats.graphs_captured == len(SIZES)
    assert capturer.token_counts.data_ptr() == counts_ptr and capturer.buffer.data_ptr() == buffer_ptr
    assert capturer.check_errors(raise_error=False) == 0


@pytest.mark.gpu
def test_lazy_capture_runs_the_real_step_once(cuda_device):
    """A size captured on first use is captured on padding rows; the real step then runs once."""
    capturer = RoutingCapturer(SHAPE, 48, cuda_device)
    calls = torch.zeros(STATE_SLOTS, dtype=torch.int64, device=cuda_device)

    def step(token_ids, slot_ids):
        calls.index_add_(0, slot_ids, torch.ones_like(slot_ids))
        return token_ids + 0

    runner = StepRunner(
        step, INPUTS, mode="cuda-graph", capture_sizes=(4,), device=cuda_device, capturer=capturer
    )
    runner.step(torch.tensor([5, 6, 7]), torch.tensor([0, 1, 1]))
    assert calls[:DUMMY].tolist() == [1, 2, 0, 0, 0], "real rows ran more than once (or not at all)"


class ProtocolOnly:
    """A real RoutingCapturer behind exactly the StepCapturer members, and nothing else: a runner
    that reached for any other attribute (token_counts, buffer, ...) fails here."""

    def __init__(self, capturer: RoutingCapturer):
        self._capturer = capturer
        self.dp_size = capturer.dp_size
        self.max_num_tokens = capturer.max_num_tokens

    def set_step(self, token_counts, shard_sizes=None, *, stream=None):
        self._capturer.set_step(token_counts, shard_sizes, stream=stream)

    def clear_counts(self, *, stream=None):
        self._capturer.clear_counts(stream=stream)


def test_the_runner_talks_to_the_capturer_through_the_protocol_only():
    capturer = RoutingCapturer(SHAPE, 48, "cpu")
    state = torch.zeros(STATE_SLOTS, dtype=torch.int64)
    wrapped = ProtocolOnly(capturer)
    assert isinstance(wrapped, StepCapturer) and isinstance(capturer, StepCapturer)
    runner = StepRunner(
        toy_step(capturer, state),
        INPUTS,
        mode="compiled",
        capture_sizes=SIZES,
        device="cpu",
        capturer=wrapped,
    )
    capturer.set_step([7])
    capturer.buffer.fill_(POISON)
    runner.warm_up((4,))
    assert capturer.token_counts.tolist() == [0] and capturer.num_tokens == 0, "warm-up must clear the counts"
    assert (capturer.buffer == POISON).all(), "warm-up recorded padding rows"
    tokens = torch.tensor([3, 1, 4], dtype=torch.int64)
    runner.step(tokens, torch.tensor([0, 1, 2], dtype=torch.int64))
    assert capturer.token_counts.tolist() == [3] and capturer.num_tokens == 3
    assert torch.equal(capturer.buffer[:3], expected_ids(tokens))
    assert (capturer.buffer[3:] == POISON).all()


def test_a_capturer_without_the_protocol_is_refused_naming_what_it_lacks():
    capturer = RoutingCapturer(SHAPE, 48, "cpu")

    class NoClear:
        dp_size, max_num_tokens = 1, 48
        set_step = capturer.set_step

    with pytest.raises(TypeError, match=r"capturer must be a StepCapturer .* NoClear lacks clear_counts"):
        StepRunner(lambda t, s: t, INPUTS, mode="eager", capturer=NoClear())


def test_clear_counts_zeroes_the_live_counts_only():
    capturer = RoutingCapturer(SHAPE, 8, "cpu", dp_size=2, dp_rank=1, shards_per_rank=2)
    capturer.set_step([3, 5], [1, 2, 2, 3])
    step, stamps = capturer.step, capturer.layer_stamps.clone()
    counts_ptr = capturer.token_counts.data_ptr()
    capturer.clear_counts()
    assert capturer.token_counts.tolist() == [0, 0] and capturer.num_tokens == 0
    assert capturer.token_counts.data_ptr() == counts_ptr, "the counts' address is baked into graphs"
    assert capturer.shard_sizes.tolist() == [1, 2, 2, 3] and capturer.step == step
    assert capturer.step_tensor.tolist() == [step] and torch.equal(capturer.layer_stamps, stamps)
    ids = torch.zeros(5, SHAPE.top_k, dtype=torch.int32)
    capturer.buffer.fill_(POISON)
    capturer.capture(0, ids)
    assert (capturer.buffer == POISON).all(), "a capture after clear_counts recorded rows"
