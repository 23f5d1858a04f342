"""benchmarks/bench_replay.py on a machine without a GPU: every case and peer builds and runs once on
the CPU (--dry-run), and every case names a test that checks its shapes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_replay", ROOT / "benchmarks" / "bench_replay.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def test_dry_run_builds_and_calls_every_peer(bench):
    table = bench.dry_run([1, 8])
    ran = {(row[0], row[1], row[2], row[3]) for row in table.rows}
    for case in bench.CASES:
        for n in (1, 8):
            for name in bench.FORWARD_PEERS:
                assert ("forward", case.name, n, name) in ran
            for name in bench.BACKWARD_PEERS:
                if name != "compiled-ref":  # the dry run compiles nothing
                    assert ("backward", case.name, n, name) in ran
    for n in (1, 8):
        for mode in bench.LAYER_MODES:
            assert ("layer", "tiny", n, mode) in ran
        for case in bench.CASES:  # conftest interprets Triton on CPU: the Triton-only peers run too
            assert ("floor", case.name, n, "floor-1") in ran and ("floor", case.name, n, "floor-2") in ran
            assert ("sweep", case.name, n, "bwd m=1 w=1") in ran
            assert ("sweep", case.name, n, "fwd m=8 w=4") in ran


def test_floor_grids_are_the_replay_launches(bench):
    """The do-nothing peers launch the grids replay launches: the forward's and the
    backward's launch configurations at the benchmark's sizes."""
    from moe_ops.replay.kernels import backward_launch_config, forward_launch_config
    from moe_ops.router.args import tile_shape

    for case in bench.CASES:
        for n in (1, 128, 4096):
            (fwd_p, fwd_w), (bwd_p, bwd_w) = bench._replay_grids(case, n)
            fwd_m, want_fwd_w = forward_launch_config(n, *tile_shape(case.num_experts, case.n_group or 1))
            bwd_m, want_bwd_w = backward_launch_config(n, 1 << (case.num_experts - 1).bit_length())
            assert (fwd_p, fwd_w) == (-(-n // fwd_m), want_fwd_w)
            assert (bwd_p, bwd_w) == (-(-n // bwd_m), want_bwd_w)


def test_every_case_names_an_existing_test(bench):
    for case in bench.CASES:
        path, name = case.test.split("::")
        source = (ROOT / path).read_text()
        assert f"def {name}(" in source, f"{case.name}: {case.test} does not exist"
