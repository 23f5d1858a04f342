"""One registry of benchmarks and one runner: ``python -m benchmarks [NAMES...] [--csv F] [--quick]
[--list] [--dry-run] [options of the chosen benchmarks]``.

A benchmark is a table function registered by name with the cases it measures::

    @benchmark("e2e", cases=BENCH_CASES["e2e"], options=[sizes_option("--batches", BENCH_SIZES["e2e"])])
    def e2e(cases, run: Run) -> list[Table]: ...

Its cases come from ``benchmarks/cases.py`` (``BENCH_CASES``, ``BENCH_SIZES``), and each names the
test that checks the library at that shape, so a benchmark never measures a shape no test covers.
The benchmarks import nothing of ``tests/``; the tests import their shapes from ``benchmarks.cases``.

Tables: a benchmark may declare the tables it prints (:func:`table`: what it measures, whether it
needs a CUDA GPU, the flags that select it), so that ``--list`` says which run on this machine and a
run on a machine without a GPU says at once which it skips; undeclared, its one table needs what
the benchmark needs.

Options: a benchmark declares its own flags (:func:`option`, :func:`sizes_option`); the runner accepts
the flags of every registered benchmark, and a flag applies to each chosen benchmark that declares it
(``--sizes 1,128`` sets the sizes of routing and replay alike). A flag no chosen benchmark declares is
an error. Two benchmarks that declare one flag must agree on its type and choices.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.harness import Table, environment, running  # noqa: E402 - needs ROOT on sys.path
from moe_ops.demo.progress import StatusLine  # noqa: E402

__all__ = [
    "Benchmark",
    "Option",
    "Run",
    "TableSpec",
    "benchmark",
    "int_list",
    "load_all",
    "main",
    "missing_tests",
    "option",
    "registry",
    "sizes_option",
    "switch",
    "table",
    "tables_here",
    "write_csv",
]

NEEDS = ("cuda", "cpu")


def int_list(text: str) -> tuple[int, ...]:
    """``"1,16,128"`` -> ``(1, 16, 128)``: positive ints, comma-separated (an argparse type)."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated ints such as 1,16,128, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return values


@dataclass(frozen=True)
class Option:
    """One flag of a benchmark (an ``argparse`` argument)."""

    # the flag, e.g. "--batches"; starts with "--"
    flag: str
    # the value without the flag; for a switch (``kind == "switch"``) False
    default: Any
    # parses the text after the flag (a switch has none)
    type: Callable[[str], Any] | None = None
    # the values the flag accepts; None: any the type parses
    choices: tuple | None = None
    help: str = ""
    # "value": takes one argument; "switch": store_true
    kind: str = "value"

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def signature(self) -> tuple:
        """What two benchmarks that share this flag must agree on."""
        return (self.type, self.choices, self.kind)


def option(
    flag: str,
    default: Any = None,
    *,
    type: Callable[[str], Any] | None = str,
    choices: Sequence | None = None,
    help: str = "",
) -> Option:
    """A flag taking one value; ``type`` parses it (``str`` by default)."""
    if not flag.startswith("--") or len(flag) < 3:
        raise ValueError(f"option flag must look like --name, got {flag!r}")
    return Option(flag, default, type, tuple(choices) if choices is not None else None, help)


def switch(flag: str, help: str = "") -> Option:
    """A flag without a value (False unless given)."""
    if not flag.startswith("--") or len(flag) < 3:
        raise ValueError(f"option flag must look like --name, got {flag!r}")
    return Option(flag, False, None, None, help, kind="switch")


def sizes_option(flag: str, default: Sequence[int], help: str = "") -> Option:
    """A comma-separated list of sizes (tokens, batch sizes), parsed to a tuple of ints."""
    default = tuple(default)
    text = ",".join(map(str, default))
    return option(flag, default, type=int_list, help=help or f"comma-separated sizes (default {text})")


@dataclass(frozen=True)
class Run:
    """What a benchmark's table function receives besides its cases."""

    # the benchmark's options by dest (``run.options["batches"]``), defaults filled in
    options: dict[str, Any]
    # fewer trials and repetitions: a smoke run, numbers not for the record
    quick: bool = False
    # the dests of the options given on the command line (a given flag beats a --quick default)
    given: frozenset[str] = frozenset()

    def __getattr__(self, name: str) -> Any:
        # run.batches reads like the argparse namespace the benchmarks used before
        if name == "options":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        try:
            return self.options[name]
        except KeyError:
            raise AttributeError(f"the benchmark declares no option {name!r}") from None


