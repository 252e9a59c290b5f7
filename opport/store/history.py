"""`opport history DB`: the runs in a results store; `--compare RUN_A RUN_B`: what changed from A to B
(docs/store.md): cases that started failing or passing, bench rows slower or faster beyond their measured noise.

Exit status: 0; with --compare, 1 when B has a case that started failing, a row slower beyond its noise or a
row A timed that B ran and could not time; 2 for a bad store path or run id (one line, from the CLI's boundary).
"""

from __future__ import annotations

from opport.conformance.gate import FAILING
from opport.store.db import Store, StoreError

SKIPPED = ("skip", "xfail")  # as the conformance closing line counts them


def add_arguments(p):
    p.add_argument("store", metavar="DB", help="a results store written by `--store DB`")
    p.add_argument("--compare", nargs=2, type=int, metavar=("RUN_A", "RUN_B"),
                   help="what changed from run A to run B (ids from the listing)")


def run(args) -> int:
    with Store(args.store) as store:
        if args.compare:
            lines, worse = compare(store, *args.compare)
            print("\n".join(lines))
            return 1 if worse else 0
        print("\n".join(listing(store)))
        return 0


# --------------------------------------------------------------------------- the listing


def listing(store: Store) -> list[str]:
    """One line per run: id, time, kind, commit, hosts, and its cases (bench: opport's rows) by outcome."""
    runs, counts = store.runs(), store.counts()
    if not runs:
        return [f"{store.path}: no runs stored yet"]
    head = f"{'id':>4}  {'created (UTC)':25s}  {'kind':11s}  {'commit':10s}  {'pass':>6}  {'fail':>6}  {'skipped':>7}  hosts"
    lines = [head]
    for r in runs:
        c = counts.get(r["id"], {})
        passed, skipped = c.get("pass", 0), sum(c.get(s, 0) for s in SKIPPED)
        failed = sum(n for s, n in c.items() if s not in ("pass", *SKIPPED))
        lines.append(f"{r['id']:>4}  {r['created']:25s}  {r['kind']:11s}  {(r['git_commit'] or '-')[:10]:10s}  "
                     f"{passed:>6}  {failed:>6}  {skipped:>7}  {', '.join(r['hosts'])}")
    return lines


# --------------------------------------------------------------------------- comparing two runs


def compare(store: Store, run_a: int, run_b: int) -> tuple[list[str], bool]:
    """(lines to print, whether B is worse than A anywhere)."""
    a, b = store.run(run_a), store.run(run_b)
    if a["kind"] != b["kind"]:
        raise StoreError(f"--compare {run_a} {run_b}: run {run_a} is {a['kind']}, run {run_b} is {b['kind']}: "
                         "compare two runs of one kind")
    lines = [f"{a['kind']}: run {a['id']} ({_when(a)}) -> run {b['id']} ({_when(b)})"]
    by_host = bool(set(a["hosts"]) & set(b["hosts"]))
    if not by_host:
        lines.append(f"the runs share no host ({', '.join(a['hosts'])} / {', '.join(b['hosts'])}): matched without it")
    if a["kind"] == "conformance":
        more, worse = _compare_cases(store.cases(a["id"]), store.cases(b["id"]), by_host)
    else:
        more, worse = _compare_rows(store.bench_rows(a["id"]), store.bench_rows(b["id"]), by_host)
    return lines + more, worse


def _when(r: dict) -> str:
    return f"{r['created']}, commit {(r['git_commit'] or 'none')[:10]}"


def _where(item: dict, by_host: bool) -> str:
    return f" on {item['host']}" if by_host else ""


