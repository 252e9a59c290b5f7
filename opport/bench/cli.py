"""`opport bench`: time opport against the ceilings and baselines of the same run (docs/benchmarking.md).

    opport bench --backend cpu [--op rmsnorm] [--tier smoke|small|llm] [--json F] [--plot F] [--baseline F]
    opport bench --backend cuda               # Llama-3 shapes; torch eager and torch.compile baselines
    opport bench --backend neuron             # emulator: DMA bytes and instruction counts, not speed
    opport bench --overhead                   # what opport.<op>() adds over calling its kernel

Exit status: 0 when every opport row that ran was correct (and, with --baseline, none regressed);
1 otherwise; 2 when the backend cannot be benchmarked here.
"""

from __future__ import annotations

import datetime
import json
import sys
import time

from opport.bench.workloads import TIERS

DEFAULT_TIER = {"cpu": "small", "cuda": "llm", "neuron": "smoke"}
DEFAULT_DTYPES = {"cpu": ["float32"], "cuda": ["bfloat16"], "neuron": ["float32"]}


def add_arguments(p):
    p.add_argument("--backend", default="cpu", help="cpu, cuda or neuron (default cpu)")
    p.add_argument("--op", action="append", default=[], metavar="NAME", help="only this op (repeat for several)")
    p.add_argument("--dtype", action="append", default=[], help="dtype to run (repeat); default float32 on cpu, bfloat16 on cuda")
    p.add_argument("--tier", choices=TIERS, help="shape set: smoke (CI), small (cpu default), llm (cuda default)")
    p.add_argument("--smoke", action="store_true", help="same as --tier smoke with short timing: seconds, for CI")
    p.add_argument("--json", metavar="F", help="write the report as JSON (docs/design.md section 6)")
    p.add_argument("--plot", metavar="F", help="write a PNG: roofline chart and per-op speedup bars")
    p.add_argument("--baseline", metavar="F", help="fail if an opport row is slower than in this earlier --json report")
    p.add_argument("--margin", type=float, default=0.10, help="--baseline: allowed slowdown, a fraction (default 0.10)")
    p.add_argument("--repeats", type=int, default=2, help="--baseline: re-runs of a suspect row before it counts (default 2)")
    p.add_argument("--overhead", action="store_true", help="measure dispatch overhead instead of kernel time")
    p.add_argument("--compile", dest="compile", action="store_true", default=None,
                   help="include torch.compile (default on cuda; off on cpu, where Inductor needs a C++ compiler)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip the torch.compile baseline")
    p.add_argument("--compile-mode", default="default", help="torch.compile mode for the baseline (recorded)")
    p.add_argument("--no-graphs", action="store_true", help="cuda: skip the CUDA-graph variant of launch-bound shapes")
    p.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds per shape (default 2; 1 with --smoke)")
    p.add_argument("--budget-ms", type=float, default=None, help="timing budget per provider and shape, in ms")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop starting new shapes after this long (default 7 on cuda); skipped shapes are listed")


def run(args) -> int:
    from rich.console import Console

    from opport.errors import OpError
    from opport.ops import all_ops, get_op

    console = Console(width=None if sys.stdout.isatty() else 200)  # CI logs: wide enough for the row table
    try:
        specs = [get_op(n) for n in args.op] if args.op else list(all_ops().values())
    except OpError as e:
        console.print(f"[red]opport bench: {e}[/red]")
        return 2
    if args.overhead:
        return _run_overhead(console, specs, args)
    tier = "smoke" if args.smoke else (args.tier or DEFAULT_TIER.get(args.backend, "small"))
    setup = _setup(console, args, tier)
    if isinstance(setup, int):
        return setup
    report, settings = setup
    if args.backend == "neuron":
        report["rows"] = _run_counts(console, specs, tier, report["dtypes"])
    else:
        report["rows"], report["skipped"] = _run_rows(console, specs, tier, report["dtypes"], settings, args)
    return _finish(console, report, settings, specs, tier, args)


# --------------------------------------------------------------------------- setup


