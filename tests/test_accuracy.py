"""The accuracy judge (opport/accuracy.py): the rules of docs/numerics.md section 3 on hand-made outputs,
and the same verdicts on torch tensors (the bench judges on the device)."""

import importlib.util

import numpy as np
import pytest

from opport import accuracy as cmp
from opport.dtypes import np_dtype
from opport.spec import BASE_TOLERANCE, Tolerance

F32 = BASE_TOLERANCE["float32"]


def test_contract_checks_dtype_then_shape():
    ref = np.zeros((2, 3))
    assert cmp.contract(np.zeros((2, 3), np.float32), ref, "float32") is None
    assert "dtype float16" in cmp.contract(np.zeros((2, 3), np.float16), ref, "float32")
    assert "shape (3, 2)" in cmp.contract(np.zeros((3, 2), np.float32), ref, "float32")
    assert "dtype" in cmp.contract(np.zeros((3, 2), np.float16), ref, "float32")  # dtype is reported first


def test_exact_output_passes_with_zero_metrics():
    r = np.linspace(-3, 3, 50)
    v = cmp.compare(r.astype(np.float32), r, F32, "float32")
    assert v.ok and v.metrics["mismatches"] == 0 and v.metrics["max_ulp"] <= 0.5


def test_nan_positions_must_match():
    r = np.array([1.0, np.nan, 3.0])
    assert cmp.compare(np.array([1, np.nan, 3], np.float32), r, F32, "float32").ok
    v = cmp.compare(np.array([1, 2, 3], np.float32), r, F32, "float32")
    assert not v.ok and v.worst["index"] == (1,) and "special value" in v.message
    v = cmp.compare(np.array([np.nan, np.nan, 3], np.float32), r, F32, "float32")
    assert not v.ok and v.worst["index"] == (0,)


def test_infinities_match_with_sign():
    r = np.array([np.inf, -np.inf, 0.0])
    assert cmp.compare(np.array([np.inf, -np.inf, 0], np.float32), r, F32, "float32").ok
    assert not cmp.compare(np.array([-np.inf, -np.inf, 0], np.float32), r, F32, "float32").ok
    assert not cmp.compare(np.array([np.inf, -np.inf, np.inf], np.float32), r, F32, "float32").ok


def test_reference_that_overflows_the_dtype_accepts_inf_or_max():
    r = np.array([70000.0, 1.0])  # above float16's max (65504): rounds to inf
    assert cmp.compare(np.array([np.inf, 1], np.float16), r, BASE_TOLERANCE["float16"], "float16").ok
    assert cmp.compare(np.array([65504, 1], np.float16), r, BASE_TOLERANCE["float16"], "float16").ok
    assert not cmp.compare(np.array([-np.inf, 1], np.float16), r, BASE_TOLERANCE["float16"], "float16").ok


def test_elementwise_tolerance_boundary():
    r = np.full(4, 2.0)
    allowed = F32.atol + F32.rtol * 2.0
    inside = np.array([2.0, 2.0, 2.0, 2.0 + 0.9 * allowed])
    outside = np.array([2.0, 2.0, 2.0, 2.0 + 1.5 * allowed])
    assert cmp.compare(inside, r, F32, "float64").ok
    v = cmp.compare(outside, r, F32, "float64")
    assert not v.ok and v.worst["index"] == (3,) and v.metrics["tol_ratio"] == pytest.approx(1.5, rel=1e-6)


def test_normwise_scales_with_max_reference():
    tol = Tolerance(1e-3, 0.0, "normwise", reason="test")
    r = np.array([1000.0, 1e-3])
    out = np.array([1000.0, 1e-3 + 0.5])  # 0.5 <= 1e-3 * 1000: fine norm-wise, far off element-wise
    assert cmp.compare(out, r, tol, "float64").ok
    assert not cmp.compare(out, r, Tolerance(1e-3, 0.0, reason="test"), "float64").ok


def test_ulp_or_abs_passes_on_either():
    tol = Tolerance(0.0, 1e-7, "ulp_or_abs", ulp=2, reason="test")
    r = np.array([1.0, 1e-9])
    one_ulp = float(np.spacing(np.float32(1.0)))
    assert cmp.compare(np.array([1 + one_ulp, 1e-9 + 5e-8], np.float32), r, tol, "float32").ok  # 1 ulp; abs 5e-8
    v = cmp.compare(np.array([1 + 4 * one_ulp, 1e-9], np.float32), r, tol, "float32")  # 4 ulp and abs 4.8e-7
    assert not v.ok and v.worst["index"] == (0,)
    v = cmp.compare(np.array([1.0, 1e-9 + 3e-7], np.float32), r, tol, "float32")  # abs 3e-7, a huge ulp count
    assert not v.ok and v.worst["index"] == (1,)


