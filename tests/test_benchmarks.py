"""The benchmark registry and runner (benchmarks/registry.py, ``python -m benchmarks``) on the CPU:
every registered benchmark dry-runs, its cases are those of benchmarks/cases.py and name tests that
exist, and the shapes those cases name are checked here where no other test covers them."""

from __future__ import annotations

import ast
import contextlib
import csv
import io
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from routing_checks import check_routing
from strategies import MODEL_ROUTERS, POISON, RouterCase, RouterConfig
from terminal import frames, on_a_terminal

from benchmarks import harness, registry
from benchmarks.cases import BENCH_CASES, BENCH_DEEPSEEK_V3, BENCH_SIZES
from benchmarks.harness import Table
from benchmarks.host import target_column, target_note
from moe_ops import (
    BatchLayout,
    CaptureTarget,
    TransferPipeline,
    capture_routing,
    decode_routing,
    encode_routing,
    route,
)
from moe_ops.demo.progress import StatusLine
from moe_ops.models import reference_config

ROOT = Path(__file__).resolve().parents[1]

# benchmarks converted to the registry; the others keep their own main() until converted
CONVERTED = ("e2e", "distributed", "transfer", "replay", "capture", "routing")


@pytest.fixture(scope="module")
def benches():
    return registry.load_all()


@pytest.fixture
def scratch_registry():
    """The registry as it was before the test: tests that register throwaway benchmarks."""
    saved = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)


# ------------------------------------------------------------------------------- the runner


def test_runner_dry_runs_every_registered_benchmark(benches, tmp_path, capsys):
    """One in-process run of ``--dry-run`` over every benchmark: each runs its CPU check, each table
    is printed, and the one CSV carries every table's rows with the environment stamp."""
    assert set(CONVERTED) <= set(benches)
    out = tmp_path / "dry.csv"
    assert registry.main(["--dry-run", "--csv", str(out)]) == 0
    printed = capsys.readouterr().out
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows, "the dry run wrote no rows"
    assert {"gpu", "torch", "triton", "git_sha"} <= set(rows[0])
    assert rows[0]["torch"] == torch.__version__
    assert {r["bench"] for r in rows} == set(benches), "a benchmark wrote no rows"
    for r in rows:
        assert f"## {r['benchmark']}" in printed, f"{r['bench']}: its table was not printed"
    for name, bench in benches.items():
        if bench.dry_run is None:  # the cases table: every case and its test
            assert [r["case"] for r in rows if r["bench"] == name] == [c.name for c in bench.cases]
    # the dry runs that check something: e2e compared the capture buffer with the routed ids of
    # every peer that captures, at every dry batch, and distributed ran every grid on 2 ranks
    # in both modes outside CUDA graphs (eager, compiled) and at decode and prefill batches
    e2e = [r for r in rows if r["bench"] == "e2e"]
    bench_e2e = sys.modules["benchmarks.bench_e2e"]
    checked = {
        (r["mode"], r["kind"], int(r["tokens"]), r["peer"], r["checked"])
        for r in e2e
        if r["checked"].startswith("capture == routed ids")
    }
    batches = [("decode", n) for n in bench_e2e.DRY_BATCHES] + [("prefill", n) for n in bench_e2e.DRY_PREFILL]
    assert bench_e2e.DRY_MODES == ("eager", "compiled")
    # the +w peers also checked that every routed row's weights were written, and nothing past them
    what = {p: "capture == routed ids" for p in ("on", "on+snapshot")}
    what.update({p: "capture == routed ids, weights written" for p in ("on+w", "on+w+snapshot")})
    assert checked == {
        (m, k, n, p, w) for m in bench_e2e.DRY_MODES for k, n in batches for p, w in what.items()
    }
    assert {r["peer"] for r in e2e} == {"off", "on", "on+snapshot", "on+w", "on+w+snapshot", "off[auto]"}
    dist = [r for r in rows if r["bench"] == "distributed"]
    assert [r["case"] for r in dist] == [c.name for c in BENCH_CASES["distributed"]]


