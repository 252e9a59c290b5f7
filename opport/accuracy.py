"""The accuracy judge: how an output is compared with its float64 reference (docs/numerics.md section 3).

One set of rules for every caller: `opport conformance` (every case), `opport bench` (every provider's
output before it is timed) and the op tests (tests/ops/_check.py).

Order of checks: output dtype and shape (`contract`), then special values exactly (NaN positions, signed
infinities, signed zeros where the tolerance asks), then the finite values under the `Tolerance` metric,
then, for conformance, the RMSE noise floor against a plain same-dtype NumPy evaluation (`noise_floor`).
Every check returns plain numbers (`metrics`) and, when it fails, the worst element.

Arrays: `compare` takes NumPy arrays or torch tensors (output and reference of the same kind: callers
with mixed kinds convert the output with `like`). The rules are written once, against the functions
NumPy and torch share (isnan, where, signbit, log2, ...); the handful that differ live in `_NumpyOps` and
`_TorchOps`. Converting torch to NumPy at the boundary would be simpler, but the bench's cuda reference is
torch float64 on the GPU and its outputs reach 10^8 elements: copying both to the host and judging there
costs seconds per row of a run budgeted in minutes, on the device milliseconds. Only scalars and the
worst element cross to the host. The noise floor (conformance only) stays NumPy.
"""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass, field

import numpy as np

from opport.dtypes import INTS, finfo, np_dtype

# docs/numerics.md 3.1 rule 3: RMSE multiplier over the baseline's RMSE
FLOOR_MULT = {"float32": 2.0, "float64": 2.0}
FLOOR_MULT_LOW = 3.0  # 16-bit dtypes, and any case with fewer than 1000 elements
FLOOR_SMALL = 1000
# below this many elements the floor is not judged: the ratio of two RMSEs over n elements is F-distributed
# with n degrees of freedom each, and at n = 1 it is Cauchy (P(ratio > 27) ~ 2.4%), so a kernel as good as the
# baseline would fail by luck; from 32 elements P(ratio > 3) is below 1e-8. The per-element tolerance still judges
# every element (measured: a 1 x 1 matmul_backward db, a sum of 342 loguniform products, 27x the baseline's error
# and half a unit roundoff of its sum |terms|).
FLOOR_MIN_ELEMENTS = 32
RULE6_ZERO = 1e-3  # max|r| below atol * this counts as a zero output for rule 6


@dataclass
class Verdict:
    ok: bool
    metrics: dict = field(default_factory=dict)
    message: str = ""
    worst: dict | None = None  # {"index", "expected", "got", "abs_err", "allowed"}


class _NumpyOps:
    xp = np

    @staticmethod
    def f64(a):
        return np.asarray(a).astype(np.float64)

    @staticmethod
    def rounded(r, dtype: str):
        """`r` as `dtype` can hold it (overflow to inf is the point), back in float64."""
        with np.errstate(over="ignore", invalid="ignore"):
            return r.astype(np_dtype(dtype)).astype(np.float64)

    @staticmethod
    def full(like, value: float):
        return np.full(like.shape, value, np.float64)

    @staticmethod
    def first(mask) -> int:
        return int(np.argmax(mask.reshape(-1)))

    @staticmethod
    def quiet():
        return np.errstate(all="ignore")  # log2(0), 0/0: the results are masked afterwards


class _TorchOps:
    def __init__(self, torch):
        self.xp = torch

    def f64(self, a):
        return a.detach().to(self.xp.float64)

    def rounded(self, r, dtype: str):
        return r.to(getattr(self.xp, dtype)).to(self.xp.float64)

    def full(self, like, value: float):
        return self.xp.full_like(like, value)

    def first(self, mask) -> int:
        return int(self.xp.argmax(mask.reshape(-1).to(self.xp.uint8)))  # argmax: the first maximum

    @staticmethod
    def quiet():
        return contextlib.nullcontext()  # torch does not warn on these


def _torch():
    return sys.modules.get("torch")  # never imported here: a tensor can only exist if torch is loaded


def _ops(a):
    torch = _torch()
    return _TorchOps(torch) if torch is not None and isinstance(a, torch.Tensor) else _NumpyOps


def _size(a) -> int:
    return math.prod(a.shape)


def dtype_name(a) -> str:
    """'float32', 'bfloat16', ... for a NumPy array or a torch tensor."""
    torch = _torch()
    if torch is not None and isinstance(a, torch.Tensor):
        return str(a.dtype).removeprefix("torch.")
    return np.asarray(a).dtype.name


