"""The command line a newcomer meets first: --help, --version and usage errors (argparse's, exit 2)
instead of tracebacks, all answered without importing torch."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from terminal import frames, on_a_terminal

import moe_ops
from moe_ops import cli_args, encode_routing, encode_routing_weights
from moe_ops.cli import MAX_DEMO_REQUESTS, MAX_STEP_ROWS, _build_parser, main
from moe_ops.wire import FORMATS

NO_CUDA = not torch.cuda.is_available()
ROOT = Path(__file__).resolve().parents[2]


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"moe-ops {moe_ops.__version__}"


BAD = [
    (["demo", "--preset", "foo"], "unknown preset 'foo'"),
    (["demo", "--capture-sizes", "abc"], "not a comma-separated list of integers"),
    (["demo", "--capture-sizes", "4,0"], "capture sizes must be >= 1"),
    (["demo", "--requests", "0"], "must be >= 1, got 0"),
    (["demo", "--max-batch-tokens", "x"], "'x' is not an integer"),
    (["demo", "--device", "tpu"], "'tpu'"),
    (["demo", "--modes", "warp"], "unknown mode(s) warp"),
    (["selftest", "--device", "cpu:x"], "'cpu:x' is not a device"),
]
if NO_CUDA:
    BAD += [
        (["demo", "--device", "cuda"], "sees no CUDA device"),
        (["selftest", "--device", "cuda"], "sees no CUDA device"),
    ]


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_values_are_one_line_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"moe-ops {argv[0]}: error: ")


# values that ran for minutes growing memory (--requests), asked for terabytes (--max-batch-tokens,
# --capture-sizes) or raised from numpy and torch (--seed): usage errors at parse time now
OUT_OF_RANGE = [
    (["demo", "--requests", str(10**20)], f"must be <= {MAX_DEMO_REQUESTS}, got {10**20}"),
    (["demo", "--requests", str(MAX_DEMO_REQUESTS + 1)], f"must be <= {MAX_DEMO_REQUESTS}"),
    (["demo", "--seed", str(10**23)], f"must be <= {2**63 - 1}, got {10**23}"),
    (["demo", "--seed", str(2**63)], f"must be <= {2**63 - 1}"),
    (["demo", "--seed", "-5"], "must be >= 0, got -5"),
    (["demo", "--max-batch-tokens", str(10**11)], f"must be <= {MAX_STEP_ROWS}"),
    (
        ["demo", "--max-batch-tokens", "5"],
        "must be >= 20 (the longest synthetic prompt fits in one step), got 5",
    ),
    (["demo", "--capture-sizes", "99999999999"], f"capture sizes must be <= {MAX_STEP_ROWS} rows"),
    (["demo", "--capture-sizes", f"8,{MAX_STEP_ROWS + 1}"], f"capture sizes must be <= {MAX_STEP_ROWS} rows"),
]


@pytest.mark.parametrize("argv, message", OUT_OF_RANGE, ids=[" ".join(a) for a, _ in OUT_OF_RANGE])
def test_out_of_range_values_are_usage_errors_before_any_work(argv, message, capsys):
    """Parsing alone refuses them (exit 2): the demo never starts."""
    with pytest.raises(SystemExit) as exc:
        _build_parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("moe-ops demo: error: ")


def test_the_range_ends_are_accepted():
    args = _build_parser().parse_args(
        ["demo", "--requests", str(MAX_DEMO_REQUESTS), "--seed", str(2**63 - 1), "--max-batch-tokens", "20"]
    )
    assert (args.requests, args.seed, args.max_batch_tokens) == (MAX_DEMO_REQUESTS, 2**63 - 1, 20)
    args = _build_parser().parse_args(
        ["demo", "--max-batch-tokens", str(MAX_STEP_ROWS), "--capture-sizes", "1"]
    )
    assert args.max_batch_tokens == MAX_STEP_ROWS and args.capture_sizes == "1"


def test_the_largest_seed_runs_the_demo(tmp_path, capsys):
    """2**63 - 1 seeds numpy's and torch's generators alike."""
    argv = ["demo", "--modes", "eager", "--requests", "2", "--no-train", "--device", "cpu"]
    assert main([*argv, "--seed", str(2**63 - 1), "--out", str(tmp_path)]) == 0, capsys.readouterr().out


@pytest.mark.parametrize("where", ["under a regular file", "a regular file"])
def test_an_unwritable_output_folder_stops_the_demo_before_any_work(tmp_path, capsys, where):
    """--out under a regular file used to fail after the whole run; now: argparse's usage error at
    once (exit 2), nothing run."""
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "demo" if where == "under a regular file" else tmp_path / "file"
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--modes", "eager", "--requests", "2", "--device", "cpu", "--out", str(out)])
    captured = capsys.readouterr()
    assert exc.value.code == 2 and captured.out == "", captured.out  # the demo never started
    lines = captured.err.strip().splitlines()
    assert lines[0].startswith("usage: moe-ops demo ") and "Traceback" not in captured.err
    assert lines[-1].startswith(f"moe-ops demo: error: --out '{out}': ")


# usage errors found after parsing (by the demo, or by a check that needs the file system or the
# integration): reported as argparse reports its own, not as a bare "error: ..." line
LATE = [
    (
        ["demo", "--modes", "eager,cuda-graph", "--device", "cpu"],
        "include CUDA-graph modes, but the device is cpu",
    ),
    (["demo", "--hf", "no-such-arch", "--device", "cpu"], "--hf 'no-such-arch' is not supported; supported:"),
    (["demo", "--indexer", "--device", "cpu"], "--indexer records a transformers model's indexer: add --hf"),
    (["demo", "--hf", "qwen3_moe", "--indexer", "--device", "cpu"], "--hf deepseek_v4, got 'qwen3_moe'"),
]


@pytest.mark.parametrize("argv, message", LATE, ids=[" ".join(a) for a, _ in LATE])
def test_usage_errors_found_after_parsing_are_argparses(argv, message, tmp_path, capsys):
    if "--hf" in argv:
        pytest.importorskip("transformers")
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and "Traceback" not in captured.err
    assert lines[0].startswith(f"usage: moe-ops {argv[0]} "), lines
    assert lines[-1].startswith(f"moe-ops {argv[0]}: error: ") and message in lines[-1], lines


def test_the_command_line_constants_are_the_packages():
    """The modes, presets and the longest prompt are written in moe_ops.cli so that parsing imports no
    torch; they must be what the runner, the reference model and the request generator use."""
    from moe_ops.demo.serve import MAX_PROMPT_TOKENS, synthetic_requests
    from moe_ops.graphs import RunnerMode
    from moe_ops.models.reference import PRESETS

    assert tuple(m.value for m in RunnerMode) == cli_args._MODES
    assert tuple(m.value for m in RunnerMode if m.needs_cuda) == cli_args._CUDA_MODES
    assert tuple(sorted(PRESETS)) == cli_args._PRESETS
    assert MAX_PROMPT_TOKENS == cli_args.MAX_PROMPT_TOKENS
    requests = synthetic_requests(200, vocab_size=64, max_seq_len=64, seed=3)
    assert max(len(r.prompt) for r in requests) == cli_args.MAX_PROMPT_TOKENS


# Runs the command line on each argv in one fresh interpreter and prints, per argv, its exit code
# and whether torch (or torch._dynamo) had been imported by then.
_WITHOUT_TORCH = """
import contextlib, io, json, sys
from moe_ops.cli import main
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    print(json.dumps([argv, code, sorted(m for m in ("torch", "torch._dynamo") if m in sys.modules)]))
"""


def test_help_version_and_usage_errors_import_no_torch(tmp_path):
    """`moe-ops --help` and `--version` took 6-7 s of CPU importing torch and torch._dynamo; now
    neither they nor a usage error import torch (checked in a fresh interpreter, in order)."""
    argvs = [
        ["--version"],
        ["--help"],
        *([c, "--help"] for c in ("selftest", "backends", "demo", "inspect")),
        ["bogus"],
        ["demo", "--requests", "0"],
        ["demo", "--preset", "foo"],
        ["demo", "--device", "tpu"],
        ["demo", "--max-batch-tokens", "5"],
        ["demo", "--capture-sizes", "4,0"],
        ["demo", "--modes", "warp"],
        ["demo", "--modes", "eager,cuda-graph", "--device", "cpu"],
        ["demo", "--out", str(tmp_path / "file" / "out")],
        ["selftest", "--device", "cpu:x"],
        ["inspect"],
    ]
    (tmp_path / "file").write_text("x")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # a hang guard: well under a second each without torch, 8 s with it on a busy 2-core machine
    out = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TORCH, json.dumps(argvs)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    results = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r[0] for r in results] == argvs
    assert [r[1] for r in results] == [0] * 6 + [2] * (len(argvs) - 6)
    imported = [(argv, modules) for argv, _, modules in results if modules]
    assert not imported, f"torch imported by: {imported[0]}"


def test_the_package_root_resolves_every_public_name_on_first_use():
    """`import moe_ops` imports nothing heavy; each name of __all__ resolves to its definition, and
    once one is used, the subpackages an eager root used to bind are attributes again."""
    code = (
        "import sys, moe_ops\n"
        "print('torch' in sys.modules)\n"
        "names = {n: getattr(moe_ops, n) for n in moe_ops.__all__}\n"
        "print(sorted(n for n, v in names.items() if getattr(v, '__name__', n) != n))\n"
        "print(moe_ops.replay.replayer.RoutingReplayer is moe_ops.RoutingReplayer)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["False", "[]", "True"], out.stdout
    assert set(moe_ops.__all__) == set(moe_ops._LAZY)


@pytest.mark.parametrize("command", ["selftest", "backends", "demo", "inspect"])
def test_every_subcommand_has_a_description_and_argument_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: moe-ops " + command)
    description = out.split("\n\n")[1]
    assert not description.startswith(("options", "positional")), f"{command} has no description"
    # every option line carries a help text (argparse prints it on the same or the next line)
    options = [line for line in out.splitlines() if line.strip().startswith("--")]
    assert all(len(line.split("  ")) > 1 or line.strip().endswith("...") for line in options), options


# ---------------------------------------------------------------------------------------------------
# moe-ops inspect on hostile files: one line each, never a traceback, never a large allocation
# ---------------------------------------------------------------------------------------------------

# The memory a child running `moe-ops inspect` may allocate beyond what its imports took: every file
# below asks for far more (1 GiB of zip bomb, 8 GiB of counts for id 10**9, 8 TiB for 2**40) and a
# well-formed summary needs a few MiB.
INSPECT_BOUND = 512 << 20

# Runs `moe-ops inspect` on each file in one child process under RLIMIT_AS (what its imports
# mapped + INSPECT_BOUND); prints per file its exit code, what it wrote to stderr, and the type of
# any exception that escaped the command.
_BOUNDED_INSPECT = """
import contextlib, io, json, resource, sys
from moe_ops.cli import main
import moe_ops.demo.inspect  # everything imported before the bound
vm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + int(sys.argv[1]), resource.RLIM_INFINITY))
for path in sys.argv[2:]:
    out, err, escaped = io.StringIO(), io.StringIO(), None
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = main(["inspect", path])
    except SystemExit as e:
        rc = e.code
    except BaseException as e:
        rc, escaped = None, type(e).__name__
    result = {"path": path, "rc": rc, "out": out.getvalue(), "err": err.getvalue(), "escaped": escaped}
    print(json.dumps(result), flush=True)
