"""Correctness before timing: each provider's output against a float64 reference, with the op's tolerance.

The reference is the op's NumPy float64 reference on the cpu backend, and torch on float64 copies of
the same (already rounded) inputs on cuda, where NumPy would take longer than the whole benchmark.
Works on NumPy arrays and torch tensors alike (the comparison stays on the tensor's device).
"""

from __future__ import annotations

import sys

import numpy as np

from opport.dtypes import finfo
from opport.spec import Tolerance


def _xp(a):
    torch = sys.modules.get("torch")
    return torch if torch is not None and isinstance(a, torch.Tensor) else np


def to64(a):
    """`a` as float64 of its own framework (torch tensors stay on their device; bfloat16 included)."""
    xp = _xp(a)
    if xp is np:
        return np.asarray(a, dtype=np.float64)
    return a.detach().to(xp.float64)


def same_framework(a, like):
    """`a` (NumPy or torch) moved to `like`'s framework and device, for comparing there."""
    if _xp(like) is np:
        if _xp(a) is np:
            return a
        from opport.dispatch.adapters import TorchAdapter

        return TorchAdapter.to_numpy(a)
    if _xp(a) is np:
        from opport.dispatch.adapters import NumpyAdapter

        return NumpyAdapter.to_torch(np.ascontiguousarray(a), str(like.device))
    return a.to(like.device)


def compare(out, ref, tol: Tolerance, dtype: str) -> tuple[bool, dict]:
    """(ok, metrics): `out` within `tol` of the float64 `ref`, NaN where ref is NaN, infinities exact."""
    out = to64(same_framework(out, ref))
    ref = to64(ref)
    if tuple(out.shape) != tuple(ref.shape):
        return False, {"error": f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"}
    xp = _xp(ref)
    if (ref.size if xp is np else ref.numel()) == 0:
        return True, {"max_abs": 0.0, "max_rel": 0.0, "bad": 0}
    nan_ref, nan_out = xp.isnan(ref), xp.isnan(out)
    inf_ref = xp.isinf(ref)
    finite = ~(nan_ref | inf_ref)
    diff = xp.where(finite, xp.abs(out - ref), xp.zeros_like(ref))
    diff = xp.where(nan_out & finite, xp.full_like(ref, float("inf")), diff)
    mag = xp.abs(xp.where(finite, ref, xp.zeros_like(ref)))
    allowed = _allowed(xp, mag, tol, dtype)
    bad = (diff > allowed) | (nan_ref != nan_out) | (inf_ref & (out != ref))
    n_bad = int(bad.sum())
    max_abs = float(diff.max())
    rel = diff / xp.where(mag > 0, mag, xp.ones_like(mag))
    metrics = {"max_abs": max_abs, "max_rel": float(rel.max()), "bad": n_bad}
    return n_bad == 0, metrics


def _allowed(xp, mag, tol: Tolerance, dtype: str):
    if tol.metric == "normwise":
        return tol.atol + tol.rtol * float(mag.max())
    if tol.metric == "ulp_or_abs":
        fi = finfo(dtype)
        tiny, eps = float(fi.tiny), float(fi.eps)
        spacing = 2.0 ** xp.floor(xp.log2(xp.where(mag > tiny, mag, xp.full_like(mag, tiny)))) * eps
        return xp.maximum(spacing * (tol.ulp or 1.0), xp.full_like(mag, tol.atol))
    return tol.atol + tol.rtol * mag
