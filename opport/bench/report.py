"""Aggregates (geometric-mean speedups, fast_p), the terminal tables, and the comparison with a baseline JSON."""

from __future__ import annotations

import math

FAST_P = (0.8, 1.0)


def geomean(xs) -> float | None:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def pass_of(r: dict) -> str:
    """A row's pass; reports from before training rows existed timed the forward only."""
    return r.get("pass", "fwd")


def summary(rows: list) -> dict:
    """Per pass, per op and overall, per baseline: geomean of vs, and fast_p = share of shapes correct and vs > p.

    {pass: {"per_op": {op: aggregate}, "overall": aggregate}}: a forward and a forward+backward ratio are
    never mixed. A shape counts in fast_p's denominator when opport ran it (timed or failed its check), so
    an incorrect or crashing kernel lowers the share instead of vanishing from it.
    """
    mine = [r for r in rows if r.get("impl") == "opport" and r.get("status") in ("ok", "error")]
    out = {}
    for p in sorted({pass_of(r) for r in mine}, key=_pass_order):
        here = [r for r in mine if pass_of(r) == p]
        per_op = {op: _aggregate([r for r in here if r["op"] == op]) for op in sorted({r["op"] for r in here})}
        out[p] = {"per_op": per_op, "overall": _aggregate(here)}
    return out


def _pass_order(p: str) -> int:
    from opport.bench.training import PASSES

    return PASSES.index(p) if p in PASSES else len(PASSES)


def _aggregate(mine: list) -> dict:
    names = sorted({k for r in mine for k in r.get("vs", {})})
    out = {"shapes": len(mine), "correct": sum(1 for r in mine if r.get("correct") is True)}
    for name in names:
        ratios = [r["vs"][name] for r in mine if name in r.get("vs", {}) and r.get("correct") is not False]
        entry = {"geomean": geomean(ratios), "n": len(ratios)}
        for p in FAST_P:
            good = sum(1 for r in mine if r.get("correct") is True and r.get("vs", {}).get(name, 0) > p)
            entry[f"fast_{p}"] = good / len(mine) if mine else None
        out[f"vs_{name}"] = entry
    return out


# --------------------------------------------------------------------------- baseline comparison


def row_key(r: dict) -> tuple:
    return (r["op"], r.get("case", r.get("shape")), r["dtype"], pass_of(r), r["impl"])


def regressions(current: list, baseline: list, margin: float) -> list:
    """opport rows whose median is slower than the baseline's by more than `margin` (a fraction).

    `current` rows may carry `rerun_ms`: the medians of repeated runs of that row; a row regresses only
    if every run is slower (the best of them is still past the margin), so one noisy run cannot fail it.
    """
    base = {row_key(r): r for r in baseline if r.get("impl") == "opport" and r.get("ms")}
    out = []
    for r in current:
        b = base.get(row_key(r))
        if b is None or not r.get("ms"):
            continue
        best = min([r["ms"], *r.get("rerun_ms", [])])
        if best > b["ms"] * (1 + margin):
            out.append({"op": r["op"], "case": r.get("case"), "shape": r["shape"], "dtype": r["dtype"], "pass": pass_of(r),
                        "baseline_ms": b["ms"], "ms": best, "slower_by": best / b["ms"] - 1})
    return out


def missing_rows(current: list, baseline: list) -> list:
    """opport rows the baseline timed that this run did not time (a kernel that stopped working)."""
    have = {row_key(r) for r in current if r.get("ms")}
    return [row_key(r) for r in baseline if r.get("impl") == "opport" and r.get("ms") and row_key(r) not in have]


# --------------------------------------------------------------------------- terminal output


def _f(x, fmt="{:.3g}") -> str:
    return "-" if x is None else fmt.format(x)


def print_rows(console, report: dict):
    from rich.table import Table

    rows = report["rows"]
    base_names = sorted({k for r in rows for k in r.get("vs", {})})
    t = Table(title=f"opport bench --backend {report['backend']} ({report['mode']}) on {report['device']['name']}",
              caption=_ceiling_caption(report))
    for col in ("op", "shape", "dtype", "pass", "impl", "ms [p20-p80]", "GB/s", "TFLOP/s", "roof %", "ok", "peak MB"):
        t.add_column(col, justify="right" if col not in ("op", "shape", "pass", "impl") else "left")
    for name in base_names:
        t.add_column(f"vs {name}", justify="right")
    for r in rows:
        t.add_row(*_cells(r, base_names))
    console.print(t)


