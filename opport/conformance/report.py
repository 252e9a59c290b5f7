"""What a run shows and writes: live progress, the op x backend matrix, JSON, JUnit XML, Markdown."""

from __future__ import annotations

import json
import time
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from opport.conformance.gate import BAD, FAILING, STATUSES

SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64", "n/a": "bad"}
COLORS = {"pass": "green", "xfail": "yellow", "skip": "dim", "fail": "red", "error": "red", "crash": "red",
          "timeout": "red", "lost": "red", "xpass": "magenta"}
METRIC_KEYS = ("max_abs", "max_rel", "max_ulp", "tol_ratio", "rmse", "rmse_ratio", "floor_ratio", "mismatches")


# --------------------------------------------------------------------------- terminal


class Live:
    """Progress bar, one line per failure as it happens (with its repro command), and one line per backend and
    op as it finishes: those lines are plain text, so a log that is not a terminal shows progress too."""

    def __init__(self, console: Console | None = None, show_failures: bool = True):
        self.console = console or Console(stderr=True)
        self.show_failures = show_failures
        self.counts = dict.fromkeys(STATUSES, 0)
        self.progress = None
        self.task = None
        self.remaining: Counter = Counter()  # (backend, op) -> batches not finished
        self.per_op: dict = defaultdict(Counter)  # (backend, op) -> statuses so far
        self.t0 = time.perf_counter()

    def start(self, plan):
        modes = ", ".join(f"{n} ({i['mode'] or 'unavailable'})" for n, i in plan.backends.items())
        sel = next(iter(plan.selections.values()), None)
        extra = f", tier {sel.tier}, seed {sel.seed}" if sel else ""
        self.console.print(f"[bold]opport conformance[/bold]: {modes}{extra}; {len(plan.batches)} batches")
        self.remaining = Counter((b.backend, b.op) for b in plan.batches)
        self.t0 = time.perf_counter()
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=self.console, transient=False)
        self.task = self.progress.add_task(self._describe(), total=0)
        self.progress.start()

    def add_total(self, n: int):
        self.progress.update(self.task, total=(self.progress.tasks[0].total or 0) + n)

    def result(self, res: dict):
        self.counts[res["status"]] += 1
        self.per_op[(res["backend"], res["op"])][res["status"]] += 1
        if res["source"] not in ("plan", "batch"):
            self.progress.advance(self.task)
        self.progress.update(self.task, description=self._describe())
        if self.show_failures and res["status"] in FAILING:
            self.progress.console.print(failure_text(res), soft_wrap=True)

    def batch_done(self, batch):
        """A batch finished: the last one of its backend and op prints that pair's line."""
        key = (batch.backend, batch.op)
        self.remaining[key] -= 1
        if self.remaining[key] == 0:
            done = sum(1 for n in self.remaining.values() if n == 0)
            counts = " ".join(f"{s} {n}" for s, n in self.per_op[key].items() if n)
            self.progress.console.print(f"{time.perf_counter() - self.t0:7.1f} s  {key[0]:10s} {key[1]:14s} {counts}  "
                                        f"({done}/{len(self.remaining)} backend x op)", highlight=False)

    def _describe(self) -> str:
        parts = [f"[{COLORS[s]}]{s} {n}[/{COLORS[s]}]" for s, n in self.counts.items() if n]
        return " ".join(parts) or "starting"

    def stop(self):
        if self.progress:
            self.progress.stop()


def failure_lines(res: dict) -> list[str]:
    """One failure as plain lines: status and id, message, worst element, repro command."""
    kernel = f"  ({res['kernel']})" if res["kernel"] else ""
    lines = [f"{res['status'].upper()} {res['id']}{kernel}"]
    lines += [f"    {line}" for line in (res["message"] or "").splitlines()[:12]]
    if res.get("worst"):
        lines.append(f"    worst element: {_worst_text(res['worst'])}")
    lines.append(f"    repro: {res.get('repro', '')}")
    return lines


def failure_text(res: dict) -> str:
    """`failure_lines` with rich markup, as printed live and in the summary."""
    from rich.markup import escape

    color = COLORS[res["status"]]
    head, *body = failure_lines(res)
    status, _, rest = head.partition(" ")
    out = [f"[{color}]{status}[/{color}] {escape(rest)}"] + [escape(x) for x in body[:-1]]
    return "\n".join(out + [f"[cyan]{escape(body[-1])}[/cyan]"])


