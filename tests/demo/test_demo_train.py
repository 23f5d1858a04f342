"""The training half of ``moe-ops demo``: the rollout's routing, through the wire format, replayed
in one float32 training step of the same model with perturbed router weights."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import routing_arrays, serving_requests

import moe_ops.demo.train as demo_train
from moe_ops.cli import main
from moe_ops.demo import serve, synthetic_requests
from moe_ops.demo.train import (
    LOGPROB_TOL,
    RoutingDrift,
    TrainCheck,
    drift_figure,
    perturb_routers,
    replay_mismatch_figure,
    routing_drift,
    train_check,
    training_model,
    wire_round_trip,
)
from moe_ops.models import ReferenceMoEModel, reference_config
from moe_ops.replay.replayer import replay_batch
from moe_ops.wire import decode_routing, encode_routing

# the demo's tiny preset (float64 rollout), shorter sequences and fewer slots to stay cheap
CONFIG = reference_config("tiny", max_seq_len=32, max_requests=4)
SHAPE = CONFIG.routing_shape()
SERVE = dict(capture_sizes=(2, 4, 8, 16), max_batch_tokens=24, max_running=3, block_size=4, ring_depth=2)

pytestmark = pytest.mark.usefixtures("one_thread")

_MODEL: list[ReferenceMoEModel] = []


def model() -> ReferenceMoEModel:
    if not _MODEL:
        _MODEL.append(ReferenceMoEModel(CONFIG))
    return _MODEL[0]


def rollout(requests, mode="eager"):
    result = serve(model(), requests, mode=mode, **SERVE)
    return result, {r.req_id: len(r.prompt) for r in requests}


def gates(m: ReferenceMoEModel) -> list[torch.Tensor]:
    return [layer.mlp.gate.detach().clone() for layer in m.layers[CONFIG.first_k_dense :]]


# ------------------------------------------------------------------------------ the wire format


@given(arrays=st.lists(routing_arrays().filter(lambda a: a.ndim == 3), min_size=1, max_size=4))
def test_wire_round_trip_returns_every_request_exactly(arrays):
    routing = dict(enumerate(arrays))
    back = wire_round_trip(routing)
    assert sorted(back) == sorted(routing)
    for req_id, array in routing.items():
        got = back[req_id]
        assert got.shape == array.shape and got.dtype.newbyteorder("=") == array.dtype.newbyteorder("=")
        np.testing.assert_array_equal(got, array)


@pytest.mark.parametrize("bad", [np.zeros((3, 4), np.int32), np.int32(5), [[[1]]]])
def test_wire_round_trip_rejects_what_is_not_a_request_routing(bad):
    with pytest.raises(ValueError, match=r"routing\[7\] must be a 3-D"):
        wire_round_trip({0: np.zeros((2, 2, 4), np.uint8), 7: bad})


# ------------------------------------------------------------------------------- the weights


def test_training_model_is_a_float32_copy_that_requires_grad():
    src = model()
    train = training_model(src)
    assert train.config.dtype == torch.float32 and train.config == dataclasses.replace(
        src.config, dtype=torch.float32
    )
    for (name, p), (_, q) in zip(train.named_parameters(), src.named_parameters(), strict=True):
        assert p.dtype == torch.float32 and p.requires_grad, name
        # float64 -> float32 rounding: relative error <= 2**-24
        torch.testing.assert_close(p.detach().double(), q.double(), rtol=2**-24, atol=0)
    assert not any(q.requires_grad for q in src.parameters()), "the rollout model must stay untouched"


def test_perturb_routers_is_seeded_and_touches_only_the_gates():
    a, b = training_model(model()), training_model(model())
    before = {k: v.clone() for k, v in a.state_dict().items()}
    perturb_routers(a, 0.01, seed=3)
    perturb_routers(b, 0.01, seed=3)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name  # same seed, same numbers
        changed = not torch.equal(x, before[name])
        assert changed == name.endswith("mlp.gate"), name
    c = training_model(model())
    perturb_routers(c, 0.01, seed=4)
    assert not torch.equal(gates(c)[0], gates(a)[0])
    kept = gates(c)
    perturb_routers(c, 0.0, seed=4)
    assert all(torch.equal(g, h) for g, h in zip(kept, gates(c)))


@pytest.mark.parametrize("lr", [-0.1, float("nan"), float("inf"), True, "0.1"])
def test_perturb_routers_rejects_a_bad_lr_and_changes_nothing(lr):
    m = training_model(model())
    before = gates(m)
    with pytest.raises(ValueError, match="lr must be a finite number >= 0"):
        perturb_routers(m, lr, seed=0)
    assert all(torch.equal(g, h) for g, h in zip(before, gates(m)))


# --------------------------------------------------------------------------- the training step


def test_training_step_replays_the_record_and_matches_the_rollout():
    """The demo's fixed workload: every check the demo prints, asserted."""
    requests = synthetic_requests(6, vocab_size=CONFIG.vocab_size, max_seq_len=CONFIG.max_seq_len, seed=1)
    result, prompt_lens = rollout(requests)
    before = gates(model())
    check = train_check(model(), "eager", result.sequences, result.routing, prompt_lens, lr=0.01)
    assert all(torch.equal(g, h) for g, h in zip(before, gates(model()))), "rollout model modified"
    packed = sorted(result.routing)[: CONFIG.max_requests]
    assert check.requests == CONFIG.max_requests
    assert check.rows == sum(len(result.sequences[i]) for i in packed)
    assert check.recorded_rows == check.rows - check.requests  # a last token per request has no row
    assert check.wire_mismatched == 0
    # without replay the perturbed routers choose other experts for some tokens in every layer
    assert check.changed.shape == check.disjoint.shape == (SHAPE.num_layers,)
    assert (check.changed > 0).all(), check.changed
    assert (check.disjoint <= check.changed).all()
    # with replay every recorded token gets exactly its recorded experts
    assert (check.replay_changed == 0).all() and (check.replay_changed_unperturbed == 0).all()
    # unperturbed float32 training vs the float64 rollout: measured 1.5e-6
    assert 0 <= check.logprob_max_abs_diff <= LOGPROB_TOL
    assert check.logprob_tokens == sum(len(result.sequences[i]) - prompt_lens[i] for i in packed)
    assert np.isfinite(check.loss) and check.loss > 0
    assert check.router_grad_norm > 0, "no gradient reached the routers through the replayed weights"
    assert check.problems == []


