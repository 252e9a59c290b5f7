"""What running conformance through Ray costs, per case and per task, against the local worker processes;
and how many cases a tier has (docs/fleet.md quotes both).

    python tools/fleet_overhead.py overhead [--op silu] [--examples 10 200]  # one case set, three ways, two sizes
    python tools/fleet_overhead.py count --tier full --backend all        # cases per backend, without running them

`overhead` runs the same cases (each timing the fastest of three runs) in this process (workers=0: the
compute alone), on one local worker process and on a one-CPU `--cluster local` Ray (after a first run that
starts Ray's worker), at two case counts; and Ray's own costs: an empty task's round trip, one streamed
message, the driver's handling of one result.
`count` enumerates every batch's fixed, layout and bad-input cases exactly, and adds the tier's nominal
Hypothesis examples per op x backend x dtype (drawing the full tier's would take most of an hour).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import replace


def overhead(args) -> dict:
    """Each way timed warm at two case counts; the slope is the cost per case, the intercept the fixed cost
    (for the local pool: starting its worker process, which every run does)."""
    from opport.conformance import Options, run
    from opport.fleet.cluster import connect
    from opport.fleet.conformance import Executor

    sizes = [Options(backends=("cpu",), ops=tuple(args.op), examples=n, layouts=False) for n in args.examples]
    out = {"cases": [len(run(replace(o, workers=0)).cases) for o in sizes]}  # also warms this process up
    out["in_process_s"] = [_timed(run, replace(o, workers=0)) for o in sizes]
    out["local_worker_s"] = [_timed(run, replace(o, workers=1)) for o in sizes]
    t = time.perf_counter()
    with connect("local", num_cpus=1) as ray:
        out["ray_start_s"] = time.perf_counter() - t
        t = time.perf_counter()
        run(sizes[0], None, Executor(ray, sizes[0]))  # starts Ray's worker process, which imports opport
        out["ray_first_run_s"] = time.perf_counter() - t
        out["ray_warm_s"] = [_timed(run, o, None, Executor(ray, o)) for o in sizes]
        out.update(_ray_micro(ray))
    out["batches"] = len(_batches(sizes[0]))
    base = _fit(out["cases"], out["in_process_s"])
    for k in ("in_process_s", "local_worker_s", "ray_warm_s"):
        per, fixed = _fit(out["cases"], out[k])
        out[k.replace("_s", "")] = {"per_case_ms": 1e3 * per, "fixed_s": fixed,
                                    "overhead_per_case_ms": 1e3 * (per - base[0])}
    out["driver_sink_us"] = _sink_cost(run(replace(sizes[-1], workers=0)).cases)
    return out


REPEATS = 3  # the fastest of three runs: the machine is shared, and noise only ever adds time


def _timed(fn, *a) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        t = time.perf_counter()
        fn(*a)
        best = min(best, time.perf_counter() - t)
    return best


def _fit(ns: list, ts: list) -> tuple:
    """(seconds per case, fixed seconds) through two points."""
    per = (ts[1] - ts[0]) / (ns[1] - ns[0])
    return per, ts[0] - per * ns[0]


def _batches(o):
    from opport.conformance.runner import plan

    return plan(o).batches


def _ray_micro(ray) -> dict:
    """An empty task's round trip (warm worker) and one streamed message, each the mean of many."""
    noop = ray.remote(num_cpus=1)(lambda: None)
    ray.get(noop.remote())
    n = 200
    t = time.perf_counter()
    ray.get([noop.remote() for _ in range(n)])
    task_ms = 1e3 * (time.perf_counter() - t) / n

    @ray.remote(num_cpus=1)
    def stream(k):
        for i in range(k):
            yield ("result", i, {"id": "x" * 60, "status": "pass", "metrics": {"max_abs": 0.0}, "message": ""})

    k = 2000
    t = time.perf_counter()
    for ref in stream.remote(k):
        ray.get(ref)
    return {"ray_empty_task_ms": task_ms, "ray_stream_message_ms": 1e3 * (time.perf_counter() - t) / k}


def _sink_cost(cases: list) -> float:
    """The driver's work per result outside Ray: known failures, the repro line, JSON (what the runner's sink
    and the report writer do), in microseconds."""
    from opport.conformance import gate
    from opport.conformance.report import _case_json
    from opport.conformance.runner import Options, repro
    from opport.dispatch import get_backend

    known = gate.load_known(gate.known_failures_path(get_backend("cpu")))
    t = time.perf_counter()
    for c in cases:
        gate.apply_known(dict(c), known)
        repro(c, Options(), None)
        json.dumps(_case_json(c), default=str)
    return 1e6 * (time.perf_counter() - t) / max(1, len(cases))


def count(args) -> dict:
    """Cases per backend of a tier: fixed, layout and bad-input cases enumerated, Hypothesis examples nominal."""
    from opport.conformance import Options
    from opport.conformance.runner import plan
    from opport.conformance.worker import build_items

    p = plan(Options(backends=tuple(args.backend), tier=args.tier))
    enumerated, hypothesis, batches = Counter(), Counter(), Counter()
    t = time.perf_counter()
    for b in p.batches:
        sel = p.selections[b.backend]
        batches[b.backend] += 1
        enumerated[b.backend] += len(build_items(replace(b, sel=replace(sel, examples=0))))
        if b.kind == "cases":
            hypothesis[b.backend] += sel.n_examples()
    per = {n: {"batches": batches[n], "fixed_layout_bad": enumerated[n], "hypothesis_nominal": hypothesis[n],
               "total": enumerated[n] + hypothesis[n]} for n in batches}
    return {"tier": args.tier, "backends": per, "total": sum(v["total"] for v in per.values()),
            "count_s": time.perf_counter() - t}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    o = sub.add_parser("overhead")
    o.add_argument("--op", action="append", default=None)
    o.add_argument("--examples", type=int, nargs=2, default=[10, 200], metavar=("N1", "N2"),
                   help="Hypothesis examples per op x dtype of the small and the large run")
    c = sub.add_parser("count")
    c.add_argument("--tier", default="full")
    c.add_argument("--backend", action="append", default=None)
    args = ap.parse_args(argv)
    if args.what == "overhead":
        args.op = args.op or ["silu"]
        result = overhead(args)
    else:
        args.backend = args.backend or ["all"]
        result = count(args)
    json.dump(result, sys.stdout, indent=1, default=str)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