def _compare_cases(cases_a: list, cases_b: list, by_host: bool) -> tuple[list[str], bool]:
    key = (lambda c: (c["host"], c["id"])) if by_host else (lambda c: c["id"])
    old, new = {key(c): c for c in cases_a}, {key(c): c for c in cases_b}
    common = [k for k in new if k in old and old[k]["status"] != new[k]["status"]]
    groups = {"started failing": [k for k in common if new[k]["status"] in FAILING and old[k]["status"] not in FAILING],
              "started passing": [k for k in common if new[k]["status"] == "pass" and old[k]["status"] in FAILING]}
    groups["other status changes"] = [k for k in common if not any(k in g for g in groups.values())]
    lines = []
    for title, keys in groups.items():
        lines.append(f"{title}: {len(keys)}")
        for k in keys:
            c = new[k]
            lines.append(f"  {old[k]['status']} -> {c['status']}  {c['id']}{_where(c, by_host)}")
            if c["status"] in FAILING and c.get("repro"):
                lines.append(f"      repro: {c['repro']}")
    only_a, only_b = sum(1 for k in old if k not in new), sum(1 for k in new if k not in old)
    lines.append(f"cases only in run A: {only_a}; only in run B: {only_b}; in both: {sum(1 for k in new if k in old)}")
    return lines, bool(groups["started failing"])


def _compare_rows(rows_a: list, rows_b: list, by_host: bool) -> tuple[list[str], bool]:
    """opport's bench rows, per host (when shared) and backend, through bench's own baseline comparison."""
    from opport.bench import report as rep

    group = (lambda r: (r["host"], r["backend"])) if by_host else (lambda r: r["backend"])
    slower, faster, gone = [], [], []
    for g in sorted({group(r) for r in rows_b if r["impl"] == "opport"}):
        here_a = [r for r in rows_a if group(r) == g and r["impl"] == "opport"]
        here_b = [r for r in rows_b if group(r) == g and r["impl"] == "opport"]
        in_a, in_b = {rep.row_key(r): r for r in here_a}, {rep.row_key(r): r for r in here_b}
        # every row slower at all (margin 0), then those whose p20-p80 spreads do not overlap
        slower += [(in_a[k], in_b[k]) for k in _keys(rep.regressions(here_b, here_a, 0.0)) if _beyond_noise(in_a[k], in_b[k])]
        faster += [(in_a[k], in_b[k]) for k in _keys(rep.regressions(here_a, here_b, 0.0)) if _beyond_noise(in_b[k], in_a[k])]
        # as `opport bench --baseline` counts them: rows B ran but could not time (a row B did not run is no change)
        gone += [in_b[k] for k in rep.missing_rows(here_b, here_a) if k in in_b]
    lines = []
    for title, pairs in (("slower beyond noise", slower), ("faster beyond noise", faster)):
        lines.append(f"{title}: {len(pairs)}")
        lines += [f"  {_row_text(ra, rb, by_host)}" for ra, rb in pairs]
    lines.append(f"timed in run A, failed in run B: {len(gone)}")
    lines += [f"  {r['op']} {r['shape']} {r['dtype']} {rep.pass_of(r)} ({r['backend']}){_where(r, by_host)}: {r['verdict']} "
              f"{r.get('error') or r.get('error_detail') or ''}".rstrip() for r in gone]
    return lines, bool(slower or gone)


def _keys(found: list) -> list:
    """bench.report.regressions' entries as row keys (of opport rows)."""
    return [(f["op"], f["case"] if f["case"] is not None else f["shape"], f["dtype"], f["pass"], "opport") for f in found]


def _spread(r: dict) -> tuple[float, float]:
    """A row's measured noise: its p20-p80 interval (just its median where a report did not record them)."""
    return r.get("p20_ms", r["ms"]), r.get("p80_ms", r["ms"])


def _beyond_noise(fast: dict, slow: dict) -> bool:
    """`slow` is slower than `fast` by more than their noise: the spreads do not overlap."""
    return _spread(slow)[0] > _spread(fast)[1]


def _row_text(ra: dict, rb: dict, by_host: bool) -> str:
    from opport.bench.report import pass_of

    (a20, a80), (b20, b80) = _spread(ra), _spread(rb)
    return (f"{rb['op']} {rb['shape']} {rb['dtype']} {pass_of(rb)} ({rb['backend']}){_where(rb, by_host)}: "
            f"{ra['ms']:.4g} ms -> {rb['ms']:.4g} ms ({rb['ms'] / ra['ms'] - 1:+.0%}; p20-p80 {a20:.4g}-{a80:.4g} -> "
            f"{b20:.4g}-{b80:.4g} ms)")