@settings(max_examples=4)
@given(requests=serving_requests(CONFIG.vocab_size, CONFIG.max_seq_len, max_requests=4, max_new=6))
def test_replay_is_exact_for_any_workload(requests):
    result, prompt_lens = rollout(requests)
    check = train_check(model(), "eager", result.sequences, result.routing, prompt_lens, lr=0.05, seed=7)
    assert (check.replay_changed == 0).all() and (check.replay_changed_unperturbed == 0).all()
    assert check.wire_mismatched == 0 and check.logprob_max_abs_diff <= LOGPROB_TOL
    assert check.router_grad_norm > 0 and check.problems == []


def test_replay_off_is_caught(monkeypatch):
    """Fault injection: an attach_replay that replays nothing must show a mismatch with replay."""
    import moe_ops.integrations.hf as hf

    monkeypatch.setattr(hf, "attach_replay", lambda model, replayer: contextlib.nullcontext())
    requests = synthetic_requests(4, vocab_size=CONFIG.vocab_size, max_seq_len=CONFIG.max_seq_len, seed=1)
    result, prompt_lens = rollout(requests)
    check = train_check(model(), "eager", result.sequences, result.routing, prompt_lens, lr=0.05)
    np.testing.assert_array_equal(check.replay_changed, check.changed)
    assert (check.replay_changed > 0).any()
    assert "replayed routing differs from the record" in check.problems


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_requests=0), r"max_requests must be an int in \[1, config.max_requests=4\]"),
        (dict(max_requests=5), r"max_requests must be an int in \[1, config.max_requests=4\]"),
        (dict(lr=-1.0), "lr must be a finite number >= 0"),
        (dict(prompt_lens={}), r"prompt_lens\[0\] must be in \[1, "),
        (dict(routing={}), "at least one req_id"),
    ],
)
def test_train_check_rejects_bad_arguments(kwargs, match):
    requests = synthetic_requests(2, vocab_size=CONFIG.vocab_size, max_seq_len=CONFIG.max_seq_len, seed=1)
    result, prompt_lens = rollout(requests)
    args = dict(sequences=result.sequences, routing=result.routing, prompt_lens=prompt_lens) | kwargs
    sequences, routing, prompt_lens = args.pop("sequences"), args.pop("routing"), args.pop("prompt_lens")
    before = gates(model())
    with pytest.raises(ValueError, match=match):
        train_check(model(), "eager", sequences, routing, prompt_lens, **args)
    assert all(torch.equal(g, h) for g, h in zip(before, gates(model())))


