"""`opport report DB --html OUT/`: one static page, OUT/index.html, of a results store (docs/store.md).

The page needs no network: CSS and JavaScript are inline, plots are inline SVG drawn by matplotlib, and its
Content-Security-Policy forbids any fetch and any script but its own. It shows
the op x backend x host matrix of a conformance run with its stored counts (a cell's link opens its cases
and repro lines; `index.html#cases-N` opens one directly), each host's roofline from a bench run (drawn by
opport/bench/plot.py against that host's ceilings), and a trend per op across all runs. Every stored
string is HTML-escaped.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
from collections import defaultdict
from html import escape

from opport.conformance.gate import FAILING, STATUSES
from opport.store.db import Store, StoreError

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin:.5em 0}
th,td{border:1px solid #ccc;padding:3px 7px;text-align:left;vertical-align:top} table.runs td:nth-child(2){white-space:nowrap}
thead th{background:#f3f3f3}
td.cell.ok{background:#e6f4e6} td.cell.bad{background:#fbe3e3} td.cell.none{background:#f6f6f6}
td.cell a{color:inherit;text-decoration:none;display:block}
.st{margin-right:.6em;white-space:nowrap} .st.fail,.st.error,.st.crash,.st.timeout,.st.xpass{color:#b00;font-weight:bold}
section.cases{border:1px solid #999;padding:.5em 1em;margin:1em 0;background:#fcfcfc}
code{font-size:12px;white-space:pre-wrap} svg{max-width:100%;height:auto} .dim{color:#777}
"""
# Opens the cases panel the address names (a matrix link sets it), closes the others: no other state.
SCRIPT = """
function showPanel() {
  var id = decodeURIComponent(location.hash.slice(1));
  document.querySelectorAll("section.cases").forEach(function (s) { s.hidden = s.id !== id; });
}
window.addEventListener("hashchange", showPanel);
showPanel();
"""
# Nothing from the network, and no script but SCRIPT (by its hash): were a stored string ever to slip through
# escaping, the browser would refuse to run it. Style attributes stay allowed: matplotlib's SVG uses them.
CSP = ("default-src 'none'; img-src data:; style-src 'unsafe-inline'; "
       f"script-src 'sha256-{base64.b64encode(hashlib.sha256(SCRIPT.encode()).digest()).decode()}'")
MAX_CASES = 2000  # per cell: a full-tier cell can hold thousands, and the page must still open


def add_arguments(p):
    p.add_argument("store", metavar="DB", help="a results store written by `--store DB`")
    p.add_argument("--html", required=True, metavar="DIR", help="write DIR/index.html (DIR is created if missing)")
    p.add_argument("--run", action="append", type=int, default=[], metavar="ID",
                   help="the conformance and/or bench run to show (repeatable; default: the latest of each kind)")


def run(args) -> int:
    if os.path.exists(args.html) and not os.path.isdir(args.html):
        raise StoreError(f"--html {args.html!r}: is a file, not a directory")
    try:
        import matplotlib  # noqa: F401 (the plots; checked before any work)
    except ImportError as e:
        raise ValueError(f"--html: the page's plots need matplotlib ({e}): pip install 'opport[bench]'") from e
    with Store(args.store) as store:
        page = render(store, args.run)
    os.makedirs(args.html, exist_ok=True)
    path = os.path.join(args.html, "index.html")
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    print(f"report written to {path}")
    return 0


def render(store: Store, chosen: list) -> str:
    runs = store.runs()
    shown = {r["kind"]: r for r in runs}  # the latest of each kind ...
    for run_id in chosen:  # ... unless --run names one
        r = store.run(run_id)
        shown[r["kind"]] = r
    body = [f"<h1>opport results: {escape(store.path)}</h1>", _runs_table(store, runs)]
    body += _matrix(store, shown["conformance"]) if "conformance" in shown else ["<p>No conformance run stored.</p>"]
    body += _rooflines(store, shown["bench"]) if "bench" in shown else ["<p>No bench run stored.</p>"]
    body += _trend(store, runs)
    return ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta http-equiv=\"Content-Security-Policy\" content=\"{CSP}\">"
            f"<title>opport results: {escape(store.path)}</title><style>{CSS}</style></head>\n<body>\n"
            + "\n".join(body) + f"\n<script>{SCRIPT}</script>\n</body></html>\n")


def _run_title(r: dict) -> str:
    return (f"run {r['id']} ({escape(r['created'])}, commit {escape((r['git_commit'] or 'none')[:12])}, "
            f"hosts {escape(', '.join(r['hosts']))})")


