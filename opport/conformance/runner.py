"""Plan a conformance run, execute it (worker processes or in-process), gate it, return the Report."""

from __future__ import annotations

import fnmatch
import os
import shlex
import time
from dataclasses import dataclass, field

from opport.conformance import gate
from opport.conformance.cases import Selection
from opport.conformance.worker import Batch, Pool, run_batch, run_setup

# order of the status counters in summaries
STATUSES = gate.STATUSES
EXIT_INTERRUPTED = 130  # as the `opport` command's error boundary exits on Ctrl-C


@dataclass
class Executed:
    """What running the batches says besides the results: the hosts that ran them, whether Ctrl-C cut it short."""

    hosts: dict
    interrupted: bool = False


@dataclass
class Options:
    backends: tuple = ("cpu",)  # backend names, or ("all",): every backend that can run here
    ops: tuple = ()  # () = every op
    dtypes: tuple = ()  # () = every dtype the op and backend share
    cases: tuple = ()  # case-name patterns
    tier: str = "fast"
    examples: int | None = None
    seed: int = 0
    workers: int | None = None  # None = one per CPU core (max 8); 0 = in this process, no isolation
    timeout: float = 60.0  # per case
    compile_timeout: float = 300.0  # extra for the first case of an op on a backend in each worker
    setup: tuple = ()  # "module:function" hooks run in every worker (register test backends)
    known_failures: tuple = ()  # extra known-failure files, on top of each backend's own
    baseline: str | None = None
    errors: bool = True  # run the bad-input cases
    layouts: bool = True


@dataclass
class Report:
    options: Options
    backends: dict  # name -> {"mode", "versions", "unavailable"}
    cases: list = field(default_factory=list)
    stale: list = field(default_factory=list)
    regressions: list = field(default_factory=list)
    duration_s: float = 0.0
    hosts: dict = field(default_factory=dict)  # host id -> its doctor record (opport/doctor.py); cases carry "host"
    interrupted: bool = False  # Ctrl-C stopped a cluster run: the report is partial

    @property
    def summary(self) -> dict:
        out = dict.fromkeys(STATUSES, 0)
        for c in self.cases:
            out[c["status"]] += 1
        return out

    @property
    def exit_code(self) -> int:
        return EXIT_INTERRUPTED if self.interrupted else gate.exit_code(self.summary, self.regressions)

    def failures(self) -> list:
        return [c for c in self.cases if c["status"] in gate.FAILING]


@dataclass
class Plan:
    options: Options
    batches: list = field(default_factory=list)
    preset: list = field(default_factory=list)  # results known without running anything (no kernel, unavailable)
    backends: dict = field(default_factory=dict)  # name -> {"mode", "versions", "unavailable"}
    selections: dict = field(default_factory=dict)  # backend -> Selection
    covered: set = field(default_factory=set)  # (op, backend, dtype) that run
    known: dict = field(default_factory=dict)  # backend -> known failures (loaded on first use)
    limits: dict = field(default_factory=dict)  # backend -> its Capabilities.max_workers() (None: no limit)


def plan(options: Options) -> Plan:
    from opport.dispatch import backends, get_backend, kernels
    from opport.ops import all_ops, get_op, with_derived

    specs = _specs(options, all_ops, get_op, with_derived)
    everything = "all" in options.backends
    names = list(backends()) if everything else list(dict.fromkeys(options.backends))
    p = Plan(options)
    for name in names:
        b = get_backend(name)
        why = b.unavailable()
        p.backends[name] = {"mode": None if why else b.mode(), "versions": {} if why else _versions(b), "unavailable": why}
        if why:
            if not everything:
                p.preset += [_preset(s.name, name, "n/a", "backend-unavailable", why) for s in specs
                             if s.public]  # one row per op, not per derived op
            continue
        sel = Selection(options.tier, options.examples, options.seed, tuple(options.cases), b.capabilities.emulated(),
                        options.layouts, b.capabilities.compiles_per_shape)
        p.limits[name] = b.capabilities.max_workers()
        p.selections[name] = sel
        for spec in specs:
            ks = kernels(spec, b)
            if spec.kernels_optional and not ks:
                continue  # a backend without backward kernels: nothing to check (calls fall back to cpu)
            _plan_op(p, spec, b, sel, options, ks)
    p.batches.sort(key=lambda bt: not p.selections[bt.backend].emulated)  # slow (emulated) backends first: shorter tail
    return p