def test_rule6_stops_zeros_passing_tiny_outputs():
    r = np.full(1000, 2e-6)  # softmax over a long row: every output is below atol = 1e-5
    zeros = np.zeros(1000, np.float32)
    assert not cmp.compare(zeros, r, F32, "float32").ok
    assert cmp.compare(r.astype(np.float32), r, F32, "float32").ok
    # a case's own reasoned tolerance is the author's call, and a reference that is zero at atol's scale stays absolute
    assert cmp.compare(zeros, r, Tolerance(1.3e-6, 1e-5, reason="test"), "float32", override=True).ok
    assert cmp.compare(zeros, np.full(1000, 4e-15), F32, "float32").ok


def test_ulp_of_matches_numpy_spacing():
    for dtype in ("float32", "float16"):
        x = np.array([1.0, 3.5, 1e-3, 0.0], dtype=np_dtype(dtype))
        assert np.array_equal(cmp.ulp_of(x.astype(np.float64), dtype), np.spacing(x).astype(np.float64))
    assert cmp.ulp_of(np.array([1.0]), "bfloat16")[0] == 2.0**-7


def test_noise_floor_gate():
    rng = np.random.default_rng(0)
    r = rng.standard_normal(4096) * 100
    base = r.astype(np.float32)  # correctly rounded: the best a float32 implementation does
    tol = Tolerance(1e-3, 0.0, reason="test")  # loose elementwise, so only the RMSE gate can object
    good = (r * (1 + 2e-7 * rng.standard_normal(4096))).astype(np.float32)
    bad = (r * (1 + 5e-4 * rng.uniform(-1, 1, 4096))).astype(np.float32)  # every element within rtol
    assert cmp.compare(bad, r, tol, "float32").ok
    assert cmp.noise_floor(good, r, base, tol, "float32").ok
    v = cmp.noise_floor(bad, r, base, tol, "float32")
    assert not v.ok and v.metrics["floor_ratio"] > 1 and v.metrics["rmse_ratio"] > 100


def test_signed_zero_is_exact_only_where_the_tolerance_says_so():
    ref = np.array([-0.0, 0.0, 1.0])
    out = np.array([0.0, -0.0, 1.0], np.float32)
    assert cmp.compare(out, ref, Tolerance(1.3e-6, 1e-5), "float32").ok
    v = cmp.compare(out, ref, Tolerance(1.3e-6, 1e-5, signed_zero=True), "float32")
    assert not v.ok and v.metrics["mismatches"] == 2 and "signed zero" in v.message


def test_a_wrong_shape_is_never_broadcast():
    r = np.ones((4, 4))
    v = cmp.compare(np.ones((1, 4), np.float32), r, F32, "float32")
    assert not v.ok and "shape (1, 4)" in v.message


HAS_TORCH = importlib.util.find_spec("torch") is not None


