"""Benchmarks: one registry (``benchmarks/registry.py``) and one runner.

    python -m benchmarks --list                     # every benchmark, its cases and their tests, its flags
    python -m benchmarks [NAMES...] [--csv F] [--quick] [--dry-run] [flags of the chosen benchmarks]
    python benchmarks/bench_e2e.py [flags]          # the same as: python -m benchmarks e2e [flags]

The runner imports every ``benchmarks/bench_*.py``, runs the chosen benchmarks (default: all; one
that needs a GPU is skipped with a note where there is none, and fails the run if it was named),
prints each table and writes one CSV of all of them (overwritten), every row stamped with the GPU,
torch, triton and git sha (``MOE_OPS_GIT_SHA`` where the tree has no ``.git``). ``--quick`` runs
fewer trials (a smoke run); ``--dry-run`` checks each benchmark on the CPU: its own dry run (tiny,
untimed, results checked) where it has one, and for every benchmark that each case names a test
that exists. A flag applies to every chosen benchmark that declares it.

Adding a benchmark: a table function decorated with its name and cases, in a ``bench_*.py``::

    from benchmarks.cases import BENCH_CASES, BENCH_SIZES
    from benchmarks.registry import benchmark, sizes_option

    @benchmark("routing", cases=BENCH_CASES["routing"],
               options=[sizes_option("--sizes", BENCH_SIZES["routing"])])
    def routing(cases, run):  # run.sizes, run.quick; returns a harness Table or a list of them
        ...

    if __name__ == "__main__":
        sys.exit(main(["routing", *sys.argv[1:]]))  # from benchmarks.registry import main

Cases are defined once, in ``benchmarks/cases.py`` (``BENCH_CASES``, ``BENCH_SIZES``: the router
configurations, process grids, presets, capture layouts and sizes the benchmarks measure), each
naming the test that checks the library at that shape by path (``tests/<file>.py::<function>``).
The benchmarks import nothing of ``tests/``; the tests that check these shapes import them from
``benchmarks.cases``. ``tests/test_benchmarks.py`` checks that every registered benchmark measures
exactly those cases, that the named tests exist, and dry-runs them all.
"""