"""


def _npy_bytes(header: dict, data: bytes) -> bytes:
    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(f, header)
    return f.getvalue() + data


def _zip_bomb(path, declared: int) -> None:
    """A routing.npz whose routing.npy is ``declared`` bytes of zeros, deflated (~220x at level 1:
    1 GiB in 4.7 MB), written in 4 MiB pieces so that the test never holds it."""
    with (
        zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as z,
        z.open("routing.npy", "w", force_zip64=True) as f,
    ):
        f.write(_npy_bytes({"descr": "|u1", "fortran_order": False, "shape": (declared // 32, 4, 8)}, b""))
        chunk = bytes(4 << 20)
        for _ in range(declared // len(chunk)):
            f.write(chunk)


def _hostile_files(tmp: Path) -> dict[str, Path]:
    routing = np.array([[[0, 1]], [[2, 3]]], dtype=np.uint8)
    files = {}

    def npz(name, **arrays):
        files[name] = tmp / f"{name}.npz"
        np.savez(files[name], **{"routing": routing, **arrays})

    _zip_bomb(tmp / "bomb.npz", 1 << 30)
    files["zip bomb"] = tmp / "bomb.npz"
    npz("num_experts 10**12", num_experts=np.int64(10**12))
    npz("num_experts inf", num_experts=np.float64("inf"))
    npz("num_experts of shape (2,)", num_experts=np.array([8, 8]))
    npz("moe_layers [1.5, inf]", routing=np.zeros((2, 2, 2), np.uint8), moe_layers=np.array([1.5, np.inf]))
    npz("prompt_len of shape (2,)", tokens=np.arange(3), prompt_len=np.array([1, 2]))
    files["member declaring 2**40 elements"] = tmp / "huge_member.npz"
    with zipfile.ZipFile(files["member declaring 2**40 elements"], "w") as z:
        header = {"descr": "|u1", "fortran_order": False, "shape": (2**38, 1, 4)}
        z.writestr("routing.npy", _npy_bytes(header, bytes(8)))
    whole = (tmp / "num_experts 10**12.npz").read_bytes()
    files["truncated npz"] = tmp / "truncated.npz"
    files["truncated npz"].write_bytes(whole[: len(whole) // 2])
    files["float routing npy"] = tmp / "float.npy"
    np.save(files["float routing npy"], np.zeros((2, 1, 2)))
    npz("float routing npz", routing=np.full((2, 1, 2), 0.5))
    files["id -7"] = tmp / "minus7.npy"
    np.save(files["id -7"], np.array([[[-7, 1]]], dtype=np.int16))
    files["npy declaring more than it holds"] = tmp / "short.npy"
    files["npy declaring more than it holds"].write_bytes(
        _npy_bytes({"descr": "<i4", "fortran_order": False, "shape": (2**20, 4, 8)}, bytes(64))
    )
    return files


def _bounded_inspect(paths: list[Path]) -> dict[Path, dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _BOUNDED_INSPECT, str(INSPECT_BOUND), *map(str, paths)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = {Path(r["path"]): r for r in map(json.loads, out.stdout.splitlines())}
    missing = [p for p in paths if p not in results]
    assert not missing, f"the child died before {missing}: {out.stderr[-2000:]}"
    return results


needs_proc = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmSize from /proc")


@needs_proc
def test_inspect_refuses_hostile_files_in_one_line_within_a_memory_bound(tmp_path):
    """Measured: 20 s here (6 s writing the zip bomb, 10 s importing torch in the child, which
    imports no torch now); the timeout is a hang guard."""
    files = _hostile_files(tmp_path)
    results = _bounded_inspect(list(files.values()))
    for name, path in files.items():
        r = results[path]
        assert r["escaped"] is None, f"{name}: {r['escaped']} escaped moe-ops inspect"
        lines = r["err"].strip().splitlines()
        assert r["rc"] == 1 and len(lines) == 1, f"{name}: rc {r['rc']}, stderr {r['err']!r}"
        assert lines[0].startswith(f"{path}: cannot read routing: "), f"{name}: {lines[0]}"
        assert "out of memory" not in lines[0], f"{name}: refused only by the memory bound"


@needs_proc
def test_inspect_counts_huge_ids_without_an_array_of_that_many_experts(tmp_path):
    """A 136-byte .npy holding id 10**9 (or 2**40): the guessed expert count is the id + 1, and the
    per-layer counts are of the ids present, not a 10**9-entry bincount."""
    paths = []
    for value in (10**9, 2**40):
        paths.append(tmp_path / f"id{value}.npy")
        np.save(paths[-1], np.array([[[value, 3]]], dtype=np.int64))
        assert paths[-1].stat().st_size == 144  # header + two int64 ids
    results = _bounded_inspect(paths)
    for value, path in zip((10**9, 2**40), paths):
        r = results[path]
        assert r["escaped"] is None and r["rc"] == 0 and not r["err"], r
        assert f"experts: {value + 1} (guessed: largest id + 1" in r["out"], r["out"]
        assert f"layer   0: 2/{value + 1} experts used; busiest 3 (1), {value} (1)" in r["out"], r["out"]


def test_inspect_counts_the_no_routing_marker_apart(tmp_path, capsys):
    """-1 (signed) and an unsigned array's largest value below num_experts mark rows with no
    routing (what SlotStore writes): counted apart, never a bincount error."""
    signed = tmp_path / "signed.npy"
    np.save(signed, np.array([[[3, 1]], [[-1, -1]], [[3, 0]]], dtype=np.int16))
    assert main(["inspect", str(signed)]) == 0
    text = capsys.readouterr().out
    assert "rows with no routing (marker -1): 1 of 3" in text and "ids in [0, 3]" in text
    assert "experts: 4 (guessed" in text and "busiest 3 (2), 0 (1), 1 (1)" in text
    unsigned = tmp_path / "unsigned.npz"
    routing = np.array([[[3, 1]], [[255, 255]]], dtype=np.uint8)
    np.savez(unsigned, routing=routing, num_experts=np.int64(8), moe_layers=np.array([2]))
    assert main(["inspect", str(unsigned)]) == 0
    text = capsys.readouterr().out
    assert "rows with no routing (marker 255): 1 of 2" in text and "layer   2: 2/8 experts used" in text


@pytest.mark.parametrize("name", sorted(n for n, f in FORMATS.items() if f.magic is not None))
def test_inspect_reads_the_text_of_every_format_with_a_prefix(name, tmp_path, capsys):
    """moe-ops inspect tells a text file's format by its prefix, through the registry: a format
    module added to moe_ops/wire/ is read without a change to inspect."""
    fmt = FORMATS[name]
    dtype = (fmt.dtypes or (np.dtype(np.uint8),))[0]
    routing = np.array([[[3, 1]], [[0, 2]], [[3, 0]]], dtype=dtype)  # 3 tokens, 1 layer, top-2
    path = tmp_path / f"routing.{name}.txt"
    path.write_text(encode_routing(routing, format=name) + "\n")
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert f"3 tokens x 1 MoE layers x top-2, dtype {dtype} (text {name})" in text
    # ids 3, 1, 0, 2, 3, 0: 0 and 3 twice, ties by id
    assert "layer   0: 4/4 experts used; busiest 0 (2), 3 (2), 1 (1)" in text


def test_inspect_refuses_text_of_no_known_prefix_in_one_line(tmp_path, capsys):
    """SGLang's bare base64 has no prefix: refused, saying how to decode it, not guessed."""
    path = tmp_path / "sglang.txt"
    path.write_text(encode_routing(np.zeros((2, 1, 2), np.int32), format="sglang"))
    assert main(["inspect", str(path)]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"{path}: cannot read routing: text that starts with the prefix of no wire format")
    assert "format='sglang'" in line


