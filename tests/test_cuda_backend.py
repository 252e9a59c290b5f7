"""The cuda backend's Triton kernels (interpreter mode on CPU-only machines) against the float64 references.

`opport conformance --backend cuda` runs every case of every op; this file is the fast developer loop
plus what the conformance suite does not reach: a smoke subset of each op's fixed cases in every dtype,
NaN-gapped and other strided views, the chunked (multi-pass) row paths that GPUs take past 16K columns,
layouts that force the documented copy, the interpreter's bfloat16 work-arounds, mode detection,
`explain`, and fallbacks. Every call runs under `opport.strict()`, so a silent cpu fallback fails.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # not triton: the backend must import it after choosing its mode

import opport  # noqa: E402
from opport import accuracy  # noqa: E402
from opport.dispatch.adapters import metas_of  # noqa: E402
from opport.dispatch.registry import get_backend  # noqa: E402
from opport.dtypes import FP8, np_dtype  # noqa: E402
from opport.ops import all_ops  # noqa: E402
from opport.public import function  # noqa: E402

CUDA = get_backend("cuda")
if CUDA.unavailable():
    pytest.skip(f"cuda backend unavailable: {CUDA.unavailable()}", allow_module_level=True)

DTYPES = ("float32", "float16", "bfloat16")
OPS = [name for name in all_ops() if importlib.util.find_spec(f"opport.backends.cuda.{name}") is not None]
SMALL = 50_000  # elements per case in this file: the interpreter runs one program at a time


# --------------------------------------------------------------------------- conversions and comparison


def to_torch(a, device=None):
    if not isinstance(a, np.ndarray):
        return a
    device = device or CUDA.torch_device()
    a = np.ascontiguousarray(a).reshape(a.shape)  # ascontiguousarray alone makes a 0-d array (a scale) 1-d
    if a.dtype == np_dtype("bfloat16"):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(device)
    if a.dtype.name in FP8:
        return torch.from_numpy(a.view(np.uint8)).view(getattr(torch, a.dtype.name)).to(device)
    return torch.from_numpy(a).to(device)


def to_numpy(t):
    """A tensor's values as NumPy in its own dtype (bfloat16 via ml_dtypes), whatever its strides."""
    if not isinstance(t, torch.Tensor):
        return t
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(np_dtype("bfloat16"))
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.contiguous().view(torch.uint8).numpy().view(np_dtype(str(t.dtype).removeprefix("torch.")))
    return t.numpy().copy()


def out_dtype(spec, dtype):
    """The dtype a case of `dtype` must return (cross_entropy: always float32)."""
    return spec.fixed_out_dtype or dtype


def assert_close(spec, dtype, out, ref, tol, label):
    """docs/numerics.md 3.1: dtype and shape first, special values exact, then the op's declared metric."""
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
        ok = err <= tol.atol + tol.rtol * (np.abs(r[fin]).max() if fin.any() else 0.0)
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
    return f"{len(idx)} positions, first {tuple(int(i) for i in idx[0])}" if len(idx) else "none"


def run_case(spec, dtype, case, args=None):
    """The cuda kernel on `args` (torch; default: the case's arrays) vs the reference on the same values."""
    args = [to_torch(a) for a in case.args] if args is None else args
    if spec.writes:
        return _run_write_case(spec, dtype, case, args)
    before = [a.clone() if isinstance(a, torch.Tensor) else None for a in args]
    with opport.strict():
        out = function(spec)(*args, backend="cuda", **case.kwargs)
    for a, b in zip(args, before):
        if b is not None and b.element_size() == 1 and b.is_floating_point():  # fp8: torch compares bytes only
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "input mutated"
        elif b is not None:
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), "input mutated"
    ref = spec.run_reference(*[to_numpy(a) for a in args], **case.kwargs)
    label = f"{spec.name}/cuda/{dtype}/{case.name}"
    if spec.n_outputs > 1 or spec.dtype_pos is not None:  # outputs and dtypes from the declaration
        metas = spec.out_metas(metas_of(spec, spec.bind(*args, **case.kwargs)))
        outs, refs = (out, ref) if isinstance(ref, tuple) else ((out,), (ref,))
        for i, (o, r, (_, odt)) in enumerate(zip(outs, refs, metas)):
            o = to_numpy(o)
            assert accuracy.contract(o, r, odt) is None, f"{label}: {accuracy.contract(o, r, odt)}"
            v = accuracy.compare(o, r, spec.tolerance_for(dtype, i, case), odt)
            assert v.ok, f"{label} output {i}: {v.message}"
        return out
    assert_close(spec, dtype, out, ref, case.tolerance or spec.tolerances[dtype], label)
    return out


