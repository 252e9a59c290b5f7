"""Checks for an op's backward: its float64 reference VJP against central finite differences of the float64
forward reference, and the cpu backward kernel against that reference VJP.

The finite-difference check is directional: for random directions u of each differentiable input x,
(f(x + h u) - f(x - h u)) / 2h, contracted with the upstream gradient g, must equal <vjp(g), u>. The
error of a Richardson-extrapolated central difference in float64 is O(h^4) + O(eps |f| / h); with h = 1e-6
times the input's scale both are far below the bound used, |vjp| |u| * 1e-6 (the Cauchy-Schwarz scale of
the product), also for rows as curved as rmsnorm's at x = 0 (scale sqrt(eps) = 1e-3).
"""

from __future__ import annotations

import numpy as np

from opport import casegen
from opport.conformance.compare import compare, contract
from opport.dispatch import get_backend, kernels

FD_RTOL = 1e-6


def as64(a):
    return a.astype(np.float64) if isinstance(a, np.ndarray) and a.dtype.kind in "fV" else a


def backward_args64(bwd, fwd_bound: tuple, grad: np.ndarray) -> tuple:
    """The backward's arguments for float64 forward arguments: what the forward saves, in float64, unrounded."""
    fwd = bwd.parent
    by_name = dict(zip(fwd.params, fwd_bound), grad=grad)
    if "out" in bwd.params:
        by_name["out"] = fwd.run_reference(*fwd_bound)
    if fwd.train_forward is not None:
        by_name.update(zip(fwd.train_forward.stats, fwd.train_forward.run_stats(*fwd_bound)))
    return tuple(by_name[p] for p in bwd.params)


def check_vjp_against_fd(spec, case, probes: int = 3):
    """The op's reference VJP against central differences of its forward reference, for one forward case."""
    __tracebackhide__ = True
    bwd = spec.backward_op
    bound = tuple(as64(a) for a in spec.bind(*case.args, **case.kwargs))
    out = np.asarray(spec.run_reference(*bound), np.float64)
    rng = casegen.rng_for("fd", spec.name, case.name)
    g = rng.standard_normal(out.shape)
    grads = bwd.run_reference(*backward_args64(bwd, bound, g))
    assert len(grads) == len(bwd.wrt), f"{bwd.name}: {len(grads)} gradients for wrt {bwd.wrt}"
    for name, dx in zip(bwd.wrt, grads):
        x = bound[spec.params.index(name)]
        if x is None:
            assert dx is None, f"{bwd.name}/{case.name}: a gradient for {name}, which was None"
            continue
        assert dx.shape == x.shape, f"{bwd.name}/{case.name}: d{name} shape {dx.shape} != {x.shape}"
        for _ in range(probes):
            u = rng.standard_normal(x.shape)
            fd = _directional(spec, bound, spec.params.index(name), u, g)
            analytic = float(np.sum(dx * u))
            bound_ = FD_RTOL * float(np.linalg.norm(dx) * np.linalg.norm(u)) + 1e-12
            assert abs(fd - analytic) <= bound_, (
                f"{bwd.name}/{case.name}: <d{name}, u> = {analytic!r} but finite differences give {fd!r} "
                f"(|diff| {abs(fd - analytic):.3g} > {bound_:.3g})")


def _directional(spec, bound: tuple, i: int, u: np.ndarray, g: np.ndarray) -> float:
    """<g, J u> by central differences with one Richardson step: (4 D(h/2) - D(h)) / 3, error O(h^4)."""
    x = bound[i]
    h = 1e-6 * max(1.0, float(np.max(np.abs(x))) if x.size else 1.0)

    def central(h):
        plus, minus = list(bound), list(bound)
        plus[i], minus[i] = x + h * u, x - h * u
        fp = np.asarray(spec.run_reference(*plus), np.float64)
        fm = np.asarray(spec.run_reference(*minus), np.float64)
        return float(np.sum(g * (fp - fm)) / (2 * h))

    return (4 * central(h / 2) - central(h)) / 3


def fd_cases(spec, limit: int = 1 << 14) -> list:
    """The op's float64 fixed cases with finite inputs and outputs, small enough for finite differences."""
    out = []
    for case in spec.get_cases("float64"):
        arrays = [a for a in case.args if isinstance(a, np.ndarray) and a.dtype.kind == "f"]
        if not arrays or sum(a.size for a in arrays) > limit or not all(np.isfinite(a).all() for a in arrays):
            continue
        with np.errstate(all="ignore"):
            if not np.isfinite(np.asarray(spec.run_reference(*case.args, **case.kwargs))).all():
                continue
        out.append(case)
    return out


def check_backward_kernel(spec, case, dtype: str, backend: str = "cpu") -> list:
    """The backend's backward kernel on a backward case, each gradient judged like a conformance output."""
    __tracebackhide__ = True
    bwd = spec.backward_op
    kernel = kernels(bwd, get_backend(backend))[0]
    bound = bwd.bind(*case.args, **case.kwargs)
    got = kernel.fn(*bound)
    ref = bwd.run_reference(*bound)
    metas = bwd.out_metas(bound)
    assert isinstance(got, tuple) and len(got) == len(bwd.wrt), f"{bwd.name}: expected a tuple of {len(bwd.wrt)}"
    for i, (o, r, m) in enumerate(zip(got, ref, metas)):
        where = f"{bwd.name}/{dtype}/{case.name}: d{bwd.wrt[i]}"
        if m is None:
            assert o is None and r is None, f"{where}: expected None"
            continue
        r = np.asarray(r, np.float64)
        out_dtype = getattr(m[1], "name", m[1])
        problem = contract(o, r, out_dtype)
        assert problem is None, f"{where}: {problem}"
        verdict = compare(o, r, bwd.tolerance_for(dtype, i, case), out_dtype, override=case.tolerance is not None)
        assert verdict.ok, f"{where}: {verdict.message}"
    return got