def _worst_text(w: dict) -> str:
    parts = [f"index {tuple(w['index'])}"]
    if w.get("inputs"):
        parts.append("input " + ", ".join(f"{k}={v!r}" for k, v in w["inputs"].items()))
    for k in ("expected", "got", "abs_err", "allowed", "call", "got_call"):
        if w.get(k) is not None:
            parts.append(f"{k} {w[k]!r}")
    return ", ".join(parts)


def columns(report) -> list:
    """The matrix's columns as (backend, host kind) pairs: one per backend, or one per kind of host its cases
    ran on when there were several (a cluster with H100 and H200 hosts); kind None for a single column."""
    kinds = defaultdict(dict)  # backend -> host kinds in order of appearance
    for c in report.cases:
        if c.get("source") != "plan":  # plan rows (no kernel, unavailable) ran nowhere
            kinds[c["backend"]][host_kind(report, c)] = None
    out = []
    for n in report.backends:
        ks = list(kinds.get(n, ()))
        out += [(n, k) for k in ks] if len(ks) > 1 else [(n, None)]
    return out


def host_kind(report, case: dict) -> str:
    from opport.doctor import host_kind as kind_of

    record = getattr(report, "hosts", {}).get(case.get("host"))
    return kind_of(record) if record else "unknown host"


def cells(report) -> dict:
    """{(op, backend, host kind or None): {dtype: Counter of statuses}}, keyed by `columns(report)`; a plan row
    counts in every column of its backend."""
    cols = columns(report)
    split = {b for b, k in cols if k is not None}
    grid = defaultdict(lambda: defaultdict(lambda: defaultdict(int)))
    for c in report.cases:
        b = c["backend"]
        if b not in split:
            keys = [(b, None)]
        elif c.get("source") == "plan":
            keys = [col for col in cols if col[0] == b]
        else:
            keys = [(b, host_kind(report, c))]
        for col in keys:
            grid[(c["op"], *col)][c["dtype"]][c["status"]] += 1
    return grid


def cell_verdict(counts: dict) -> str:
    """fail | pass | skip for one op x backend x dtype cell."""
    if any(counts.get(s) for s in FAILING):
        return "fail"
    if counts.get("pass") or counts.get("xfail"):
        return "pass"
    return "skip"


def _cell_line(dtype: str, counts: dict) -> str:
    total = sum(counts.values())
    v = cell_verdict(counts)
    if v == "fail":
        bad = sum(counts.get(s, 0) for s in FAILING)
        return f"[red]{SHORT.get(dtype, dtype)} ✗ {bad}/{total}[/red]"
    if v == "skip":
        return f"[dim]{SHORT.get(dtype, dtype)} skip[/dim]"
    x = f" ({counts['xfail']} xfail)" if counts.get("xfail") else ""
    return f"[green]{SHORT.get(dtype, dtype)} ✓ {counts.get('pass', 0)}[/green]{x}"


def matrix(report) -> Table:
    """op x backend (x host kind); each cell lists its dtypes (and the bad-input checks) with pass/fail counts."""
    grid = cells(report)
    cols = columns(report)
    t = Table(title="conformance")
    t.add_column("op")
    for n, kind in cols:
        info = report.backends[n]
        t.add_column(f"{n}\n[dim]{kind or info['mode'] or 'unavailable'}[/dim]")
    for op in sorted({key[0] for key in grid}):
        row = [op]
        for n, kind in cols:
            per = grid.get((op, n, kind))
            if not per:
                why = report.backends[n]["unavailable"]
                row.append("[dim]unavailable[/dim]" if why else "-")
                continue
            order = sorted(per, key=lambda d: (d == "n/a", list(SHORT).index(d) if d in SHORT else 9))
            row.append("\n".join(_cell_line(d, per[d]) for d in order))
        t.add_row(*row)
    return t


def batch_invariance(report) -> dict:
    """{op: {backend: {dtype: True (every checked case invariant) / False}}} from the batch items: whether a row's
    outputs are bitwise the same alone, in its batch and at another position (ops that declare a batch)."""
    out: dict = {}
    for c in report.cases:
        if c.get("source") == "batch" and "batch_invariant" in c:
            cell = out.setdefault(c["op"], {}).setdefault(c["backend"], {})
            cell[c["dtype"]] = cell.get(c["dtype"], True) and c["batch_invariant"]
    return out