def like(a, ref):
    """`a` (NumPy or torch) moved to `ref`'s kind and device, for judging there."""
    same = (_ops(a) is _NumpyOps) == (_ops(ref) is _NumpyOps)
    if same:
        return a if _ops(ref) is _NumpyOps else a.to(ref.device)
    from opport.dispatch.adapters import NumpyAdapter, TorchAdapter

    if _ops(ref) is _NumpyOps:
        return TorchAdapter.to_numpy(a)
    return NumpyAdapter.to_torch(np.ascontiguousarray(a), str(ref.device))


def contract(out, ref, out_dtype: str) -> str | None:
    """Output dtype and shape before any value (docs/numerics.md 3.1 rule 8)."""
    if dtype_name(out) != out_dtype:
        return f"output dtype {dtype_name(out)}, expected {out_dtype}"
    if tuple(out.shape) != tuple(ref.shape):
        return f"output shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    return None


def ulp_of(r, dtype: str):
    """The spacing of `dtype` at |r| (subnormal spacing near zero), as float64."""
    ops, fi = _ops(r), finfo(dtype)
    xp = ops.xp
    with ops.quiet():
        e = xp.floor(xp.log2(xp.abs(r)))
    e = xp.clip(xp.nan_to_num(e, nan=fi.minexp, neginf=fi.minexp, posinf=fi.maxexp - 1), fi.minexp, fi.maxexp - 1)
    return xp.exp2(e - fi.nmant)


def compare(out, ref, tol, out_dtype: str, override: bool = False, cancel=None) -> Verdict:
    """Special values exactly, then finite values under `tol` (a spec.Tolerance); see the module docstring.

    `override`: `tol` is the case's own tolerance (rule 6 is then the case author's call). `cancel`: for an
    output that is a sum (norm-wise or element-wise), one unit roundoff of sum |terms| per element (`sum_allowance`),
    added to the allowance: what any summation order may lose where the sum cancels.
    """
    if tuple(out.shape) != tuple(ref.shape):  # never let broadcasting judge a wrong shape
        return Verdict(False, {}, f"output shape {tuple(out.shape)}, expected {tuple(ref.shape)}")
    ops = _ops(ref)
    xp = ops.xp
    a, r = ops.f64(out), ops.f64(ref)
    if getattr(out_dtype, "name", out_dtype) in INTS:  # an integer output (indices, offsets): exactly, whatever the tolerance
        return _exact(ops, a, r)
    rr = ops.rounded(r, out_dtype)  # the reference as the output dtype can hold it
    bad_special = _special_mismatch(xp, a, r, rr, out_dtype)
    if tol.signed_zero:
        bad_special = bad_special | ((r == 0) & (a == 0) & (xp.signbit(a) != xp.signbit(r)))
    fin = xp.isfinite(a) & xp.isfinite(rr)
    err = xp.where(fin, xp.abs(a - xp.where(fin, r, 0.0)), 0.0)
    allowed, ok_elem, ratio = _allowance(ops, err, r, fin, tol, out_dtype, override, cancel)
    bad = bad_special | (fin & ~ok_elem)
    metrics = _metrics(ops, r, err, fin, ratio, out_dtype)
    metrics["mismatches"] = int(bad.sum())
    if not metrics["mismatches"]:
        return Verdict(True, metrics)
    idx = _worst_index(ops, bad, bad_special, ratio)
    finite_at, special_at = bool(fin[idx]), bool(bad_special[idx])
    worst = {"index": idx, "expected": _num(r[idx]), "got": _num(a[idx]),
             "abs_err": _num(err[idx]) if finite_at else None, "allowed": _num(allowed[idx]) if finite_at else None}
    at = (float(r[idx]), float(a[idx]), float(err[idx]), float(allowed[idx]))
    return Verdict(False, metrics, _message(metrics["mismatches"], _size(a), idx, at, special_at, finite_at, tol), worst)


def _exact(ops, a, r) -> Verdict:
    """Integer outputs: every element equal (the reference's values are integers held exactly in float64)."""
    bad = a != r
    n_bad = int(bad.sum())
    if not n_bad:
        return Verdict(True, {"mismatches": 0})
    idx = tuple(int(i) for i in np.unravel_index(ops.first(bad), tuple(a.shape)))
    worst = {"index": idx, "expected": _num(r[idx]), "got": _num(a[idx]), "abs_err": _num(abs(a[idx] - r[idx])),
             "allowed": 0.0}
    return Verdict(False, {"mismatches": n_bad}, f"{n_bad} of {_size(a)} integer elements differ (exact output); "
                                                 f"first at {idx}: expected {worst['expected']}, got {worst['got']}", worst)


