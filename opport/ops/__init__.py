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
_builtin: dict[str, OpSpec] | None = None


def _load(paths) -> dict[str, OpSpec]:
    found = {}
    for path in paths:
        mod = importlib.import_module(path)
        spec = getattr(mod, path.rsplit(".", 1)[-1], None)
        if isinstance(spec, OpSpec):
            found[spec.name] = spec
    return found


def builtin_ops() -> dict[str, OpSpec]:
    """The ops declared in this package, in alphabetical order."""
    global _builtin
    if _builtin is None:
        _builtin = dict(sorted(_load(f"{__name__}.{m.name}" for m in pkgutil.iter_modules(__path__)).items()))
    return _builtin


def all_ops() -> dict[str, OpSpec]:
    """Every declared op by name (this package's and the `opport.ops` entry points'), in alphabetical order."""
    global _ops
    if _ops is None:
        extra = _load(ep.value for ep in entry_points(group="opport.ops"))
        _ops = dict(sorted({**extra, **builtin_ops()}.items()))
    return _ops


def get_op(name: str) -> OpSpec:
    """The op named `name`, or one of its derived ops (`<op>_backward`, `<op>_forward`, `<op>_value_and_grad`)."""
    ops = all_ops()
    if name in ops:
        return ops[name]
    derived = {d.name: d for spec in ops.values() for d in spec.derived}
    if name not in derived:
        raise ArgumentError(op="opport", arg="op", constraint="op.name", expected=f"one of {tuple(ops)}", got=repr(name))
    return derived[name]


def with_derived(specs) -> list:
    """Each op followed by its training forward, backward and fused value-and-grad, where it declares them."""
    return [d for spec in specs for d in spec.family()]