def batch_table(report) -> Table | None:
    """The batch-invariance column: per op and backend, ✓ where every checked dtype's rows were invariant, else the
    dtypes whose rows varied; "n/a" for an op without a declared batch (in-place writes, grouped rows, reductions
    over the whole input), blank where no case fitted the tier's caps."""
    from opport.ops import get_op

    found = batch_invariance(report)
    ops = sorted({c["op"] for c in report.cases if c.get("direction") == "forward" and _public(get_op, c["op"])})
    if not found or not ops:
        return None
    backends = list(report.backends)
    t = Table(title="batch invariance (a row alone, in its batch, moved)", title_style="bold")
    t.add_column("op")
    for b in backends:
        t.add_column(b)
    for op in ops:
        declared = bool(getattr(get_op(op), "batch_args", ()))
        t.add_row(op, *(_batch_cell(found.get(op, {}).get(b), declared) for b in backends))
    return t


def _public(get_op, name: str) -> bool:
    try:
        return get_op(name).public
    except Exception:  # a preset row of an unknown op
        return False


def _batch_cell(dtypes: dict | None, declared: bool) -> str:
    if not declared:
        return "[dim]n/a[/dim]"
    if dtypes is None:
        return ""
    varied = [_SHORT.get(d, d) for d, ok in dtypes.items() if not ok]
    return "[green]✓[/green]" if not varied else f"[yellow]varies {' '.join(varied)}[/yellow]"


_SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64"}


def print_summary(report, console: Console | None = None):
    console = console or Console()
    console.print(matrix(report))
    table = batch_table(report)
    if table is not None:
        console.print(table)
    s = report.summary
    console.print("  ".join(f"[{COLORS[k]}]{k} {v}[/{COLORS[k]}]" for k, v in s.items()) + f"   ({report.duration_s:.1f} s)")
    for n, info in report.backends.items():
        if info["unavailable"]:
            console.print(f"[dim]{n}: unavailable: {info['unavailable']}[/dim]")
    fails = report.failures()
    if fails:
        console.print(f"\n[bold red]{len(fails)} failing case(s)[/bold red]" + (" (first 30)" if len(fails) > 30 else ""))
        for res in fails[:30]:
            console.print(failure_text(res), soft_wrap=True)
    print_time(report, console)
    for e in report.stale:
        console.print(f"[yellow]stale known failure[/yellow] {e['pattern']} ({e['where']}): matched no case")
    for r in report.regressions:
        console.print(f"[red]baseline: {r['kind']}[/red] {r['id']}: {r['detail']}")
    code = report.exit_code
    verdict = "[green]PASS[/green]" if code == 0 else "[red]FAIL[/red]"
    why = "" if code == 0 else " (nothing ran)" if sum(v for k, v in s.items() if k != "skip") == 0 else ""
    why = " (interrupted: a partial report)" if getattr(report, "interrupted", False) else why
    console.print(f"conformance: {verdict}{why}")
    # a plain closing count line, as test runners end (CI logs are read for it)
    failed = sum(s[k] for k in ("fail", "error", "crash", "timeout", "lost", "xpass"))
    console.print(f"conformance: {s['pass']} passed, {failed} failed, {s['skip'] + s['xfail']} skipped", markup=False)


# --------------------------------------------------------------------------- time


def time_by_op(report) -> list:
    """[{backend, op, seconds, share, cases}] slowest first: each op x backend's time in the workers (its cases plus
    building them: Hypothesis draws, fixed cases), and its share of all of it. Derived ops count as their forward
    op (`rmsnorm` holds rmsnorm, rmsnorm_backward, ...): the budget is per declared op."""
    from opport.conformance.execute import forward_name

    secs, counts = Counter(), Counter()
    for c in report.cases:
        key = (c["backend"], forward_name(c["op"]))
        secs[key] += (c.get("duration_s") or 0.0) + (c.get("build_s") or 0.0)
        counts[key] += 1
    total = sum(secs.values()) or 1.0
    return [{"backend": b, "op": op, "seconds": round(s, 2), "share": round(s / total, 4), "cases": counts[(b, op)]}
            for (b, op), s in secs.most_common()]


