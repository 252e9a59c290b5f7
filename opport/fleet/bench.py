"""`opport bench --cluster ...`: benchmark problems on every kind of host of a Ray cluster.

One actor per host (all of its CPUs and the backend's device resource, so nothing else of the run shares
the host while it times) measures that host's ceilings once, then runs problems (op x shape x dtype) one at
a time; each row names its host and was judged against that host's own same-run ceilings. Every kind of host
(opport/doctor.py host_kind: its accelerator) runs every problem; hosts of one kind share its queue. A host
lost mid-run hands its unfinished problem to another host of its kind, or the problem's row is `lost`; a
worker that dies on a problem makes that row `crash` and is started again on its host once. Ctrl-C stops
the actors and keeps the rows so far (the problems not run are listed under "skipped").
"""

from __future__ import annotations

import collections
import datetime
import time

from opport.fleet.cluster import alive_nodes, connect, requirement
from opport.fleet.host import HostBook

RESTARTS_PER_HOST = 1  # a host whose worker died twice is left out for the rest of the run


class HostBench:
    """Ray actor: one host's profile, ceilings and runner settings, then problems on request."""

    def __init__(self, backend: str, tier: str, dtypes: list, args):
        from rich.console import Console

        from opport.bench.plan import setup_run
        from opport.bench.profile import profile
        from opport.dispatch import get_backend
        from opport.fleet.host import here

        self.node, record = here(backend)
        self.prof = profile(get_backend(backend))
        quiet = Console(quiet=True)
        self.report, self.settings = setup_run(quiet, self.prof, tier, dtypes, args)
        keys = ("mode", "device", "ceilings", "timing", "versions")
        self.info_ = {"node": self.node, "record": record, "measures": self.prof.measures,
                      **{k: self.report[k] for k in keys if k in self.report}}

    def info(self) -> dict:
        return self.info_

    def run(self, op: str, case: str, dtype: str) -> list:
        from opport.bench.runner import run_counts, run_shape
        from opport.bench.workloads import get_workload
        from opport.ops import get_op

        spec = get_op(op)
        wl = get_workload(spec)
        shape = next(s for s in wl.shapes if s.name == case)
        if self.settings is None:
            return run_counts(self.prof, spec, wl, shape, dtype, self.report["passes"])
        return run_shape(spec, wl, shape, dtype, self.settings)


def run(console, specs, prof, tier: str, dtypes: list, args) -> int:
    """The cluster run: start the host actors, run every problem on every host kind, print, write, exit status."""
    from opport.bench.plan import bad_rows, round_robin

    with connect(args.cluster, dashboard=args.dashboard) as ray:
        passes = _passes(args)
        jobs = [(s.name, shape.name, dtype) for s, _, shape, dtype in round_robin(specs, tier, dtypes, prof.backend.name,
                                                                                 passes)]
        fleet = _Fleet(ray, prof.backend.name, tier, dtypes, args)
        console.print(f"opport bench --cluster {args.cluster}: {len(jobs)} problems on {len(fleet.actors)} host(s)")
        rows, skipped, interrupted = fleet.run(jobs, console)
    report = _report(prof, tier, dtypes, args, passes, fleet, rows, skipped)
    _print(console, report, prof.get("COUNTER_COLUMNS", ()))
    for r in bad_rows(rows):
        console.print(f"[red]opport {r['op']} {r['shape']} {r['dtype']} {r.get('pass', 'fwd')} on {r['host']}: "
                      f"{r.get('error') or r.get('error_detail') or 'output differs from the reference'}[/red]")
    if args.json:
        from opport.bench.plan import write_json

        write_json(args.json, report)
    return 130 if interrupted else (1 if bad_rows(rows) or not rows else 0)


def _passes(args) -> list:
    from opport.bench.training import DEFAULT_PASSES, PASSES

    asked = set(args.passes or DEFAULT_PASSES)
    return [p for p in PASSES if p in asked or "all" in asked]