def _message(n_bad: int, n: int, idx, at: tuple, special: bool, finite: bool, tol) -> str:
    """What failed, at the worst element: `at` is (expected, got, |err|, allowed) there."""
    expected, got, err, allowed = at
    what = "special value mismatch (NaN, signed inf or signed zero)" if special else "value out of tolerance"
    msg = (f"{n_bad}/{n} elements ({100.0 * n_bad / max(n, 1):.3g}%) mismatch; worst: {what} at {idx}: "
           f"expected {expected!r}, got {got!r}")
    if finite and not special:
        msg += f", |err| {err:.3g} > allowed {allowed:.3g} ({tol.metric}, rtol {tol.rtol:g}, "
        msg += f"atol {tol.atol:g}, {tol.ulp:g} ulp)" if tol.metric == "ulp_or_abs" else f"atol {tol.atol:g})"
    return msg


def _special_mismatch(xp, a, r, rr, dtype: str):
    """NaN positions equal; ±inf equal with sign. A finite reference that overflows the dtype may come back
    as the rounded infinity or as ±max (a kernel's own rounding can land just below the threshold)."""
    nan_a, nan_r = xp.isnan(a), xp.isnan(rr)
    bad = nan_a != nan_r
    inf_any = (xp.isinf(a) | xp.isinf(rr)) & ~nan_a & ~nan_r
    overflowed = xp.isinf(rr) & xp.isfinite(r)
    ok_overflow = overflowed & (xp.sign(a) == xp.sign(rr)) & (xp.abs(a) >= float(finfo(dtype).max))
    return bad | (inf_any & (a != rr) & ~ok_overflow)


def _rule6_atol(tol, maxr: float, override: bool) -> float:
    """docs/numerics.md 3.1 rule 6: atol stays below 1% of max|r|, so all-zeros cannot pass a case of tiny outputs.

    Not applied to a case's own (reasoned) tolerance override, nor where max|r| <= atol/1000: such a
    reference is zero at the tolerance's scale (often the float64 reference's own rounding noise
    where the exact result is 0, e.g. a normalised constant row), and zeros are then right.
    """
    if override or maxr <= tol.atol * RULE6_ZERO:
        return tol.atol
    return min(tol.atol, 0.01 * maxr)


def _allowance(ops, err, r, fin, tol, dtype: str, override: bool = False, cancel=None):
    """Per-element allowed error, pass mask and fraction of the allowance used."""
    xp = ops.xp
    absr = xp.where(fin, xp.abs(r), 0.0)
    maxr = float(absr.max()) if _size(absr) else 0.0
    with ops.quiet():
        if tol.metric == "ulp_or_abs":
            return _ulp_allowance(ops, err, r, fin, tol, dtype)
        if tol.metric == "normwise":
            allowed = ops.full(err, tol.atol + tol.rtol * maxr)
            if cancel is not None:
                allowed = allowed + (ops.f64(cancel) if ops is _NumpyOps else ops.xp.as_tensor(cancel).to(allowed))
        elif tol.metric == "elementwise":
            allowed = _rule6_atol(tol, maxr, override) + tol.rtol * absr
            if cancel is not None:
                allowed = allowed + (ops.f64(cancel) if ops is _NumpyOps else ops.xp.as_tensor(cancel).to(allowed))
            # the correctly rounded result always passes: where rule 6 caps atol below the dtype's own spacing
            # (outputs near or under a 16-bit dtype's subnormals), rounding alone must not fail a kernel
            allowed = xp.maximum(allowed, 0.5 * ulp_of(xp.where(fin, r, 0.0), dtype))
        else:
            raise ValueError(f"unknown tolerance metric {tol.metric!r}")
        ratio = xp.where(fin, xp.where(err == 0, 0.0, err / allowed), 0.0)
    return allowed, fin & (err <= allowed), ratio


def _ulp_allowance(ops, err, r, fin, tol, dtype: str):
    """ulp_or_abs: an element passes within atol or within `tol.ulp` units in the last place."""
    xp, spacing = ops.xp, ulp_of(r, dtype)
    ulps = err / spacing
    ok = fin & ((err <= tol.atol) | (ulps <= (tol.ulp or 0.0)))
    by_abs = err / tol.atol if tol.atol else ops.full(err, math.inf)
    ratio = xp.where(fin, xp.minimum(by_abs, ulps / (tol.ulp or 1e-300)), 0.0)
    allowed = xp.clip((tol.ulp or 0.0) * spacing, tol.atol, None)
    return allowed, ok, xp.nan_to_num(ratio, nan=0.0)


