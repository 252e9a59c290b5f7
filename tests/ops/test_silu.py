"""silu on the cpu backend: fixed cases and Hypothesis examples against the float64 reference, and its exact semantics.

Also holds `check_case`, the small comparison used by the activation/softmax/layernorm op tests: the
tolerance rules of numerics.md section 3 with NaN, inf and (optionally) signed-zero positions exact.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import opport
from opport.dispatch.registry import get_backend, kernels
from opport.dtypes import FLOATS, finfo, np_dtype
from opport.ops.silu import silu as spec

HYPOTHESIS = settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


def _digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        if isinstance(a, np.ndarray):
            h.update(a.tobytes())
    return h.hexdigest()


def _ulp(r: np.ndarray, dtype: str) -> np.ndarray:
    """Spacing of `dtype` at |r| (the smallest subnormal below the normal range)."""
    fi = finfo(dtype)
    exp = np.frexp(np.where(np.isfinite(r), r, 1.0))[1] - 1
    return np.ldexp(1.0, np.maximum(exp, int(fi.minexp)) - int(fi.nmant))


def mismatches(out: np.ndarray, ref: np.ndarray, dtype: str, tol, signed_zero: bool) -> list:
    """Human-readable failures of `out` against the float64 `ref` under `tol` (empty when it passes)."""
    a = out.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        rd = ref.astype(np_dtype(dtype)).astype(np.float64)  # what the dtype can represent: overflow -> inf
    bad = np.isnan(a) != np.isnan(rd)
    special = np.isinf(rd) | np.isinf(a)
    bad |= special & ~np.isnan(rd) & (a != rd)
    if signed_zero:
        bad |= (ref == 0) & (a == 0) & (np.signbit(a) != np.signbit(ref))  # a nonzero a meets the tolerance
    fin = np.isfinite(rd) & np.isfinite(a)
    with np.errstate(invalid="ignore"):
        err = np.abs(a - ref, where=fin, out=np.zeros_like(a))
    if tol.metric == "ulp_or_abs":
        ok = (err <= tol.atol) | (err <= tol.ulp * _ulp(ref, dtype))
    else:
        ok = err <= tol.atol + tol.rtol * np.abs(np.where(fin, ref, 0))
    bad |= fin & ~ok
    idx = np.argwhere(bad)[:5]
    return [f"at {tuple(i)}: got {a[tuple(i)]!r}, ref {ref[tuple(i)]!r}" for i in idx] + (
        [f"... {int(bad.sum())} mismatches in all"] if bad.sum() > 5 else [])


def cpu_kernel(op):
    """The cpu backend's best kernel for `op` (imports the backend's op module on first use)."""
    return kernels(op, get_backend("cpu"))[0].fn


def check_case(op, case, dtype: str, signed_zero: bool = True):
    """Run the cpu kernel on `case`; assert dtype, shape, closeness, invariants, unmutated inputs, and the
    same result again through `op(...)` (which validates the case first)."""
    __tracebackhide__ = True
    bound = op.bind(*case.args, **case.kwargs)
    before = _digest(bound)
    out = cpu_kernel(op)(*bound)
    assert _digest(bound) == before, f"{op.name}/{case.name}: an input was mutated"
    ref = op.run_reference(*case.args, **case.kwargs)
    assert out.dtype == np_dtype(dtype), f"{op.name}/{case.name}: dtype {out.dtype}"
    assert out.shape == ref.shape, f"{op.name}/{case.name}: shape {out.shape} != {ref.shape}"
    bad = mismatches(out, ref, dtype, op.tolerances[dtype], signed_zero)
    assert not bad, f"{op.name}/{dtype}/{case.name}:\n" + "\n".join(bad)
    again = op(*case.args, **case.kwargs, backend="cpu")  # the public path: validation accepts the case
    np.testing.assert_array_equal(again.astype(np.float64), out.astype(np.float64),
                                  err_msg=f"{op.name}/{case.name}: not deterministic")  # (bfloat16 NaN via float64)
    for inv in op.invariants:
        msg = inv(out.astype(np.float64), *bound)
        assert msg is None, f"{op.name}/{dtype}/{case.name}: {msg}"
    return out


def hypothesis_test(op, signed_zero: bool = True):
    """A test over `op`'s Hypothesis strategy in every float dtype."""

    @pytest.mark.parametrize("dtype", FLOATS)
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


# --------------------------------------------------------------------------- silu


@pytest.mark.parametrize("dtype", FLOATS)
def test_fixed_cases_match_reference(dtype):
    names = []
    for case in spec.get_cases(dtype):
        check_case(spec, case, dtype)
        names.append(case.name)
    assert len(names) >= 15 and len(set(names)) == len(names)


test_hypothesis_examples_match_reference = hypothesis_test(spec)


@pytest.mark.parametrize("dtype", FLOATS)
def test_infinities_and_nan(dtype):
    x = np.array([-np.inf, np.inf, np.nan, -0.0, 0.0], np_dtype(dtype))
    y = opport.silu(x).astype(np.float64)
    assert y[0] == 0 and np.signbit(y[0]), "silu(-inf) must be -0.0"
    assert y[1] == np.inf and np.isnan(y[2])
    assert y[3] == 0 and np.signbit(y[3]) and y[4] == 0 and not np.signbit(y[4])


def test_known_values_and_stable_tails():
    x = np.array([-1.0, 1.0, -88.72, 100.0, -100.0], np.float32)
    x64 = x.astype(np.float64)
    y = opport.silu(x)
    np.testing.assert_allclose(y[:4], x64[:4] / (1 + np.exp(-x64[:4])), rtol=4e-7)  # no inf/NaN from exp(88.72)
    assert y[4] < 0 and abs(y[4] - (-100 * np.exp(-100.0))) < 1e-43  # a subnormal result, not 0 or NaN


def test_views_and_public_call():
    x = np.random.default_rng(0).standard_normal((9, 14)).astype(np.float32)
    views_match_contiguous(spec, x)
    y = opport.silu(x.astype(np_dtype("bfloat16")))
    assert y.dtype == np_dtype("bfloat16") and y.shape == x.shape