def _runs_table(store: Store, runs: list) -> str:
    counts = store.counts()
    out = ['<h2>Runs</h2><table class="runs"><thead><tr><th>id</th><th>created (UTC)</th><th>kind</th><th>commit</th>'
           "<th>hosts</th><th>counts</th><th>command</th></tr></thead><tbody>"]
    for r in runs:
        c = counts.get(r["id"], {})
        out.append(f"<tr><td>{r['id']}</td><td>{escape(r['created'])}</td><td>{escape(r['kind'])}</td>"
                   f"<td>{escape((r['git_commit'] or '-')[:12])}</td><td>{escape(', '.join(r['hosts']))}</td>"
                   f"<td>{_counts_html(c)}</td><td><code>{escape(' '.join(r['argv']))}</code></td></tr>")
    return "\n".join(out) + "</tbody></table>"


def _counts_html(counts: dict) -> str:
    order = [s for s in STATUSES if s in counts] + sorted(s for s in counts if s not in STATUSES)
    return " ".join(f'<span class="st {escape(s)}">{escape(s)} {counts[s]}</span>' for s in order)


# --------------------------------------------------------------------------- the matrix


def _matrix(store: Store, run: dict) -> list[str]:
    """op rows x (backend, host) columns; each cell the stored counts, linking to its cases."""
    counts = defaultdict(dict)
    for r in store.case_counts(run["id"]):
        counts[(r["op"], r["backend"], r["host"])][r["status"]] = r["n"]
    cases = defaultdict(list)
    for c in store.cases(run["id"]):
        cases[(c["op"], c["backend"], c["host"])].append(c)
    cols = sorted({(b, h) for _, b, h in counts})
    ops = sorted({op for op, _, _ in counts})
    out = [f"<h2>Conformance: {_run_title(run)}</h2>",
           "<p class=\"dim\">Each cell: the cases of one op on one backend and host, by status. Click a cell for its "
           "cases and repro lines.</p>",
           "<table class=\"matrix\"><thead><tr><th>op</th>"
           + "".join(f"<th>{escape(b)}<br><span class=\"dim\">{escape(h)}</span></th>" for b, h in cols)
           + "</tr></thead><tbody>"]
    panels, ids = [], {}
    for op in ops:
        row = [f"<tr><th>{escape(op)}</th>"]
        for b, h in cols:
            c = counts.get((op, b, h))
            if not c:
                row.append('<td class="cell none">-</td>')
                continue
            pid = ids.setdefault((op, b, h), f"cases-{len(ids) + 1}")
            bad = any(s in FAILING for s in c)
            row.append(f'<td class="cell {"bad" if bad else "ok"}" data-op="{escape(op)}" data-backend="{escape(b)}" '
                       f'data-host="{escape(h)}"><a href="#{pid}">{_counts_html(c)}</a></td>')
            panels.append(_panel(pid, op, b, h, cases[(op, b, h)]))
        out.append("".join(row) + "</tr>")
    return out + ["</tbody></table>"] + panels


def _panel(pid: str, op: str, backend: str, host: str, cases: list) -> str:
    """One cell's cases, failing first, each with its message's first line and repro command."""
    cases = sorted(cases, key=lambda c: (c["status"] not in FAILING, c["status"] != "pass", c["id"]))
    rows = []
    for c in cases[:MAX_CASES]:
        msg = (c.get("message") or "").splitlines()[0] if c.get("message") else ""
        rows.append(f'<tr><td><span class="st {escape(c["status"])}">{escape(c["status"])}</span></td>'
                    f"<td>{escape(c['id'])}</td><td>{escape(c.get('direction') or '')}</td>"
                    f"<td>{escape(c.get('kernel') or '')}</td><td>{_metric(c)}</td><td>{escape(msg)}</td>"
                    f"<td><code>{escape(c.get('repro') or '')}</code></td></tr>")
    more = f"<p>{len(cases) - MAX_CASES} more cases not listed.</p>" if len(cases) > MAX_CASES else ""
    return (f'<section class="cases" id="{pid}" hidden><h3>{escape(op)} on {escape(backend)}, host {escape(host)}: '
            f"{len(cases)} cases</h3><table><thead><tr><th>status</th><th>case</th><th>direction</th><th>kernel</th>"
            "<th>tol_ratio</th><th>message</th><th>repro</th></tr></thead><tbody>" + "\n".join(rows)
            + f"</tbody></table>{more}</section>")


def _metric(c: dict) -> str:
    v = (c.get("metrics") or {}).get("tol_ratio")
    return f"{v:.3g}" if isinstance(v, (int, float)) else ""


# --------------------------------------------------------------------------- bench: roofline per host


