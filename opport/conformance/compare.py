"""How an output is judged against the float64 reference (docs/numerics.md section 3).

Order of checks: output dtype and shape (`contract`), then special values exactly (NaN positions,
signed infinities), then the finite values under the case's `Tolerance` metric, then the RMSE
noise floor against a plain same-dtype NumPy evaluation of the reference (`noise_floor`).
Every check returns plain numbers (`metrics`) and, when it fails, the worst element.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from opport.dtypes import finfo, np_dtype

# docs/numerics.md 3.1 rule 3: RMSE multiplier over the baseline's RMSE
FLOOR_MULT = {"float32": 2.0, "float64": 2.0}
FLOOR_MULT_LOW = 3.0  # 16-bit dtypes, and any case with fewer than 1000 elements
FLOOR_SMALL = 1000
RULE6_ZERO = 1e-3  # max|r| below atol * this counts as a zero output for rule 6


@dataclass
class Verdict:
    ok: bool
    metrics: dict = field(default_factory=dict)
    message: str = ""
    worst: dict | None = None  # {"index", "expected", "got", "abs_err", "allowed", ...}


def contract(out: np.ndarray, ref: np.ndarray, out_dtype: str) -> str | None:
    """Output dtype and shape before any value (docs/numerics.md 3.1 rule 8)."""
    if out.dtype != np_dtype(out_dtype):
        return f"output dtype {out.dtype.name}, expected {out_dtype}"
    if out.shape != ref.shape:
        return f"output shape {out.shape}, expected {ref.shape}"
    return None


def ulp_of(r: np.ndarray, dtype: str) -> np.ndarray:
    """The spacing of `dtype` at |r| (subnormal spacing near zero), as float64."""
    fi = finfo(dtype)
    with np.errstate(divide="ignore", invalid="ignore"):
        e = np.floor(np.log2(np.abs(r)))
    e = np.clip(np.nan_to_num(e, nan=fi.minexp, neginf=fi.minexp, posinf=fi.maxexp - 1), fi.minexp, fi.maxexp - 1)
    return np.exp2(e - fi.nmant)


def compare(out: np.ndarray, ref: np.ndarray, tol, out_dtype: str, override: bool = False) -> Verdict:
    """Special values exactly, then finite values under `tol` (a spec.Tolerance); see the module docstring.

    `override`: `tol` is the case's own tolerance (rule 6 is then the case author's call).
    """
    a = np.asarray(out).astype(np.float64)
    r = np.asarray(ref, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        rr = r.astype(np_dtype(out_dtype)).astype(np.float64)  # reference as the dtype can hold it
    bad_special = _special_mismatch(a, r, rr, out_dtype)
    if tol.signed_zero:
        bad_special |= (r == 0) & (a == 0) & (np.signbit(a) != np.signbit(r))
    fin = np.isfinite(a) & np.isfinite(rr)
    err = np.where(fin, np.abs(a - np.where(fin, r, 0.0)), 0.0)
    allowed, ok_elem, ratio = _allowance(err, r, fin, tol, out_dtype, override)
    bad = bad_special | (fin & ~ok_elem)
    metrics = _metrics(a, r, err, fin, ratio, out_dtype)
    metrics["mismatches"] = int(bad.sum())
    if not bad.any():
        return Verdict(True, metrics)
    idx = _worst_index(bad, bad_special, ratio)
    worst = {"index": idx, "expected": _num(r[idx]), "got": _num(a[idx]),
             "abs_err": _num(err[idx]) if fin[idx] else None, "allowed": _num(allowed[idx]) if fin[idx] else None}
    n = a.size
    what = "special value mismatch (NaN, signed inf or signed zero)" if bad_special[idx] else "value out of tolerance"
    msg = (f"{metrics['mismatches']}/{n} elements ({100.0 * metrics['mismatches'] / max(n, 1):.3g}%) mismatch; worst: "
           f"{what} at {idx}: expected {float(r[idx])!r}, got {float(a[idx])!r}")
    if fin[idx] and not bad_special[idx]:
        msg += f", |err| {err[idx]:.3g} > allowed {allowed[idx]:.3g} ({tol.metric}, rtol {tol.rtol:g}, atol {tol.atol:g}"
        msg += f", {tol.ulp:g} ulp)" if tol.metric == "ulp_or_abs" else ")"
    return Verdict(False, metrics, msg, worst)


def _special_mismatch(a, r, rr, dtype) -> np.ndarray:
    """NaN positions equal; ±inf equal with sign. A finite reference that overflows the dtype may come back
    as the rounded infinity or as ±max (a kernel's own rounding can land just below the threshold)."""
    nan_a, nan_r = np.isnan(a), np.isnan(rr)
    bad = nan_a != nan_r
    inf_any = (np.isinf(a) | np.isinf(rr)) & ~nan_a & ~nan_r
    overflowed = np.isinf(rr) & np.isfinite(r)
    top = float(finfo(dtype).max)
    ok_overflow = overflowed & (np.sign(a) == np.sign(rr)) & (np.abs(a) >= top)
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


def _allowance(err, r, fin, tol, dtype, override=False):
    """Per-element allowed error, pass mask and fraction of the allowance used."""
    absr = np.where(fin, np.abs(r), 0.0)
    maxr = float(absr.max()) if absr.size else 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        if tol.metric == "normwise":
            allowed = np.full(err.shape, tol.atol + tol.rtol * maxr)
        elif tol.metric == "elementwise":
            allowed = _rule6_atol(tol, maxr, override) + tol.rtol * absr
        elif tol.metric == "ulp_or_abs":
            ulps = err / ulp_of(r, dtype)
            ok = fin & ((err <= tol.atol) | (ulps <= (tol.ulp or 0.0)))
            ratio = np.where(fin, np.minimum(err / tol.atol if tol.atol else np.inf, ulps / (tol.ulp or 1e-300)), 0.0)
            allowed = np.maximum(tol.atol, (tol.ulp or 0.0) * ulp_of(r, dtype))
            return allowed, ok, np.nan_to_num(ratio, nan=0.0)
        else:
            raise ValueError(f"unknown tolerance metric {tol.metric!r}")
        ratio = np.where(fin, np.where(err == 0, 0.0, err / allowed), 0.0)
    return allowed, fin & (err <= allowed), ratio


def _metrics(a, r, err, fin, ratio, dtype) -> dict:
    if not fin.any():
        return {"max_abs": 0.0, "max_rel": 0.0, "max_ulp": 0.0, "tol_ratio": 0.0, "rmse": 0.0}
    e, rf = err[fin], np.abs(r[fin])
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(rf > 0, e / rf, 0.0)
        ulp = e / ulp_of(r[fin], dtype)
    return {"max_abs": _num(e.max()), "max_rel": _num(rel.max()), "max_ulp": _num(ulp.max()),
            "tol_ratio": _num(ratio.max()), "rmse": _num(np.sqrt(np.mean(e * e)))}


def _worst_index(bad, bad_special, ratio) -> tuple:
    if bad_special.any():
        flat = int(np.flatnonzero(bad_special)[0])
    else:
        flat = int(np.argmax(np.where(bad, ratio, -1.0)))
    return tuple(int(i) for i in np.unravel_index(flat, bad.shape))


def noise_floor(out: np.ndarray, ref: np.ndarray, base: np.ndarray, tol, out_dtype: str) -> Verdict:
    """RMSE(kernel - r64) <= m * RMSE(baseline - r64) + tol/10 (docs/numerics.md 3.1 rule 3).

    `base` is the reference evaluated in the accumulation dtype on the same rounded inputs and rounded
    to the output dtype: what a plain NumPy implementation at this dtype achieves. Only elements
    finite in all three count (special values are judged exactly elsewhere). `floor_ratio` is the
    fraction of the allowance used (<= 1 passes); `rmse_ratio` is RMSE(kernel) / RMSE(baseline).
    """
    a, r, b = (np.asarray(x).astype(np.float64) for x in (out, ref, base))
    if b.shape != r.shape:
        return Verdict(True, {})
    fin = np.isfinite(a) & np.isfinite(r) & np.isfinite(b)
    if not fin.any():
        return Verdict(True, {})
    rf = r[fin]
    rmse = float(np.sqrt(np.mean((a[fin] - rf) ** 2)))
    rmse_base = float(np.sqrt(np.mean((b[fin] - rf) ** 2)))
    m = FLOOR_MULT.get(out_dtype, FLOOR_MULT_LOW) if r.size >= FLOOR_SMALL else FLOOR_MULT_LOW
    scale = float(np.abs(rf).max()) if tol.metric == "normwise" else float(np.sqrt(np.mean(rf * rf)))
    allowance = m * rmse_base + (tol.atol + tol.rtol * scale) / 10.0
    metrics = {"rmse_base": _num(rmse_base), "rmse_ratio": _num(rmse / rmse_base) if rmse_base > 0 else None,
               "floor_ratio": _num(rmse / allowance) if allowance > 0 else (0.0 if rmse == 0 else None)}
    if rmse <= allowance:
        return Verdict(True, metrics)
    msg = (f"RMSE {rmse:.3g} above the noise floor {allowance:.3g} = {m:g} x baseline RMSE {rmse_base:.3g} "
           f"(plain NumPy at {out_dtype}) + tol/10")
    return Verdict(False, metrics, msg)


def _num(x):
    """A JSON-safe float (None for NaN/inf)."""
    x = float(x)
    return x if np.isfinite(x) else None
