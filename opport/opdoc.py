"""Generate the op reference (docs/ops.md) from the op declarations.

    python -m opport.opdoc > docs/ops.md      # a test checks the committed file is current
"""

from __future__ import annotations

import inspect

from opport.ops import all_ops


def render() -> str:
    out = ["# Op reference", "",
           "Generated from the declarations in `opport/ops/` by `python -m opport.opdoc > docs/ops.md`; do not edit.", ""]
    for name, spec in all_ops().items():
        out += [f"## {name}", "", f"`{name}{spec.signature}`", ""]
        out += [inspect.cleandoc(spec.__doc__ or ""), ""]
        arrays = ", ".join(f"`{a}`" for a in spec.arrays)
        out += [f"Array arguments: {arrays}. Dtypes: {', '.join(spec.dtypes)}."
                + (f" Output dtype: always {spec.fixed_out_dtype}." if spec.fixed_out_dtype else ""), ""]
        out += ["| constraint | rule |", "|---|---|"]
        out += [f"| `{cid}` | {rule} |" for cid, rule in spec.constraints.items()]
        out += ["", "| dtype | metric | rtol | atol | ulp | why |", "|---|---|---|---|---|---|"]
        for dtype, t in spec.tolerances.items():
            ulp = "" if t.ulp is None else f"{t.ulp:g}"
            out.append(f"| {dtype} | {t.metric} | {t.rtol:g} | {t.atol:g} | {ulp} | {t.reason} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(), end="")
