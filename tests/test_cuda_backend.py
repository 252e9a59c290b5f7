"""The cuda backend's Triton kernels (interpreter mode on CPU-only machines) against the float64 references.

Every op with a kernel file in opport/backends/cuda/ runs its fixed conformance cases in each dtype,
strided/expanded/offset views of its inputs, and the chunked paths of the row-wise kernels (with a
small tile forced). All under `opport.strict()`, so a silent fallback to cpu fails instead of passing.
"""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # not triton: the backend must import it (after choosing its mode)

import opport  # noqa: E402
from opport.dispatch.registry import get_backend  # noqa: E402
from opport.dtypes import np_dtype  # noqa: E402
from opport.ops import all_ops  # noqa: E402

CUDA = get_backend("cuda")
if CUDA.unavailable():
    pytest.skip(f"cuda backend unavailable: {CUDA.unavailable()}", allow_module_level=True)

DTYPES = ("float32", "float16", "bfloat16")
OPS = [name for name in all_ops() if importlib.util.find_spec(f"opport.backends.cuda.{name}") is not None]
KNOWN = {}  # case id -> reason, from known_failures.txt
_kf = importlib.util.find_spec("opport.backends.cuda")
if _kf and _kf.submodule_search_locations:
    path = pathlib.Path(next(iter(_kf.submodule_search_locations))) / "known_failures.txt"
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                cid, _, reason = line.partition(" ")
                KNOWN[cid] = reason.strip()


# --------------------------------------------------------------------------- conversions


def to_torch(a, device=None):
    if not isinstance(a, np.ndarray):
        return a
    device = device or CUDA.torch_device()
    if a.dtype == np_dtype("bfloat16"):
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def to_numpy(t):
    """A tensor's values as NumPy in its own dtype (bfloat16 via ml_dtypes), any strides."""
    if not isinstance(t, torch.Tensor):
        return t
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(np_dtype("bfloat16"))
    return t.numpy().copy()


# --------------------------------------------------------------------------- comparison


def assert_close(spec, dtype, out, ref, tol, label):
    """numerics.md 3.1: shape and dtype first, special values exact, then the declared metric."""
    __tracebackhide__ = True
    assert str(out.dtype).removeprefix("torch.") == out_dtype(spec, dtype), f"{label}: dtype {out.dtype}"
    o = out.detach().cpu().double().numpy()
    r = np.asarray(ref, np.float64)
    assert o.shape == r.shape, f"{label}: shape {o.shape} != reference {r.shape}"
    with np.errstate(over="ignore", invalid="ignore"):
        r_rounded = r.astype(np_dtype(out_dtype(spec, dtype))).astype(np.float64)  # overflow to inf is legal
    special = ~np.isfinite(r_rounded)
    nan_diff = np.isnan(o) != np.isnan(r_rounded)
    assert not nan_diff.any(), f"{label}: NaN positions differ ({_where(nan_diff)})"
    inf_bad = special & ~np.isnan(r_rounded) & (o != r_rounded)
    assert not inf_bad.any(), f"{label}: inf mismatch at {_where(inf_bad)}"
    fin = ~special
    bad = fin & ~np.isfinite(o)
    assert not bad.any(), f"{label}: non-finite output where the reference is finite ({_where(bad)})"
    err = np.abs(o - r)[fin]
    if tol.metric == "normwise":
        bound = tol.atol + tol.rtol * (np.abs(r[fin]).max() if fin.any() else 0.0)
        ok = err <= bound
    elif tol.metric == "ulp_or_abs":
        spacing = np.spacing(np.abs(r_rounded[fin]).astype(np_dtype(dtype))).astype(np.float64)
        ok = (err <= tol.atol) | (err <= tol.ulp * spacing) | (err <= tol.rtol * np.abs(r[fin]))
    else:
        ok = err <= tol.atol + tol.rtol * np.abs(r[fin])
    if not ok.all():
        i = int(np.argmax(np.where(ok, 0, err)))
        raise AssertionError(f"{label}: {int((~ok).sum())}/{ok.size} elements out of tolerance {tol}; "
                             f"worst out {o[fin][i]!r} ref {r[fin][i]!r}")


def _where(mask):
    idx = np.argwhere(mask)
    return f"{len(idx)} positions, first {tuple(idx[0])}" if len(idx) else "none"


def out_dtype(spec, dtype):
    """The dtype a case of `dtype` must return (cross_entropy: always float32)."""
    return spec.fixed_out_dtype or dtype


def run_case(spec, dtype, case, args=None):
    """The cuda kernel on `args` (torch, default: the case's arrays) vs the reference on the same values."""
    args = [to_torch(a) for a in case.args] if args is None else args
    before = [a.clone() if isinstance(a, torch.Tensor) else None for a in args]
    with opport.strict():
        out = spec(*args, backend="cuda", **case.kwargs)
    for a, b in zip(args, before):
        if b is not None:
            assert torch.equal(a, b) or torch.equal(torch.isnan(a), torch.isnan(b)), f"{spec.name}: input mutated"
    ref = spec.run_reference(*[to_numpy(a) for a in args], **case.kwargs)
    tol = case.tolerance or spec.tolerances[dtype]
    assert_close(spec, dtype, out, ref, tol, f"{spec.name}/cuda/{dtype}/{case.name}")
    return out