class _Fleet:
    """The host actors of one run and the problems each host kind still has to run."""

    def __init__(self, ray, backend: str, tier: str, dtypes: list, args):
        self.ray, self.spec = ray, (backend, tier, dtypes, args)
        self.need = requirement(backend, ray)
        nodes = [n for n in alive_nodes(ray) if all(n[2].get(k, 0) >= v for k, v in self.need.items())]
        self.book = HostBook(alive_nodes(ray))
        self.failed: dict = {}  # host id -> why it could not run problems
        self.restarts: collections.Counter = collections.Counter()
        self.actors: dict = {}  # node id -> (actor, info)
        pending = {node: self._start(node, res) for node, _, res in nodes}
        for node, actor in pending.items():
            self._hello(node, actor)

    def _start(self, node: str, resources: dict):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        cpus = resources.get("CPU", 1)  # the whole host: nothing else of this run times beside it
        opts = {"num_cpus": cpus, "num_gpus": self.need.get("GPU", 0),
                "resources": {k: v for k, v in self.need.items() if k != "GPU"},
                "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False), "max_restarts": 0}
        return self.ray.remote(HostBench).options(**opts).remote(*self.spec)

    def _hello(self, node: str, actor):
        try:
            info = self.ray.get(actor.info.remote())
        except self.ray.exceptions.RayError as e:  # that host cannot benchmark the backend: say why, go on
            self.failed[self.book.ids.get(node, node)] = _root_cause(e)
            return
        host = self.book.add(node, info["record"])
        self.book.records[host].update({k: v for k, v in info.items() if k not in ("node", "record")})
        self.actors[node] = (actor, host)

    def run(self, jobs: list, console) -> tuple:
        """(rows, problems not run, interrupted): every host kind gets every job."""
        from opport.doctor import host_kind

        kinds = {host_kind(self.book.records[h]) for _, h in self.actors.values()}
        queues = {k: collections.deque(jobs) for k in kinds}
        rows, idle, inflight, t0 = [], list(self.actors), {}, time.perf_counter()
        try:
            while any(queues.values()) or inflight:
                for node in list(idle):
                    if queues.get(self._kind(node)):
                        idle.remove(node)
                        job = queues[self._kind(node)].popleft()
                        inflight[self.actors[node][0].run.remote(*job)] = (node, job)
                if not inflight:  # a kind left with problems and no host
                    for kind in [k for k, q in queues.items() if q]:
                        rows += [_lost(job, f"no alive host of kind {kind!r} left") for job in queues.pop(kind)]
                    break
                ready, _ = self.ray.wait(list(inflight), num_returns=1, timeout=1.0)
                for ref in ready:
                    node, job = inflight.pop(ref)
                    rows += self._collect(ref, node, job, queues, idle)
                    console.print(f"[dim]{time.perf_counter() - t0:6.1f} s  {self.actors.get(node, (0, node))[1]:24s} "
                                  f"{' '.join(job)}[/dim]")
        except KeyboardInterrupt:
            for actor, _ in self.actors.values():
                self.ray.kill(actor)
            left = [job for q in queues.values() for job in q] + [job for _, job in inflight.values()]
            return rows, ["/".join(j) for j in left], True
        return rows, [], False

    def _kind(self, node: str) -> str:
        from opport.doctor import host_kind

        return host_kind(self.book.records[self.actors[node][1]])

    def _collect(self, ref, node: str, job: tuple, queues: dict, idle: list) -> list:
        """The job's rows (tagged with the host), or what its failure means: crash, a lost host, a moved job."""
        host = self.actors[node][1]
        try:
            got = self.ray.get(ref)
        except self.ray.exceptions.RayError as e:
            kind = self._kind(node)
            if node not in {n for n, _, _ in alive_nodes(self.ray)}:
                del self.actors[node]
                if any(self._kind(n) == kind for n in self.actors):
                    queues[kind].appendleft(job)  # another host of its kind takes it
                    return []
                return [_lost(job, f"host {host} was lost ({_first_line(e)}) and no other host of kind {kind!r} is left",
                              host)]
            self._restart(node, host)
            if node in self.actors:
                idle.append(node)
            return [dict(_lost(job, f"worker died on {host}: {_first_line(e)}", host), status="crash")]
        idle.append(node)
        return [dict(r, host=host) for r in got]

    def _restart(self, node: str, host: str):
        actor, _ = self.actors.pop(node)
        self.restarts[host] += 1
        if self.restarts[host] > RESTARTS_PER_HOST:
            self.failed[host] = f"its worker died {self.restarts[host]} times; left out"
            return
        res = next((r for n, _, r in alive_nodes(self.ray) if n == node), {})
        self._hello(node, self._start(node, res))


def _lost(job: tuple, why: str, host: str | None = None) -> dict:
    op, case, dtype = job
    return {"op": op, "case": case, "shape": case, "dtype": dtype, "pass": "fwd", "impl": "opport", "status": "lost",
            "error": why, "host": host}


def _report(prof, tier: str, dtypes: list, args, passes: list, fleet: _Fleet, rows: list, skipped: list) -> dict:
    from opport.bench import env
    from opport.bench import report as rep
    from opport.bench.plan import command

    by_host = collections.defaultdict(list)
    for r in rows:
        by_host[r.get("host")].append(r)
    hosts = fleet.book.records
    return {"backend": prof.backend.name, "mode": {h: rec.get("mode") for h, rec in hosts.items()}, "tier": tier,
            "dtypes": dtypes, "command": command(args, tier) + f" --cluster {args.cluster}", "passes": passes,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "versions": env.versions(), "hosts": hosts, "hosts_left_out": fleet.failed, "skipped": skipped,
            "summary": {h: rep.summary(rs) for h, rs in by_host.items() if h in hosts and hosts[h]["measures"] == "time"},
            "rows": rows}


def _print(console, report: dict, counter_columns: tuple):
    """Each host's rows as a local run prints them, under that host's mode, device and ceilings."""
    from opport.bench import report as rep

    for host, rec in report["hosts"].items():
        mine = [r for r in report["rows"] if r.get("host") == host]
        sub = {**report, "mode": rec.get("mode"), "device": rec.get("device"), "ceilings": rec.get("ceilings"),
               "timing": rec.get("timing"), "rows": mine, "summary": report["summary"].get(host)}
        console.print(f"[bold]host {host}[/bold] ({rec.get('accelerator')}, {rec.get('mode')})")
        if rec.get("measures") == "counts":
            rep.print_counts(console, sub, counter_columns)
        else:
            rep.print_rows(console, sub)
            rep.print_summary(console, sub)
    for host, why in report["hosts_left_out"].items():
        console.print(f"[yellow]host {host} left out: {why}[/yellow]")
    if report["skipped"]:
        console.print(f"[yellow]interrupted: {len(report['skipped'])} problems not run[/yellow]")


def _root_cause(e: Exception) -> str:
    """What an actor's constructor raised (Ray wraps it in an ActorDiedError whose first line says only that)."""
    cause = e
    while getattr(cause, "cause", None) is not None and cause.cause is not cause:
        cause = cause.cause
    if cause is not e:
        return f"{type(cause).__name__}: {_first_line(cause)}"
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[-1][:300] if lines else type(e).__name__


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]
