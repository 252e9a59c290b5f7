"""The Range of matmul and attention (docs/numerics.md 3.9): where their results are defined, and what comes
past it. The boundary cases sit where they say; what the float64 reference cannot say (a +inf score), every
backend says alike; float16 matmul overflows to inf exactly where torch's does."""

from __future__ import annotations

import numpy as np
import pytest

from opport.dispatch import backends, call, kernels, strict
from opport.dtypes import finfo
from opport.ops import attention as att
from opport.ops import matmul as mm

BACKENDS = [name for name, b in backends().items() if not b.unavailable()]


def _with_kernels(spec) -> list:
    """The backends that have kernels for `spec` (the jax backend has a few ops only): strict calls run there."""
    return [name for name in BACKENDS if kernels(spec, backends()[name])]


def _acc_max(dtype: str) -> float:
    return float(finfo("float64" if dtype == "float64" else "float32").max)


def _cases(spec, dtype, prefix):
    return {c.name: c for c in spec.get_cases(dtype) if c.name.startswith(prefix)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_matmul_range_cases_sit_where_they_say(dtype):
    cases = _cases(mm.matmul, dtype, ("near-max", "past-max"))
    near = mm.accumulation_bound(*cases["near-max"].args).max()
    assert near <= 0.9 * _acc_max(dtype)
    if dtype != "float16":  # float16 results reach 65504 far inside float32's range
        assert near >= 0.8 * _acc_max(dtype)
    a, b, _ = cases["past-max"].args
    products = a.astype(np.float64)[:, :, None] * b.astype(np.float64)[None]
    with np.errstate(over="ignore"):
        past = np.abs(mm.matmul.run_reference(a, b)) > float(finfo(dtype).max)
    assert past.all() if dtype != "float16" else past[:, :4].all() and not past[:, 4:].any()  # float16: 4 columns
    one_sign = (products > 0).all(axis=1) | (products < 0).all(axis=1)
    assert one_sign[past].all()  # each sum past the maximum has one sign: ±inf in any order
    grad, a, b, bias = next(c for c in mm.matmul_backward.get_cases(dtype) if c.name == "near-max-grad").args
    worst = max(mm.accumulation_bound(a, b).max(), mm.accumulation_bound(grad, b.T).max(),
                mm.accumulation_bound(a.T, grad).max())
    assert 0.8 * float(finfo(dtype).max) <= worst <= 0.9 * float(finfo(dtype).max)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_attention_range_cases_sit_where_they_say(dtype):
    cases = _cases(att.attention, dtype, ("near-max", "past-max"))
    big = _acc_max(dtype)
    scores, _ = att.range_bounds(*cases["near-max-qk"].args, **cases["near-max-qk"].kwargs)
    _, values = att.range_bounds(*cases["near-max-v"].args, **cases["near-max-v"].kwargs)
    if dtype == "float16":  # q, k, v at the dtype's own maximum: far inside float32's range
        assert np.abs(cases["near-max-qk"].args[0].astype(np.float64)).max() > 60000
        assert np.abs(cases["near-max-v"].args[2].astype(np.float64)).max() > 60000
    else:
        assert 0.8 * big <= scores <= 0.91 * big and 0.8 * big <= values <= 0.91 * big  # 0.9, as rounded
    if dtype in ("float32", "bfloat16"):
        for name in ("past-max-negative", "past-max-softcap"):
            q, k, v = (a.astype(np.float64) for a in cases[name].args)
            with np.errstate(over="ignore"):
                far = np.abs(np.einsum("bhqd,bhkd->bhqk", q, np.repeat(k, 2, axis=1))) > 2 * big
            assert far[..., np.arange(20) % 3 != 0].all() and not far[..., ::3].any()  # two of three keys, never key 0


@pytest.mark.parametrize("backend", _with_kernels(att.attention))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_positive_score_overflow_makes_the_row_nan_on_every_backend(backend, dtype):
    # the exact scores are finite in float64 (the reference's answer is one-hot), but +inf in the accumulation
    # dtype: the documented result is a NaN row, as torch's float32 attention gives
    case = _cases(att.attention, dtype, "past-max-softcap")["past-max-softcap"]
    q, k, v = case.args
    with strict():
        out = np.asarray(call(att.attention, att.attention.bind(q, k, v, True, 1.0), backend)).astype(np.float64)
    assert np.isnan(out).all()  # every row sees a key past the maximum
    with strict():  # the same keys under a soft cap: capped to the cap, finite, as the reference
        capped = np.asarray(call(att.attention, att.attention.bind(q, k, v, True, 1.0, 8.0), backend))
    assert np.isfinite(capped.astype(np.float64)).all()


@pytest.mark.parametrize("backend", _with_kernels(mm.matmul))
def test_float16_matmul_overflows_where_torch_does(backend):
    torch = pytest.importorskip("torch")
    for name in ("near-max", "past-max"):
        a, b, _ = _cases(mm.matmul, "float16", name)[name].args
        want = torch.matmul(torch.from_numpy(a), torch.from_numpy(b)).numpy()
        with strict():
            got = np.asarray(call(mm.matmul, mm.matmul.bind(a, b), backend))
        np.testing.assert_array_equal(got, want)
        assert np.isinf(got).any() == (name == "past-max")
