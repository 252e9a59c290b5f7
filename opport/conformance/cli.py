"""`opport conformance`: run the suite, print the matrix, write reports, gate (see docs/conformance.md).

Every input is checked before the run (names, numbers, the files it reads and the paths it writes): a bad
one is one line on stderr and exit status 2.
"""

from __future__ import annotations

import os
import sys

from rich.console import Console

from opport.conformance.cases import TIERS

EXIT_USAGE = 2


def add_arguments(p):
    p.add_argument("--backend", action="append", default=None, metavar="NAME",
                   help="a backend (`opport doctor` lists them) or all (every backend that can run here); repeatable. "
                        "Default: cpu")
    p.add_argument("--op", action="append", default=[], metavar="NAME", help="only this op (repeatable)")
    p.add_argument("--dtype", action="append", default=[], metavar="D", help="only this dtype (repeatable)")
    p.add_argument("--case", action="append", default=[], metavar="NAME",
                   help="only cases with this name (fnmatch pattern, repeatable); bypasses tier filters")
    p.add_argument("--tier", choices=tuple(TIERS), default="fast",
                   help="smoke: every op, backend and dtype in about a minute; fast: CI (capped examples, no 'large' "
                        "cases); full: thousands of examples, every layout")
    p.add_argument("--examples", type=int, default=None, metavar="N", help="Hypothesis examples per op x dtype")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="Hypothesis seed (0 = the derandomized CI profile)")
    p.add_argument("--json", metavar="F", help="write the JSON report (docs/design.md section 6)")
    p.add_argument("--junit", metavar="F", help="write JUnit XML (one testcase per case, metrics as properties)")
    p.add_argument("--markdown", metavar="F", help="write a Markdown summary (e.g. $GITHUB_STEP_SUMMARY)")
    p.add_argument("--baseline", metavar="F",
                   help="judge against this baseline (a ratchet): a case failing now and in F is reported as known in "
                        "the baseline (xfail) and does not fail the run; a new failure, or a metric > 2x its value in "
                        "F, does")
    p.add_argument("--update-baseline", action="store_true",
                   help="write this run's statuses and metrics into --baseline F (merged: cases not run keep their "
                        "entry); this run is judged without it")
    p.add_argument("--known-failures", action="append", default=[], metavar="F",
                   help="an extra known-failures file (each backend's own known_failures.txt is always read)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="worker processes (default: one per core, max 8; 0 = in this process, no crash isolation)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S", help="per-case time limit (default 60)")
    p.add_argument("--compile-timeout", type=float, default=300.0, metavar="S",
                   help="extra time for the first case of an op in each worker (JIT compilation; default 300)")
    p.add_argument("--setup", action="append", default=[], metavar="MODULE:FUNCTION",
                   help="call this in every process before running (registers extra/test backends)")
    p.add_argument("--no-layouts", action="store_true", help="skip the strided-layout variants")
    p.add_argument("--no-bad-inputs", action="store_true", help="skip the bad-input cases")
    p.add_argument("--self-test", action="store_true",
                   help="check the gate itself: 5 mutant kernels per op must be caught, a crashing backend isolated")
    p.add_argument("--covered-by", metavar="REPORT",
                   help="run nothing: every case this run would run must be in REPORT (a --json report of a larger "
                        "tier) with the same verdict it would need here; a case REPORT lacks fails. CI's check that "
                        "the smoke tier (make run) is green whenever the gate is")
    p.add_argument("-q", "--quiet", action="store_true", help="no live progress")
    # the results store (docs/store.md)
    p.add_argument("--store", metavar="DB", help="append this run to a SQLite results store (`opport history DB`)")
    from opport.fleet import add_arguments as add_cluster_arguments

    add_cluster_arguments(p)  # --cluster, --dashboard: batches run as Ray tasks (docs/fleet.md)


def run(args) -> int:
    from opport.conformance.runner import Options
    from opport.errors import OpError

    problem = check_args(args)
    if problem:
        print(f"opport conformance: {problem}", file=sys.stderr)
        return EXIT_USAGE
    if args.self_test:
        return self_test(args)
    opts = Options(backends=tuple(args.backend or ["cpu"]), ops=tuple(args.op), dtypes=tuple(args.dtype),
                   cases=tuple(args.case), tier=args.tier, examples=args.examples, seed=args.seed, workers=args.workers,
                   timeout=args.timeout, compile_timeout=args.compile_timeout, setup=tuple(args.setup),
                   known_failures=tuple(args.known_failures), baseline=None if args.update_baseline else args.baseline,
                   errors=not args.no_bad_inputs, layouts=not args.no_layouts)
    try:
        report = _run(opts, args.quiet, args.cluster, args.dashboard, args.covered_by)
    except (OpError, ValueError) as e:  # unknown op/backend/dtype, a --setup hook that failed
        print(f"opport conformance: {e}", file=sys.stderr)
        return EXIT_USAGE
    _write(report, args)
    return report.exit_code


def check_args(args) -> str | None:
    """What is wrong with the command line, or None: numbers, --setup hooks, files read, paths written."""
    from opport import runargs as ra

    if args.update_baseline and not args.baseline:
        return "--update-baseline needs --baseline FILE"
    return ra.first(
        ra.positive("--examples", args.examples, allow_zero=True), ra.positive("--timeout", args.timeout),
        ra.positive("--compile-timeout", args.compile_timeout, allow_zero=True),
        ra.positive("--workers", args.workers, allow_zero=True),
        *[_setup_problem(ref) for ref in args.setup],
        *[_known_problem(path) for path in args.known_failures],
        _baseline_problem(args.baseline, args.update_baseline) if args.baseline else None,
        ra.writable("--json", args.json), ra.writable("--junit", args.junit), ra.writable("--markdown", args.markdown),
        _store_problem(args),
    )


def _store_problem(args) -> str | None:
    from opport.store import db

    if args.store and args.self_test:
        return "--store keeps suite runs; --self-test has none to keep"
    return db.problem("--store", args.store)


def _setup_problem(ref: str) -> str | None:
    """None if `ref` names a callable as MODULE:FUNCTION (imported here, not called)."""
    import importlib

    mod, colon, fn = ref.partition(":")
    if not colon or not mod or not fn:
        return f"--setup {ref!r}: expected MODULE:FUNCTION"
    try:
        found = getattr(importlib.import_module(mod), fn, None)
    except Exception as e:  # ImportError, or the module failing as it loads
        return f"--setup {ref!r}: cannot import {mod}: {type(e).__name__}: {e}"
    return None if callable(found) else f"--setup {ref!r}: {mod} has no function {fn!r}"


def _known_problem(path: str) -> str | None:
    from opport import runargs as ra
    from opport.conformance import gate

    _, why = ra.read_text("--known-failures", path)
    if why:
        return why
    try:
        gate.load_known(path)
    except gate.KnownFailureFileError as e:
        return f"--known-failures: {e}"
    return None


def _baseline_problem(path: str, update: bool) -> str | None:
    """--baseline must be a readable baseline or report; with --update-baseline it may be new, and is written."""
    import os

    from opport import runargs as ra
    from opport.conformance import gate

    if not update:
        return ra.json_file("--baseline", path, gate.baseline_problem)
    if os.path.exists(path):  # merged into: it must be a baseline already, and may hold no cases yet
        why = ra.json_file("--baseline", path, lambda data: gate.baseline_problem(data, allow_empty=True))
        if why:
            return why
    return ra.writable("--baseline", path)


def _run(opts, quiet: bool, cluster: str | None = None, dashboard: bool = False, covered_by: str | None = None):
    from opport.conformance import report as rep
    from opport.conformance.runner import covered
    from opport.conformance.runner import run as run_suite

    _check_names(opts)
    live = None if quiet else rep.Live(Console(stderr=True, width=None if sys.stderr.isatty() else 160))
    if covered_by:
        report = run_suite(opts, live, covered(covered_by))
    elif cluster:
        from opport.fleet.conformance import run as run_on_cluster

        report = run_on_cluster(opts, live, cluster, dashboard)
    else:
        report = run_suite(opts, live)
    rep.print_summary(report, Console(width=None if sys.stdout.isatty() else 160))
    return report


def _check_names(opts):
    from opport.dtypes import FLOATS
    from opport.errors import ArgumentError
    from opport.ops import get_op

    for name in opts.ops:
        get_op(name)
    for d in opts.dtypes:
        if d not in FLOATS:
            raise ArgumentError(op="conformance", arg="dtype", constraint="conformance.dtype", expected=f"one of {FLOATS}",
                                got=repr(d))


def _write(report, args):
    from opport.conformance import gate
    from opport.conformance import report as rep

    if args.json:
        rep.write_json(report, args.json)
    if args.junit:
        rep.write_junit(report, args.junit)
    if args.markdown:
        with open(args.markdown, "a" if args.markdown == os.environ.get("GITHUB_STEP_SUMMARY") else "w") as f:
            f.write(rep.to_markdown(report))
    if args.update_baseline:
        old = gate.load_baseline(args.baseline) if os.path.exists(args.baseline) else {}
        gate.write_baseline(args.baseline, report.cases, old)
        Console().print(f"baseline written: {args.baseline} ({len(report.cases)} cases)")
    if args.store:
        from opport.store import db

        with db.Store(args.store, create=True) as store:
            run_id = store.append("conformance", rep.to_json(report), args.argv, report.exit_code)
        Console().print(f"stored as run {run_id} in {args.store}", highlight=False)


def self_test(args) -> int:
    """Mutant kill matrix (G4) and the crash-isolation check (G5), both on cpu."""
    from rich.table import Table

    from opport.conformance import faults, mutants
    from opport.conformance.runner import Options
    from opport.conformance.runner import run as run_suite

    console = Console()
    kills = mutants.self_test(ops=args.op or None, examples=args.examples if args.examples is not None else 5)
    t = Table(title="mutant kernels (each must be caught by a case)")
    t.add_column("op")
    for m in mutants.MUTANTS:
        t.add_column(m)
    for op in sorted({op for op, _ in kills}):
        t.add_row(op, *[f"[green]caught[/green]\n[dim]{kills[(op, m)].split('/')[-1]}[/dim]" if kills[(op, m)]
                        else "[red]SURVIVED[/red]" for m in mutants.MUTANTS])
    console.print(t)
    survivors = [k for k, v in kills.items() if v is None]
    opts = Options(backends=("faulty",), ops=("rmsnorm",), dtypes=("float32",), cases=tuple(faults.EXPECTED), workers=1,
                   timeout=3.0, compile_timeout=0.0, setup=("opport.conformance.faults:install",), errors=False, layouts=False)
    try:
        report = run_suite(opts)
    finally:
        faults.uninstall()
    got = {c["case"]: c["status"] for c in report.cases}
    ok_isolation = got == faults.EXPECTED
    console.print(f"crash isolation: {'[green]ok[/green]' if ok_isolation else '[red]FAILED[/red]'} "
                  f"(statuses {got}, expected {faults.EXPECTED})")
    if survivors:
        console.print(f"[red]{len(survivors)} mutant(s) survived:[/red] {survivors}")
    return 0 if not survivors and ok_isolation else 1