def _run_write_case(spec, dtype, case, args):
    """An op that writes in place: returns None; its region holds the reference's values, the rest is unchanged."""
    before = [to_numpy(a).copy() if isinstance(a, torch.Tensor) else a for a in args]
    with opport.strict():
        assert function(spec)(*args, backend="cuda", **case.kwargs) is None
    regions = spec.written_region(tuple(spec.bind(*before, **case.kwargs)))
    refs = spec.run_reference(*before, **case.kwargs)
    for j, (i, region, ref) in enumerate(zip(spec.write_pos, regions, refs)):
        got, old = to_numpy(args[i]), before[i]
        v = accuracy.compare(got[region], np.asarray(ref, np.float64), spec.tolerance_for(dtype, j, case),
                             str(got.dtype))  # each written array: its own tolerance, in its own dtype
        assert v.ok, f"{spec.name}/cuda/{dtype}/{case.name}/{spec.writes[j]}: {v.message}"
        keep = np.ones(got.shape, bool)
        keep[region] = False
        assert got[keep].tobytes() == old[keep].tobytes(), f"{spec.name}: {spec.writes[j]} changed outside its region"
    for a, b in zip(args, before):
        if isinstance(a, torch.Tensor) and not any(a is args[i] for i in spec.write_pos):
            assert to_numpy(a).tobytes() == b.tobytes(), "input mutated"


def _size(case) -> int:
    return sum(a.size for a in case.args if isinstance(a, np.ndarray))


def pick(name, dtype, n, want=lambda case: True):
    """The first `n` small cases of an op that `want` accepts, preferring LLM shapes and edge cases."""
    cases = [c for c in all_ops()[name].get_cases(dtype) if _size(c) <= SMALL and want(c)]
    cases.sort(key=lambda c: ("llm" not in c.tags and "edge" not in c.tags, "edge" in c.tags))
    return cases[:n]


# --------------------------------------------------------------------------- fixed cases (smoke subset)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", OPS)
def test_fixed_cases(name, dtype):
    cases = pick(name, dtype, 4)
    assert cases, f"{name} has no case under {SMALL} elements"
    for case in cases:
        run_case(all_ops()[name], dtype, case)


# --------------------------------------------------------------------------- layouts


def _fill(t):
    return float("nan") if t.is_floating_point() else 0


def _gapped(t):
    """Same values in a buffer twice as wide, NaN (0 for ints) in the gaps: a [..., ::2] view."""
    buf = torch.full((*t.shape[:-1], 2 * t.shape[-1]), _fill(t), dtype=t.dtype, device=t.device)
    buf[..., ::2] = t
    return buf[..., ::2]


def _transposed(t):
    return t.mT.contiguous().mT if t.dim() >= 2 else t


def _offset(t):
    flat = torch.full((t.numel() + 3,), _fill(t), dtype=t.dtype, device=t.device)
    flat[3:] = t.reshape(-1)
    return flat.as_strided(t.shape, t.contiguous().stride(), 3)


def _expanded(t):
    """Stride 0 along the first dim (the reference sees the same repeated values)."""
    return t[:1].expand_as(t) if t.dim() >= 2 and t.shape[0] > 1 else t