_INSPECT_WITHOUT_TORCH = """
import contextlib, io, json, sys
from moe_ops.cli import main
for path in sys.argv[1:]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["inspect", path])
    print(json.dumps([path, rc, out.getvalue(), err.getvalue(), "torch" in sys.modules]))
"""


def test_inspect_imports_no_torch(tmp_path):
    """`moe-ops inspect` reads numpy files: a 26-row file took 17-19 s and a missing file 24-47 s
    on a busy 2-core machine, all of it importing torch through moe_ops.demo. Checked in a fresh
    interpreter: neither a summary nor a refusal imports it."""
    good = tmp_path / "routing.npz"
    routing = np.arange(26 * 2 * 4, dtype=np.uint8).reshape(26, 2, 4) % 16
    np.savez(good, routing=routing, num_experts=np.int64(16), moe_layers=np.array([1, 2]))
    missing = tmp_path / "missing.npz"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", _INSPECT_WITHOUT_TORCH, str(good), str(missing)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,  # a hang guard: 0.15 s measured
    )
    assert out.returncode == 0, out.stderr
    (_, rc_good, text, _, torch_good), (_, rc_missing, _, err, torch_missing) = map(
        json.loads, out.stdout.splitlines()
    )
    assert rc_good == 0 and "26 tokens x 2 MoE layers x top-4" in text
    assert rc_missing == 1 and err.startswith(f"{missing}: cannot read routing: ")
    assert not torch_good and not torch_missing, "moe-ops inspect imported torch"


