"""`--plot F`: a roofline chart of every timed row and per-op speedup bars (matplotlib, Agg, PNG), one row of
the two per pass (fwd, fwd+bwd, bwd), so forward and training ratios are never drawn together."""

from __future__ import annotations

import math


def write_plot(report: dict, path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    passes = list(report["summary"]) or ["fwd"]
    fig, axes = plt.subplots(len(passes), 2, figsize=(15, 7.5 * len(passes)), squeeze=False,
                             gridspec_kw={"width_ratios": [1.15, 1]})
    for (ax_roof, ax_bar), p in zip(axes, passes):
        _roofline(ax_roof, report, p)
        _speedups(ax_bar, report["summary"].get(p, {}).get("per_op", {}), p)
    dev = report["device"]["name"]
    fig.suptitle(f"opport bench --backend {report['backend']} ({report['mode']}) on {dev}, tier {report['tier']}",
                 fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_figheight()))  # room for the title above the first row
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _roofline(ax, report: dict, pass_: str):
    """x: arithmetic intensity (FLOP per model byte); y: achieved TFLOP/s; the roof from this run's ceilings."""
    import matplotlib.pyplot as plt

    from opport.bench.report import pass_of

    rows = [r for r in report["rows"] if r.get("ms") and r.get("flops") and r.get("bytes") and pass_of(r) == pass_]
    c = report["ceilings"]
    bw, peak = c["copy_GBps"], c["matmul_TFLOPs"]  # GB/s, TFLOP/s of the run's main dtype
    ops = sorted({r["op"] for r in rows})
    colors = dict(zip(ops, plt.get_cmap("tab10" if len(ops) <= 10 else "tab20").colors * 2))
    markers = {"opport": "o", "torch_eager": "s", "torch_compile": "^", "numpy": "D"}
    xs = [r["flops"] / r["bytes"] for r in rows] or [1.0]
    lo, hi = min(xs + [peak * 1e3 / bw]) / 4, max(xs + [peak * 1e3 / bw]) * 4
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(grid, [min(peak, x * bw / 1e3) for x in grid], color="black", lw=2,
            label=f"roof: {bw:.0f} GB/s copy, {peak:.3g} TFLOP/s matmul")
    for r in rows:
        mine = r["impl"] == "opport"
        ax.scatter(r["flops"] / r["bytes"], r["TFLOPs"], s=60 if mine else 28, marker=markers.get(r["impl"], "x"),
                   facecolors=colors[r["op"]] if mine else "none", edgecolors=colors[r["op"]], alpha=0.9, zorder=3)
    for op in ops:
        ax.scatter([], [], marker="o", color=colors[op], label=op)
    for impl, m in markers.items():
        if any(r["impl"] == impl for r in rows):
            ax.scatter([], [], marker=m, facecolors="black" if impl == "opport" else "none", edgecolors="black",
                       label=impl + (" (filled)" if impl == "opport" else ""))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / model byte)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(f"{pass_}: roofline (each point: one op, shape and provider)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=5, frameon=False)  # off the data


def _speedups(ax, per_op: dict, pass_: str):
    """Geometric-mean speedup of opport per op against each baseline (> 1: opport faster)."""
    ops = list(per_op)
    names = sorted({k for v in per_op.values() for k in v if k.startswith("vs_")})
    if not ops or not names:
        ax.text(0.5, 0.5, "no baseline ratios in this run", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        vals = [(per_op[op].get(name) or {}).get("geomean") for op in ops]
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(ops))]
        bars = ax.bar(xs, [v or 0 for v in vals], width, label="vs " + name.removeprefix("vs_"))
        for b, v in zip(bars, vals):
            if v:
                ax.annotate(f"{v:.2f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="black", lw=1, ls="--")
    ax.set_xticks(range(len(ops)))
    ax.set_xticklabels(ops, rotation=30, ha="right")
    ax.set_yscale("log")
    top = max([(per_op[op].get(n) or {}).get("geomean") or 1 for op in ops for n in names] + [1.0])
    bottom = min([(per_op[op].get(n) or {}).get("geomean") or 1 for op in ops for n in names] + [1.0])
    ax.set_ylim(bottom / 1.6, top * 1.6)
    ax.yaxis.set_major_formatter(matplotlib_formatter())
    ax.set_ylabel("baseline time / opport time (geomean over shapes)")
    ax.set_title(f"{pass_}: opport speedup per op (> 1: opport faster)")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", which="both", alpha=0.3)


def matplotlib_formatter():
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _: f"{v:g}x" if v >= 0.01 and math.isfinite(v) else "")


def write_roofline(report: dict, out, fmt: str = "png"):
    """The roofline chart alone, one per pass of `report`'s rows, to a path or file (`opport report` draws one
    host's rows against that host's ceilings this way)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from opport.bench.report import pass_of

    passes = list(dict.fromkeys(pass_of(r) for r in report["rows"] if r.get("ms"))) or ["fwd"]
    fig, axes = plt.subplots(1, len(passes), figsize=(7.5 * len(passes), 6.5), squeeze=False)
    for ax, p in zip(axes[0], passes):
        _roofline(ax, report, p)
    fig.tight_layout()
    fig.savefig(out, format=fmt, metadata={"Date": None} if fmt == "svg" else None)
    plt.close(fig)