def _specs(options: Options, all_ops, get_op, with_derived) -> list:
    """The ops to run, each followed by its training forward and backward (its gradients are checked too).
    `--op rmsnorm` selects rmsnorm and its derived ops; `--op rmsnorm_backward` the backward alone."""
    if not options.ops:
        return with_derived(all_ops().values())
    named = [get_op(n) for n in options.ops]
    return list(dict.fromkeys(d for s in named for d in s.family()))


def _plan_op(p: Plan, spec, b, sel: Selection, options: Options, ks: list):
    if not ks:
        p.preset.append(_preset(spec.name, b.name, "n/a", "no-kernel", f"no {b.name} kernel for {spec.name}"))
        return
    for d in options.dtypes or spec.dtypes:
        if d not in spec.dtypes or d not in b.dtypes:
            continue
        if not any(d in k.dtypes for k in ks):
            p.preset.append(_preset(spec.name, b.name, d, "no-kernel", f"no {b.name} kernel for {spec.name} in {d}"))
            continue
        p.batches.append(Batch("cases", spec.name, b.name, d, sel))
        p.covered.add((spec.name, b.name, d))
    if options.errors and spec.own_error_cases:
        p.batches.append(Batch("errors", spec.name, b.name, "n/a", sel))


def _versions(b) -> dict:
    import platform

    import hypothesis

    from opport import __version__

    return {"opport": __version__, "python": platform.python_version(), "hypothesis": hypothesis.__version__,
            **b.versions()}


def _preset(op, backend, dtype, case, why) -> dict:
    from opport.conformance.execute import direction

    return {"id": f"{op}/{backend}/{dtype}/{case}", "op": op, "direction": direction(op), "backend": backend,
            "kernel": "", "dtype": dtype,
            "case": case, "source": "plan", "layout": None, "tags": [], "status": "skip", "metrics": {},
            "message": why, "worst": None, "index": -1}


def default_workers(n_batches: int, limits=()) -> int:
    """One worker per core (at most 8), and no more than any backend of the run allows (`limits`: its
    Capabilities.max_workers(), e.g. 4 where the workers share one real device, each holding a context)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    caps = [n for n in limits if n is not None]
    return max(1, min(cpus, 8, n_batches, *caps))


def run(options: Options, display=None, execute=None) -> Report:
    """Plan, run every batch, apply known failures and the baseline; `display` gets live progress.
    `execute(batches, sink, on_count, on_done) -> Executed` runs the batches (default: this machine's
    worker processes; opport/fleet runs them on a cluster); each result it sinks names its "host"."""
    from opport.doctor import host_record

    t0 = time.perf_counter()
    run_setup(options.setup)  # the parent must know the same backends as the workers
    p = plan(options)
    for name in p.backends:
        known_for(p, name)  # a malformed file stops the run before anything runs
    report = Report(options, p.backends)
    here = host_record(list(p.backends))
    report.hosts = {here["hostname"]: here}  # the planning host: plan rows (no kernel, unavailable) are its

    def sink(res: dict):
        res.setdefault("host", here["hostname"])
        gate.apply_known(res, known_for(p, res["backend"]))
        res["repro"] = repro(res, options, p.selections.get(res["backend"]))
        report.cases.append(res)
        if display:
            display.result(res)

    if display:
        display.start(p)
    try:
        for res in p.preset:
            sink(res)
        on_count = display.add_total if display else (lambda n: None)
        on_done = display.batch_done if display else (lambda batch: None)
        done = (execute or _local(options, p))(p.batches, sink, on_count, on_done)
        report.hosts.update(done.hosts)
        report.interrupted = done.interrupted
    finally:
        if display:
            display.stop()
    order = {name: i for i, name in enumerate(p.backends)}
    report.cases.sort(key=lambda c: (order.get(c["backend"], 99), c["op"], c["dtype"] == "n/a", c["dtype"], c.get("index", -1)))
    if not options.cases and options.tier != "smoke":  # smoke samples the cases: an entry it missed is not stale
        report.stale = gate.stale_known([e for es in p.known.values() for e in es], p.covered, options.tier)
    if options.baseline and os.path.exists(options.baseline):
        report.regressions = gate.regressions(report.cases, gate.load_baseline(options.baseline))
    report.duration_s = round(time.perf_counter() - t0, 2)
    return report


def known_for(p: Plan, backend: str) -> list:
    """The backend's own known failures plus the extra files' entries for it (cached on the plan)."""
    from opport.dispatch import get_backend

    if backend not in p.known:
        extra = [e for path in p.options.known_failures for e in gate.load_known(path)]
        own = gate.load_known(gate.known_failures_path(get_backend(backend)))
        p.known[backend] = own + [e for e in extra if fnmatch.fnmatchcase(backend, e.pattern.split("/")[1])]
    return p.known[backend]


def _local(options: Options, p: Plan):
    """This machine's executor: worker processes, or this process with `workers=0`."""

    def execute(batches, sink, on_count, on_done) -> Executed:
        if options.workers == 0:
            _in_process(batches, sink, on_count, on_done)
        elif batches:
            n = options.workers or default_workers(len(batches), p.limits.values())
            Pool(n, tuple(options.setup), options.timeout, options.compile_timeout, sink, on_count,
                 on_done=on_done).run(batches)
        return Executed({})

    return execute