def _weights(n: int = 6) -> np.ndarray:
    rng = np.random.default_rng(0)
    w = rng.random((n, 2, 4)).astype(np.float32) + 0.05
    w /= w.sum(-1, keepdims=True)  # a renormalising router's top-k weights
    w[1, 0] = np.nan  # a layer not captured in that step
    return w


def test_inspect_refuses_routing_weights_saying_what_they_are(tmp_path, capsys):
    """A weights text or array is not summarised as expert ids: encode_routing_weights' bfloat16
    text (uint16 bits that read as ids 15000-16256 and 32704), its float32 text (vLLM's
    routed_expert_weights), a float16 .npy and a capturer's bfloat16 "weights" channel saved with
    np.save (its fill is 0xFFFF) each get one line saying they are routing weights."""
    w = _weights()
    files = {
        "bfloat16 text": encode_routing_weights(w),
        "float32 text": encode_routing_weights(w, dtype="float32"),
    }
    paths = {}
    for name, text in files.items():
        paths[name] = tmp_path / f"{name.replace(' ', '_')}.txt"
        paths[name].write_text(text)
    paths["float16 npy"] = tmp_path / "w16.npy"
    np.save(paths["float16 npy"], w.astype(np.float16))
    bits = (w.view(np.uint32) >> 16).astype(np.uint16)  # bfloat16 bits (truncated: still weights)
    bits[1, 0] = 0xFFFF  # the channel's fill
    paths["bfloat16 channel npy"] = tmp_path / "channel.npy"
    np.save(paths["bfloat16 channel npy"], bits)
    for name, path in paths.items():
        assert main(["inspect", str(path)]) == 1, name
        captured = capsys.readouterr()
        (line,) = captured.err.strip().splitlines()
        assert line.startswith(f"{path}: cannot read routing: ") and not captured.out, name
        assert "routing weights" in line and "not expert ids" in line, f"{name}: {line}"
    text_line = "a text of routing weights (npy, float values, shape (6, 2, 4), values "
    assert main(["inspect", str(paths["float32 text"])]) == 1
    assert text_line in capsys.readouterr().err
    assert main(["inspect", str(paths["bfloat16 text"])]) == 1
    err = capsys.readouterr().err
    assert "uint16 values that read as bfloat16 routing weights (shape (6, 2, 4)" in err
    assert "4 NaN (no weight recorded)" in err and "more than 12416 experts" in err