def _cells(r: dict, base_names: list) -> list:
    if "ms" not in r:
        msg = r.get("error", r.get("status", ""))
        return [r["op"], r["shape"], r["dtype"], pass_of(r), r["impl"], f"[red]{r.get('status')}[/red]", msg[:60], "",
                "", "", "", *["" for _ in base_names]]
    ms = f"{r['ms']:.4g} [{r['p20_ms']:.3g}-{r['p80_ms']:.3g}]"
    if r.get("graph_ms") is not None:
        ms += f"\ngraph {r['graph_ms']:.3g}"
    ok = {True: "[green]yes[/green]", False: "[red]NO[/red]", None: "[yellow]?[/yellow]"}[r.get("correct")]
    vs = []
    for name in base_names:
        v = r.get("vs", {}).get(name)
        vs.append("" if v is None else f"[{'green' if v >= 1 else 'red'}]{v:.2f}x[/]")
    impl = r["impl"] if r["impl"] != "opport" else "[bold]opport[/bold]"
    return [r["op"], r["shape"], r["dtype"], pass_of(r), impl, ms, _f(r.get("GBps"), "{:.4g}"), _f(r.get("TFLOPs"), "{:.3g}"),
            _f(r.get("roofline_pct"), "{:.0f}"), ok, _memory(r), *vs]


def _memory(r: dict) -> str:
    """Peak memory a call allocates beyond its inputs (MB), and for opport each baseline's peak over it."""
    if r.get("peak_MB") is None:
        return "-"
    ratios = " ".join(f"{v:.3g}x {k}" for k, v in sorted(r.get("mem_vs", {}).items()))
    return f"{r['peak_MB']:.4g}" + (f"\n({ratios})" if ratios else "")


def _ceiling_caption(report: dict) -> str:
    c = report.get("ceilings", {})
    by = ", ".join(f"{k} {v:.4g}" for k, v in c.get("matmul_TFLOPs_by_dtype", {}).items())
    return f"ceilings measured in this run: copy {c.get('copy_GBps', 0):.4g} GB/s; matmul TFLOP/s {by}"


def print_summary(console, report: dict):
    from rich.table import Table

    s = report["summary"]
    names = sorted({k for by in s.values() for v in by["per_op"].values() for k in v if k.startswith("vs_")})
    t = Table(title="speedup of opport (baseline time / opport time): geometric mean, fast_p")
    for col in ("op", "pass", "shapes ok"):
        t.add_column(col)
    for n in names:
        t.add_column(f"{n}\ngeomean | fast_1.0 | fast_0.8", justify="right")
    lines = [(op, p, by["per_op"][op]) for op in sorted({o for by in s.values() for o in by["per_op"]})
             for p, by in s.items() if op in by["per_op"]]
    for op, p, agg in lines + [("ALL", p, by["overall"]) for p, by in s.items()]:
        cells = [op, p, f"{agg['correct']}/{agg['shapes']}"]
        for n in names:
            e = agg.get(n)
            cells.append("-" if not e else f"{_f(e['geomean'], '{:.2f}x')} | {_f(e['fast_1.0'], '{:.0%}')} | "
                                          f"{_f(e['fast_0.8'], '{:.0%}')}")
        t.add_row(*cells)
    console.print(t)


def print_counts(console, report: dict, columns=()):
    """Counts per call (an emulated device): the op's minimum bytes and the backend's counters `columns`."""
    from rich.table import Table

    t = Table(title=f"opport bench --backend {report['backend']} ({report['mode']}): counts per call, not speed")
    ratio = next((k for r in report["rows"] for k in r if k.endswith("_vs_min")), None)
    for col in ("op", "shape", "dtype", "pass", "kernel", "ok", "min bytes", *columns, *([ratio] if ratio else [])):
        t.add_column(col)
    for r in report["rows"]:
        if "counts" not in r:
            t.add_row(r["op"], r["shape"], r["dtype"], pass_of(r), "-", f"[red]{r.get('status')}[/red]",
                      r.get("error", "")[:80])
            continue
        cells = [_count(r["counts"].get(c)) for c in columns] + ([_f(r.get(ratio), "{:.2f}")] if ratio else [])
        t.add_row(r["op"], r["shape"], r["dtype"], pass_of(r), r["kernel"], "yes" if r["correct"] else "[red]NO[/red]",
                  str(r["bytes"]), *cells)
    console.print(t)


def _count(v) -> str:
    if isinstance(v, dict):  # per engine, per queue, ...
        return ", ".join(f"{k} {n}" for k, n in v.items() if n)
    return "-" if v is None else str(v)
