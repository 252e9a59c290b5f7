"""Checks for an op's backward: its float64 reference VJP against central finite differences of the float64
forward reference, and the cpu backward kernel against that reference VJP.

The finite-difference check is directional: for random directions u of each differentiable input x,
(f(x + h u) - f(x - h u)) / 2h, contracted with the upstream gradient g, must equal <vjp(g), v>, where v is
the direction actually taken (x +- h u round: v = ((x + h u) - (x - h u)) / 2h, not quite u for inputs
far from 1). The error of a Richardson-extrapolated central difference in float64 is O(h^4) + O(eps / h)
rounding noise; the bound is |vjp| |v| * 1e-6 (the Cauchy-Schwarz scale of the product) plus that noise,
estimated from the outputs and inputs. No single step suits every case: the input's magnitude sets the
curvature of scale-invariant ops (rmsnorm rows of 5e6), its spread that of shift-invariant ones (softmax
rows near 1e8: a step of 1e-6 * 1e8 = 100 would be meaningless), and a constant (eps) that of a norm's
constant rows; the VJP must agree at one of the three.
"""

from __future__ import annotations

import math

import numpy as np

from opport import casegen
from opport.accuracy import compare, contract
from opport.dispatch import get_backend, kernels

FD_RTOL = 1e-6
EPS = float(np.finfo(np.float64).eps)


def as64(a):
    return a.astype(np.float64) if isinstance(a, np.ndarray) and a.dtype.kind in "fV" else a


def backward_args64(bwd, fwd_bound: tuple, grad: np.ndarray) -> tuple:
    """The backward's arguments for float64 forward arguments: what the forward saves, in float64, unrounded.
    For an op with several outputs (add_rmsnorm), `grad` stacks their upstream gradients along a new first axis."""
    fwd = bwd.parent
    by_name = dict(zip(fwd.params, fwd_bound))
    if bwd.grads == ("grad",):
        by_name["grad"] = grad
        if "out" in bwd.params:
            by_name["out"] = fwd.run_reference(*fwd_bound)
    else:  # an op with several outputs: `grad` stacks one upstream gradient per floating output, as _value does
        by_name.update(zip(bwd.grads, grad if len(bwd.grads) > 1 else (grad,)))
        by_name.update(zip(bwd.saved_outputs, fwd.run_reference(*fwd_bound)))
    if fwd.train_forward is not None:
        by_name.update(zip(fwd.train_forward.stats, fwd.train_forward.run_stats(*fwd_bound)))
    return tuple(by_name[p] for p in bwd.params)


def _value(spec, bound) -> np.ndarray:
    """The forward reference's floating outputs in float64, several (all shaped alike) stacked; integer outputs (a
    router's indices, group offsets) are left out: they take no gradient."""
    outs = spec.run_reference(*bound)
    if spec.integer_outputs:
        outs = tuple(o for o, name in zip(outs, spec.output_names) if name not in spec.integer_outputs)
        outs = outs[0] if len(outs) == 1 else outs
    return np.asarray(outs, np.float64)


def check_vjp_against_fd(spec, case, probes: int = 3):
    """The op's reference VJP against central differences of its forward reference, for one forward case."""
    __tracebackhide__ = True
    bwd = spec.backward_op
    bound = tuple(as64(a) for a in spec.bind(*case.args, **case.kwargs))
    out = _value(spec, bound)
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
            tries = [_fd_try(spec, bound, spec.params.index(name), u, g, dx, h) for h in _steps(x)]
            assert any(ok for ok, _ in tries), (
                f"{bwd.name}/{case.name}: <d{name}, u> disagrees with finite differences at every step: "
                + "; ".join(msg for _, msg in tries))


def _steps(x: np.ndarray) -> tuple:
    """Steps to difference with: 1e-6 of the input's magnitude (scale-invariant ops: the norms), of its spread
    (shift-invariant ones: softmax rows near 1e8) and of 1 (curvature set by a constant: a norm's eps on a
    constant row of 5e6). The VJP must agree with the differences at one of them."""
    if not x.size:
        return (1e-6,)
    with np.errstate(over="ignore", invalid="ignore"):
        sizes = (float(np.max(np.abs(x))), float(np.max(x) - np.min(x)), 1.0)
    return tuple(sorted({1e-6 * max(1.0, s) for s in sizes if math.isfinite(s)}))


def _fd_try(spec, bound: tuple, i: int, u: np.ndarray, g: np.ndarray, dx: np.ndarray, h: float) -> tuple:
    """(ok, message): the VJP against Richardson-extrapolated differences with step h, along the direction v
    actually taken (x +- h u round), within FD_RTOL |dx| |v| plus the differences' rounding noise: that of
    the outputs, eps sum|g| (|f+| + |f-|) / 2h, and that of the inputs through the Jacobian, eps sum|dx x| / h
    (a mean of rows of 5e6 rounds by 5e6 eps). A step at which x +- h u overflows decides nothing."""
    fd, v, noise = _directional(spec, bound, i, u, g, h)
    analytic = float(np.sum(dx * v))
    noise += EPS * float(np.sum(np.abs(dx * bound[i]))) / h
    allowed = FD_RTOL * float(np.linalg.norm(dx) * np.linalg.norm(v)) + 16 * noise + 1e-12
    ok = abs(fd - analytic) <= allowed  # False for NaN
    return ok, f"step {h:.3g}: {analytic!r} vs {fd!r} (|diff| {abs(fd - analytic):.3g} > {allowed:.3g})"


def _directional(spec, bound: tuple, i: int, u: np.ndarray, g: np.ndarray, h: float) -> tuple:
    """(<g, J v>, v, output rounding noise) by central differences with one Richardson step: (4 D(h/2) - D(h)) / 3,
    error O(h^4), where v = (4 v(h/2) - v(h)) / 3 combines the directions v(h) = ((x + h u) - (x - h u)) / 2h."""
    x = bound[i]

    def central(h):
        plus, minus = list(bound), list(bound)
        with np.errstate(over="ignore", invalid="ignore"):
            plus[i], minus[i] = x + h * u, x - h * u
            if not (np.isfinite(plus[i]).all() and np.isfinite(minus[i]).all()):
                return math.nan, np.zeros_like(x), math.nan
        fp, fm = _value(spec, plus), _value(spec, minus)
        noise = EPS * float(np.sum(np.abs(g) * (np.abs(fp) + np.abs(fm)))) / (2 * h)
        return float(np.sum(g * (fp - fm)) / (2 * h)), (plus[i] - minus[i]) / (2 * h), noise

    (d1, v1, n1), (d2, v2, n2) = central(h), central(h / 2)
    return (4 * d2 - d1) / 3, (4 * v2 - v1) / 3, (4 * n2 + n1) / 3


def fd_cases(spec, limit: int = 1 << 14) -> list:
    """The op's float64 fixed cases with finite inputs and outputs, small enough for finite differences."""
    out = []
    for case in spec.get_cases("float64"):
        arrays = [a for a in case.args if isinstance(a, np.ndarray) and a.dtype.kind == "f"]
        if not arrays or sum(a.size for a in arrays) > limit or not all(np.isfinite(a).all() for a in arrays):
            continue
        with np.errstate(all="ignore"):
            if not np.isfinite(_value(spec, spec.bind(*case.args, **case.kwargs))).all():
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