@dataclass(frozen=True)
class TableSpec:
    """One table a benchmark prints: what ``--list`` shows of it."""

    # what it measures, one line
    name: str
    # "cuda": measured on a GPU only; "cpu": runs anywhere
    needs: str = "cuda"
    # the flags that select it, e.g. "--mode eager|compiled"; "" when the benchmark prints it by default
    flags: str = ""


def table(name: str, needs: str = "cuda", flags: str = "") -> TableSpec:
    """A table a benchmark declares (:func:`benchmark`'s ``tables``)."""
    if not name or "\n" in name:
        raise ValueError(f"table name must be one non-empty line, got {name!r}")
    if needs not in NEEDS:
        raise ValueError(f"needs must be one of {NEEDS}, got {needs!r}")
    return TableSpec(name, needs, flags)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


TableFn = Callable[[Sequence, Run], "Table | list[Table]"]


@dataclass(frozen=True)
class Benchmark:
    """A registered benchmark."""

    # what ``python -m benchmarks NAME`` selects; [a-z0-9_-]+
    name: str
    # the table function: fn(cases, run) -> Table or list of Tables
    fn: TableFn
    # the cases it measures, in table order; each has .name and .test (benchmarks/cases.py)
    cases: tuple
    # "cuda": measures on a GPU (skipped with a note without one); "cpu": runs anywhere
    needs: str
    # its own flags
    options: tuple[Option, ...] = ()
    # CPU check that it runs (tiny, untimed, results checked): dry_run(cases, run) -> Tables;
    # None: --dry-run checks only that every case names an existing test
    dry_run: TableFn | None = None
    # one line: the first line of the table function's docstring
    doc: str = ""
    # the file that registered it
    source: str = field(default="", compare=False)
    # the tables it prints; empty: one, needing what the benchmark needs (see :meth:`table_specs`)
    tables: tuple[TableSpec, ...] = ()

    def defaults(self) -> dict[str, Any]:
        return {o.dest: o.default for o in self.options}

    def table_specs(self) -> tuple[TableSpec, ...]:
        """The declared tables, or the benchmark's one table (its doc line, its needs)."""
        return self.tables or (TableSpec(self.doc or self.name, self.needs),)


def tables_here(bench: Benchmark, has_cuda: bool | None = None) -> tuple[list[TableSpec], list[TableSpec]]:
    """(the tables of ``bench`` that run on this machine, those that need a CUDA GPU it lacks)."""
    cuda = _has_cuda() if has_cuda is None else has_cuda
    specs = bench.table_specs()
    if bench.needs == "cuda" and not cuda:
        return [], list(specs)
    return [t for t in specs if t.needs == "cpu" or cuda], [
        t for t in specs if t.needs == "cuda" and not cuda
    ]


_REGISTRY: dict[str, Benchmark] = {}


def registry() -> dict[str, Benchmark]:
    """The registered benchmarks by name (a copy), in registration order."""
    return dict(_REGISTRY)


def benchmark(
    name: str,
    *,
    cases: Sequence,
    needs: str = "cuda",
    options: Sequence[Option] = (),
    dry_run: TableFn | None = None,
    tables: Sequence[TableSpec] = (),
) -> Callable[[TableFn], TableFn]:
    """Registers the decorated table function ``fn(cases, run)`` as benchmark ``name``; returns it
    unchanged. ``tables``: what it prints (:func:`table`), for ``--list`` and the note of what a
    machine without a GPU skips. Re-registering a name from the same file replaces the entry (a
    file run as a script and imported as ``benchmarks.bench_x`` executes twice); from another file
    it is an error."""
    if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", name or ""):
        raise ValueError(f"benchmark name must match [a-z0-9][a-z0-9_-]*, got {name!r}")
    if needs not in NEEDS:
        raise ValueError(f"needs must be one of {NEEDS}, got {needs!r}")
    cases = tuple(cases)
    if not cases:
        raise ValueError(f"benchmark {name!r}: cases must not be empty")
    for case in cases:
        if not isinstance(getattr(case, "name", None), str) or not isinstance(
            getattr(case, "test", None), str
        ):
            raise TypeError(f"benchmark {name!r}: every case needs str .name and .test, got {case!r}")
    flags = [o.flag for o in options]
    if len(set(flags)) != len(flags):
        raise ValueError(f"benchmark {name!r}: an option flag is declared twice in {flags}")
    for o in options:
        if o.flag in ("--csv", "--quick", "--list", "--dry-run"):
            raise ValueError(f"benchmark {name!r}: {o.flag} is a runner flag")
    tables = tuple(tables)
    if not all(isinstance(t, TableSpec) for t in tables):
        raise TypeError(f"benchmark {name!r}: tables must be made with table(), got {tables!r}")
    if needs == "cuda" and any(t.needs == "cpu" for t in tables):
        raise ValueError(f"benchmark {name!r} needs cuda, so none of its tables runs on the CPU")

    def register(fn: TableFn) -> TableFn:
        source = (
            os.path.realpath(getattr(fn, "__code__", None).co_filename) if hasattr(fn, "__code__") else ""
        )
        old = _REGISTRY.get(name)
        if old is not None and old.source != source:
            raise ValueError(f"benchmark {name!r} is registered by {old.source}; {source} registers it again")
        for other in _REGISTRY.values():
            if other.name == name:
                continue
            for o in options:
                for p in other.options:
                    if o.flag == p.flag and o.signature() != p.signature():
                        raise ValueError(
                            f"benchmark {name!r}: {o.flag} differs from {other.name!r}'s "
                            f"(type, choices, kind) {p.signature()} vs {o.signature()}"
                        )
        doc = (fn.__doc__ or "").strip().splitlines()
        _REGISTRY[name] = Benchmark(
            name, fn, cases, needs, tuple(options), dry_run, doc[0] if doc else "", source, tables
        )
        return fn

    return register