def case_params():
    for name in OPS:
        spec = all_ops()[name]
        for dtype in DTYPES:
            for case in spec.get_cases(dtype):
                cid = f"{name}/cuda/{dtype}/{case.name}"
                marks = [pytest.mark.xfail(reason=KNOWN[cid], strict=True)] if cid in KNOWN else []
                yield pytest.param(name, dtype, case.name, id=cid, marks=marks)


_CASES: dict = {}


def get_case(name, dtype, case_name):
    key = (name, dtype)
    if key not in _CASES:
        _CASES[key] = {c.name: c for c in all_ops()[name].get_cases(dtype)}
    return _CASES[key][case_name]


@pytest.mark.parametrize("name,dtype,case_name", list(case_params()))
def test_fixed_cases(name, dtype, case_name):
    run_case(all_ops()[name], dtype, get_case(name, dtype, case_name))


# --------------------------------------------------------------------------- layouts


def _gapped(t):
    """Same values in a buffer twice as wide, NaN (or 0 for ints) in the gaps: a [..., ::2] view."""
    buf = torch.full((*t.shape[:-1], 2 * t.shape[-1]), float("nan") if t.is_floating_point() else 0, dtype=t.dtype,
                     device=t.device)
    buf[..., ::2] = t
    return buf[..., ::2]


def _transposed(t):
    return t.mT.contiguous().mT if t.dim() >= 2 else t


def _offset(t):
    flat = torch.full((t.numel() + 3,), float("nan") if t.is_floating_point() else 0, dtype=t.dtype, device=t.device)
    flat[3:] = t.reshape(-1)
    return flat.as_strided(t.shape, t.contiguous().stride(), 3)


def _expanded(t):
    """Stride 0 along the first dim (values repeat: the reference sees the same repeated values)."""
    return t[:1].expand_as(t) if t.dim() >= 2 and t.shape[0] > 1 else t


LAYOUTS = {"gapped": _gapped, "transposed": _transposed, "offset": _offset, "expanded": _expanded}


def _layout_cases(name, dtype, n=3):
    """The first `n` non-empty cases of an op (cheap ones: under 100K elements)."""
    picked = []
    for case in all_ops()[name].get_cases(dtype):
        arrays = [a for a in case.args if isinstance(a, np.ndarray)]
        if all(a.size > 0 for a in arrays) and sum(a.size for a in arrays) < 100_000 and "edge" not in case.tags:
            picked.append(case)
        if len(picked) == n:
            break
    return picked


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", OPS)
def test_strided_inputs(name, dtype, layout):
    spec = all_ops()[name]
    cases = _layout_cases(name, dtype)
    assert cases, f"{name} has no small case to re-layout"
    for case in cases:
        args = [LAYOUTS[layout](to_torch(a)) if isinstance(a, np.ndarray) and a.ndim else to_torch(a) for a in case.args]
        run_case(spec, dtype, case, args)


# --------------------------------------------------------------------------- chunked row paths


@pytest.mark.parametrize("name", [n for n in ("rmsnorm", "layernorm", "softmax", "cross_entropy") if n in OPS])
def test_chunked_rows(name, monkeypatch):
    """Rows longer than one tile take the multi-pass path; force it with a 128-element tile (GPUs take it past 16K)."""
    from opport.backends.cuda import _launch

    monkeypatch.setattr(_launch, "INTERP_TILE", 128)
    monkeypatch.setattr(_launch, "ROW_MAX", 128)
    spec = all_ops()[name]
    for dtype in ("float32", "bfloat16"):
        picked = [c for c in spec.get_cases(dtype) if 128 < _row_len(c) and c.args[0].size <= 20_000][:4]
        assert picked, f"{name} has no case with rows longer than 128"
        for case in picked:
            run_case(spec, dtype, case)


def _row_len(case) -> int:
    x = case.args[0]
    return x.shape[case.kwargs.get("axis", -1)] if x.ndim else 1


# --------------------------------------------------------------------------- dispatch


def test_mode_and_device():
    assert CUDA.mode() in ("compiled", "interpreter")
    assert CUDA.torch_device() == ("cuda" if CUDA.mode() == "compiled" else "cpu")
    if CUDA.mode() == "interpreter":
        import os

        assert os.environ.get("TRITON_INTERPRET") == "1"


def test_explain_names_the_triton_kernel():
    x = to_torch(np.ones((4, 64), np.float32))
    d = opport.explain("rmsnorm", x, backend="cuda")
    assert (d.backend, d.kernel, d.mode) == ("cuda", "cuda.rmsnorm", CUDA.mode())
    assert d.fallback is None


def test_float64_falls_back_with_reason():
    x = to_torch(np.ones((4, 64), np.float64))
    d = opport.explain("rmsnorm", x, backend="cuda")
    assert d.backend == "cpu" and "float64" in d.fallback
    with opport.strict(), pytest.raises(opport.UnsupportedError, match="float64"):
        opport.rmsnorm(x, backend="cuda")


@pytest.mark.skipif(CUDA.mode() != "compiled", reason="needs a CUDA device")
def test_cuda_tensors_select_the_triton_kernel():
    x = torch.ones((4, 64), device="cuda")
    d = opport.explain("rmsnorm", x)
    assert (d.backend, d.kernel) == ("cuda", "cuda.rmsnorm")


def test_case_ids_in_known_failures_exist():
    """Stale ids in known_failures.txt are an error (array-api-tests style)."""
    ids = {f"{n}/cuda/{d}/{c.name}" for n in OPS for d in DTYPES for c in all_ops()[n].get_cases(d)}
    stale = sorted(set(KNOWN) - ids)
    assert not stale, f"stale known failures: {stale}"

