"""Every declared constraint has a bad input that raises its typed error before any kernel runs."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

import opport
from opport.dispatch import impl, remove_kernel
from opport.errors import DeviceError, DTypeError, OpError
from opport.ops import all_ops
from opport.public import function

# forward ops and their backwards (a training forward validates exactly as its forward does)
OPS = {**all_ops(), **{s.backward_op.name: s.backward_op for s in all_ops().values() if s.backward_op is not None}}
GENERIC = ("array_type", "device", "backend", "supported")


def _error_params():
    for name, spec in OPS.items():
        for i, case in enumerate(spec.get_error_cases()):
            yield pytest.param(spec, case, id=f"{name}-{case.constraint}-{i}")


def _digest(args, kwargs):
    h = hashlib.sha256()
    for a in (*args, *kwargs.values()):
        if isinstance(a, np.ndarray):
            h.update(a.tobytes())
            h.update(repr((a.dtype, a.shape, a.strides)).encode())
    return h.hexdigest()


@pytest.fixture
def spy_kernels():
    """A top-priority cpu kernel on every op that records whether it was ever called."""
    calls = []
    for spec in OPS.values():
        impl(spec, "cpu", priority=1000, name="cpu.spy")(lambda *a, _n=spec.name: calls.append(_n))
    yield calls
    for spec in OPS.values():
        remove_kernel(spec, "cpu", "cpu.spy")


@pytest.mark.parametrize("spec,case", list(_error_params()))
def test_error_case_raises_typed_error_before_any_kernel(spec, case, spy_kernels):
    before = _digest(case.args, case.kwargs)
    with pytest.raises(case.error) as info:
        function(spec)(*case.args, **case.kwargs)
    err = info.value
    assert isinstance(err, OpError)
    assert err.constraint == case.constraint, str(err)
    assert err.op == spec.name
    assert case.constraint in spec.constraints, f"{case.constraint} is not declared by {spec.name}"
    assert spec.name in str(err) and case.constraint in str(err)
    assert err.expected is not None and err.got is not None
    assert spy_kernels == [], "a kernel ran on bad input"
    assert _digest(case.args, case.kwargs) == before, "bad input was mutated"


@pytest.mark.parametrize("name", OPS)
def test_every_declared_constraint_has_an_error_case(name):
    spec = OPS[name]
    covered = {c.constraint for c in spec.get_error_cases()}
    missing = {c for c in spec.constraints if c.rsplit(".", 1)[1] not in GENERIC} - covered
    assert not missing, f"{name}: constraints without an error case: {sorted(missing)}"


def _valid_args(spec):
    case = next(iter(spec.get_cases("float32")))
    return list(case.args), dict(case.kwargs)


@pytest.mark.parametrize("name", OPS)
def test_non_array_argument_is_a_dtype_error(name):
    spec = OPS[name]
    args, kwargs = _valid_args(spec)
    args[0] = args[0].tolist()
    with pytest.raises(DTypeError) as info:
        function(spec)(*args, **kwargs)
    assert info.value.constraint == f"{name}.array_type"


@pytest.mark.parametrize("name", OPS)
def test_arrays_on_an_unusable_or_mixed_device_are_device_errors(name):
    torch = pytest.importorskip("torch")
    spec = OPS[name]
    args, kwargs = _valid_args(spec)
    meta = torch.empty(args[0].shape, dtype=torch.float32, device="meta")
    with pytest.raises(DeviceError) as info:  # a device no backend can use
        function(spec)(meta, *args[1:], **kwargs)
    assert info.value.constraint == f"{name}.device"
    arrays = [i for i, a in enumerate(args) if isinstance(a, np.ndarray)]
    if len(arrays) > 1:  # numpy on cpu next to a tensor on another device
        j = arrays[1]
        mixed = list(args)
        mixed[j] = torch.empty(args[j].shape, device="meta")
        with pytest.raises(DeviceError):
            function(spec)(*mixed, **kwargs)


def test_errors_are_also_builtins():
    assert issubclass(opport.ShapeError, ValueError)
    assert issubclass(opport.DTypeError, TypeError)
    assert issubclass(opport.ArgumentError, ValueError)
    assert issubclass(opport.DeviceError, ValueError)
    assert issubclass(opport.UnsupportedError, NotImplementedError)
    assert issubclass(opport.BackendUnavailableError, RuntimeError)


def test_missing_required_argument_is_a_type_error():
    with pytest.raises(TypeError):
        opport.rmsnorm()
