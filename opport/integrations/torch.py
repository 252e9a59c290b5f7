"""Every opport op as a torch.library custom op, `torch.ops.opport.<name>`, so torch.compile can trace it.

The schema comes from the op's declaration: array parameters are `Tensor` (`Tensor?` when they
default to None), scalars are typed from their annotation or, failing that, their default value, and a
keyword-only `str? backend=None` is appended (opport's `backend=`). The output is one `Tensor`.

- The real kernel (every device type) is opport's dispatcher, so CPU tensors run on the cpu backend,
  CUDA tensors on cuda, with `use_backend`, `OPPORT_BACKEND` and strict mode read when it runs.
- The fake kernel validates the metadata exactly as an eager call does (typed opport errors at trace
  time) and returns an empty tensor of the declared output shape and dtype on the input's device.

Importing this module registers the ops; `opport.<op>(...)` on torch tensors imports it by itself the
first time torch.compile traces such a call. Eager calls do not use the custom op: they go straight to
the dispatcher, which is cheaper. The ops have no autograd formula: they are for inference (wrap
training code in torch.no_grad(), or keep opport out of the differentiated path).
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

from opport import errors
from opport.dispatch import call
from opport.dispatch.adapters import NumpyAdapter, metas_of
from opport.integrations import small_cases
from opport.ops import all_ops

NAMESPACE = "opport"

_SCALAR_TYPES = {"bool": "bool", "int": "int", "float": "float", "str": "str"}

OPS: dict[str, torch._ops.OpOverload] = {}  # op name -> torch.ops.opport.<name>.default
NOT_REGISTERED: dict[str, str] = {}  # op name -> why it has no custom op


def schema(spec) -> str:
    """The torch schema of `spec`, e.g. `(Tensor x, Tensor? weight=None, float eps=1e-06, *, str? backend=None) -> Tensor`."""
    params = []
    for name, p in spec.signature.parameters.items():
        if name in spec.arrays:
            kind = "Tensor?" if p.default is None else "Tensor"
        else:
            kind = _scalar_type(spec, p)
        default = "" if p.default is p.empty else f"={_literal(p.default)}"
        params.append(f"{kind} {name}{default}")
    return f"({', '.join(params)}, *, str? backend=None) -> Tensor"


def _scalar_type(spec, p: inspect.Parameter) -> str:
    """A scalar parameter's schema type, from its annotation or else its default value."""
    if p.annotation is not p.empty:
        return _annotation_type(spec, p)
    kind = _SCALAR_TYPES.get(type(p.default).__name__)
    if kind is None:
        raise TypeError(f"opport.{spec.name}: cannot type scalar parameter {p.name!r} for torch (default "
                        f"{p.default!r}); annotate it in opport/ops/{spec.name}.py, e.g. `{p.name}: float | None = None`")
    return kind


def _annotation_type(spec, p: inspect.Parameter) -> str:
    ann = p.annotation if isinstance(p.annotation, str) else getattr(p.annotation, "__name__", str(p.annotation))
    ann = ann.replace(" ", "")
    optional = ann.startswith("Optional[") or "|None" in ann or "None|" in ann
    base = ann.removeprefix("Optional[").removesuffix("]").replace("|None", "").replace("None|", "")
    if base not in _SCALAR_TYPES:
        raise TypeError(f"opport.{spec.name}: annotation {p.annotation!r} of {p.name!r} is not one of "
                        f"bool, int, float, str (optionally `| None`)")
    return _SCALAR_TYPES[base] + ("?" if optional or p.default is None else "")


def _literal(value) -> str:
    if value is None:
        return "None"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


_LIB = torch.library.Library(NAMESPACE, "DEF")  # owns the definitions: kept for the process's life


def register(spec):
    """Define `torch.ops.opport.<spec.name>` with its real and fake kernels; returns its OpOverload.

    The real kernel is registered low-level, as CompositeExplicitAutograd (one kernel for every device):
    `torch.library.custom_op` would add a Python autograd layer and a dynamo-disable wrapper that cost
    tens of microseconds per call, and opport ops have no autograd formula to put there.
    """
    _LIB.define(f"{spec.name}{schema(spec)}")
    _LIB.impl(spec.name, _real_kernel(spec), "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{spec.name}", _fake_kernel(spec), lib=_LIB)
    return getattr(getattr(torch.ops, NAMESPACE), spec.name).default


def _real_kernel(spec):
    def kernel(*args, backend=None, **kwargs):  # torch passes the arguments as its caller gave them
        return call(spec, spec.bind(*args, **kwargs), backend)

    kernel.__name__ = spec.name
    return kernel


def _fake_kernel(spec):
    def fake(*args, backend=None, **kwargs):
        bound = spec.bind(*args, **kwargs)
        metas = metas_of(spec, bound)
        _check_one_device(spec, metas)
        spec.validate(*metas)
        like = bound[spec.array_pos[0]]
        return like.new_empty(spec.out_shape(metas), dtype=getattr(torch, spec.out_dtype(metas)))

    return fake


def _check_one_device(spec, metas):
    """Inputs on several devices fail at trace time with the DeviceError an eager call raises."""
    arrays = [(spec.params[i], metas[i]) for i in spec.array_pos if metas[i] is not None]
    devices = sorted({m.device for _, m in arrays})
    if len(devices) > 1:
        raise errors.DeviceError(op=spec.name, arg=arrays[-1][0], constraint=f"{spec.name}.device",
                                 expected="all arrays on one device", got=", ".join(devices))


def compiled_call(spec, bound: tuple, backend: str | None):
    """`opport.<op>(...)` while torch.compile traces: the custom op, which the graph keeps as one node."""
    op = OPS.get(spec.name)
    if op is None:
        raise errors.UnsupportedError(
            op=spec.name, arg=None, constraint=f"{spec.name}.torch_custom_op", expected="a torch custom op",
            got=NOT_REGISTERED.get(spec.name, "not registered"),
            message=f"{spec.name}: no torch.ops.opport.{spec.name}: {NOT_REGISTERED.get(spec.name, 'not registered')}")
    args = list(bound)
    for i in spec.array_pos:  # as in eager calls, gradients do not flow through opport ops
        if args[i] is not None:
            args[i] = args[i].detach()
    return op(*args, backend=backend)


def _register_all():
    for name, spec in all_ops().items():
        if name in OPS:
            continue
        try:
            OPS[name] = register(spec)
        except (TypeError, RuntimeError, ValueError) as e:  # one undeclarable op must not hide the others
            NOT_REGISTERED[name] = f"{type(e).__name__}: {e}"


def to_torch(case) -> tuple:
    """A conformance case's arguments with its NumPy arrays as CPU tensors (bfloat16 bit-exact)."""
    return tuple(NumpyAdapter.to_torch(a, "cpu") if isinstance(a, np.ndarray) else a for a in case.args)


def opcheck(spec, dtypes=("float32", "bfloat16")) -> dict:
    """`torch.library.opcheck` of `torch.ops.opport.<spec.name>` on a few of the op's small cases.

    Returns {case id: {test name: "SUCCESS" or the failure}}; every value is "SUCCESS" when the
    registration (schema, fake kernel, dynamic shapes under AOT) agrees with the real kernel.
    """
    op = OPS[spec.name]
    results = {}
    for dtype in dtypes:
        for case in small_cases(spec, dtype):
            found = torch.library.opcheck(op, to_torch(case), case.kwargs, raise_exception=False)
            results[f"{spec.name}/{dtype}/{case.name}"] = {k: v if v == "SUCCESS" else repr(v) for k, v in found.items()}
    return results


_register_all()
