"""A bench run's plan, shared by `opport bench` (opport/bench/cli.py) and a cluster run (opport/fleet/bench.py):
the report skeleton and this host's ceilings, the order jobs run in, which rows failed, the JSON it writes."""

from __future__ import annotations

import datetime
import json

from opport.bench.training import DEFAULT_PASSES, PASSES


def setup_run(console, prof, tier: str, dtypes: list, args):
    """(report skeleton, runner Settings or None when the backend reports counts); measures this host's
    ceilings (a cluster run calls it on every host: opport/fleet/bench.py)."""
    from opport.bench import env
    from opport.bench.runner import Settings
    from opport.doctor import host_record

    b = prof.backend
    here = host_record([b.name])
    report = {"backend": b.name, "mode": prof.mode, "tier": tier, "dtypes": dtypes, "command": command(args, tier),
              "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "versions": {**env.versions(), **_backend_versions(b)}, "device": prof.device(), **_passes(args, b.name),
              "hosts": {here["hostname"]: here}}  # rows name their "host"; a cluster run has one entry per host
    if prof.measures == "counts":
        report["timing"] = {"method": f"none: {prof.get('COUNTS_MEANING', 'counts per call')}, not speed"}
        return report, None
    timer, ceilings = _timer_and_ceilings(console, prof, tier, dtypes, args)
    report.update(timing=timer.method, ceilings=ceilings.as_json())
    here["ceilings"] = report["ceilings"]  # measured on this host, in this run: its rows' roofs
    compile_ = args.compile if args.compile is not None else prof.compile_baseline
    report["timing"]["baselines"] = {"torch_compile": f"dynamic=False, mode={args.compile_mode!r}, "
                                                      "fail_on_recompile while timing" if compile_ else "not run"}
    rounds = args.rounds or (1 if args.smoke else 2)
    settings = Settings(b.name, b.array_kind, prof.input_device, timer, ceilings, rounds=rounds, budget_ms=args.budget_ms,
                        compile=compile_, compile_mode=args.compile_mode, graphs=prof.graphs and not args.no_graphs,
                        max_minutes=prof.max_minutes, passes=tuple(report["passes"]),
                        batch_invariant=getattr(args, "batch_invariant", False))
    return report, settings


def _passes(args, backend: str) -> dict:
    """The passes of this run, in order, and the ops whose training rows the backend cannot make."""
    from opport.bench.training import TRAINING, has_backward
    from opport.ops import all_ops, get_op

    asked = set(args.passes or DEFAULT_PASSES)
    passes = [p for p in PASSES if p in asked or "all" in asked]
    out = {"passes": passes}
    if any(p in TRAINING for p in passes):
        specs = [get_op(n) for n in args.op] if args.op else list(all_ops().values())
        out["no_backward_kernel"] = [s.name for s in specs if not has_backward(s, backend)]
    return out


def command(args, tier: str | None) -> str:
    """The command that repeats this run (what the JSON records)."""
    run = "--smoke" if args.smoke else f"--tier {tier}"
    parts = ["opport bench", "--overhead" if args.overhead else f"--backend {args.backend} {run}"]
    parts += [f"--op {o}" for o in args.op] + [f"--dtype {d}" for d in args.dtype] + [f"--pass {p}" for p in args.passes]
    for flag, value in (("--budget-ms", args.budget_ms), ("--rounds", args.rounds), ("--max-minutes", args.max_minutes)):
        if value is not None:
            parts.append(f"{flag} {value:g}")
    if args.compile is not None:
        parts.append("--compile" if args.compile else "--no-compile")
    return " ".join(parts)


def _backend_versions(b) -> dict:
    try:
        return {f"{b.name}_backend": b.versions()}
    except Exception as e:  # versions are informative; a failing probe must not stop the run
        return {f"{b.name}_backend": f"unreadable: {e}"}


def _timer_and_ceilings(console, prof, tier: str, dtypes: list, args):
    from opport.bench.ceilings import Ceilings

    timer = prof.module.timer(args.budget_ms, args.smoke or tier == "smoke")
    with console.status(f"measuring the {prof.backend.name} ceilings (memory copy, vendor GEMM)"):
        c = prof.module.ceilings(timer, tier, dtypes)
    return timer, Ceilings(**c)


def round_robin(specs, tier: str, dtypes: list, backend: str, passes):
    """(spec, workload, shape, dtype) jobs, one op after another per round; ops with no pass to run are left out."""
    from opport.bench.runner import passes_for
    from opport.bench.workloads import get_workload

    per_op = []
    for spec in specs:
        if not passes_for(spec, backend, passes):
            continue
        wl = get_workload(spec)
        per_op.append([(spec, wl, shape, dtype) for shape in wl.shapes_for(tier) for dtype in dtypes])
    for i in range(max((len(x) for x in per_op), default=0)):
        for jobs in per_op:
            if i < len(jobs):
                yield jobs[i]


def bad_rows(rows: list) -> list:
    """opport rows that failed: an error, a wrong result, or (on a cluster) a crashed worker or a lost host."""
    return [r for r in rows if r["impl"] == "opport" and (r.get("status") in ("error", "crash", "lost")
                                                          or r.get("correct") is False)]


def write_json(path: str, report: dict):
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=_jsonable)
        f.write("\n")


def _jsonable(x):
    if hasattr(x, "item"):  # NumPy scalars
        return x.item()
    return str(x)