def print_time(report, console, top: int = 8):
    """The slowest op x backend pairs and their share: where the gate's time goes (the per-op budget, docs/conformance.md)."""
    rows = time_by_op(report)
    if not rows:
        return
    total = sum(r["seconds"] for r in rows)
    if not total:  # nothing ran here (--covered-by)
        return
    budget = [r for r in rows if r["share"] > OP_BUDGET_SHARE] if len(rows) >= 1 / OP_BUDGET_SHARE else []  # a whole run
    text = ", ".join(f"{r['op']}/{r['backend']} {r['seconds']:.0f} s ({100 * r['share']:.0f}%)" for r in rows[:top])
    console.print(f"time in workers: {total:.0f} s; slowest: {text}", highlight=False)
    for r in budget:
        console.print(f"[yellow]over the per-op budget[/yellow] {r['op']}/{r['backend']}: {100 * r['share']:.0f}% of the "
                      f"run (budget {100 * OP_BUDGET_SHARE:.0f}%): choose smaller cases", highlight=False)


# One op x backend may take at most this share of a run's worker time (a fair share of 19 ops on 3 backends is
# ~2%): the gate names the pairs above it so the fast tier stays inside make test's 15 minutes as ops are added.
OP_BUDGET_SHARE = 0.08


# --------------------------------------------------------------------------- files


def to_json(report) -> dict:
    """docs/design.md section 6, plus run details (seed, tier, stale entries, baseline regressions)."""
    names = list(report.backends)
    single = len(names) == 1
    o = report.options
    return {
        "backend": names[0] if single else "all",
        "mode": report.backends[names[0]]["mode"] if single else ",".join(f"{n}={i['mode']}" for n, i in report.backends.items()),
        "versions": report.backends[names[0]]["versions"] if single else {n: i["versions"] for n, i in report.backends.items()},
        "backends": report.backends,
        "summary": report.summary,
        "exit_code": report.exit_code,
        "tier": o.tier, "seed": o.seed, "examples": o.examples, "duration_s": report.duration_s,
        "stale_known_failures": report.stale,
        "baseline_regressions": report.regressions,
        "hosts": report.hosts,  # host id -> opport/doctor.py's record; every case names its "host"
        "interrupted": report.interrupted,
        "time_by_op": time_by_op(report),
        "batch_invariance": batch_invariance(report),
        "cases": [_case_json(c) for c in report.cases],
    }


def _case_json(c: dict) -> dict:
    keys = ("id", "op", "direction", "backend", "kernel", "dtype", "status", "metrics", "message", "repro", "case", "source",
            "layout", "tags", "worst", "known_failure", "duration_s", "build_s", "host", "batch_invariant")
    return {k: c.get(k) for k in keys if k in c}


def write_json(report, path):
    with open(path, "w") as f:
        json.dump(to_json(report), f, indent=1, default=_plain)
        f.write("\n")


def _plain(x):
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)


