"""`opport bench`: time opport against the ceilings and baselines of the same run (docs/benchmarking.md).

    opport bench --backend cpu [--op rmsnorm] [--tier smoke|small|llm] [--json F] [--plot F] [--baseline F]
    opport bench --backend NAME               # the backend's own timer, ceilings, tier and dtypes
    opport bench --overhead                   # what opport.<op>() adds over calling its kernel

How a backend is measured (its timer and ceilings, or counts where it only runs emulated here; its default
tier, dtypes, time limit and baselines) is declared by the backend: opport/bench/profile.py.

Exit status: 0 when every opport row that ran was correct (and, with --baseline, none regressed);
1 otherwise; 2 for a bad argument or a backend that cannot be benchmarked here (one line on stderr,
before any measurement).
"""

from __future__ import annotations

import json
import sys
import time

from opport.bench.plan import bad_rows, command, round_robin, setup_run, write_json
from opport.bench.training import DEFAULT_PASSES, PASSES
from opport.bench.workloads import TIERS

EXIT_USAGE = 2


def add_arguments(p):
    p.add_argument("--backend", default="cpu", help="the backend to measure (`opport doctor` lists them; default cpu)")
    p.add_argument("--op", action="append", default=[], metavar="NAME", help="only this op (repeat for several)")
    p.add_argument("--dtype", action="append", default=[], help="dtype to run (repeat); default: the backend's")
    p.add_argument("--tier", choices=TIERS, help="shape set: smoke (CI), small, llm; default: the backend's")
    p.add_argument("--smoke", action="store_true", help="same as --tier smoke with short timing: seconds, for CI")
    p.add_argument("--pass", dest="passes", action="append", default=[], choices=(*PASSES, "all"),
                   help="what to time (repeat): fwd, fwd+bwd (training forward + backward), bwd (backward alone), "
                        f"all; default {' and '.join(DEFAULT_PASSES)}. Training rows: ops with a backward kernel")
    p.add_argument("--json", metavar="F", help="write the report as JSON (docs/design.md section 6)")
    p.add_argument("--plot", metavar="F", help="write a PNG: roofline chart and per-op speedup bars")
    p.add_argument("--baseline", metavar="F", help="fail if an opport row is slower than in this earlier --json report")
    p.add_argument("--margin", type=float, default=0.10, help="--baseline: allowed slowdown, a fraction (default 0.10)")
    p.add_argument("--repeats", type=int, default=2, help="--baseline: re-runs of a suspect row before it counts (default 2)")
    p.add_argument("--overhead", action="store_true", help="measure dispatch overhead instead of kernel time")
    p.add_argument("--batch-invariant", action="store_true",
                   help="also time each op with a batch under opport.batch_invariant() (row opport_invariant: its "
                        "vs column is the mode's cost; goal <= 1.25x)")
    p.add_argument("--compile", dest="compile", action="store_true", default=None,
                   help="include torch.compile (default: the backend's; off for host backends, where Inductor needs a "
                        "C++ compiler)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip the torch.compile baseline")
    p.add_argument("--compile-mode", default="default", help="torch.compile mode for the baseline (recorded)")
    p.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph variant of launch-bound shapes")
    p.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds per shape (default 2; 1 with --smoke)")
    p.add_argument("--budget-ms", type=float, default=None, help="timing budget per provider and shape, in ms")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop starting new shapes after this long (default: the backend's); skipped shapes are listed")
    # the results store (docs/store.md)
    p.add_argument("--store", metavar="DB", help="append this run to a SQLite results store (`opport history DB`)")
    from opport.fleet import add_arguments as add_cluster_arguments

    add_cluster_arguments(p)  # --cluster, --dashboard: problems run on every host kind of a Ray cluster


def run(args) -> int:
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 200)  # CI logs: wide enough for the row table
    started = _start(args)
    if isinstance(started, str):
        print(f"opport bench: {started}", file=sys.stderr)
        return EXIT_USAGE
    specs, prof = started
    if args.overhead:
        return _run_overhead(console, specs, args)
    tier = "smoke" if args.smoke else (args.tier or prof.tier)
    if args.cluster:
        from opport.fleet.bench import run as run_on_cluster

        return run_on_cluster(console, specs, prof, tier, _dtypes(args, prof), args)
    report, settings = setup_run(console, prof, tier, _dtypes(args, prof), args)
    if prof.measures == "counts":
        report["rows"] = _run_counts(console, prof, specs, tier, report["dtypes"], report["passes"])
    else:
        report["rows"], report["skipped"] = _run_rows(console, specs, tier, report["dtypes"], settings, args)
    for r in report["rows"]:
        r["host"] = next(iter(report["hosts"]))
    return _finish(console, report, prof, settings, specs, args)


# --------------------------------------------------------------------------- checks, before any measurement