def _setup(console, args, tier: str):
    """(report skeleton, Settings) or an exit status when the backend cannot be benchmarked here."""
    from opport.bench import env
    from opport.bench.runner import Settings
    from opport.dispatch import get_backend

    try:
        b = get_backend(args.backend)
    except Exception as e:
        console.print(f"[red]opport bench: {e}[/red]")
        return 2
    reason = b.unavailable()
    mode = "-" if reason else b.mode()
    reason = reason or _mode_problem(b.name, mode)
    if reason:
        console.print(f"[red]opport bench --backend {b.name}: cannot benchmark here: {reason}[/red]")
        return 2
    dtypes = args.dtype or DEFAULT_DTYPES.get(b.name, ["float32"])
    report = {"backend": b.name, "mode": mode, "tier": tier, "dtypes": dtypes,
              "command": _command(args, tier),
              "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "versions": {**env.versions(), **_backend_versions(b)}}
    if b.name == "neuron":
        report.update(device={"kind": "neuron", "name": f"NKI emulator ({mode})"},
                      timing={"method": "none: emulator counts (DMA bytes, instructions per engine), not speed"})
        return report, None
    timer, ceilings, device = _timer_and_ceilings(console, b.name, tier, dtypes, args)
    report.update(device=device, timing=timer.method, ceilings=ceilings.as_json())
    compile_ = args.compile if args.compile is not None else b.name == "cuda"
    report["timing"]["baselines"] = {"torch_compile": f"dynamic=False, mode={args.compile_mode!r}, "
                                                      "fail_on_recompile while timing" if compile_ else "not run"}
    rounds = args.rounds or (1 if args.smoke else 2)
    settings = Settings(b.name, b.array_kind, "cuda" if b.name == "cuda" else "cpu", timer, ceilings, rounds=rounds,
                        budget_ms=args.budget_ms, compile=compile_, compile_mode=args.compile_mode,
                        graphs=b.name == "cuda" and not args.no_graphs)
    return report, settings


def _command(args, tier: str | None) -> str:
    """The command that repeats this run (what the JSON records)."""
    run = "--smoke" if args.smoke else f"--tier {tier}"
    parts = ["opport bench", "--overhead" if args.overhead else f"--backend {args.backend} {run}"]
    parts += [f"--op {o}" for o in args.op] + [f"--dtype {d}" for d in args.dtype]
    for flag, value in (("--budget-ms", args.budget_ms), ("--rounds", args.rounds), ("--max-minutes", args.max_minutes)):
        if value is not None:
            parts.append(f"{flag} {value:g}")
    if args.compile is not None:
        parts.append("--compile" if args.compile else "--no-compile")
    return " ".join(parts)


def _mode_problem(name: str, mode: str) -> str | None:
    if name == "cuda" and mode != "compiled":
        return (f"mode {mode!r}: no CUDA GPU is visible to torch (torch.cuda.is_available() is False); Triton's "
                "interpreter checks correctness (opport conformance) but its timings mean nothing")
    if name == "neuron":
        from opport.bench.neuron import unsupported_reason

        return unsupported_reason(mode)
    return None


def _backend_versions(b) -> dict:
    try:
        return {f"{b.name}_backend": b.versions()}
    except Exception as e:  # versions are informative; a failing probe must not stop the run
        return {f"{b.name}_backend": f"unreadable: {e}"}


def _timer_and_ceilings(console, backend: str, tier: str, dtypes: list, args):
    from opport.bench import ceilings, env, timing

    smoke = args.smoke or tier == "smoke"
    if backend == "cuda":
        timer = timing.CudaTimer(budget_ms=args.budget_ms or (30.0 if smoke else 100.0))
        device = env.cuda_device()
        with console.status("measuring ceilings (device copy, cuBLAS GEMM)"):
            c = ceilings.measure_cuda(timer, tier, dtypes)
    else:
        timer = timing.CpuTimer(budget_ms=args.budget_ms or (30.0 if smoke else 200.0), warmup_ms=5.0 if smoke else 20.0)
        device = env.cpu_device()
        with console.status("measuring ceilings (memory copy, BLAS GEMM)"):
            c = ceilings.measure_cpu(timer, tier, dtypes)
    return timer, c, device


# --------------------------------------------------------------------------- running


def _run_rows(console, specs, tier: str, dtypes: list, settings, args):
    """Shapes round-robin over ops, so a time limit trims every op's tail instead of whole ops."""
    from opport.bench.runner import run_shape

    limit = args.max_minutes if args.max_minutes is not None else (7.0 if settings.backend == "cuda" else None)
    start, rows, skipped = time.perf_counter(), [], []
    for spec, wl, shape, dtype in _round_robin(specs, tier, dtypes):
        if limit is not None and time.perf_counter() - start > limit * 60:
            skipped.append(f"{spec.name}/{shape.name}/{dtype}")
            continue
        t0 = time.perf_counter()
        new = run_shape(spec, wl, shape, dtype, settings)
        rows += new
        state = f"{new[0]['ms']:.4g} ms" if "ms" in new[0] else new[0].get("status", "")
        console.print(f"[dim]{time.perf_counter() - start:6.1f} s  {spec.name:14s} {shape.label:34s} {dtype:9s} "
                      f"opport {state} ({time.perf_counter() - t0:.1f} s)[/dim]")
    if skipped:
        console.print(f"[yellow]time limit ({limit} min) reached: {len(skipped)} shapes not run[/yellow]")
    order = {s.name: i for i, s in enumerate(specs)}
    return sorted(rows, key=lambda r: order[r["op"]]), skipped


def _round_robin(specs, tier: str, dtypes: list):
    from opport.bench.workloads import get_workload

    per_op = []
    for spec in specs:
        wl = get_workload(spec)
        per_op.append([(spec, wl, shape, dtype) for shape in wl.shapes_for(tier) for dtype in dtypes])
    for i in range(max((len(x) for x in per_op), default=0)):
        for jobs in per_op:
            if i < len(jobs):
                yield jobs[i]


def _run_counts(console, specs, tier: str, dtypes: list) -> list:
    from opport.bench.runner import run_counts
    from opport.bench.workloads import get_workload

    rows = []
    for spec in specs:
        wl = get_workload(spec)
        for shape in wl.shapes_for(tier):
            for dtype in dtypes:
                rows.append(run_counts(spec, wl, shape, dtype))
    return rows


def _run_overhead(console, specs, args) -> int:
    from opport.bench import env, overhead

    rows = overhead.measure(specs, budget_ms=args.budget_ms or (100.0 if args.smoke else 300.0))
    overhead.print_overhead(console, rows)
    report = {"kind": "overhead", "command": _command(args, None), "device": env.cpu_device(),
              "versions": env.versions(), "goal_us": {"gate": overhead.GATE_US, "moonshot": overhead.MOONSHOT_US},
              "method": overhead.__doc__.strip(), "rows": rows}
    if args.json:
        _write_json(args.json, report)
    if args.plot:
        console.print("[yellow]--plot draws kernel timings; --overhead has only the table and JSON[/yellow]")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


# --------------------------------------------------------------------------- output


def _finish(console, report: dict, settings, specs, tier: str, args) -> int:
    from opport.bench import report as rep

    status = 0
    if report["backend"] == "neuron":
        rep.print_counts(console, report)
    else:
        if report["device"].get("kind") == "cuda":
            from opport.bench.env import gpu_clocks

            report["device"]["clocks_end"] = gpu_clocks()
        report["summary"] = rep.summary(report["rows"])
        if args.baseline:
            status |= _check_baseline(console, report, settings, specs, args)
        rep.print_rows(console, report)
        rep.print_summary(console, report)
    bad = [r for r in report["rows"] if r["impl"] == "opport" and (r.get("status") == "error" or r.get("correct") is False)]
    for r in bad:
        console.print(f"[red]opport {r['op']} {r['shape']} {r['dtype']}: "
                      f"{r.get('error') or 'output differs from the reference'}[/red]")
    status |= 1 if bad else 0
    if args.json:
        _write_json(args.json, report)
    if args.plot and report["backend"] != "neuron":
        from opport.bench.plot import write_plot

        write_plot(report, args.plot)
        console.print(f"plot written to {args.plot}")
    return status


def _check_baseline(console, report: dict, settings, specs, args) -> int:
    """Fail on rows slower than the baseline by more than the margin in every one of 1 + repeats runs."""
    from opport.bench import report as rep
    from opport.bench.runner import run_shape
    from opport.bench.workloads import get_workload

    with open(args.baseline) as f:
        base_rows = json.load(f)["rows"]
    rows = report["rows"]
    by_name = {s.name: s for s in specs}
    for _ in range(max(args.repeats, 0)):
        suspects = {(r["op"], r["case"], r["dtype"]) for r in rep.regressions(rows, base_rows, args.margin)}
        for r in rows:
            key = (r["op"], r.get("case"), r["dtype"])
            if r["impl"] != "opport" or key not in suspects:
                continue
            wl = get_workload(by_name[r["op"]])
            shape = next(s for s in wl.shapes if s.name == r["case"])
            again = next(x for x in run_shape(by_name[r["op"]], wl, shape, r["dtype"], settings) if x["impl"] == "opport")
            if "ms" in again:
                r.setdefault("rerun_ms", []).append(again["ms"])
    slow = rep.regressions(rows, base_rows, args.margin)
    now = {rep.row_key(r) for r in rows}
    broken = [k for k in rep.missing_rows(rows, base_rows) if k in now]
    report["regressions"] = {"baseline": args.baseline, "margin": args.margin, "slower": slow,
                             "no_longer_timed": [list(k) for k in broken]}
    for s in slow:
        console.print(f"[red]regression: {s['op']} {s['shape']} {s['dtype']}: {s['ms']:.4g} ms vs "
                      f"{s['baseline_ms']:.4g} ms in the baseline (+{s['slower_by']:.0%}, margin {args.margin:.0%})[/red]")
    for k in broken:
        console.print(f"[red]regression: {'/'.join(map(str, k))} was timed in the baseline and fails now[/red]")
    if not slow and not broken:
        console.print(f"[green]no row slower than {args.baseline} by more than {args.margin:.0%}[/green]")
    return 1 if slow or broken else 0


def _write_json(path: str, report: dict):
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=_jsonable)
        f.write("\n")


def _jsonable(x):
    if hasattr(x, "item"):  # NumPy scalars
        return x.item()
    return str(x)