def write_junit(report, path):
    """One <testsuite> per backend, one <testcase> per case, metrics as <property> elements."""
    root = ET.Element("testsuites", name="opport-conformance", time=f"{report.duration_s:.3f}")
    by_backend = defaultdict(list)
    for c in report.cases:
        by_backend[c["backend"]].append(c)
    for name, cases in by_backend.items():
        info = report.backends.get(name, {})
        counts = defaultdict(int)
        for c in cases:
            counts[c["status"]] += 1
        suite = ET.SubElement(root, "testsuite", name=f"opport.conformance.{name}", tests=str(len(cases)),
                              failures=str(counts["fail"] + counts["xpass"]),
                              errors=str(counts["error"] + counts["crash"] + counts["timeout"] + counts["lost"]),
                              skipped=str(counts["skip"] + counts["xfail"]),
                              time=f"{sum(c.get('duration_s') or 0 for c in cases):.3f}")
        props = ET.SubElement(suite, "properties")
        ET.SubElement(props, "property", name="mode", value=str(info.get("mode")))
        for k, v in (info.get("versions") or {}).items():
            ET.SubElement(props, "property", name=f"version.{k}", value=str(v))
        for c in cases:
            _junit_case(suite, c)
    ET.indent(root)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def _junit_case(suite, c: dict):
    tc = ET.SubElement(suite, "testcase", classname=f"opport.{c['backend']}.{c['op']}.{c['dtype']}", name=c["case"],
                       time=f"{c.get('duration_s') or 0:.4f}")
    props = ET.SubElement(tc, "properties")
    for k in METRIC_KEYS:
        v = (c.get("metrics") or {}).get(k)
        if v is not None:
            ET.SubElement(props, "property", name=k, value=repr(v))
    for k in ("direction", "kernel", "status", "repro"):
        ET.SubElement(props, "property", name=k, value=str(c.get(k) or ""))
    text = "\n".join(filter(None, [c["message"], c.get("worst") and f"worst element: {_worst_text(c['worst'])}",
                                   f"repro: {c.get('repro', '')}"]))
    first = (c["message"] or c["status"]).splitlines()[0][:500]
    status = c["status"]
    if status in ("fail", "xpass"):
        ET.SubElement(tc, "failure", message=first, type=status).text = text
    elif status in ("error", "crash", "timeout", "lost"):
        ET.SubElement(tc, "error", message=first, type=status).text = text
    elif status in ("skip", "xfail"):
        why = f"xfail: {c.get('known_failure', '')}" if status == "xfail" else first
        ET.SubElement(tc, "skipped", message=why[:500], type=status)


def to_markdown(report) -> str:
    """A summary for a CI job page ($GITHUB_STEP_SUMMARY): verdict, counts, matrix, failures with repros."""
    code = report.exit_code
    s = report.summary
    out = [f"## opport conformance: {'✅ PASS' if code == 0 else '❌ FAIL'}", ""]
    modes = ", ".join(f"`{n}` ({i['mode'] or 'unavailable'})" for n, i in report.backends.items())
    out += [f"Backends {modes}; tier `{report.options.tier}`, seed `{report.options.seed}`, {report.duration_s:.0f} s.", ""]
    out += ["| " + " | ".join(s) + " |", "|" + "---|" * len(s), "| " + " | ".join(str(v) for v in s.values()) + " |", ""]
    grid = cells(report)
    cols = columns(report)
    out += ["| op | " + " | ".join(n + (f" ({kind})" if kind else "") for n, kind in cols) + " |",
            "|---|" + "---|" * len(cols)]
    for op in sorted({key[0] for key in grid}):
        row = []
        for n, kind in cols:
            per = grid.get((op, n, kind), {})
            row.append("<br>".join(_md_cell(d, per[d]) for d in sorted(per, key=lambda d: d == "n/a")) or "-")
        out.append(f"| {op} | " + " | ".join(row) + " |")
    fails = report.failures()
    if fails:
        out += ["", f"### Failures ({len(fails)})", ""]
        for c in fails[:50]:
            msg = (c["message"] or "").splitlines()[0] if c["message"] else ""
            out += [f"- **{c['status']}** `{c['id']}` {('(' + c['kernel'] + ')') if c['kernel'] else ''}: {msg}"]
            if c.get("worst"):
                out.append(f"  - worst element: {_worst_text(c['worst'])}")
            out.append(f"  - repro: `{c.get('repro', '')}`")
    if report.regressions:
        out += ["", "### Baseline regressions", ""] + [f"- `{r['id']}`: {r['kind']}: {r['detail']}" for r in report.regressions]
    if report.stale:
        out += ["", "### Stale known failures", ""] + [f"- `{e['pattern']}` ({e['where']})" for e in report.stale]
    return "\n".join(out) + "\n"


def _md_cell(dtype: str, counts: dict) -> str:
    v = cell_verdict(counts)
    total = sum(counts.values())
    if v == "fail":
        return f"❌ {SHORT.get(dtype, dtype)} {sum(counts.get(s, 0) for s in FAILING)}/{total}"
    if v == "skip":
        return f"⏭️ {SHORT.get(dtype, dtype)}"
    x = f" ({counts['xfail']} xfail)" if counts.get("xfail") else ""
    return f"✅ {SHORT.get(dtype, dtype)} {counts.get('pass', 0)}{x}"


__all__ = ["BAD", "Live", "matrix", "print_summary", "to_json", "to_markdown", "write_json", "write_junit"]
