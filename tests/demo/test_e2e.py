"""End to end: serve requests of random lengths and finish times with the reference model, capture
routing in each runner mode through the snapshot pipeline, slot store and ledger, and compare every
request's rows with an eager uncaptured reference run."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from strategies import serving_requests

from moe_ops import cli, cli_args
from moe_ops.cli import main
from moe_ops.demo import reference_routing, serve, synthetic_requests, verify
from moe_ops.demo.inspect import read_routing_file
from moe_ops.graphs import RunnerMode
from moe_ops.models import ReferenceMoEModel, reference_config
from moe_ops.wire import encode_routing, encode_routing_bytes

# 3 layers (1 dense, 2 MoE with DeepSeek-V3 routing), float64 (see docs/demo.md)
CONFIG = reference_config("tiny", num_layers=3, max_seq_len=32, max_requests=4)
SHAPE = CONFIG.routing_shape()
REQUESTS = serving_requests(CONFIG.vocab_size, CONFIG.max_seq_len)
# small batches and capture sizes so that padding, eager fallbacks and slot reuse all happen
SERVE = dict(capture_sizes=(2, 4, 8, 16), max_batch_tokens=24, max_running=3, block_size=4, ring_depth=2)


pytestmark = pytest.mark.usefixtures("one_thread")


MODELS: dict[str, ReferenceMoEModel] = {}


def model_on(device) -> ReferenceMoEModel:
    key = str(device)
    if key not in MODELS:
        # one router kernel on CUDA for the served and the reference runs (see docs/demo.md)
        backend = "triton" if torch.device(device).type == "cuda" else "auto"
        MODELS[key] = ReferenceMoEModel(dataclasses.replace(CONFIG, router_backend=backend), device)
    return MODELS[key]


def check_served(model, requests, result):
    """Zero mismatched rows, (num_tokens - 1, L, K) per request, every request, nothing else.

    The served rows ran in batches of other shapes than the one-prefill reference (and compiled), so
    their float64 values differ by ~1e-15. Ids are still compared exactly: the router chooses on
    float32 roundings of them, which differ only where a value lies within ~1e-15 of a float32
    rounding boundary, and then by one ulp, which changes a choice only at a float32 near-tie (see
    F64_TOL in test_reference_model.py).
    """
    report = verify(result, lambda tokens: reference_routing(model, tokens), SHAPE)
    assert report.ok, (
        f"{result.mode}: {report.mismatched_rows}/{report.rows} mismatched rows, shapes {report.bad_shapes}, "
        f"missing {report.missing}"
    )
    assert sorted(result.routing) == sorted(r.req_id for r in requests)
    for r in requests:
        tokens = result.sequences[r.req_id]
        assert len(tokens) == r.num_tokens and tokens[: len(r.prompt)] == list(r.prompt)
        assert result.routing[r.req_id].shape == (r.num_tokens - 1, SHAPE.num_layers, SHAPE.top_k)
    assert result.tokens == sum(r.num_tokens - 1 for r in requests), "rows run != rows returned"
    assert result.capture_faults == 0


@settings(max_examples=6)
@given(requests=REQUESTS)
def test_eager_serving_captures_every_request_exactly(requests):
    model = model_on("cpu")
    captured = serve(model, requests, mode="eager", **SERVE)
    check_served(model, requests, captured)
    plain = serve(model, requests, mode="eager", capture=False, **SERVE)
    # token ids from the argmax of float64 logits of the same steps (same shapes, one thread)
    assert plain.sequences == captured.sequences, "capture changed what the model generated"
    assert not plain.routing


@pytest.mark.slow
@settings(max_examples=3)
@given(requests=REQUESTS)
def test_compiled_serving_pads_without_recompiling(requests):
    model = model_on("cpu")
    result = serve(model, requests, mode="compiled", **SERVE)
    check_served(model, requests, result)
    # one dynamic graph for every padded size (2 if inductor's cache splits off a guard, see docs)
    assert result.graphs_compiled <= 2, result.recompile_reasons


def test_workload_really_pads_and_changes_counts():
    """The fixed demo workload: steps of many sizes, padding rows, eager fallbacks, reused slots."""
    model = model_on("cpu")
    requests = synthetic_requests(10, vocab_size=CONFIG.vocab_size, max_seq_len=CONFIG.max_seq_len, seed=3)
    result = serve(model, requests, mode="compiled", **SERVE)
    check_served(model, requests, result)
    assert result.distinct_batch_sizes >= 5 and result.graphs_compiled <= 2
    assert result.padded_rows > 0 and result.eager_fallbacks > 0
    assert len({r.num_tokens for r in requests}) > 1


# ------------------------------------------------------------------------------------------- GPU

GPU_MODES = [RunnerMode.CUDA_GRAPH, RunnerMode.COMPILED_CUDA_GRAPH, RunnerMode.REDUCE_OVERHEAD]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", GPU_MODES, ids=lambda m: m.value)
@settings(max_examples=3)
@given(requests=REQUESTS)
def test_gpu_serving_captures_every_request_exactly(mode, requests):
    model = model_on("cuda")
    result = serve(model, requests, mode=mode, **SERVE)
    check_served(model, requests, result)
    assert result.graphs_compiled <= 2, result.recompile_reasons
    assert result.cudagraph_skips == 0


# ------------------------------------------------------------------------------------ the command


def test_demo_command_writes_verified_routing_and_inspect_reads_it(tmp_path, capsys):
    out = tmp_path / "demo"
    code = main(["demo", "--modes", "eager", "--requests", "4", "--device", "cpu", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "eager" in text and "PASS" in text
    files = sorted(out.glob("request_*/routing.npz"))
    assert len(files) == 4
    with np.load(files[0]) as data:
        routing, tokens = data["routing"], data["tokens"]
        assert routing.shape == (len(tokens) - 1, len(data["moe_layers"]), reference_config("tiny").top_k)
        assert routing.dtype == np.uint8
    assert main(["inspect", str(files[0])]) == 0
    summary = capsys.readouterr().out
    assert f"routing rows = num_tokens - 1 = {len(tokens) - 1}" in summary
    assert "MoE layers (model index): [1, 2]" in summary


def test_demo_exits_non_zero_on_a_mismatch(tmp_path, monkeypatch, capsys):
    """Fault injection: a reference that disagrees in one row must fail the demo."""
    # the command's module looks the reference up in its own namespace (moe_ops.demo re-exports it)
    import moe_ops.demo.command as demo

    real = demo.reference_routing

    def off_by_one(model, tokens):
        ids = real(model, tokens).copy()
        ids[len(ids) // 2, 0, 0] = (ids[len(ids) // 2, 0, 0] + 1) % model.config.num_experts
        return ids

    monkeypatch.setattr(demo, "reference_routing", off_by_one)
    code = main(["demo", "--modes", "eager", "--requests", "3", "--device", "cpu", "--out", str(tmp_path)])
    text = capsys.readouterr().out
    assert code == 1 and "3 mismatched rows" in text and "FAILED" in text


@pytest.mark.parametrize("form", ["text", "raw", "npy"])
def test_inspect_reads_the_wire_formats(tmp_path, capsys, form):
    routing = np.random.default_rng(0).integers(0, 16, size=(5, 3, 4)).astype(np.uint8)
    path = tmp_path / f"r.{form}"
    if form == "text":
        path.write_text(encode_routing(routing))
    elif form == "raw":
        path.write_bytes(encode_routing_bytes(routing))
    else:
        np.save(path, routing)
    assert main(["inspect", str(path)]) == 0
    assert "5 tokens x 3 MoE layers x top-4" in capsys.readouterr().out


def test_inspect_marks_guessed_values_as_guessed(tmp_path, capsys):
    """A bare array carries the ids only: its layer indices and expert count are guessed, and the
    summary says so; a routing.npz says what it read."""
    routing = np.array([[[3, 1]], [[0, 2]], [[3, 0]]], dtype=np.uint8)  # 3 tokens, 1 layer, top-2
    bare = tmp_path / "bare.npy"
    np.save(bare, routing)
    read = read_routing_file(str(bare))
    assert read.guessed == {"moe_layers", "num_experts"}
    assert read.moe_layers == (0,) and read.num_experts == 4 and read.tokens is None
    assert main(["inspect", str(bare)]) == 0
    text = capsys.readouterr().out
    assert "experts: 4 (guessed: largest id + 1; the file does not say)" in text
    assert (
        "MoE layers (model index): [0] (guessed: the columns numbered from 0; the file does not say)" in text
    )
    assert "read from the file: routing; guessed: moe_layers, num_experts" in text

    npz = tmp_path / "routing.npz"
    tokens = np.arange(4, dtype=np.int64)
    np.savez(npz, routing=routing, tokens=tokens, moe_layers=np.array([5]), num_experts=np.int64(8))
    read = read_routing_file(str(npz))
    assert read.guessed == frozenset() and read.moe_layers == (5,) and read.num_experts == 8
    assert read.prompt_len is None and np.array_equal(read.tokens, tokens)
    assert main(["inspect", str(npz)]) == 0
    text = capsys.readouterr().out
    assert (
        "experts: 8 (read from the file)" in text
        and "MoE layers (model index): [5] (read from the file)" in text
    )
    assert "4 tokens (prompt length not in the file)" in text and "(guessed" not in text
    assert "read from the file: routing, moe_layers, num_experts, tokens; guessed: nothing" in text

    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, routing=routing, moe_layers=np.array([1, 2]))
    with pytest.raises(ValueError, match="moe_layers has 2 entries but routing has 1 layer columns"):
        read_routing_file(str(wrong))


def test_inspect_rejects_what_is_not_routing(tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_text("not base64 at all ???")
    flat = tmp_path / "flat.npy"
    np.save(flat, np.zeros(4, dtype=np.uint8))
    assert main(["inspect", str(bad), str(flat), os.path.join(tmp_path, "missing.npz")]) == 1
    err = capsys.readouterr().err
    assert err.count("cannot read routing") == 3 and "(tokens, num_layers, top_k)" in err


def test_demo_hf_uses_the_transformers_integration(tmp_path, capsys):
    """With moe_ops.integrations.hf: serves a tiny model and verifies it; without it, or for an
    architecture it does not support: argparse's usage error (exit 2) saying why."""
    try:
        from moe_ops.integrations import hf
    except ImportError as exc:
        with pytest.raises(SystemExit) as code:
            main(["demo", "--hf", "mixtral", "--device", "cpu", "--out", str(tmp_path)])
        assert code.value.code == 2 and "moe_ops.integrations.hf" in capsys.readouterr().err, exc
        return
    arch = sorted(hf.SUPPORTED_ARCHITECTURES)[0]
    code = main(["demo", "--hf", arch, "--requests", "3", "--device", "cpu", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().out
    assert len(list(tmp_path.glob("request_*/routing.npz"))) == 3
    with pytest.raises(SystemExit) as code:
        main(["demo", "--hf", "no-such-arch", "--device", "cpu", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code.value.code == 2 and arch in err and "moe-ops demo: error: --hf 'no-such-arch'" in err


def test_demo_indexer_records_deepseek_v4s_indexer_beside_the_routing(tmp_path, capsys):
    """``--hf deepseek_v4 --indexer``: the indexer's choices ride the snapshot ring, the slot store
    and the ledger beside the ids, match the reference forwards row for row, and the compact text
    written per request decodes to rows of positions the query could read."""
    transformers = pytest.importorskip("transformers", reason="the demo's model is transformers' DeepSeek-V4")
    if not hasattr(transformers, "DeepseekV4Config"):
        pytest.skip("this transformers has no DeepSeek-V4 (5.24 and later)")
    from moe_ops.indexer import decode_positions

    code = main(
        [
            "demo",
            "--hf",
            "deepseek_v4",
            "--indexer",
            "--requests",
            "3",
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "0 mismatched, 0 requests without a record PASS" in out
    texts = sorted(tmp_path.glob("request_*/indexer.compact"))
    assert len(texts) == 3
    for path in texts:
        rows = decode_positions(path.read_text())
        routing = np.load(path.parent / "routing.npz")
        assert rows.shape[0] == routing["routing"].shape[0] and rows.shape[1:] == (2, 4)
        # query t reads entries below (t + 1) // 4: at most that many positions, every one below it
        bound = (np.arange(rows.shape[0]) + 1) // 4
        chosen = (rows >= 0).sum(-1)
        assert (chosen <= np.minimum(bound, 4)[:, None]).all() and chosen.sum() > 0
        assert (np.where(rows >= 0, rows, -1) < bound[:, None, None]).all()


def test_the_demo_program_asks_for_scalar_cpu_kernels_for_the_whole_process():
    """A cold first run: inductor's vectorised C++ took the demo from 27 to 42 s of CPU (docs/demo.md);
    the tiny model gains nothing from it. The command sets TORCHINDUCTOR_VEC_ISA_OK=0 before torch
    is imported (process-wide: a config.patch inside a running process broke later compiles), only
    for a CPU demo, never over the user's setting, never once torch is imported."""
    code = textwrap.dedent(
        """
        import os, sys
        from moe_ops import cli
        args = cli._build_parser().parse_args(sys.argv[1:])
        print(cli.scalar_cpu_kernels(args), os.environ.get("TORCHINDUCTOR_VEC_ISA_OK"))
        import torch._inductor.config as c
        print(c.cpp.vec_isa_ok)
        """
    )

    def run(*argv: str, env: dict | None = None) -> list[str]:
        environ = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_VEC_ISA_OK"}
        environ.update(env or {})
        out = subprocess.run(
            [sys.executable, "-c", code, *argv], capture_output=True, text=True, env=environ, timeout=600
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.split()

    assert run("demo", "--device", "cpu") == ["True", "0", "False"]
    assert run("demo", "--device", "cpu", env={"TORCHINDUCTOR_VEC_ISA_OK": "1"})[:2] == ["False", "1"]
    # in-process callers, torch already imported: their inductor setting stays as it is
    args = cli_args._build_parser().parse_args(["demo", "--device", "cpu"])
    assert "torch" in sys.modules and cli.scalar_cpu_kernels(args) is False


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--modes", "fast"], "--modes: unknown mode(s) fast"),
        (
            ["--modes", "eager,cuda-graph", "--device", "cpu"],
            "include CUDA-graph modes, but the device is cpu",
        ),
    ],
)
def test_demo_rejects_bad_modes(tmp_path, capsys, argv, match):
    try:
        rc = main(["demo", *argv, "--out", str(tmp_path)])
    except SystemExit as exc:  # argparse's usage error for a value it checks itself
        rc = exc.code
    assert rc == 2
    assert match in capsys.readouterr().err