def _metrics(ops, r, err, fin, ratio, dtype: str) -> dict:
    if not bool(fin.any()):
        return {"max_abs": 0.0, "max_rel": 0.0, "max_ulp": 0.0, "tol_ratio": 0.0, "rmse": 0.0}
    xp = ops.xp
    e, rf = err[fin], xp.abs(r[fin])
    with ops.quiet():
        rel = xp.where(rf > 0, e / rf, 0.0)
        ulp = e / ulp_of(r[fin], dtype)
    return {"max_abs": _num(e.max()), "max_rel": _num(rel.max()), "max_ulp": _num(ulp.max()),
            "tol_ratio": _num(ratio.max()), "rmse": _num(math.sqrt(float((e * e).mean())))}


def _worst_index(ops, bad, bad_special, ratio) -> tuple:
    """The first special-value mismatch, else the element that used most of its allowance."""
    if bool(bad_special.any()):
        flat = ops.first(bad_special)
    else:
        flat = int(ops.xp.argmax(ops.xp.where(bad, ratio, -1.0).reshape(-1)))
    return tuple(int(i) for i in np.unravel_index(flat, tuple(bad.shape)))


def sum_allowance(magnitude, acc_dtype: str):
    """One unit roundoff of the accumulation dtype times sum |terms| (`OpSpec.magnitude`), per element."""
    if magnitude is None:
        return None
    u = float(np.finfo(acc_dtype).eps) / 2
    return np.nan_to_num(np.abs(np.asarray(magnitude, np.float64)), nan=0.0, posinf=0.0) * u


def noise_floor(out: np.ndarray, ref: np.ndarray, base: np.ndarray, tol, out_dtype: str, cancel=None) -> Verdict:
    """RMSE(kernel - r64) <= m * RMSE(baseline - r64) + tol/10 (docs/numerics.md 3.1 rule 3).

    `base` is the reference evaluated in the accumulation dtype on the same rounded inputs and rounded
    to the output dtype: what a plain NumPy implementation at this dtype achieves. Only elements
    finite in all three count (special values are judged exactly elsewhere). `floor_ratio` is the
    fraction of the allowance used (<= 1 passes); `rmse_ratio` is RMSE(kernel) / RMSE(baseline).
    """
    a, r, b = (np.asarray(x).astype(np.float64) for x in (out, ref, base))
    if b.shape != r.shape or getattr(out_dtype, "name", out_dtype) in INTS:  # integer outputs are judged exactly by `compare`
        return Verdict(True, {})
    fin = np.isfinite(a) & np.isfinite(r) & np.isfinite(b)
    if not fin.any():
        return Verdict(True, {})
    rf = r[fin]
    rmse, rmse_base = _rms(a[fin] - rf), _rms(b[fin] - rf)
    if rf.size < FLOOR_MIN_ELEMENTS:
        return Verdict(True, {"rmse_base": _num(rmse_base), "rmse_ratio": _num(rmse / rmse_base) if rmse_base > 0 else None})
    m = FLOOR_MULT.get(out_dtype, FLOOR_MULT_LOW) if r.size >= FLOOR_SMALL else FLOOR_MULT_LOW
    scale = float(np.abs(rf).max()) if tol.metric == "normwise" else _rms(rf)
    extra = 0.0
    if cancel is not None and tol.metric != "ulp_or_abs":  # the same statistic as the tolerance's |r| term
        c = np.asarray(cancel, np.float64)[fin]
        extra = float(c.max()) if tol.metric == "normwise" else _rms(c)
    allowance = m * rmse_base + (tol.atol + tol.rtol * scale + extra) / 10.0
    metrics = {"rmse_base": _num(rmse_base), "rmse_ratio": _num(rmse / rmse_base) if rmse_base > 0 else None,
               "floor_ratio": _num(rmse / allowance) if allowance > 0 else (0.0 if rmse == 0 else None)}
    if rmse <= allowance:
        return Verdict(True, metrics)
    msg = (f"RMSE {rmse:.3g} above the noise floor {allowance:.3g} = {m:g} x baseline RMSE {rmse_base:.3g} "
           f"(plain NumPy at {out_dtype}) + tol/10")
    return Verdict(False, metrics, msg)


def _rms(e: np.ndarray) -> float:
    """Root mean square without overflow: values near the float64 maximum (gradients of huge inputs) would
    square to inf."""
    big = float(np.abs(e).max()) if e.size else 0.0
    if big == 0.0 or not np.isfinite(big):
        return big
    return big * float(np.sqrt(np.mean((e / big) ** 2)))


def _num(x):
    """A JSON-safe float (None for NaN/inf)."""
    x = float(x)
    return x if math.isfinite(x) else None