LAYOUTS = {"gapped": _gapped, "transposed": _transposed, "offset": _offset, "expanded": _expanded}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", OPS)
def test_strided_inputs(name, dtype, layout):
    spec = all_ops()[name]
    if spec.writes and layout == "expanded":
        pytest.skip("an op that writes in place is not given a broadcast (stride-0) view to write through")
    for case in pick(name, dtype, 2, lambda c: "edge" not in c.tags and all(
            a.size for a in c.args if isinstance(a, np.ndarray))):
        args = [LAYOUTS[layout](to_torch(a)) if isinstance(a, np.ndarray) and a.ndim else to_torch(a) for a in case.args]
        run_case(spec, dtype, case, args)


def _irregular(t):
    """Same values, five leading dims whose strides merge with nothing: the launchers must copy (documented)."""
    perm = list(range(t.dim()))
    return t.permute(*reversed(perm[:-1]), perm[-1]).contiguous().permute(*reversed(perm[:-1]), perm[-1])


@pytest.mark.parametrize("name", [n for n in ("rmsnorm", "softmax", "silu", "swiglu", "layernorm", "gelu") if n in OPS])
def test_irregular_leading_dims(name):
    spec = all_ops()[name]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 2, 3, 2, 33)).astype(np.float32)
    arrays = [x] + ([rng.standard_normal(x.shape).astype(np.float32)] if name == "swiglu" else [])
    args = [_irregular(to_torch(a)) for a in arrays]
    assert not args[0].is_contiguous()
    case = type(next(iter(spec.get_cases("float32"))))(f"irregular-{name}", tuple(arrays))
    run_case(spec, "float32", case, args)


def test_matmul_irregular_batch_dims():
    spec = all_ops()["matmul"]
    rng = np.random.default_rng(1)
    a = rng.standard_normal((2, 3, 2, 3, 17, 20)).astype(np.float32)
    b = rng.standard_normal((2, 3, 2, 3, 20, 9)).astype(np.float32)
    args = [_irregular(to_torch(a)), _irregular(to_torch(b)), None]
    case = type(next(iter(spec.get_cases("float32"))))("irregular-batch", (a, b, None))
    run_case(spec, "float32", case, args)


# --------------------------------------------------------------------------- chunked row paths


@pytest.mark.parametrize("name", [n for n in ("rmsnorm", "layernorm", "softmax", "cross_entropy") if n in OPS])
def test_chunked_rows(name, monkeypatch):
    """Rows longer than one tile take the multi-pass path (GPUs do past 16K columns); force it with a 128-wide tile."""
    from opport.backends.cuda import _launch

    monkeypatch.setattr(_launch, "INTERP_TILE", 128)
    monkeypatch.setattr(_launch, "ROW_MAX", 128)
    spec = all_ops()[name]
    for dtype in ("float32", "bfloat16"):
        cases = pick(name, dtype, 3, lambda c: _row_len(c) > 128 and _size(c) <= 20_000)
        assert cases, f"{name} has no case with rows longer than 128"
        for case in cases:
            run_case(spec, dtype, case)


def _row_len(case) -> int:
    x = case.args[0]
    return x.shape[case.kwargs.get("axis", -1)] if x.ndim else 1


# --------------------------------------------------------------------------- interpreter work-arounds


from opport.backends.cuda._launch import f32, narrow, tl, triton  # noqa: E402 (after the mode is chosen)


@triton.jit
def _roundtrip_kernel(x_ptr, wide_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(wide_ptr + offs, f32(tl.load(x_ptr + offs, mask=mask)), mask=mask)
    y = tl.load(wide_ptr + offs, mask=mask) * 1.0009765625  # 1 + 2^-10: moves values off the bfloat16 grid
    tl.store(y_ptr + offs, narrow(y, y_ptr.dtype.element_ty), mask=mask)


def test_bfloat16_conversions_are_exact():
    """f32/narrow: every bfloat16 bit pattern widens exactly; float32 (subnormals included) rounds nearest-even."""
    dev = CUDA.torch_device()
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).to(dev)
    wide, y = torch.empty(bits.shape, device=dev), torch.empty_like(bits)
    _roundtrip_kernel[(1,)](bits, wide, y, bits.numel(), BLOCK=1 << 16)
    expect = bits.float()
    # compiled kernels may flush subnormals (docs/numerics.md 3.1 rule 9): judged on normal values there
    judged = torch.ones_like(expect, dtype=torch.bool) if CUDA.mode() == "interpreter" else expect.abs() >= 2.0**-126
    same = (wide == expect) | (wide.isnan() & expect.isnan()) | ~judged
    assert bool(same.all()), f"{int((~same).sum())} bfloat16 values widened wrongly"
    y_expect = (expect * 1.0009765625).to(torch.bfloat16)
    same = (y.view(torch.int16) == y_expect.view(torch.int16)) | (y.isnan() & y_expect.isnan()) | ~judged
    assert bool(same.all()), f"{int((~same).sum())} float32 values rounded wrongly"


