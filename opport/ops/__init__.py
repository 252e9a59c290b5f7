"""The op declarations: one module per op, found by scanning this package (no central list).

Third-party packages can add ops through the `opport.ops` entry-point group (value: a module
that defines an `OpSpec` named like the module).
"""

from __future__ import annotations

import importlib
import pkgutil
from importlib.metadata import entry_points

from opport.errors import ArgumentError
from opport.spec import OpSpec

_ops: dict[str, OpSpec] | None = None


def all_ops() -> dict[str, OpSpec]:
    """Every declared op by name, in alphabetical order."""
    global _ops
    if _ops is None:
        found = {}
        modules = [f"{__name__}.{m.name}" for m in pkgutil.iter_modules(__path__)]
        modules += [ep.value for ep in entry_points(group="opport.ops")]
        for path in modules:
            mod = importlib.import_module(path)
            spec = getattr(mod, path.rsplit(".", 1)[-1], None)
            if isinstance(spec, OpSpec):
                found[spec.name] = spec
        _ops = dict(sorted(found.items()))
    return _ops


def get_op(name: str) -> OpSpec:
    ops = all_ops()
    if name not in ops:
        raise ArgumentError(op="opport", arg="op", constraint="op.name", expected=f"one of {tuple(ops)}", got=repr(name))
    return ops[name]