def _start(args):
    """(op specs, the backend's Profile or None for --overhead), or the one line saying what is wrong."""
    from opport.errors import OpError
    from opport.ops import all_ops, get_op

    problem = _check_args(args)
    if problem:
        return problem
    try:
        specs = [get_op(n) for n in args.op] if args.op else list(all_ops().values())
    except OpError as e:
        return str(e)
    if args.overhead:
        return specs, None
    prof = _profile(args.backend, bool(args.cluster))
    if isinstance(prof, str):
        return prof
    bad = _bad_dtype(args.dtype, prof.backend)
    return bad or (specs, prof)


def _check_args(args) -> str | None:
    from opport import runargs as ra

    if args.cluster and (args.baseline or args.plot or args.overhead):
        return "--cluster: --baseline, --plot and --overhead judge one host's timings; run them without --cluster"
    return ra.first(
        ra.positive("--budget-ms", args.budget_ms), ra.positive("--rounds", args.rounds),
        ra.positive("--repeats", args.repeats, allow_zero=True), ra.positive("--margin", args.margin, allow_zero=True),
        ra.positive("--max-minutes", args.max_minutes),
        ra.writable("--json", args.json), ra.writable("--plot", args.plot),
        ra.json_file("--baseline", args.baseline, _baseline_shape) if args.baseline else None,
        _store_problem(args),
    )


def _store_problem(args) -> str | None:
    from opport.store import db

    if args.store and args.overhead:
        return "--store keeps kernel rows; --overhead has none (use --json)"
    return db.problem("--store", args.store)


def _baseline_shape(data) -> str | None:
    """What is wrong with a --baseline file as an earlier `opport bench --json` report, or None."""
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list) or data.get("kind") == "overhead":
        return "not an `opport bench --json` report of kernel timings (no 'rows' list)"
    if not rows:
        return "the report has no rows"
    if not all(isinstance(r, dict) and {"op", "impl", "dtype"} <= set(r) for r in rows):
        return "a row lacks 'op', 'impl' or 'dtype'"
    return None


def _profile(name: str, cluster: bool = False):
    """The backend's bench Profile, or why it cannot be benchmarked here; on a cluster only what it declares
    (each host judges itself)."""
    from opport.bench.profile import Unsupported, declared, profile
    from opport.dispatch import get_backend
    from opport.errors import OpError

    try:
        return (declared if cluster else profile)(get_backend(name, op="bench"))
    except OpError as e:
        return str(e)
    except Unsupported as e:
        return f"--backend {name}: cannot benchmark here: {e}"


def _bad_dtype(dtypes: list, backend) -> str | None:
    for d in dtypes:
        if d not in backend.dtypes:
            return f"--dtype {d}: not a dtype of backend {backend.name!r} (one of {', '.join(backend.dtypes)})"
    return None


def _dtypes(args, prof) -> list:
    return list(args.dtype) or [d for d in prof.dtypes if d in prof.backend.dtypes]


# --------------------------------------------------------------------------- setup


# --------------------------------------------------------------------------- running


def _run_rows(console, specs, tier: str, dtypes: list, settings, args):
    """Shapes round-robin over ops, so a time limit trims every op's tail instead of whole ops."""
    from opport.bench.runner import run_shape

    limit = args.max_minutes if args.max_minutes is not None else settings.max_minutes
    start, rows, skipped = time.perf_counter(), [], []
    for spec, wl, shape, dtype in round_robin(specs, tier, dtypes, settings.backend, settings.passes):
        if limit is not None and time.perf_counter() - start > limit * 60:
            skipped.append(f"{spec.name}/{shape.name}/{dtype}")
            continue
        t0 = time.perf_counter()
        new = run_shape(spec, wl, shape, dtype, settings)
        rows += new
        console.print(f"[dim]{time.perf_counter() - start:6.1f} s  {spec.name:14s} {shape.label:34s} {dtype:9s} "
                      f"opport {_progress(new)} ({time.perf_counter() - t0:.1f} s)[/dim]")
    _say_no_backward(console, settings.backend, settings.passes, specs)
    if skipped:
        console.print(f"[yellow]time limit ({limit} min) reached: {len(skipped)} shapes not run[/yellow]")
    order = {s.name: i for i, s in enumerate(specs)}
    return sorted(rows, key=lambda r: order[r["op"]]), skipped


def _progress(rows: list) -> str:
    """What opport did on one shape, per pass: its median time, or counted, or the row's status."""
    parts = []
    for r in rows:
        if r["impl"] == "opport":
            state = f"{r['ms']:.4g} ms" if "ms" in r else "counted" if "counts" in r else r.get("status", "")
            parts.append(f"{r['pass']} {state}")
    return ", ".join(parts)


def _say_no_backward(console, backend: str, passes, specs):
    from opport.bench.runner import passes_for

    none = [s.name for s in specs if len(passes_for(s, backend, passes)) < len(passes)]
    if none:
        console.print(f"[yellow]no {backend} kernel for the backward of {', '.join(none)}: no training rows for "
                      f"{'them' if len(none) > 1 else 'it'}[/yellow]")