def load_all() -> dict[str, Benchmark]:
    """Imports every ``benchmarks/bench_*.py`` (registering what they declare); returns the registry.
    A file that fails to import raises: a benchmark that silently vanished would look like a pass."""
    for path in sorted((ROOT / "benchmarks").glob("bench_*.py")):
        importlib.import_module(f"benchmarks.{path.stem}")
    return registry()


def missing_tests(bench: Benchmark) -> list[str]:
    """The cases of ``bench`` whose ``test`` (``tests/<file>.py::<function>``) does not exist."""
    missing = []
    for case in bench.cases:
        path, _, name = case.test.partition("::")
        file = ROOT / path
        if (
            not name
            or not file.is_file()
            or not re.search(rf"^def {re.escape(name)}\(", file.read_text(), re.M)
        ):
            missing.append(f"{bench.name}/{case.name}: {case.test}")
    return missing


def write_csv(path: str, tables: Sequence[tuple[str, Table]]) -> None:
    """One CSV of every ``(benchmark name, table)`` of a run (overwritten): ``bench`` (the registry
    name), ``benchmark`` (the table's title, as ``Table.write_csv`` writes it), the union of the
    tables' columns in order of first appearance (empty where a table lacks one), and the
    environment stamp (GPU, torch, triton, git sha) on every row."""
    env = environment()
    columns: list[str] = []
    for _, t in tables:
        columns += [c for c in t.columns if c not in columns]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["bench", "benchmark", *columns, *env.keys()])
        for name, t in tables:
            for row in t.rows:
                cells = dict(zip(t.columns, row))
                writer.writerow([name, t.name, *(cells.get(c, "") for c in columns), *env.values()])


def _cases_table(bench: Benchmark) -> Table:
    table = Table(f"{bench.name}: cases (dry run: the names of the tests that check them)", ["case", "test"])
    for case in bench.cases:
        table.add(case.name, case.test)
    return table


def _parser(benches: dict[str, Benchmark]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Runs the chosen benchmarks (default: all), prints each table, writes one CSV.",
    )
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run: {', '.join(benches)}")
    parser.add_argument("--csv", default=None, help="write every table's rows to this CSV file (overwritten)")
    parser.add_argument("--quick", action="store_true", help="fewer trials: a smoke run, not for the record")
    parser.add_argument("--list", action="store_true", help="list the benchmarks, their cases and options")
    parser.add_argument(
        "--dry-run", action="store_true", help="check each benchmark on the CPU: tiny, untimed, checked"
    )
    parser.add_argument(
        "--cases",
        default=None,
        help="comma-separated case names: measure only these cases of each chosen benchmark (--list "
        "names them); a name no chosen benchmark has is an error",
    )
    seen: dict[str, str] = {}
    for bench in benches.values():
        for o in bench.options:
            if o.flag in seen:
                continue
            seen[o.flag] = bench.name
            users = [b.name for b in benches.values() if any(p.flag == o.flag for p in b.options)]
            help = f"{o.help} [{', '.join(users)}]"
            if o.kind == "switch":
                parser.add_argument(o.flag, action="store_true", default=argparse.SUPPRESS, help=help)
            else:
                parser.add_argument(
                    o.flag, type=o.type, choices=o.choices, default=argparse.SUPPRESS, help=help
                )
    return parser