def _cases():
    """(out, ref, tolerance, dtype): passing and failing outputs under every rule, incl. signed zero and overflow."""
    rng = np.random.default_rng(3)
    r = rng.standard_normal(257) * 10
    r[:6] = [np.nan, np.inf, -np.inf, -0.0, 70000.0, 2e-6]
    tol16, sz = BASE_TOLERANCE["float16"], Tolerance(1.3e-6, 1e-5, signed_zero=True)
    ulp = Tolerance(0.0, 1e-7, "ulp_or_abs", ulp=2, reason="test")
    norm = Tolerance(1e-3, 0.0, "normwise", reason="test")
    noisy = r * (1 + 3e-3 * rng.standard_normal(r.size))
    flipped = r.copy()
    flipped[3] = 0.0
    for dtype, tol in (("float32", F32), ("float16", tol16), ("float32", sz), ("float32", ulp), ("float32", norm)):
        for out in (r, noisy, flipped, np.where(np.isnan(r), 0.0, r)):
            with np.errstate(over="ignore"):  # 70000 overflows float16 on purpose
                cast = out.astype(np_dtype(dtype))
            yield cast, r, tol, dtype
    tiny = np.full(300, 2e-6)
    yield np.zeros(300, np.float32), tiny, F32, "float32"  # rule 6: zeros for tiny outputs


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_torch_tensors_get_the_numpy_verdict():
    """One judge: a torch output against a torch float64 reference gets the verdict NumPy gives (same worst
    element and mismatch count; metrics equal up to summation order), signed-zero and overflow rules included."""
    import torch

    seen = set()
    for out, ref, tol, dtype in _cases():
        want = cmp.compare(out, ref, tol, dtype)
        got = cmp.compare(torch.from_numpy(out.astype(np.float32)).to(getattr(torch, dtype)), torch.from_numpy(ref),
                          tol, dtype)
        assert (got.ok, got.worst, got.metrics["mismatches"]) == (want.ok, want.worst, want.metrics["mismatches"])
        for k, v in want.metrics.items():
            assert got.metrics[k] == pytest.approx(v, rel=1e-12, abs=0) if v is not None else got.metrics[k] is None
        seen.add((want.ok, "special" in want.message))
    assert seen == {(True, False), (False, True), (False, False)}  # passes, special-value and tolerance failures


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_like_moves_an_output_to_the_references_kind():
    import torch

    r = np.linspace(-1, 1, 8)
    t = torch.from_numpy(r.astype(np.float32)).to(torch.bfloat16)
    assert isinstance(cmp.like(t, r), np.ndarray) and cmp.compare(cmp.like(t, r), r, BASE_TOLERANCE["bfloat16"],
                                                                  "bfloat16").ok
    assert isinstance(cmp.like(r.astype(np.float32), torch.from_numpy(r)), torch.Tensor)
    assert cmp.dtype_name(t) == "bfloat16" and cmp.contract(t, torch.from_numpy(r), "float32") == (
        "output dtype bfloat16, expected float32")


def test_a_sum_that_cancels_is_allowed_one_roundoff_of_its_magnitude():
    """docs/numerics.md 3.10: 342 loguniform terms (1e-4 .. 1e4) cancelling in pairs to ~16: a plain sequential float32
    sum errs by 5.4e-3, 300x the norm-wise table's 1e-5 of |r|, inside one roundoff of sum |terms| (1.1e-2)."""
    from opport.accuracy import compare, sum_allowance
    from opport.spec import Tolerance

    rng = np.random.default_rng(2)
    x = np.exp(rng.uniform(np.log(1e-4), np.log(1e4), 171))
    terms = np.concatenate([x, -x * (1 + rng.uniform(-1e-3, 1e-3, 171))]).astype(np.float32)
    rng.shuffle(terms)
    exact = np.array([terms.astype(np.float64).sum()])
    seq = np.float32(0)
    for t in terms:
        seq = np.float32(seq + t)  # a correct float32 order, not NumPy's pairwise one
    tol = Tolerance(1e-5, 1e-5, "normwise")
    got = np.array([seq], np.float64)
    cancel = sum_allowance(np.array([np.abs(terms.astype(np.float64)).sum()]), "float32")
    assert not compare(got, exact, tol, "float32").ok  # the table alone judges the summation order
    assert compare(got, exact, tol, "float32", cancel=cancel).ok
    assert not compare(got + 2 * cancel, exact, tol, "float32", cancel=cancel).ok  # a real error is still one


def test_the_noise_floor_is_not_judged_on_a_handful_of_elements():
    from opport.accuracy import noise_floor
    from opport.spec import Tolerance

    ref = np.ones(4)
    tol = Tolerance(1e-5, 1e-5, "normwise")
    assert noise_floor(ref + 1e-5, ref, ref + 1e-9, tol, "float32").ok
    big = np.ones(64)
    assert not noise_floor(big + 1e-5, big, big + 1e-9, tol, "float32").ok


def test_matmul_declares_its_magnitude_as_the_product_of_absolute_values():
    from opport.ops import get_op

    rng = np.random.default_rng(0)
    a, b, bias = rng.standard_normal((3, 5)), rng.standard_normal((5, 4)), rng.standard_normal(4)
    (mag,) = get_op("matmul").get_magnitude((a, b, bias))
    np.testing.assert_allclose(mag, np.abs(a) @ np.abs(b) + np.abs(bias))
    g = rng.standard_normal((3, 4))
    da, db, dbias = get_op("matmul_backward").get_magnitude((g, a, b, bias))
    np.testing.assert_allclose(db, np.abs(a).T @ np.abs(g))
    np.testing.assert_allclose(dbias, np.abs(g).sum(0))