def test_triton_imported_first():
    """torch.compile and user code may import triton before opport picks interpreter mode; kernels must still run."""
    code = ("import torch, triton, triton.language, opport\n"
            "from opport.dispatch.registry import get_backend\n"
            "x = torch.randn(4, 300, device=get_backend('cuda').torch_device())\n"
            "with opport.strict():\n"
            "    y = opport.softmax(x, backend='cuda')\n"
            "assert torch.allclose(y, torch.softmax(x, -1), atol=1e-6)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_interpreter_patches_are_undone_after_each_launch():
    """The interpreter patches triton.language for a launch (opport skips re-patching it for helper calls inside
    one, _launch._patch_lang_once_per_launch): after a launch that calls helpers, kernels and helpers still
    compute right and triton.language's builtins are the originals again, so code outside a launch sees them."""
    if CUDA.mode() != "interpreter":
        pytest.skip("the interpreter's patching only")
    import triton.language as tl

    before = {n: getattr(tl, n) for n in ("load", "store", "arange", "zeros", "dot")}
    x = torch.randn(3, 200, device=CUDA.torch_device())
    for _ in range(2):  # softmax's kernel calls tl.max / tl.sum (helpers of triton.language.standard)
        torch.testing.assert_close(opport.softmax(x, backend="cuda"), torch.softmax(x, -1), atol=1e-6, rtol=1e-6)
    assert {n: getattr(tl, n) for n in before} == before



def test_the_interpreters_lighter_types_keep_tritons_answers():
    """_launch._lighter_types builds a block_type's shape once per shape: the same kinds of objects, names and
    errors as Triton's own, and a bad shape still refused."""
    if CUDA.mode() != "interpreter":
        pytest.skip("the interpreter's patching only")
    import triton.language as tl

    a, b = tl.block_type(tl.float32, [16, 32]), tl.block_type(tl.float16, tl.tuple([tl.constexpr(16), 32]))
    assert type(a.shape) is tl.tuple and a.shape.values == [16, 32] and a.numel == 512
    assert a.name == "<['16', '32'], fp32>" and b.shape.values == [16, 32] and a != b
    assert a == tl.block_type(tl.float32, [16, 32]) and a.with_element_ty(tl.float16) == b
    t = tl.tensor(None, a)
    assert [type(s) for s in t.shape] == [tl.constexpr] * 2 and t.numel.value == 512 and t.dtype == tl.float32
    s = tl.tensor(None, tl.float32)
    assert len(s.shape) == 0 and s.numel.value == 1 and tl.core._unwrap_if_constexpr(tl.constexpr(3)) == 3
    with pytest.raises(ValueError, match="power of 2"):
        tl.block_type(tl.float32, [16, 24])
    with pytest.raises(TypeError, match="0d"):
        tl.block_type(tl.float32, [])
    x = torch.randn(4, 1, device=CUDA.torch_device())  # a kernel broadcasting a column against a tile still does
    torch.testing.assert_close(opport.softmax(x.expand(4, 96), backend="cuda"), torch.full((4, 96), 1 / 96))


def test_the_interpreter_skips_overflow_checks_only_where_their_assert_is_dropped():
    """_launch._no_dead_overflow_checks: without debug Triton's int overflow check ends in a device_assert that is
    nothing (the compiler deletes the check); the interpreter skips it then, and runs Triton's own with debug on."""
    if CUDA.mode() != "interpreter":
        pytest.skip("the interpreter's patching only")
    from types import SimpleNamespace

    import triton.language as tl
    from triton.language.semantic import TritonSemantic

    asserted, ops = [], []
    options = SimpleNamespace(debug=False, sanitize_overflow=True)
    fake = SimpleNamespace(builder=SimpleNamespace(options=options), device_assert=lambda c, msg, m: asserted.append(msg))
    for name in ("cast", "less_equal", "greater_equal", "and_", "scalar_constant"):
        setattr(fake, name, lambda *a, name=name: ops.append(name))
    lhs = SimpleNamespace(type=SimpleNamespace(scalar=tl.int32))
    check = TritonSemantic.binary_op_sanitize_overflow_impl
    check(fake, lhs, lhs, lambda *a: None)
    assert asserted == ops == []  # debug off: nothing to assert, nothing computed
    options.debug = True
    check(fake, lhs, lhs, lambda *a: None)
    assert asserted == ["int32 overflow detected for operation <lambda>"] and "cast" in ops  # Triton's own ran
    x = torch.arange(-3, 5, dtype=torch.float32, device=CUDA.torch_device()).reshape(2, 4)
    torch.testing.assert_close(opport.softmax(x, backend="cuda"), torch.softmax(x, -1))  # index arithmetic still right

# --------------------------------------------------------------------------- dispatch


def test_mode_and_device():
    assert CUDA.mode() in ("compiled", "interpreter")
    assert CUDA.torch_device() == ("cuda" if CUDA.mode() == "compiled" else "cpu")
    assert {"torch", "triton"} <= set(CUDA.versions())


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


def test_attention_head_dim_over_256_is_refused():
    q = to_torch(np.ones((1, 2, 4, 512), np.float32))
    d = opport.explain("attention", q, q, q, backend="cuda")
    assert d.backend == "cpu" and "D, Dv <= 256" in d.fallback
    with opport.strict(), pytest.raises(opport.UnsupportedError, match="256"):
        opport.attention(q, q, q, backend="cuda")


@pytest.mark.skipif(CUDA.mode() != "compiled", reason="needs a CUDA device")
def test_cuda_tensors_select_the_triton_kernel():
    x = torch.ones((4, 64), device="cuda")
    d = opport.explain("rmsnorm", x)
    assert (d.backend, d.kernel) == ("cuda", "cuda.rmsnorm")


# ------------------------------------------------------------------- backward kernels: norms, softmax, activations (cudaA)
# `opport conformance --backend cuda` runs every backward case; in the interpreter its tiles hold whole rows of up
# to 64K elements, so the paths below (chunked rows, several programs each summing several row tiles into its
# partial row) are reached here, with the tiles shrunk.

from opport.ops import get_op  # noqa: E402
from opport.spec import Case  # noqa: E402

NORM_BACKWARDS = ("rmsnorm_backward", "layernorm_backward")


def _backward_case(name, dtype, shape, affine=True, seed=0):
    """A backward case of `name` (its forward's arguments with seeded values, a seeded upstream gradient)."""
    bwd = get_op(name)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 3 + 1
    w = rng.uniform(-2, 2, shape[-1:])
    args = {"rmsnorm_backward": (x, w if affine else None), "layernorm_backward": (x, w, w[::-1] if affine else None),
            "softmax_backward": (x,)}[name]
    args = tuple(None if a is None else a.astype(np_dtype(dtype)) for a in args)
    return bwd, bwd.from_forward(Case(f"{name}-{shape}", args, {}), dtype)


def _run_backward(bwd, case, dtype):
    """The cuda kernel's gradients against the reference VJP on the case's values, each with its tolerance."""
    args = [to_torch(a) for a in case.args]
    with opport.strict():
        got = function(bwd)(*args, backend="cuda", **case.kwargs)
    ref = bwd.run_reference(*case.args, **case.kwargs)
    for i, (out, r) in enumerate(zip(got, ref)):
        assert (out is None) == (r is None), f"{bwd.name} gradient {i}"
        if out is not None:
            assert_close(bwd, dtype, out, r, bwd.tolerance_for(dtype, i, case), f"{bwd.name}/{dtype}/{case.name}/{i}")
    return got


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", [*NORM_BACKWARDS, "softmax_backward"])
def test_backward_chunked_rows(name, dtype, monkeypatch):
    """Rows longer than one tile take the multi-pass backward (GPUs do past 16K columns, 4K for float32 layernorm)."""
    from opport.backends.cuda import _launch

    monkeypatch.setattr(_launch, "INTERP_TILE", 128)
    monkeypatch.setattr(_launch, "ROW_MAX", 128)
    for shape in ((6, 300), (3, 2, 129)):
        _run_backward(*_backward_case(name, dtype, shape), dtype)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("name", NORM_BACKWARDS)
def test_norm_weight_grads_from_many_programs(name, chunked, affine, monkeypatch):
    """Several programs, each summing several row tiles into its own partial row, reduced in a fixed order:
    right, and the same bits on every call."""
    from opport.backends.cuda import _launch

    monkeypatch.setattr(_launch, "INTERP_TILE", 16 if chunked else 64)
    monkeypatch.setattr(_launch, "ROW_MAX", 16 if chunked else 64)
    monkeypatch.setattr(importlib.import_module(f"opport.backends.cuda.{name.removesuffix('_backward')}"),
                        "partial_programs", lambda n_tiles, device: min(n_tiles, 3))
    bwd, case = _backward_case(name, "float32", (50, 37), affine)
    first = _run_backward(bwd, case, "float32")
    again = _run_backward(bwd, case, "float32")
    for a, b in zip(first, again):
        assert a is None or torch.equal(a, b)


def test_activation_backward_infinite_grads_keep_the_reference_signs():
    """Where float32's derivative underflows but float64's does not (silu' below -87, gelu' below -13), an infinite
    grad gives the reference's signed inf, not inf * 0 = NaN; where float64's is 0 too (x = -inf), NaN."""
    x = np.array([-90.0, -200.0, -700.0, -20.0, -30.0, -800.0, -np.inf], np.float32)
    g = np.full_like(x, np.inf)
    for name, kwargs in (("silu_backward", {}), ("gelu_backward", {"approximate": "none"}),
                         ("gelu_backward", {"approximate": "tanh"}), ("swiglu_backward", {})):
        bwd = get_op(name)
        args = (g, x, np.ones_like(x)) if name == "swiglu_backward" else (g, x)
        for dtype in ("float32", "bfloat16"):
            case = Case("inf-grads", tuple(a.astype(np_dtype(dtype)) for a in args), kwargs)
            with np.errstate(invalid="ignore"):  # inf - inf where both are inf: compared as special values
                _run_backward(bwd, case, dtype)


# --------------------------------------------------------------- backward kernels: rope, matmul, cross_entropy, attention (cudaB)
# The conformance suite runs every case of these backwards (and of cross_entropy_forward, attention_forward);
# below: paths its cases do not reach in the interpreter, and the attention backward's exactness claims.


def _attention_grad_case(q, k, v, causal, dtype, grad=None, name="attention"):
    """attention_backward's case for float64 q, k, v (cast to `dtype`): out and lse from the float64 reference."""
    fwd = Case(name, tuple(a.astype(np_dtype(dtype)) for a in (q, k, v)), {"causal": causal, "scale": None})
    g = None if grad is None else grad.astype(np_dtype(dtype))
    return get_op("attention_backward").from_forward(fwd, dtype, grad=g)


def _qkv(shape_q, shape_kv, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape_q), rng.standard_normal(shape_kv), rng.standard_normal(shape_kv)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_backward_first_row_of_causal_sees_one_key_exactly(dtype):
    """Causal, Sq = Sk: row 0 sees key 0 alone, so its dS, hence its dq, is exactly 0 however large v is (the
    max-key form dO.(v_j* - O)); the plain dP - D would leave eps |dO| |v| there."""
    q, k, v = _qkv((1, 4, 24, 32), (1, 2, 24, 32))
    case = _attention_grad_case(q, k, v * (300.0 if dtype == "float16" else 1e4), True, dtype)
    dq, _, _ = _run_backward(get_op("attention_backward"), case, dtype)
    assert bool((dq[:, :, 0] == 0).all())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_backward_visible_neg_inf_key_under_causal_mask(dtype):
    """k[20, 3] = -inf: rows from 20 on see it (score -inf, P = 0, so dq[:, 3] = 0 * -inf = NaN, as the reference);
    rows before it must stay finite although the key sits in their diagonal block (the exact re-run)."""
    q, k, v = _qkv((1, 2, 40, 32), (1, 1, 40, 32), seed=1)
    q[..., 3] = np.abs(q[..., 3]) + 0.1
    k[0, 0, 20, 3] = -np.inf
    case = _attention_grad_case(q, k, v, True, dtype)
    with np.errstate(invalid="ignore"):
        dq, _, _ = _run_backward(get_op("attention_backward"), case, dtype)
    assert bool(dq[:, :, 20:, 3].isnan().all()) and bool(dq[:, :, :20].isfinite().all())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_backward_infinite_grad_under_causal_mask(dtype):
    """dO[17] holds +inf and -inf: dv of the keys row 17 sees gets them with their signs (P > 0), keys after 17
    stay finite (their P for row 17 is 0, and 0 * inf must not reach their dv)."""
    q, k, v = _qkv((1, 2, 40, 32), (1, 1, 40, 32), seed=2)
    grad = np.random.default_rng(3).standard_normal((1, 2, 40, 32))
    grad[0, 1, 17, 3], grad[0, 1, 17, 4] = np.inf, -np.inf
    case = _attention_grad_case(q, k, v, True, dtype, grad)
    with np.errstate(invalid="ignore"):
        _, _, dv = _run_backward(get_op("attention_backward"), case, dtype)
    assert bool((dv[0, 0, :18, 3] == np.inf).all()) and bool((dv[0, 0, :18, 4] == -np.inf).all())
    assert bool(dv[0, 0, 18:].isfinite().all())


def test_attention_backward_is_deterministic_across_gqa_groups():
    """dk, dv sum a KV head's query heads inside one program, in order: the same bits on every call."""
    q, k, v = _qkv((2, 8, 33, 16), (2, 2, 47, 16), seed=4)
    case = _attention_grad_case(q, k, v, False, "float32")
    first = _run_backward(get_op("attention_backward"), case, "float32")
    again = _run_backward(get_op("attention_backward"), case, "float32")
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def _irregular_lead(t):
    """Same values, leading dims (all but the last two) with strides that merge with nothing."""
    n = t.dim() - 2
    perm = [*reversed(range(n)), n, n + 1]
    return t.permute(*perm).contiguous().permute(*perm)


@pytest.mark.parametrize("shared_b", [True, False])
@pytest.mark.parametrize("batch", [(2, 3), (2, 3, 2, 3, 2)])
def test_matmul_backward_irregular_batch_dims(batch, shared_b):
    """Batch dims that do not merge: up to three are read by strides (a shared b's db sums them inside one
    accumulator), more are copied first (the documented copy); dbias sums every row either way."""
    rng = np.random.default_rng(5)
    a = rng.standard_normal((*batch, 17, 20)).astype(np.float32)
    b = rng.standard_normal((20, 9) if shared_b else (*batch, 20, 9)).astype(np.float32)
    bias = rng.standard_normal(9).astype(np.float32)
    bwd = get_op("matmul_backward")
    case = bwd.from_forward(Case("irregular", (a, b, bias), {}), "float32")
    args = [_irregular_lead(to_torch(x)) if isinstance(x, np.ndarray) and x.ndim > 2 else to_torch(x) for x in case.args]
    with opport.strict():
        got = function(bwd)(*args, backend="cuda")
    ref = bwd.run_reference(*case.args)
    for i, (out, r) in enumerate(zip(got, ref)):
        assert_close(bwd, "float32", out, r, bwd.tolerance_for("float32", i), f"matmul_backward/irregular/{i}")


def test_matmul_dbias_two_stage_sum_is_deterministic():
    """dbias over 300 rows: several row chunks of float32 partials, added in order by a second launch."""
    rng = np.random.default_rng(6)
    a, b = rng.standard_normal((300, 40)).astype(np.float32), rng.standard_normal((40, 70)).astype(np.float32)
    bwd = get_op("matmul_backward")
    case = bwd.from_forward(Case("rows-300", (a, b, rng.standard_normal(70).astype(np.float32)), {}), "float32")
    first = _run_backward(bwd, case, "float32")
    assert torch.equal(first[2], _run_backward(bwd, case, "float32")[2])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cross_entropy_training_forward_chunked_rows(dtype, monkeypatch):
    """The training forward's lse over vocabulary chunks (the GPU path past 16K columns), then the backward."""
    from opport.backends.cuda import _launch

    monkeypatch.setattr(_launch, "INTERP_TILE", 128)
    monkeypatch.setattr(_launch, "ROW_MAX", 128)
    fwd = get_op("cross_entropy_forward")
    for case in pick("cross_entropy", dtype, 3, lambda c: c.args[0].shape[-1] > 128 and _size(c) <= 20_000):
        args = [to_torch(a) for a in case.args]
        with opport.strict():
            loss, lse = function(fwd)(*args, backend="cuda", **case.kwargs)
        ref_loss, ref_lse = fwd.run_reference(*case.args, **case.kwargs)
        assert_close(fwd, dtype, loss, ref_loss, fwd.tolerances[dtype], f"cross_entropy_forward/{case.name}/loss")
        assert torch.allclose(lse.double(), torch.from_numpy(np.asarray(ref_lse, np.float64)), rtol=2e-6, atol=0,
                              equal_nan=True)
        bwd = get_op("cross_entropy_backward")
        _run_backward(bwd, bwd.from_forward(case, dtype), dtype)


# ------------------------------------------------------------------------------------------- varlen_attention


def test_varlen_attention_finds_each_sequence_among_many():
    """37 sequences (empty ones among them) and two query blocks' worth of tokens in some: every program's binary
    search lands on its own sequence, and each sequence matches the reference alone."""
    from opport.ops.varlen_attention import cu
    from opport.ops.varlen_attention import varlen_attention as spec

    rng = np.random.default_rng(7)
    lq = [int(n) for n in rng.choice([0, 1, 3, 17, 150], size=37)]
    lk = [n + int(e) for n, e in zip(lq, rng.integers(0, 20, size=37))]
    q = rng.standard_normal((sum(lq), 4, 32)).astype(np.float32)
    k, v = (rng.standard_normal((sum(lk), 2, 32)).astype(np.float32) for _ in range(2))
    kw = dict(causal=True, softcap=20.0, sliding_window=40)
    with opport.strict():
        out = opport.varlen_attention(*(to_torch(a) for a in (q, k, v, cu(lq), cu(lk))), backend="cuda", **kw)
    ref = spec.run_reference(q, k, v, cu(lq), cu(lk), **kw)
    assert np.allclose(out.cpu().numpy(), ref, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------- linear_cross_entropy (issue 19): the chunked backward


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("chunk", [16, 1 << 20])
def test_linear_cross_entropy_backward_chunks(dtype, chunk, monkeypatch):
    """One vocabulary chunk, or many (a dlogits buffer of 16 elements: one 64/128-column tile per chunk), give the
    reference's gradients, and the same bits on a second run (no atomics)."""
    from opport.backends.cuda import linear_cross_entropy as mod

    monkeypatch.setattr(mod, "CHUNK_ELEMENTS", chunk)
    bwd = get_op("linear_cross_entropy_backward")
    for name in ("none-odd-vocab", "softcap", "smoothing-1-bias"):  # reduction "none": grads [N]
        case = next(c for c in bwd.get_cases(dtype) if c.name == name)
        first = _run_backward(bwd, case, dtype)
        again = _run_backward(bwd, case, dtype)
        assert all(torch.equal(a, b) for a, b in zip(first, again) if a is not None), name