def _run_counts(console, prof, specs, tier: str, dtypes: list, passes) -> list:
    """Counts instead of time (an emulated device): rows per op, shape, dtype and pass, a progress line each shape."""
    from opport.bench.runner import passes_for, run_counts
    from opport.bench.workloads import get_workload

    start, rows = time.perf_counter(), []
    for spec in specs:
        if not passes_for(spec, prof.backend.name, passes):
            continue
        wl = get_workload(spec)
        for shape in wl.shapes_for(tier):
            for dtype in dtypes:
                new = run_counts(prof, spec, wl, shape, dtype, passes)
                rows += new
                console.print(f"[dim]{time.perf_counter() - start:6.1f} s  {spec.name:14s} {shape.label:34s} {dtype:9s} "
                              f"opport {_progress(new)}[/dim]")
    _say_no_backward(console, prof.backend.name, passes, specs)
    return rows


def _run_overhead(console, specs, args) -> int:
    from opport.bench import env, overhead

    rows = overhead.measure(specs, budget_ms=args.budget_ms or (100.0 if args.smoke else 300.0))
    overhead.print_overhead(console, rows)
    report = {"kind": "overhead", "command": command(args, None), "device": env.host(),
              "versions": env.versions(), "goal_us": {"gate": overhead.GATE_US, "moonshot": overhead.MOONSHOT_US},
              "method": overhead.__doc__.strip(), "rows": rows}
    if args.json:
        write_json(args.json, report)
    if args.plot:
        console.print("[yellow]--plot draws kernel timings; --overhead has only the table and JSON[/yellow]")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


# --------------------------------------------------------------------------- output


def _finish(console, report: dict, prof, settings, specs, args) -> int:
    from opport.bench import report as rep

    status = 0
    if prof.measures == "counts":
        rep.print_counts(console, report, prof.get("COUNTER_COLUMNS", ()))
    else:
        report["device"].update(prof.device_end())
        report["summary"] = rep.summary(report["rows"])
        if args.baseline:
            status |= _check_baseline(console, report, settings, specs, args)
        rep.print_rows(console, report)
        rep.print_summary(console, report)
    bad = bad_rows(report["rows"])
    for r in bad:
        console.print(f"[red]opport {r['op']} {r['shape']} {r['dtype']} {r.get('pass', 'fwd')}: "
                      f"{r.get('error') or r.get('error_detail') or 'output differs from the reference'}[/red]")
    status |= 1 if bad else 0
    if args.json:
        write_json(args.json, report)
    if args.plot and prof.measures == "time":
        from opport.bench.plot import write_plot

        write_plot(report, args.plot)
        console.print(f"plot written to {args.plot}")
    elif args.plot:
        console.print("[yellow]--plot draws timings; this backend reports counts, so no plot was written[/yellow]")
    if args.store:
        from opport.store import db

        with db.Store(args.store, create=True) as store:
            run_id = store.append("bench", report, args.argv, status)
        console.print(f"stored as run {run_id} in {args.store}", highlight=False)
    return status


def _check_baseline(console, report: dict, settings, specs, args) -> int:
    """Fail on rows slower than the baseline by more than the margin in every one of 1 + repeats runs."""
    from dataclasses import replace

    from opport.bench import report as rep
    from opport.bench.runner import run_shape
    from opport.bench.workloads import get_workload

    with open(args.baseline) as f:
        base_rows = json.load(f)["rows"]  # its shape was checked before the run
    rows = report["rows"]
    by_name = {s.name: s for s in specs}
    for _ in range(args.repeats):
        suspects = {(s["op"], s["case"], s["dtype"], s["pass"], "opport") for s in rep.regressions(rows, base_rows, args.margin)}
        for r in rows:
            if rep.row_key(r) not in suspects:
                continue
            wl = get_workload(by_name[r["op"]])
            shape = next(s for s in wl.shapes if s.name == r["case"])
            again = run_shape(by_name[r["op"]], wl, shape, r["dtype"], replace(settings, passes=(r["pass"],)))
            again = next(x for x in again if x["impl"] == "opport")
            if "ms" in again:
                r.setdefault("rerun_ms", []).append(again["ms"])
    slow = rep.regressions(rows, base_rows, args.margin)
    now = {rep.row_key(r) for r in rows}
    broken = [k for k in rep.missing_rows(rows, base_rows) if k in now]
    report["regressions"] = {"baseline": args.baseline, "margin": args.margin, "slower": slow,
                             "no_longer_timed": [list(k) for k in broken]}
    for s in slow:
        console.print(f"[red]regression: {s['op']} {s['shape']} {s['dtype']} {s['pass']}: {s['ms']:.4g} ms vs "
                      f"{s['baseline_ms']:.4g} ms in the baseline (+{s['slower_by']:.0%}, margin {args.margin:.0%})[/red]")
    for k in broken:
        console.print(f"[red]regression: {'/'.join(map(str, k))} was timed in the baseline and fails now[/red]")
    if not slow and not broken:
        console.print(f"[green]no row slower than {args.baseline} by more than {args.margin:.0%}[/green]")
    return 1 if slow or broken else 0