def covered(path: str):
    """An executor that runs nothing: each case of each batch takes its result from the --json report at `path` (a
    larger tier's run); a case that report lacks is an error. `--covered-by`: the smoke tier judged from the gate."""
    import json

    from opport.conformance.cases import shared_cases
    from opport.conformance.worker import build_items

    with open(path) as f:
        ran = {c["id"]: c for c in json.load(f)["cases"]}

    def execute(batches, sink, on_count, on_done) -> Executed:
        with shared_cases():  # an op's batches in a row: each dtype's declared cases built once for all backends
            for batch in sorted(batches, key=lambda b: (b.op, b.dtype)):
                _judge(build_items(batch), ran, path, sink, on_count)
                on_done(batch)
        return Executed({})

    return execute


def _judge(items: list, ran: dict, path: str, sink, on_count):
    """Each item's result taken from the covering report's case of the same id."""
    from opport.conformance.execute import new_result

    on_count(len(items))
    for i, it in enumerate(items):
        found = ran.get(it.id)
        res = dict(new_result(it), index=i)
        if found is None:
            res.update(status="error", message=f"not run by {path}: the covered-by run lacks this case")
        else:
            res.update({k: found[k] for k in ("status", "kernel", "metrics", "message", "worst") if k in found})
            # as it ran, before known failures: the sink applies them again (a known failure stays xfail)
            res["status"] = {"xfail": "fail", "xpass": "pass"}.get(found["status"], found["status"])
        sink(res)


def _in_process(batches: list, sink, on_count, on_done=lambda batch: None):
    """Run batches here, without isolation (debugging, the pytest plugin, fast unit tests)."""
    from opport.conformance.worker import _batch_result

    for batch in batches:
        def send(msg, batch=batch):
            if msg[0] == "count":
                on_count(max(0, msg[1] - batch.start))
            elif msg[0] == "result":
                sink(msg[2])
            elif msg[0] == "batch_error":
                sink(_batch_result(batch, "error", msg[1]))

        run_batch(batch, send)
        on_done(batch)


def repro(res: dict, options: Options, sel: Selection | None) -> str:
    """A command that reruns exactly this case."""
    parts = ["opport", "conformance", "--backend", res["backend"], "--op", res["op"]]
    if res["dtype"] != "n/a":
        parts += ["--dtype", res["dtype"]]
    if res.get("source") not in ("plan", "batch"):
        parts += ["--case", res["case"]]
    if res.get("source") == "hypothesis" and sel is not None:
        parts += ["--seed", str(sel.seed), "--examples", str(sel.n_examples())]
        if sel.tier != "fast":
            parts += ["--tier", sel.tier]
    for hook in options.setup:
        parts += ["--setup", hook]
    return " ".join(shlex.quote(x) for x in parts)