def _rooflines(store: Store, run: dict) -> list[str]:
    from opport.bench.plot import write_roofline

    rows, hosts = store.bench_rows(run["id"]), store.hosts(run["id"])
    out = [f"<h2>Bench: {_run_title(run)}</h2>"]
    for host in hosts:
        mine = [r for r in rows if r["host"] == host]
        timed = [r for r in mine if r.get("ms") and r.get("ceilings")]
        device = (hosts[host].get("device") or {}).get("name", "")
        out.append(f"<h3>host {escape(host)} <span class=\"dim\">{escape(device)}</span></h3>")
        if timed:
            svg = io.StringIO()
            write_roofline({"rows": timed, "ceilings": timed[0]["ceilings"]}, svg, fmt="svg")
            out.append(_inline_svg(svg.getvalue()))
        else:
            out.append("<p>No timed rows on this host (an emulated backend reports counts, not time).</p>")
        out.append(_bench_table([r for r in mine if r["impl"] == "opport"]))
    return out


def _bench_table(rows: list) -> str:
    out = ["<table><thead><tr><th>op</th><th>shape</th><th>dtype</th><th>pass</th><th>backend</th><th>verdict</th>"
           "<th>ms [p20-p80]</th><th>GB/s</th><th>roof %</th><th>speed ratios</th></tr></thead><tbody>"]
    for r in rows:
        ms = f"{r['ms']:.4g} [{r.get('p20_ms', r['ms']):.3g}-{r.get('p80_ms', r['ms']):.3g}]" if r.get("ms") else ""
        vs = ", ".join(f"{escape(k)} {v:.2f}x" for k, v in (r.get("vs") or {}).items() if isinstance(v, (int, float)))
        out.append(f"<tr><td>{escape(r['op'])}</td><td>{escape(str(r.get('shape', '')))}</td><td>{escape(r['dtype'])}</td>"
                   f"<td>{escape(r.get('pass', 'fwd'))}</td><td>{escape(r['backend'])}</td>"
                   f'<td><span class="st {escape(r["verdict"])}">{escape(r["verdict"])}</span></td><td>{ms}</td>'
                   f"<td>{_num(r.get('GBps'))}</td><td>{_num(r.get('roofline_pct'))}</td><td>{vs}</td></tr>")
    return "\n".join(out) + "</tbody></table>"


def _num(v) -> str:
    return f"{v:.3g}" if isinstance(v, (int, float)) else ""


def _inline_svg(svg: str) -> str:
    """matplotlib's SVG document as an element of the page (its XML declaration and doctype dropped)."""
    return svg[svg.index("<svg"):]


# --------------------------------------------------------------------------- trend per op across runs


def _trend(store: Store, runs: list) -> list[str]:
    """Per op and run: the share of conformance cases passing, and the geomean of opport's bench speed ratios."""
    from opport.bench.report import geomean

    passing = defaultdict(lambda: defaultdict(lambda: [0, 0]))  # op -> run -> [passed, judged]
    for r in store.case_counts():
        if r["status"] not in ("skip", "xfail"):
            cell = passing[r["op"]][r["run_id"]]
            cell[0] += r["n"] if r["status"] == "pass" else 0
            cell[1] += r["n"]
    ratios = defaultdict(lambda: defaultdict(list))  # op -> run -> ratios against every baseline
    for r in store.speed_ratios():
        ratios[r["op"]][r["run_id"]] += [v for v in r["vs"].values() if isinstance(v, (int, float))]
    share = {op: {run: p / n for run, (p, n) in by.items() if n} for op, by in passing.items()}
    speed = {op: {run: g for run, xs in by.items() if (g := geomean(xs))} for op, by in ratios.items()}
    if not any(share.values()) and not any(speed.values()):
        return ["<h2>Trend per op</h2><p>Nothing to plot yet.</p>"]
    return ["<h2>Trend per op across runs</h2>", _inline_svg(_trend_svg(share, speed, [r["id"] for r in runs]))]


def _trend_svg(share: dict, speed: dict, run_ids: list) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_c, ax_b) = plt.subplots(1, 2, figsize=(14, 5.5))
    ax_c.set_ylim(0, 1.05)  # a share: a small dip must not look like a collapse
    for ax, series, ylabel in ((ax_c, share, "conformance: share of cases passing"),
                               (ax_b, speed, "bench: geomean speed ratio vs same-run baselines")):
        for op, by in sorted(series.items()):
            xs = [x for x in run_ids if x in by]
            if xs:
                ax.plot(xs, [by[x] for x in xs], marker="o", label=op)
        ax.set_xlabel("run id")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8, ncol=2)
        else:
            ax.text(0.5, 0.5, "no runs of this kind", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    out = io.StringIO()
    fig.savefig(out, format="svg", metadata={"Date": None})
    plt.close(fig)
    return out.getvalue()
