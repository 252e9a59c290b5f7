"""The files generated from the op declarations: the op reference (docs/ops.md), the op table of
docs/design.md section 1 and the public op functions (opport/_ops.py). After adding or changing an op,
regenerate them:

    python -m opport.opdoc          # writes docs/ops.md, docs/design.md's table, opport/_ops.py; a test checks
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

from opport.ops import builtin_ops

ROOT = Path(__file__).resolve().parent.parent
GENERATED = {"docs/ops.md": lambda: render(), "docs/design.md": lambda: _design(), "opport/_ops.py": lambda: _public_functions()}
TABLE = ("<!-- the op table: generated from the declarations by `python -m opport.opdoc` (a test checks it is current) -->\n",
         "<!-- end of the op table -->\n")


def render() -> str:
    out = ["# Op reference", "",
           "Generated from the declarations in `opport/ops/` by `python -m opport.opdoc`; do not edit.", ""]
    for name, spec in builtin_ops().items():
        out += [f"## {name}", "", f"`{name}{spec.signature}`", ""]
        out += [inspect.cleandoc(spec.__doc__ or ""), ""]
        arrays = ", ".join(f"`{a}`" for a in spec.arrays)
        out += [f"Array arguments: {arrays}. Dtypes: {', '.join(spec.dtypes)}."
                + (f" Output dtype: always {spec.fixed_out_dtype}." if spec.fixed_out_dtype else "")
                + (f" Outputs, returned as a tuple: {', '.join(f'`{o}`' for o in spec.output_names)}." if spec.n_outputs > 1
                   else ""), ""]
        out += _constraints(spec) + _tolerances(spec) + _backward(spec)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out))  # one blank line between blocks


def _design() -> str:
    """docs/design.md with its op table (section 1) made from the declarations."""
    text = (ROOT / "docs/design.md").read_text()
    start, end = text.index(TABLE[0]) + len(TABLE[0]), text.index(TABLE[1])
    return text[:start] + op_table() + text[end:]


def op_table() -> str:
    """One row per op: its signature, the first paragraph of its docstring, what its arrays take, its gradients."""
    rows = ["| op | signature | semantics ([ops.md](ops.md) has the rest) | array dtypes | gradients |",
            "|---|---|---|---|---|"]
    for name, spec in builtin_ops().items():
        summary = inspect.cleandoc(spec.__doc__ or "").split("\n\n")[0].replace("\n", " ").replace("|", "\\|")
        odd = [f"{a}: {', '.join(spec.domains[a].dtypes)}" for a in spec.arrays if a in spec.domains]
        dtypes = "; ".join([f"{', '.join(spec.dtypes)}" + (" (the others)" if odd else "")] + odd)
        grads = ", ".join(f"d{w}" for w in spec.backward_op.wrt) if spec.backward_op else "none"
        rows.append(f"| {name} | `{name}{_plain(spec.signature)}` | {summary} | {dtypes} | {grads} |")
    return "\n".join(rows) + "\n"


def _plain(sig: inspect.Signature) -> str:
    """The signature without annotations, as a user calls it."""
    return "(" + ", ".join(p.name if p.default is p.empty else f"{p.name}={p.default!r}" for p in sig.parameters.values()) + ")"


def _constraints(spec) -> list:
    return ["| constraint | rule |", "|---|---|", *(f"| `{cid}` | {rule} |" for cid, rule in spec.constraints.items()), ""]


def _tolerances(spec) -> list:
    """Per dtype; per output and dtype for an op with several outputs."""
    lead = ["output"] if spec.n_outputs > 1 else []
    cols = [*lead, "dtype", "metric", "rtol", "atol", "ulp", "why"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for i, output in enumerate(spec.output_names):
        for dtype in spec.tolerances:
            t = spec.tolerance_for(dtype, i)
            ulp = "" if t.ulp is None else f"{t.ulp:g}"
            row = [output] if lead else []
            row += [dtype, t.metric, f"{t.rtol:g}", f"{t.atol:g}", ulp, t.reason]
            out.append("| " + " | ".join(row) + " |")
    return out + [""]


def _backward(spec) -> list:
    bwd = spec.backward_op
    if bwd is None:
        return ["Not differentiable.", ""]
    saved = [p for p in bwd.params[len(bwd.grads):] if p in bwd.arrays]
    out = [f"### {bwd.name}", "", f"`{bwd.name}{bwd.signature}`", "",
           f"Differentiable inputs: {', '.join(f'`{n}`' for n in bwd.wrt)}."
           + (f" Summed over rows (judged norm-wise): {', '.join(f'`{n}`' for n in bwd.reduces)}." if bwd.reduces else ""),
           f"Saved for the backward: {', '.join(f'`{n}`' for n in saved)}.", ""]
    for name, why in bwd.constants.items():
        out.append(f"No gradient for `{name}`: {why}.")
    if spec.train_forward is not None:
        stats = ", ".join(f"`{n}`" for n in spec.train_forward.stats)
        out.append(f"Training forward `{spec.train_forward.name}` returns the output and {stats} (float32).")
    out += ["", inspect.cleandoc(bwd.__doc__ or ""), ""]
    out += _constraints(bwd)
    return out + _value_and_grad(spec)


def _value_and_grad(spec) -> list:
    vag = spec.value_and_grad_op
    if vag is None:
        return []
    grads = ", ".join(f"`d{n}`" for n in vag.wrt)
    return [f"### {vag.name}", "", f"`{vag.name}{vag.signature}`", "",
            f"Returns the output and {grads} for a unit upstream gradient; its output is judged as `{spec.name}`'s, "
            f"its gradients as `{spec.backward_op.name}`'s.", "", inspect.cleandoc(vag.__doc__ or ""), ""]


def _public_functions() -> str:
    from opport.public import module_source

    return module_source(builtin_ops().values())


def stale() -> list:
    """The generated files that differ from what the declarations give now."""
    return [path for path, make in GENERATED.items() if (ROOT / path).read_text() != make()]


def main(argv=None) -> int:
    for path, make in GENERATED.items():
        text = make()
        if (ROOT / path).read_text() != text:
            (ROOT / path).write_text(text)
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