def test_list_shows_every_case_and_option(benches, capsys):
    assert registry.main(["--list"]) == 0
    printed = capsys.readouterr().out
    for bench in benches.values():
        assert f"{bench.name} (needs {bench.needs}" in printed
        for case in bench.cases:
            assert f"case {case.name}: {case.test}" in printed
        for o in bench.options:
            assert o.flag in printed


@pytest.mark.parametrize(
    "script",
    [["-m", "benchmarks", "--list"], ["benchmarks/bench_e2e.py", "--list"]],
    ids=["module", "script"],
)
def test_runs_from_the_repository_root_without_an_install(script):
    """``python -m benchmarks`` and a bench file run as a script find the package and the benchmarks
    with their cases from the repository root (PYTHONPATH empty, as on the device)."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ""}
    # a hang guard: 2.8 s measured (importing torch); a loaded machine has made 3 s take over 60
    out = subprocess.run(
        [sys.executable, *script], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stderr
    assert "e2e (needs cuda, dry run)" in out.stdout
    assert ("distributed (needs cpu" in out.stdout) == (script[0] == "-m")


def test_gpu_benchmark_without_a_gpu_is_skipped_and_fails_when_named(benches, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: e2e would run")
    assert registry.main(["e2e", "--batches", "1"]) == 1
    out = capsys.readouterr().out
    assert (
        "e2e: needs a CUDA GPU; skipped (decode steps in CUDA graphs, decode and prefill steps outside CUDA "
        "graphs; --dry-run checks it on the CPU)" in out
    )


def test_list_says_which_tables_run_on_this_machine(benches, capsys):
    assert registry.main(["--list", "e2e", "replay", "distributed"]) == 0
    out = capsys.readouterr().out
    here = torch.cuda.is_available()
    assert out.startswith(f"this machine: {'a CUDA GPU' if here else 'no CUDA GPU'}\n")
    where = "runs here" if here else "not here: needs a CUDA GPU"
    for t in benches["e2e"].tables:
        assert f"    table {t.name} ({t.flags}): {where}" in out
    assert ("replay (needs cuda, dry run)" in out) and (
        "    runs here (its tables are not declared" if here else "    not here: needs a CUDA GPU"
    ) in out.split("replay (needs cuda")[1].split("\n")[1]
    assert "distributed (needs cpu, dry run)" in out and "    runs here (its tables" in out


def test_tables_here_splits_by_what_this_machine_has(scratch_registry, benches):
    fn = lambda cases, run: []
    cases = BENCH_CASES["e2e"]
    gpu, cpu = registry.table("graphs", flags="--graphs"), registry.table("host", needs="cpu")
    registry.benchmark("mixed", cases=cases, needs="cpu", tables=[gpu, cpu])(fn)
    registry.benchmark("gpu_only", cases=cases, tables=[gpu])(fn)
    registry.benchmark("plain", cases=cases, needs="cpu")(fn)
    got = registry.registry()
    assert registry.tables_here(got["mixed"], has_cuda=False) == ([cpu], [gpu])
    assert registry.tables_here(got["mixed"], has_cuda=True) == ([gpu, cpu], [])
    assert registry.tables_here(got["gpu_only"], has_cuda=False) == ([], [gpu])
    (plain,) = got["plain"].table_specs()  # undeclared: one table, needing what the benchmark needs
    assert plain.needs == "cpu" and registry.tables_here(got["plain"], has_cuda=False) == ([plain], [])


def test_a_cpu_run_says_what_it_skips_before_it_runs(scratch_registry, benches, capsys):
    """A benchmark with a table that needs a GPU, run on a machine without one: the note comes first,
    before the minutes its CPU tables may take."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: every table runs")

    def fn(cases, run):
        print("measuring the host table")
        t = Table("host", ["x"])
        t.add(1)
        return t

    tables = [registry.table("device table in CUDA graphs"), registry.table("host", needs="cpu")]
    registry.benchmark("mixed", cases=BENCH_CASES["e2e"], needs="cpu", tables=tables)(fn)
    assert registry.main(["mixed"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:3] == [
        "mixed: no CUDA GPU, not measured here: device table in CUDA graphs",
        "mixed: running",
        "measuring the host table",
    ]


@pytest.mark.parametrize(
    "argv, match",
    [
        (["nope"], "unknown benchmark nope"),
        (["distributed", "--batches", "1,2"], "--batches is an option of e2e, none of which is chosen"),
        (["e2e", "--batches", "1,x"], "comma-separated ints"),
        (["e2e", "--batches", "0"], "positive ints"),
        (["e2e", "--mode", "reduce-overhead"], "invalid choice"),
        (["e2e", "--prefill", "0"], "positive ints"),
        (["routing", "--cases", "nope"], "--cases: nope is not a case of routing"),
        (["routing", "--cases", ","], "--cases: no name given"),
    ],
)
def test_runner_rejects_bad_arguments(benches, capsys, argv, match):
    with pytest.raises(SystemExit) as exc:
        registry.main(argv)
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


def test_cases_runs_only_the_named_cases_and_skips_benchmarks_without_them(scratch_registry, benches):
    seen = {}
    for name, cases in (("aa", BENCH_CASES["routing"]), ("bb", BENCH_CASES["capture"])):

        def fn(cases, run, name=name):
            seen[name] = tuple(c.name for c in cases)
            return Table(name, ["x"])

        registry.benchmark(name, cases=cases, needs="cpu")(fn)
    assert registry.main(["aa", "bb", "--cases", "renormalize-512,deepseek-v3"]) == 0
    # table order kept; bb has neither case and does not run
    assert seen == {"aa": ("deepseek-v3", "renormalize-512")}


def test_an_option_applies_to_every_chosen_benchmark_that_declares_it(scratch_registry, benches, capsys):
    seen = {}
    for name in ("aa", "bb"):

        def fn(cases, run, name=name):
            seen[name] = (run.sizes, run.quick, run.given)
            return Table(name, ["x"])

        registry.benchmark(
            name, cases=BENCH_CASES["e2e"], needs="cpu", options=[registry.sizes_option("--sizes", (5,))]
        )(fn)
    assert registry.main(["aa", "bb", "--sizes", "2,3", "--quick"]) == 0
    assert seen == {"aa": ((2, 3), True, {"sizes"}), "bb": ((2, 3), True, {"sizes"})}
    assert registry.main(["aa"]) == 0
    assert seen["aa"] == ((5,), False, set())


def test_a_failing_benchmark_fails_the_run_and_the_others_still_run(scratch_registry, benches, capsys):
    def broken(cases, run):
        raise RuntimeError("broken benchmark")

    def fine(cases, run):
        t = Table("fine", ["case"])
        for case in cases:
            t.add(case.name)
        return t

    registry.benchmark("broken", cases=BENCH_CASES["e2e"], needs="cpu")(broken)
    registry.benchmark("fine", cases=BENCH_CASES["distributed"], needs="cpu")(fine)
    assert registry.main(["broken", "fine"]) == 1
    captured = capsys.readouterr()
    assert "RuntimeError: broken benchmark" in captured.err and "failed: broken" in captured.err
    assert "## fine" in captured.out


class Terminal(io.StringIO):
    """A stream that says it is a terminal (the status line draws on terminals only)."""

    def isatty(self) -> bool:
        return True


def test_a_run_on_a_terminal_names_each_step_and_keeps_prints_off_the_status_line(scratch_registry, benches):
    """`python -m benchmarks NAME` printed only "NAME: running" for the minutes a CPU table takes:
    on a terminal the status line names what the benchmark said it measures (harness.step) and
    each row as it is added; the benchmark's own prints clear the line first (one terminal here
    for stdout and the status line, as a person's screen)."""

    def stepper(cases, run):
        t = Table("stepper", ["case", "us"])
        harness.step("compiling the first case")
        print("a line of the benchmark's own")
        t.add(cases[0].name, 1.5)
        return t

    registry.benchmark("stepper", cases=BENCH_CASES["e2e"], needs="cpu")(stepper)
    term = Terminal()
    with contextlib.redirect_stdout(term):
        assert registry.main(["stepper"], status=StatusLine(stream=term)) == 0
    drawn = frames(term.getvalue())
    order = [
        "stepper: running",
        "0 s  stepper: running",
        "0 s  stepper: compiling the first case",
        "a line of the benchmark's own",
        f"0 s  stepper: row 1 done: {BENCH_CASES['e2e'][0].name} 1.500",
        "## stepper",
    ]
    at = [next((i for i, f in enumerate(drawn) if f == want), None) for want in order]
    assert None not in at and at == sorted(at), (order, drawn)
    # the status line was cleared before the print: that terminal line shows the print alone
    (line,) = [ln for ln in term.getvalue().split("\n") if "a line of the benchmark's own" in ln]
    assert line.split("\r")[-1] == "a line of the benchmark's own" and not line.split("\r")[-2].strip()
    assert harness._status is None, "the step reporter outlived its run"
    harness.step("after the run")  # no run: nothing is drawn, nothing raises


def test_a_benchmark_that_raises_mid_line_leaves_the_status_line_drawing(scratch_registry, benches):
    """A benchmark that raised after printing part of a line held the status line's redraws; the
    next benchmark's steps are drawn all the same."""

    def broken(cases, run):
        print("half a line", end="")
        raise RuntimeError("broken benchmark")

    def fine(cases, run):
        harness.step("measuring the fine one")
        t = Table("fine", ["case"])
        t.add(cases[0].name)
        return t

    registry.benchmark("broken", cases=BENCH_CASES["e2e"], needs="cpu")(broken)
    registry.benchmark("fine", cases=BENCH_CASES["distributed"], needs="cpu")(fine)
    term = Terminal()
    with contextlib.redirect_stdout(term), contextlib.redirect_stderr(term):
        assert registry.main(["broken", "fine"], status=StatusLine(stream=term)) == 1
    drawn = frames(term.getvalue())
    assert "0 s  fine: measuring the fine one" in drawn, drawn
    assert "RuntimeError: broken benchmark" in term.getvalue()


def test_the_runner_draws_a_status_line_before_its_imports():
    """On a terminal `python -m benchmarks` draws its first line before importing torch and the
    bench files (3-4 s warm on 2 cores; far more on cold caches)."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ""}
    out = on_a_terminal([sys.executable, "-m", "benchmarks", "--list"], "this machine:", cwd=ROOT, env=env)
    drawn = frames(out)
    assert drawn[0] == "0 s  benchmarks: importing torch, moe_ops and every benchmarks/bench_*.py", drawn[:3]
    assert any(f.startswith("this machine:") for f in drawn), out[-2000:]


def test_host_tables_label_the_gpu_targets_on_the_cpu():
    """`bench_capture --host` on the CPU printed the targets (eager <= 25 us, compiled <= 5 us, set
    for a GPU machine's host) beside CPU numbers without saying so."""
    assert target_column(torch.device("cpu")) == "gpu_target_us"
    assert "not for this CPU run" in target_note(torch.device("cpu"))
    assert (target_column(torch.device("cuda")), target_note(torch.device("cuda"))) == ("target_us", "")


def test_registration_rejects_bad_entries_and_leaves_the_registry(scratch_registry, benches):
    before = registry.registry()
    cases = BENCH_CASES["e2e"]
    fn = lambda cases, run: []
    with pytest.raises(ValueError, match="benchmark name must match"):
        registry.benchmark("Bad Name", cases=cases)
    with pytest.raises(ValueError, match="needs must be one of"):
        registry.benchmark("x", cases=cases, needs="tpu")
    with pytest.raises(ValueError, match="cases must not be empty"):
        registry.benchmark("x", cases=())
    with pytest.raises(TypeError, match=r"every case needs str \.name and \.test"):
        registry.benchmark("x", cases=[MODEL_ROUTERS[0]])
    with pytest.raises(ValueError, match="--csv is a runner flag"):
        registry.benchmark("x", cases=cases, options=[registry.option("--csv")])
    with pytest.raises(ValueError, match="declared twice"):
        registry.benchmark("x", cases=cases, options=[registry.option("--a"), registry.option("--a")])
    with pytest.raises(ValueError, match="option flag must look like --name"):
        registry.option("-a")
    with pytest.raises(ValueError, match="--batches differs from 'e2e'"):
        registry.benchmark("x", cases=cases, options=[registry.option("--batches", type=int)])(fn)
    with pytest.raises(ValueError, match=r"benchmark 'e2e' is registered by .*bench_e2e\.py"):
        registry.benchmark("e2e", cases=cases)(fn)
    with pytest.raises(ValueError, match="needs must be one of"):
        registry.table("x", needs="tpu")
    with pytest.raises(ValueError, match="table name must be one non-empty line"):
        registry.table("")
    with pytest.raises(TypeError, match=r"tables must be made with table\(\)"):
        registry.benchmark("x", cases=cases, tables=["graphs"])
    with pytest.raises(ValueError, match="needs cuda, so none of its tables runs on the CPU"):
        registry.benchmark("x", cases=cases, tables=[registry.table("host", needs="cpu")])
    assert registry.registry() == before


def test_capture_and_routing_keep_their_cases_sizes_and_flags(benches):
    """The converted capture and routing benchmarks measure the sizes and cases their own parsers
    had (capture 1,64,512,8192 over LOCAL and GATHERED; routing 1,128,4096, sweep up to 16384, over
    its three routers) and keep their flags, --host and --tokens included."""
    want = {
        "capture": {"sizes": (1, 64, 512, 8192), "sweep": False, "host": False, "tokens": 64},
        "routing": {
            "sizes": (1, 128, 4096),
            "sweep_sizes": (1, 128, 1024, 4096, 16384),
            "sweep": False,
            "host": False,
        },
    }
    for name, defaults in want.items():
        assert benches[name].defaults() == defaults, name
        assert benches[name].needs == "cpu", f"{name}: --host must run without a GPU"
    assert BENCH_SIZES["capture"] == want["capture"]["sizes"]
    assert BENCH_SIZES["routing"] == want["routing"]["sizes"]
    assert [(c.name, c.layout, c.dp_size, c.layers, c.top_k) for c in benches["capture"].cases] == [
        ("LOCAL", BatchLayout.LOCAL, 1, 61, 8),
        ("GATHERED", BatchLayout.GATHERED, 4, 61, 8),
    ]
    routers = [
        (c.name, c.method.name, c.num_experts, c.top_k, c.n_group, c.topk_group)
        for c in benches["routing"].cases
    ]
    assert routers == [
        ("deepseek-v3", "DEEPSEEK_V3", 256, 8, 8, 4),
        ("renormalize-128", "RENORMALIZE", 128, 8, None, None),
        ("renormalize-512", "RENORMALIZE", 512, 8, None, None),
        ("deepseek-v2", "DEEPSEEK_V2", 160, 6, 8, 3),
        ("deepseek-v4", "SQRTSOFTPLUS", 256, 6, None, None),
    ]
    assert [(c.routed_scaling_factor, c.has_bias) for c in benches["routing"].cases] == [
        (2.5, True),
        (None, False),
        (None, False),
        (16.0, False),
        (1.5, True),
    ]
    module = sys.modules["benchmarks.bench_routing"]
    assert module.Case is type(BENCH_CASES["routing"][0]) and module.CASES is BENCH_CASES["routing"]


def test_capture_and_routing_without_a_gpu_measure_nothing_and_say_so(benches, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the graph tables would run")
    assert registry.main(["capture", "routing", "--sizes", "1"]) == 0
    out = capsys.readouterr().out
    assert "capture: the graph tables need a CUDA GPU; nothing measured" in out
    assert "routing: the router tables need a CUDA GPU; nothing measured" in out
    assert "##" not in out, "a table was printed without a GPU"


def test_capture_rejects_bad_tokens_and_foreign_cases(benches, capsys):
    """--tokens 0 fails the run before anything is measured; a case of another depth or width than
    the module's buffer is refused (the case's test would not cover what is measured)."""
    assert registry.main(["capture", "--host", "--tokens", "0"]) == 1
    err = capsys.readouterr().err
    assert "--tokens takes a positive int (tokens per DP rank), got 0" in err and "failed: capture" in err
    capture = benches["capture"]
    run = registry.Run(capture.defaults())
    bad = (replace(capture.cases[0], layers=58),)
    with pytest.raises(ValueError, match="case LOCAL: 58 layers x top_k 8, the benchmark measures 61 x 8"):
        capture.fn(bad, run)


@given(st.lists(st.integers(1, 2**40), min_size=1, max_size=6))
def test_int_list_round_trips(values):
    assert registry.int_list(",".join(map(str, values))) == tuple(values)


def test_one_csv_holds_tables_of_different_columns(tmp_path):
    a, b = Table("a", ["n", "us"]), Table("b", ["n", "ratio", "note"])
    a.add(1, 2.5)
    b.add(7, 0.5, "x")
    path = tmp_path / "out.csv"
    registry.write_csv(str(path), [("one", a), ("two", b)])
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0][:6] == ["bench", "benchmark", "n", "us", "ratio", "note"]
    assert rows[0][6:] == ["gpu", "torch", "triton", "git_sha"]
    assert [r[:6] for r in rows[1:]] == [["one", "a", "1", "2.5", "", ""], ["two", "b", "7", "", "0.5", "x"]]


# ---------------------------------------------------------------------- cases are test cases


def test_benchmarks_import_nothing_of_tests():
    """The dependency runs from the tests to the benchmarks' cases, never back: no benchmark module
    imports a module of tests/ or names the tests/ directory (to put it on sys.path)."""
    test_modules = {p.stem for p in (ROOT / "tests").rglob("*.py")} | {"strategies", "tests"}
    files = sorted((ROOT / "benchmarks").glob("*.py"))
    assert len(files) >= 8, "benchmarks/ not found"
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    assert node.value.strip("/") != "tests", f"{path.name}:{node.lineno} names tests/"
                continue
            for name in names:
                assert name.split(".")[0] not in test_modules, f"{path.name}:{node.lineno} imports {name}"


def test_registered_cases_are_the_cases_of_benchmarks_cases(benches):
    """A registered benchmark measures exactly BENCH_CASES[name] (the same objects), and every case
    names a test that exists."""
    for name, bench in benches.items():
        assert name in BENCH_CASES, f"{name}: no BENCH_CASES entry in benchmarks/cases.py"
        assert len(bench.cases) == len(BENCH_CASES[name])
        assert all(a is b for a, b in zip(bench.cases, BENCH_CASES[name])), name
        assert registry.missing_tests(bench) == []
        assert len({c.name for c in bench.cases}) == len(bench.cases), f"{name}: case names repeat"
    e2e = benches["e2e"].options
    assert next(o for o in e2e if o.flag == "--batches").default == BENCH_SIZES["e2e"]


def test_missing_tests_finds_a_case_naming_no_test(scratch_registry, benches):
    grid = BENCH_CASES["distributed"][0]
    bad = (
        replace(grid, test="tests/distributed/test_distributed.py::test_does_not_exist"),
        replace(grid, test="nofile.py::f"),
    )
    registry.benchmark("x", cases=bad, needs="cpu")(lambda cases, run: [])
    assert len(registry.missing_tests(registry.registry()["x"])) == 2


def test_bench_deepseek_v3_is_the_model_router():
    """The benchmarks' DeepSeek-V3 is MODEL_ROUTERS' (what the router tests draw), renamed."""
    assert replace(RouterConfig.of(BENCH_DEEPSEEK_V3), name=MODEL_ROUTERS[0].name) == MODEL_ROUTERS[0]


def test_e2e_preset_is_the_benchmarked_shape():
    """The e2e case's preset routes exactly the benchmarks' DeepSeek-V3 router (whose routing
    test_bench_routers_route_like_the_reference checks), and its dry run checks its capture."""
    for case in BENCH_CASES["e2e"]:
        config = reference_config(case.name)
        got = (
            config.routing_method,
            config.num_experts,
            config.top_k,
            config.n_group,
            config.topk_group,
            config.routed_scaling_factor,
            config.router_bias,
        )
        r = BENCH_DEEPSEEK_V3
        want = (
            r.method,
            r.num_experts,
            r.top_k,
            r.n_group,
            r.topk_group,
            r.routed_scaling_factor,
            r.has_bias,
        )
        assert got == want, case.name
        assert config.max_requests >= max(BENCH_SIZES["e2e"])


def test_e2e_step_batches_are_decode_rows_and_whole_prompts(benches):
    """The rows the e2e benchmark steps: decode, one row per request at position 64 (KV slots 0..n-1);
    prefill, whole prompts of max_seq_len tokens from position 0, one slot each (the last shorter)."""
    bench_e2e = sys.modules["benchmarks.bench_e2e"]  # loaded by the benches fixture
    config = reference_config("deepseek_small")
    cpu = torch.device("cpu")
    decode = bench_e2e.step_batch(config, "decode", 16, cpu)
    assert decode.kind == "decode" and decode.n == 16
    assert decode.positions.tolist() == [64] * 16 and decode.slot_ids.tolist() == list(range(16))
    for n in bench_e2e.PREFILL:
        prefill = bench_e2e.step_batch(config, "prefill", n, cpu)
        assert prefill.n == n and prefill.token_ids.shape == (n,)
        assert prefill.positions.tolist() == [i % 128 for i in range(n)]
        assert prefill.slot_ids.tolist() == [i // 128 for i in range(n)]
        assert int(prefill.slot_ids.max()) < config.max_requests
    odd = bench_e2e.step_batch(config, "prefill", 130, cpu)  # a full prompt, then 2 tokens
    assert odd.positions.tolist()[-3:] == [127, 0, 1] and odd.slot_ids.tolist()[-3:] == [0, 1, 1]
    assert ((decode.token_ids >= 1) & (decode.token_ids < config.vocab_size)).all()
    with pytest.raises(ValueError, match="decode batch 129 > max_requests=128"):
        bench_e2e.step_batch(config, "decode", 129, cpu)
    with pytest.raises(ValueError, match="prefill of 16385 tokens > max_requests \\* max_seq_len = 16384"):
        bench_e2e.step_batch(config, "prefill", 16385, cpu)
    with pytest.raises(ValueError, match="kind must be 'decode' or 'prefill'"):
        bench_e2e.step_batch(config, "chunked", 8, cpu)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_e2e_outside_cuda_graphs_measures_every_peer_gpu(cuda_device, benches, capsys, mode):
    """The e2e modes outside CUDA graphs on the real preset, one decode and one prefill size, few
    steps: every peer measured, the ratios against off printed (numbers: docs/performance.md)."""
    argv = ["e2e", "--mode", mode, "--batches", "1", "--prefill", "2048", "--steps", "3", "--trials", "2"]
    assert registry.main([*argv, "--peers", "off,on,on+snapshot"]) == 0
    out = capsys.readouterr().out
    assert f"## bench_e2e (deepseek_small, {mode}, no CUDA graphs" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["decode"], ["prefill"])]
    assert {(r[0], r[1], r[2]) for r in rows} == {
        (k, n, p) for k, n in (("decode", "1"), ("prefill", "2048")) for p in ("off", "on", "on+snapshot")
    }


# ------------------------------------------------- the shapes only the benchmark cases name

# each router once: routing and replay measure DeepSeek-V3 and renormalize-128 alike
ROUTERS = list({c.name: c for name in ("replay", "routing") for c in BENCH_CASES[name]}.values())
LAYERS = 61  # the routing benchmark's capture buffer depth (DeepSeek-V3's MoE-bearing layers)


def _route_and_capture(case, n: int, device) -> None:
    """Triton routing of bf16 logits, with the fused capture into the last of 61 layers, against
    the float64 reference; the buffer holds the routed ids and nothing else."""
    config = RouterConfig.of(case)
    logits, bias = RouterCase(config, n, torch.bfloat16, n, "normal", 1.0).tensors(device)
    buffer = torch.full((n, LAYERS, case.top_k), POISON, dtype=torch.int32, device=device)
    counts = torch.tensor([n], dtype=torch.int32, device=device)
    target = CaptureTarget(buffer, LAYERS - 1, token_counts=counts)
    kw = config.route_kwargs(bias)
    weights, ids = route(logits, case.top_k, case.method, capture=target, backend="triton", **kw)
    check_routing(config, logits, bias, weights, ids)
    assert torch.equal(buffer[:, LAYERS - 1], ids)
    assert (buffer[:, : LAYERS - 1] == POISON).all(), "the capture wrote another layer"


@pytest.mark.parametrize("case", ROUTERS, ids=lambda c: c.name)
def test_bench_routers_route_like_the_reference(case):
    """Every benchmarked router, interpreted on the CPU at a few tokens (the GPU twin below runs
    the benchmark's sizes)."""
    _route_and_capture(case, 5, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("n", sorted(set(BENCH_SIZES["routing"]) | set(BENCH_SIZES["replay"])))
@pytest.mark.parametrize("case", ROUTERS, ids=lambda c: c.name)
def test_bench_routers_route_like_the_reference_gpu(cuda_device, case, n):
    _route_and_capture(case, n, cuda_device)


def _capture_case(case, n: int, device) -> None:
    """The capture benchmark's write: the last of ``dp_size`` ranks captures its ``n`` rows of a
    (possibly gathered) batch into every layer; exactly those rows land, nothing else changes."""
    dp, rank = case.dp_size, case.dp_size - 1
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, 256, (n * dp, case.top_k), generator=g, dtype=torch.int32).to(device)
    counts = torch.full((dp,), n, dtype=torch.int32, device=device)
    buffer = torch.full((n + 2, case.layers, case.top_k), POISON, dtype=torch.int32, device=device)
    for layer in range(case.layers):
        capture_routing(buffer, ids + layer, layer, token_counts=counts, dp_rank=rank, layout=case.layout)
    start = rank * n if case.layout == BatchLayout.GATHERED else 0
    want = torch.stack([ids[start : start + n] + layer for layer in range(case.layers)], dim=1)
    assert torch.equal(buffer[:n], want)
    assert (buffer[n:] == POISON).all(), "rows past this rank's count were written"


@pytest.mark.parametrize("case", BENCH_CASES["capture"], ids=lambda c: c.name)
def test_bench_capture_cases_capture_exactly(case):
    _capture_case(case, 3, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("n", BENCH_SIZES["capture"])
@pytest.mark.parametrize("case", BENCH_CASES["capture"], ids=lambda c: c.name)
def test_bench_capture_cases_capture_exactly_gpu(cuda_device, case, n):
    _capture_case(case, n, cuda_device)


def _transfer_case(case, n: int, device) -> None:
    """The transfer benchmark's path at its shape: a snapshot of ``n`` rows narrowed to the shape's
    id dtype, then the wire round trip of those rows; every id arrives unchanged."""
    shape = case.shape
    g = torch.Generator().manual_seed(n)
    source = torch.randint(0, shape.num_experts, (n + 3, shape.num_layers, shape.top_k), generator=g)
    source = source.to(device=device, dtype=torch.int32)
    pipe = TransferPipeline(source, shape.id_dtype, depth=4)
    with pipe.snapshot(n) as handle:
        rows = handle.result()
    pipe.synchronize()
    want = source[:n].cpu().numpy()
    assert rows.dtype == shape.id_dtype and rows.shape == want.shape
    assert (rows == want).all()
    back = decode_routing(encode_routing(rows), num_layers=shape.num_layers, top_k=shape.top_k)
    assert back.dtype == rows.dtype and (back == want).all()


def test_bench_transfer_shape_snapshots_and_encodes_exactly():
    for case in BENCH_CASES["transfer"]:
        _transfer_case(case, 5, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("n", BENCH_SIZES["transfer"])
def test_bench_transfer_shape_snapshots_and_encodes_exactly_gpu(cuda_device, n):
    for case in BENCH_CASES["transfer"]:
        _transfer_case(case, n, cuda_device)
