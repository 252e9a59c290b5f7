"""Shared checks for the op tests: the cpu kernel on an op's cases, judged by the conformance comparator.

`assert_matches` applies the same rules as `opport conformance` (dtype and shape first, NaN and signed
inf positions exact, then the case's tolerance metric), plus, optionally, signed zeros where the
reference defines them. `check_case` adds unmutated inputs, the public call path and the invariants.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from opport.accuracy import compare, contract
from opport.dispatch import kernel_args
from opport.dispatch.registry import get_backend, kernels
from opport.dtypes import FLOATS
from opport.public import function

HYPOTHESIS = settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


def cpu_kernel(op):
    """The cpu backend's best kernel for `op` (imports the backend's op module on first use)."""
    return kernels(op, get_backend("cpu"))[0].fn


def assert_matches(op, case, dtype: str, out: np.ndarray, signed_zero: bool = False):
    __tracebackhide__ = True
    ref = np.asarray(op.run_reference(*case.args, **case.kwargs), np.float64)
    out_dtype = op.fixed_out_dtype or dtype
    problem = contract(out, ref, out_dtype)
    assert problem is None, f"{op.name}/{dtype}/{case.name}: {problem}"
    verdict = compare(out, ref, case.tolerance or op.tolerances[dtype], out_dtype, override=case.tolerance is not None)
    assert verdict.ok, f"{op.name}/{dtype}/{case.name}: {verdict.message}"
    if signed_zero:
        a = out.astype(np.float64)
        wrong = (ref == 0) & (a == 0) & (np.signbit(a) != np.signbit(ref))
        assert not wrong.any(), f"{op.name}/{dtype}/{case.name}: sign of zero differs at {tuple(np.argwhere(wrong)[0])}"


def _digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        if isinstance(a, np.ndarray):
            h.update(a.tobytes())
    return h.hexdigest()


def check_case(op, case, dtype: str, signed_zero: bool = True):
    """Run the cpu kernel on `case`: closeness, unmutated inputs, the same result through `op(...)`
    (which validates the case first), and the op's invariants."""
    __tracebackhide__ = True
    bound = op.bind(*case.args, **case.kwargs)
    before = _digest(bound)
    out = cpu_kernel(op)(*kernel_args(op, bound))  # as the dispatcher hands it over (0-d scales as (1, 1))
    assert _digest(bound) == before, f"{op.name}/{case.name}: an input was mutated"
    assert_matches(op, case, dtype, out, signed_zero)
    again = function(op)(*case.args, **case.kwargs, backend="cpu")
    np.testing.assert_array_equal(again.astype(np.float64), out.astype(np.float64),
                                  err_msg=f"{op.name}/{case.name}: not deterministic")  # (bfloat16 NaN via float64)
    for inv in op.invariants:
        msg = inv(out.astype(np.float64), *bound)
        assert msg is None, f"{op.name}/{dtype}/{case.name}: {msg}"
    return out


def fixed_cases_test(op, min_cases: int = 12, signed_zero: bool = True, max_elements: int = 1 << 20):
    """A test over `op`'s fixed cases in every float dtype: enough of them, uniquely named, small enough
    for the emulating backends that run the same cases, and each one passing `check_case`."""

    @pytest.mark.parametrize("dtype", FLOATS)
    def test(dtype):
        cases = list(op.get_cases(dtype))
        assert len(cases) >= min_cases and len({c.name for c in cases}) == len(cases)
        for case in cases:
            size = sum(a.size for a in case.args if isinstance(a, np.ndarray))
            assert size <= max_elements, f"{case.name}: {size} elements (the emulators run these too)"
            check_case(op, case, dtype, signed_zero)

    return test


def hypothesis_test(op, signed_zero: bool = True, dtypes=FLOATS):
    """A test over `op`'s Hypothesis strategy in every float dtype."""

    @pytest.mark.parametrize("dtype", dtypes)
    def test(dtype):
        @HYPOTHESIS
        @given(op.get_strategy(dtype))
        def run(case):
            check_case(op, case, dtype, signed_zero)

        run()

    return test


def views_match_contiguous(op, *arrays, **kwargs):
    """A transposed and a strided view give bitwise what their contiguous copies give."""
    kernel = cpu_kernel(op)
    for view in (lambda a: a.T, lambda a: a[::2], lambda a: a[:, 1::3]):
        vs = [view(a) for a in arrays]
        got = kernel(*op.bind(*vs, **kwargs))
        want = kernel(*op.bind(*[np.ascontiguousarray(v) for v in vs], **kwargs))
        np.testing.assert_array_equal(got, want)