def main(argv: Sequence[str] | None = None, status: StatusLine | None = None) -> int:
    """The runner; returns the exit status (0: every chosen benchmark ran, or was dry-run).
    ``status``: the status line it draws each benchmark and its steps on (default: one on stderr,
    drawn on a terminal only; ``python -m benchmarks`` passes the one it drew before its imports)."""
    status = StatusLine() if status is None else status
    try:
        return _main(argv, status)
    finally:
        status.close()


def _main(argv: Sequence[str] | None, status: StatusLine) -> int:
    status.phase("benchmarks: importing every benchmarks/bench_*.py")
    benches = load_all()
    status.close()
    parser = _parser(benches)
    args = vars(parser.parse_args(argv))
    named = bool(args["names"])
    names = args.pop("names") or list(benches)
    csv_path, quick, listing, dry = args.pop("csv"), args.pop("quick"), args.pop("list"), args.pop("dry_run")
    case_names = args.pop("cases")
    unknown = [n for n in names if n not in benches]
    if unknown:
        parser.error(f"unknown benchmark {', '.join(unknown)}; registered: {', '.join(benches)}")
    chosen = [benches[n] for n in dict.fromkeys(names)]
    if case_names is not None:
        wanted = [c for c in case_names.split(",") if c]
        known = {c.name for b in chosen for c in b.cases}
        missing = [c for c in wanted if c not in known]
        if not wanted or missing:
            parser.error(
                f"--cases: {', '.join(missing) or 'no name given'} is not a case of "
                f"{', '.join(b.name for b in chosen)} (cases: {', '.join(sorted(known))})"
            )
        # a benchmark none of whose cases is wanted is not run
        chosen = [
            dataclasses.replace(b, cases=tuple(c for c in b.cases if c.name in wanted))
            for b in chosen
            if any(c.name in wanted for c in b.cases)
        ]
    for dest in args:  # only the flags given on the command line are left (default SUPPRESS)
        if not any(o.dest == dest for b in chosen for o in b.options):
            users = [b.name for b in benches.values() if any(o.dest == dest for o in b.options)]
            parser.error(
                f"--{dest.replace('_', '-')} is an option of {', '.join(users)}, none of which is chosen"
            )
    has_cuda = _has_cuda()
    if listing:
        print(f"this machine: {'a CUDA GPU' if has_cuda else 'no CUDA GPU'}")
        for b in chosen:
            here, not_here = tables_here(b, has_cuda)
            print(f"{b.name} (needs {b.needs}{', dry run' if b.dry_run else ''}): {b.doc}")
            if not b.tables:
                print(
                    "    runs here (its tables are not declared: it says when it runs which need a GPU)"
                    if here
                    else "    not here: needs a CUDA GPU"
                )
            for t in b.tables:
                where = "runs here" if t in here else "not here: needs a CUDA GPU"
                print(f"    table {t.name}{f' ({t.flags})' if t.flags else ''}: {where}")
            if not here and b.dry_run is not None:
                print("    --dry-run checks it on the CPU")
            for case in b.cases:
                print(f"    case {case.name}: {case.test}")
            for o in b.options:
                print(f"    {o.flag} (default {o.default!r}) {o.help}")
        return 0

    tables: list[tuple[str, Table]] = []
    skipped, failed = [], []
    for b in chosen:
        mine = {k: v for k, v in args.items() if k in b.defaults()}
        run = Run({**b.defaults(), **mine}, quick=quick, given=frozenset(mine))
        here, not_here = tables_here(b, has_cuda)
        try:
            if dry:
                missing = missing_tests(b)
                if missing:
                    raise AssertionError("cases name tests that do not exist: " + "; ".join(missing))
                with running(status, b.name, "dry run"):
                    out = b.dry_run(b.cases, run) if b.dry_run is not None else _cases_table(b)
            elif b.needs == "cuda" and not has_cuda:
                print(
                    f"{b.name}: needs a CUDA GPU; skipped ({', '.join(t.name for t in not_here)}; --dry-run "
                    "checks it on the CPU)",
                    flush=True,
                )
                skipped.append(b.name)
                continue
            else:
                if not_here:  # said before the run, which may take minutes on the CPU tables
                    print(f"{b.name}: no CUDA GPU, not measured here: {'; '.join(t.name for t in not_here)}")
                print(f"{b.name}: running", flush=True)
                with running(status, b.name):
                    out = b.fn(b.cases, run)
        except Exception:
            status.close()
            traceback.print_exc()
            failed.append(b.name)
            continue
        status.close()
        for t in [out] if isinstance(out, Table) else list(out):
            t.print()
            tables.append((b.name, t))
    if csv_path and tables:
        write_csv(csv_path, tables)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    # a benchmark named on the command line that could not run is a failure; "all" skips with a note
    return 1 if skipped and named else 0