def test_problems_name_each_failed_check():
    zeros = np.zeros(SHAPE.num_layers, dtype=np.float32)
    ok = TrainCheck("eager", 1, 5, 4, 0, 0.01, zeros, zeros, zeros, zeros, 1e-6, 2, 1.0, 0.5)
    assert ok.problems == []
    bad = dataclasses.replace(
        ok,
        wire_mismatched=1,
        replay_changed=np.full(SHAPE.num_layers, 0.25, dtype=np.float32),
        logprob_max_abs_diff=float("nan"),
        loss=float("inf"),
        router_grad_norm=0.0,
    )
    assert bad.problems == [
        "1 requests changed through the wire format",
        "replayed routing differs from the record",
        "logprobs differ by nan > 1e-04",
        "loss is inf",
        "router gradient norm is 0.0",
    ]


@pytest.mark.parametrize("engine", ["vllm", "sglang-int32", "sglang-uint8"])
def test_vllm_and_sglang_output_feed_replay_batch(engine):
    """docs/replay.md's recipe: an engine's per-request text (a column per decoder layer), decoded,
    with a dropped prompt prefix put back as -1 rows, gives the batch of the MoE-axis routing."""
    requests = synthetic_requests(3, vocab_size=CONFIG.vocab_size, max_seq_len=CONFIG.max_seq_len, seed=2)
    result, _ = rollout(requests)
    ours = [result.routing[i] for i in sorted(result.routing)]
    received = []
    for rows in ours:
        if engine == "vllm":
            text = encode_routing(SHAPE.vllm_layout(rows))
            wide = decode_routing(text)
        else:
            dtype = np.int32 if engine == "sglang-int32" else np.uint8
            text = encode_routing(SHAPE.sglang_layout(rows, dtype=dtype), format="sglang")
            wide = decode_routing(
                text,
                format="sglang",
                num_layers=SHAPE.num_model_layers,
                top_k=SHAPE.top_k,
                dtype=dtype.__name__,
            )
        assert wide.shape == (rows.shape[0], SHAPE.num_model_layers, SHAPE.top_k)
        received.append(wide)
    want = replay_batch(ours, SHAPE, pad_to=CONFIG.max_seq_len)
    got = replay_batch(received, SHAPE, layer_axis="model", pad_to=CONFIG.max_seq_len)
    np.testing.assert_array_equal(got, want)
    # a server that left out the first `start` prompt rows: -1 rows in front restore the row index
    start = 2
    cut = [
        np.concatenate([np.full((start, *w.shape[1:]), -1, np.int32), w[start:].astype(np.int32)])
        for w in received
    ]
    expected = want.copy()
    for i in range(len(ours)):
        expected[i * CONFIG.max_seq_len : i * CONFIG.max_seq_len + start] = -1
    np.testing.assert_array_equal(
        replay_batch(cut, SHAPE, layer_axis="model", pad_to=CONFIG.max_seq_len), expected
    )


# ------------------------------------------------------------------- training over several steps