def test_inspect_still_reads_uint16_ids_of_a_large_model(tmp_path, capsys):
    """The weights rule never takes real ids for weights: uint16 ids of a 384-expert model (Kimi
    K2's count) with the no-routing marker 0xFFFF, and ids from 12416 up beside lower ones."""
    ids = np.random.default_rng(1).integers(0, 384, (5, 2, 4)).astype(np.uint16)
    ids[2] = 0xFFFF
    path = tmp_path / "ids.txt"
    path.write_text(encode_routing(ids))
    assert main(["inspect", str(path)]) == 0
    assert "dtype uint16 (text npy)" in capsys.readouterr().out
    high = np.full((2, 1, 2), 16000, dtype=np.uint16)
    high[0, 0, 0] = 5  # an id below the weights' range: ids
    np.save(tmp_path / "high.npy", high)
    assert main(["inspect", str(tmp_path / "high.npy")]) == 0
    assert "experts: 16001 (guessed" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, first_row",
    [
        (["selftest", "--device", "cpu"], "LOCAL              eager"),
        (["backends"], 'routing (backend="auto"):'),
    ],
    ids=["selftest", "backends"],
)
def test_a_terminal_sees_a_status_line_first_then_each_step(argv, first_row):
    """`moe-ops selftest` was silent ~40 s and then printed everything, `moe-ops backends` 23 s (cold
    caches, 2 busy cores): on a terminal the first thing drawn is a status line, before torch is
    imported; the selftest then names each check and prints its row when it ends."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = on_a_terminal([sys.executable, "-m", "moe_ops", *argv], first_row, cwd=ROOT, env=env)
    drawn = frames(out)
    assert first_row in out, out[-2000:]
    assert drawn[0] == f"0 s  moe-ops {argv[0]}: importing torch and moe_ops", drawn[:3]
    if argv[0] == "selftest":
        check = next(i for i, f in enumerate(drawn) if f.endswith("check 1/8: LOCAL, eager"))
        header = next(i for i, f in enumerate(drawn) if f.startswith("layout "))
        row = next(i for i, f in enumerate(drawn) if f.startswith(first_row))
        assert header < check < row, drawn
    else:
        assert any("loading FlashInfer's op table" in f for f in drawn), drawn


# ---------------------------------------------------------------------------------------------------
# moe-ops demo --hf: the KV cache under the argument the installed transformers takes
# ---------------------------------------------------------------------------------------------------


def test_demo_hf_passes_the_kv_cache_under_the_supported_name(tmp_path, capsys):
    """transformers 5.24 renamed past_key_values to cache and warns (FutureWarning) that the old name
    goes in 5.40; 5.13-5.17 take past_key_values only. The demo runs warning-free on either."""
    transformers = pytest.importorskip("transformers")
    try:
        from moe_ops.integrations import hf
    except ImportError as exc:  # a transformers older than the integration supports
        pytest.skip(str(exc))
    import inspect
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(
            ["demo", "--hf", "qwen3_moe", "--requests", "2", "--device", "cpu", "--out", str(tmp_path)]
        )
    assert code == 0, capsys.readouterr().out
    deprecations = [str(w.message) for w in caught if "past_key_values" in str(w.message)]
    assert not deprecations, (
        f"transformers {transformers.__version__}, {len(deprecations)} x {deprecations[:1]}"
    )

    from moe_ops.demo.hf import kv_cache_argument

    model = hf.build_tiny_model("qwen3_moe")
    takes = inspect.signature(model.forward).parameters
    assert kv_cache_argument(model) == ("cache" if "cache" in takes else "past_key_values")
    assert kv_cache_argument(model) in takes