def test_routing_drift_leaves_the_rollout_without_replay_and_stays_on_it_with_replay():
    """routing_drift.png's data: Adam steps with replay; the trainer's own routing moves away from
    the record in every MoE layer, the replayed forward's never does, and the loss falls."""
    requests = synthetic_requests(6, vocab_size=CONFIG.vocab_size, max_seq_len=CONFIG.max_seq_len, seed=1)
    result, prompt_lens = rollout(requests)
    before = gates(model())
    drift = routing_drift(model(), "eager", result.sequences, result.routing, prompt_lens, steps=6)
    assert all(torch.equal(g, h) for g, h in zip(before, gates(model()))), "rollout model modified"
    assert drift.steps == 6 and drift.mode == "eager" and drift.lr == demo_train.DRIFT_LR
    assert drift.changed.shape == drift.replay_changed.shape == (7, SHAPE.num_layers)
    packed = sorted(result.routing)[: CONFIG.max_requests]
    assert drift.recorded_rows == sum(len(result.sequences[i]) - 1 for i in packed)
    assert (drift.replay_changed == 0).all(), "the replayed forward left the record"
    assert (drift.changed[-1] > 0).all(), drift.changed
    assert ((drift.changed >= 0) & (drift.changed <= 1)).all()
    assert drift.loss.shape == (7,) and np.isfinite(drift.loss).all() and drift.loss[-1] < drift.loss[0]


def test_routing_drift_is_caught_when_replay_is_off(monkeypatch):
    """Fault injection: an attach_replay that replays nothing shows the replayed line leaving 0."""
    import moe_ops.integrations.hf as hf

    monkeypatch.setattr(hf, "attach_replay", lambda model, replayer: contextlib.nullcontext())
    requests = synthetic_requests(4, vocab_size=CONFIG.vocab_size, max_seq_len=CONFIG.max_seq_len, seed=1)
    result, prompt_lens = rollout(requests)
    drift = routing_drift(model(), "eager", result.sequences, result.routing, prompt_lens, steps=3)
    assert (drift.replay_changed[-1] > 0).any()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(steps=0), "steps must be an int >= 1, got 0"),
        (dict(steps=2.0), "steps must be an int >= 1, got 2.0"),
        (dict(lr=0.0), "lr must be a finite number > 0, got 0.0"),
        (dict(lr=float("nan")), "lr must be a finite number >= 0"),
        (dict(max_requests=9), r"max_requests must be an int in \[1, config.max_requests=4\]"),
    ],
)
def test_routing_drift_rejects_bad_arguments(kwargs, match):
    requests = synthetic_requests(2, vocab_size=CONFIG.vocab_size, max_seq_len=CONFIG.max_seq_len, seed=1)
    result, prompt_lens = rollout(requests)
    with pytest.raises(ValueError, match=match):
        routing_drift(model(), "eager", result.sequences, result.routing, prompt_lens, **kwargs)


def _drift(steps: int = 3) -> RoutingDrift:
    rng = np.random.default_rng(0)
    changed = np.sort(rng.uniform(0, 1, size=(steps + 1, SHAPE.num_layers)), axis=0).astype(np.float32)
    changed[0] = 0
    replay = np.zeros_like(changed)
    return RoutingDrift("compiled", 1e-3, 120, changed, replay, np.linspace(2.5, 1.0, steps + 1))


def test_the_drift_picture_plots_each_layer_with_and_without_replay():
    plt = pytest.importorskip("matplotlib.pyplot", reason="the picture needs the plot extra")
    drift = _drift()
    fig = drift_figure(drift, SHAPE)
    try:
        (ax,) = fig.axes
        assert ax.get_ylabel() == "fraction of tokens"
        assert ax.get_xlabel() == "training step (Adam, lr 0.001)"
        assert "compiled rollout, 120 tokens" in ax.get_title()
        lines = {line.get_label(): line for line in ax.get_lines()}
        for i, layer in enumerate(SHAPE.moe_layers):
            for label, values in (
                (f"layer {layer}, no replay", drift.changed),
                (f"layer {layer}, replay", drift.replay_changed),
            ):
                np.testing.assert_array_equal(lines[label].get_xdata(), np.arange(drift.steps + 1))
                np.testing.assert_array_equal(lines[label].get_ydata(), values[:, i])
        assert len(lines) == 2 * SHAPE.num_layers
        assert [t.get_text() for t in ax.get_legend().get_texts()] == list(lines)
    finally:
        plt.close(fig)


def test_the_mismatch_picture_has_one_pair_of_bars_per_layer():
    plt = pytest.importorskip("matplotlib.pyplot", reason="the picture needs the plot extra")
    changed = np.array([0.25, 0.5], dtype=np.float32)[: SHAPE.num_layers]
    zeros = np.zeros(SHAPE.num_layers, dtype=np.float32)
    check = TrainCheck("eager", 3, 50, 47, 0, 0.01, changed, zeros, zeros, zeros, 1e-6, 2, 1.0, 0.5)
    fig = replay_mismatch_figure(check, SHAPE)
    try:
        (ax,) = fig.axes
        assert ax.get_ylabel() == "fraction of tokens" and ax.get_xlabel() == "MoE layer (model index)"
        assert [t.get_text() for t in ax.get_xticklabels()] == [str(layer) for layer in SHAPE.moe_layers]
        no_replay, replay = ax.containers  # one BarContainer each: no other bars drawn
        assert [no_replay.get_label(), replay.get_label()] == ["no replay", "replay"]
        for bars, values in ((no_replay, check.changed), (replay, check.replay_changed)):
            assert [p.get_height() for p in bars.patches] == pytest.approx(values.tolist())
        for i in range(SHAPE.num_layers):  # the pair of layer i sits side by side around x = i
            left, right = no_replay.patches[i], replay.patches[i]
            assert left.get_x() + left.get_width() == pytest.approx(right.get_x())
            assert (left.get_x() + right.get_x() + right.get_width()) / 2 == pytest.approx(i)
        labels = [t.get_text() for t in ax.texts]
        assert labels == [f"{v:.2f}" for v in (*check.changed, *check.replay_changed)]
    finally:
        plt.close(fig)


# ------------------------------------------------------------------------------------ the command


def test_demo_prints_the_training_half_and_plots_it(tmp_path, capsys):
    out = tmp_path / "demo"
    code = main(["demo", "--modes", "eager", "--requests", "4", "--device", "cpu", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "training step: the same model in float32 with autograd" in text
    row = next(line for line in text.splitlines() if line.startswith("eager") and "e-" in line)
    assert row.endswith("PASS"), row
    pictures = [out / "replay_mismatch.png", out / "routing_drift.png"]
    try:
        import matplotlib  # noqa: F401 - only whether it imports matters here
    except ImportError:
        for png in pictures:
            assert f"matplotlib is not installed (pip install 'moe-ops[plot]'): skipped {png.name}" in text
            assert not png.exists()
    else:
        for png in pictures:
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png.name} (" in text
    assert not (out / "expert_load.png").exists()  # it showed a random model's load, nothing of replay
    drift = next(line for line in text.splitlines() if "routing_drift.png" in line)
    assert "over 10 training steps" in drift and "0.00 / 0.00 with replay" in drift
    code = main(
        [
            "demo",
            "--modes",
            "eager",
            "--requests",
            "2",
            "--no-train",
            "--device",
            "cpu",
            "--out",
            str(tmp_path / "b"),
        ]
    )
    assert code == 0 and "training step" not in capsys.readouterr().out


def test_demo_fails_when_the_wire_changes_a_request(tmp_path, monkeypatch, capsys):
    """Fault injection: a wire format that flips one id must fail the demo (exit 1)."""
    real = demo_train.wire_round_trip

    def flip_one(routing):
        back = real(routing)
        first = min(back)
        row = back[first][0, 0]
        # an expert the row does not hold: a valid, distinct id, so only the wire check can catch it
        row[0] = next(e for e in range(CONFIG.num_experts) if e not in row.tolist())
        return back

    monkeypatch.setattr(demo_train, "wire_round_trip", flip_one)
    code = main(["demo", "--modes", "eager", "--requests", "3", "--device", "cpu", "--out", str(tmp_path)])
    text = capsys.readouterr().out
    assert code == 1 and "1 requests changed through the wire format" in text and "FAILED" in text
