"""The cpu backend's fused numba loops (opport/backends/cpu/_fused.py): used when numba is present, off with
OPPORT_NUMBA=0, within each op's tolerance of the NumPy kernels (and of the reference), the NumPy kernel's exact
bits on the rows the loops leave to it, and bitwise the same at 1 and 2 threads."""

from __future__ import annotations

import numpy as np
import pytest

import opport.backends.cpu._common as common
from opport.accuracy import compare
from opport.backends.cpu import _fused
from opport.ops import get_op
from opport.spec import Case
from tests.ops._check import assert_matches, cpu_kernel

pytest.importorskip("numba")

# (name, op, which fused entry points it must call)
PATHS = [
    ("rmsnorm", "rmsnorm", ("rms_forward",)),
    ("rmsnorm_backward", "rmsnorm", ("rms_backward",)),
    ("add_rmsnorm", "add_rmsnorm", ("rms_forward",)),
    ("add_rmsnorm_backward", "add_rmsnorm", ("rms_backward",)),
    ("layernorm", "layernorm", ("ln_forward",)),
    ("layernorm_backward", "layernorm", ("ln_backward",)),
    ("softmax", "softmax", ("softmax_forward",)),
    ("softmax_backward", "softmax", ("softmax_backward",)),
    ("silu", "silu", ("_silu",)),
    ("silu_backward", "silu", ("_silu_grad",)),
    ("gelu_tanh", "gelu", ("_gelu_tanh",)),
    ("gelu_tanh_backward", "gelu", ("_gelu_tanh_grad",)),
    ("gelu_erf", "gelu", ("_gelu_erf",)),
    ("gelu_erf_backward", "gelu", ("_gelu_erf_grad",)),
    ("rope", "rope", ("rope",)),
    ("rope_backward", "rope", ("rope",)),
    ("cross_entropy", "cross_entropy", ("ce_stats",)),
    ("cross_entropy_value_and_grad", "cross_entropy", ("ce_stats", "ce_grad")),
    ("swiglu", "swiglu", ("_swiglu",)),
    ("swiglu_backward", "swiglu", ("_swiglu_grad",)),
]


def _inputs(name: str, dtype: str, rows: int = 64, n: int = 1000, special: bool = False):
    """(spec, args) of the kernel `name` on random inputs; `special` plants rows/elements the loops leave to NumPy."""
    rng = np.random.default_rng(3)
    dt = np.dtype(dtype) if dtype != "bfloat16" else np.dtype("bfloat16")

    def arr(shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(dt)

    x = arr((rows, n), 2.0)
    if special:  # overflowing sums of squares, inf, NaN, deep negative tails
        big = np.finfo(np.float32).max / 4 if dtype != "float64" else 1e300
        x[3, :] = np.asarray(big, dt) if dtype != "float16" else np.float16(60000)
        x[5, 7], x[9, 1], x[11, 2], x[13, 4] = np.nan, np.inf, -np.inf, -120
    w = (rng.uniform(0.5, 1.5, n)).astype(dt)
    g = arr((rows, n))
    op = name.removesuffix("_value_and_grad").removesuffix("_backward").removesuffix("_tanh").removesuffix("_erf")
    approximate = "none" if "_erf" in name else "tanh"
    spec = get_op(op)
    bwd = name.endswith("_backward")
    if op == "rmsnorm":
        args = (g, x, w, 1e-6) if bwd else (x, w, 1e-6)
    elif op == "add_rmsnorm":
        args = (g, arr((rows, n)), x, w, 1e-6) if bwd else (x, arr((rows, n)), w, 1e-6)
    elif op == "layernorm":
        args = (g, x, w, w, 1e-5) if bwd else (x, w, w, 1e-5)
    elif op == "softmax":
        args = (g, cpu_kernel(spec)(x, -1), -1) if bwd else (x, -1)
    elif op == "rope":  # x [B=4, H=2, S=rows/8, D=n], per-batch tables [4, S, D/2], half-split and interleaved
        ang = rng.uniform(-10, 10, (4, rows // 8, n // 2))
        args = ((g if bwd else x).reshape(4, 2, rows // 8, n), np.cos(ang), np.sin(ang), special)
    elif op == "cross_entropy":  # smoothing, an ignored row
        t = rng.integers(0, n, rows)
        t[20] = -100
        vag = name.endswith("_value_and_grad")
        return (spec.value_and_grad_op if vag else spec), (x, t, -100, "mean", 0.1)
    elif op == "gelu":
        args = (g, x, approximate) if bwd else (x, approximate)
    elif op == "swiglu":
        args = (g, x, arr((rows, n), 3.0)) if bwd else (x, arr((rows, n), 3.0))
    else:
        args = (g, x) if bwd else (x,)
    return (spec.backward_op if bwd else spec), args


def _run(monkeypatch, spec, args, numba_on: bool):
    monkeypatch.setenv("OPPORT_NUMBA", "1" if numba_on else "0")
    out = cpu_kernel(spec)(*args)
    return out if isinstance(out, tuple) else (out,)


def _spy(monkeypatch, names):
    calls = {n: 0 for n in names}
    for n in names:
        real = getattr(_fused, n)

        def wrapped(*a, _real=real, _n=n, **k):
            calls[_n] += 1
            return _real(*a, **k)

        monkeypatch.setattr(_fused, n, wrapped)
    return calls


@pytest.mark.parametrize("name,op,entry", PATHS, ids=[p[0] for p in PATHS])
def test_fused_path_is_taken_and_switched_off(monkeypatch, name, op, entry):
    spec, args = _inputs(name, "float32")
    calls = _spy(monkeypatch, entry)
    _run(monkeypatch, spec, args, numba_on=True)
    assert all(calls[e] > 0 for e in entry), f"{name}: fused loop not called with numba present: {calls}"
    for e in entry:
        calls[e] = 0
    _run(monkeypatch, spec, args, numba_on=False)
    assert not any(calls.values()), f"{name}: OPPORT_NUMBA=0 still called {calls}"


@pytest.mark.parametrize("dtype", ("float32", "bfloat16", "float16"))
@pytest.mark.parametrize("name,op,entry", PATHS, ids=[p[0] for p in PATHS])
def test_fused_agrees_with_numpy_within_tolerance(monkeypatch, name, op, entry, dtype):
    """Both paths against the float64 reference, and the fused result against the NumPy kernel's, each within
    the op's tolerance for the dtype; elements the loops leave to NumPy (`special` rows) bitwise NumPy's."""
    for special in (False, True):
        spec, args = _inputs(name, dtype, special=special)
        fused = _run(monkeypatch, spec, args, numba_on=True)
        plain = _run(monkeypatch, spec, args, numba_on=False)
        for i, (f, p) in enumerate(zip(fused, plain)):
            if f is None:
                continue
            assert f.dtype == p.dtype and f.shape == p.shape
            if op == "cross_entropy" and special:  # rows 5 (NaN) and 9 (+inf): the NumPy kernel's
                if f.ndim == 2:
                    np.testing.assert_array_equal(f[[5, 9]], p[[5, 9]], err_msg=name)
                continue
            if op == "rope":  # products and sums in the NumPy kernel's order: the same bits, NaN and inf included
                np.testing.assert_array_equal(f, p, err_msg=f"{name} {dtype}")
                continue
            if special and f.ndim == 1:  # dweight, dbias: sums over rows (with NaN rows: NaN where NumPy's are)
                np.testing.assert_array_equal(np.isnan(f.astype(np.float64)), np.isnan(p.astype(np.float64)))
                continue
            if special:  # rows 3, 5, 9, 11 hold values only the NumPy kernels handle
                if op in ("rmsnorm", "add_rmsnorm", "layernorm", "softmax"):  # those rows, by the NumPy kernel
                    rows = [3, 5, 9, 11]  # sums of squares that overflow, NaN, inf, -inf (exp out of range)
                    if name.endswith("_backward"):  # the backward loops leave rows whose sums or results are not finite
                        rows = np.flatnonzero(~np.isfinite(p.astype(np.float64)).all(axis=-1))
                        assert rows.size
                    np.testing.assert_array_equal(f[rows], p[rows], err_msg=f"{name}[{i}] left rows")
                else:  # the elements the loop leaves (NaN, inf, deep tails) are the NumPy block function's
                    left = [(5, 7), (9, 1), (11, 2), (13, 4)]
                    np.testing.assert_array_equal(f[tuple(zip(*left))], p[tuple(zip(*left))], err_msg=f"{name}[{i}]")
                continue  # the reference comparison of inf/NaN inputs is the conformance suite's job
            tol = spec.tolerances[dtype]
            out_dtype = spec.fixed_out_dtype or dtype
            v = compare(f, p.astype(np.float64), tol, out_dtype)
            assert v.ok, f"{name}[{i}] {dtype}: fused vs NumPy: {v.message}"
        if not special and not name.endswith("_backward") and len(fused) == 1:
            kwargs = {"approximate": args[1]} if op == "gelu" else {}
            assert_matches(spec, Case("fused", args[:1] if kwargs else args, kwargs), dtype, fused[0])


@pytest.mark.parametrize("name,op,entry", PATHS, ids=[p[0] for p in PATHS])
def test_fused_bitwise_same_at_1_and_2_threads(monkeypatch, name, op, entry):
    """Inputs above PARALLEL_MIN (two shares of the pool), with special rows: the same bits on 1 and 2 threads."""
    spec, args = _inputs(name, "float32", rows=600, n=1024, special=True)
    monkeypatch.setenv("OPPORT_NUMBA", "1")
    outs = []
    for threads in (1, 2):
        monkeypatch.setenv("OPPORT_NUM_THREADS", str(threads))
        out = cpu_kernel(spec)(*args)
        outs.append(out if isinstance(out, tuple) else (out,))
    assert 600 * 1024 >= common.PARALLEL_MIN
    for a, b in zip(*outs):
        if a is not None:
            np.testing.assert_array_equal(a, b, err_msg=f"{name}: 1 vs 2 threads")


def test_switch_reads_the_environment(monkeypatch):
    monkeypatch.setenv("OPPORT_NUMBA", "0")
    assert not _fused.enabled()
    monkeypatch.delenv("OPPORT_NUMBA")
    assert _fused.enabled() and _fused.enabled(np.dtype("float32")) and _fused.enabled(np.dtype("bfloat16"))
    assert not _fused.enabled(np.dtype("float64"))  # float64 keeps the NumPy kernels (one compiled signature)
    monkeypatch.setattr(_fused, "numba", None)
    assert not _fused.enabled()


# ---------------------------------------------------------------------------- attention's score blocks

def _attention_inputs(dtype: str, sq: int = 100, sk: int = 100, seed: int = 5):
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    q, k, v = (rng.standard_normal(s).astype(dt) for s in ((2, 4, sq, 32), (2, 2, sk, 32), (2, 2, sk, 32)))
    return q, k, v, rng.standard_normal((2, 4, sq, 32)).astype(dt)


ATTENTION_CALLS = [  # (causal, sliding_window, sq, sk)
    (True, None, 100, 100), (False, None, 70, 300), (True, 24, 100, 100), (True, None, 1, 40), (True, None, 40, 90)]


def _attention_run(monkeypatch, numba_on: bool, args, causal, window):
    monkeypatch.setenv("OPPORT_NUMBA", "1" if numba_on else "0")
    spec = get_op("attention")
    q, k, v, g = args
    out, lse = cpu_kernel(spec.train_forward)(q, k, v, causal, None, None, window)
    return (out, lse, *cpu_kernel(spec.backward_op)(g, q, k, v, out, lse, causal, None, None, window))


def test_attention_blocks_take_the_fused_loops_and_switch_off(monkeypatch):
    """16-bit blocks (upcast to float32) go through the score-block loops; float32 calls take the compiled tasks."""
    calls = _spy(monkeypatch, ("attention_softmax", "attention_grad_scores"))
    args = _attention_inputs("float16")
    _attention_run(monkeypatch, True, args, True, None)
    assert calls["attention_softmax"] > 0 and calls["attention_grad_scores"] > 0, calls
    calls.update(attention_softmax=0, attention_grad_scores=0)
    _attention_run(monkeypatch, False, args, True, None)
    assert not any(calls.values()), calls


def test_float32_attention_takes_the_tasks_and_switches_off(monkeypatch):
    from opport.backends.cpu import _attn_tasks

    ran = []
    real = _attn_tasks._run
    monkeypatch.setattr(_attn_tasks, "_run", lambda kind, *a: ran.append(kind) or real(kind, *a))
    args = _attention_inputs("float32")
    _attention_run(monkeypatch, True, args, True, None)
    assert ran == ["forward", "backward"]
    ran.clear()
    _attention_run(monkeypatch, False, args, True, None)
    _attention_run(monkeypatch, True, args, True, 24)  # a window: the blocks
    assert ran == []


@pytest.mark.parametrize("where", ("q", "k", "v", "g"))
def test_attention_tasks_leave_non_finite_calls_to_the_numpy_kernel(monkeypatch, where):
    """A NaN anywhere: NaN where the NumPy kernel puts it and nowhere else (a task that meets it declines and the NumPy
    kernel runs the whole call, or, a NaN of v in a block every row sees, it reaches the rows that see it)."""
    args = list(_attention_inputs("float32"))
    args["qkvg".index(where)][1, 1, 60, 3] = np.nan
    fused = _attention_run(monkeypatch, True, args, True, None)
    plain = _attention_run(monkeypatch, False, args, True, None)
    for f, p in zip(fused, plain):
        np.testing.assert_array_equal(np.isnan(f), np.isnan(p))
        np.testing.assert_allclose(f[~np.isnan(f)], p[~np.isnan(p)], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", ("float32", "bfloat16", "float16"))
@pytest.mark.parametrize("causal,window,sq,sk", ATTENTION_CALLS)
def test_attention_fused_blocks_agree_with_numpy_and_the_reference(monkeypatch, dtype, causal, window, sq, sk):
    """Output, lse and the three gradients within the ops' tolerances of the NumPy blocks, and the output within
    attention's tolerance of the float64 reference (full, causal, windowed, decode-length and Sq < Sk calls)."""
    spec = get_op("attention")
    args = _attention_inputs(dtype, sq, sk)
    fused = _attention_run(monkeypatch, True, args, causal, window)
    plain = _attention_run(monkeypatch, False, args, causal, window)
    tols = [spec.tolerances[dtype], None] + [spec.backward_op.tolerances[dtype]] * 3
    for i, (f, p, tol) in enumerate(zip(fused, plain, tols)):
        assert f.dtype == p.dtype and f.shape == p.shape
        if tol is None:  # lse, float32: the same rows of -inf, values within float32 rounding of the sums
            np.testing.assert_allclose(f, p, rtol=1e-6, atol=1e-6)
            continue
        v = compare(f, p.astype(np.float64), tol, dtype)
        assert v.ok, f"output {i} {dtype} causal={causal} window={window}: fused vs NumPy: {v.message}"
    kwargs = {"causal": causal, "sliding_window": window}
    assert_matches(spec, Case("fused", args[:3], kwargs), dtype, fused[0])


def test_attention_softmax_loop_declines_non_finite_scores_and_writes_nothing():
    rng = np.random.default_rng(1)
    s = rng.standard_normal((2, 8, 16)).astype(np.float32)
    m = np.full((2, 8, 1), -np.inf, np.float32)
    for bad in (np.nan, np.inf, -np.inf):
        t = s.copy()
        t[1, 3, 5] = bad
        before = t.copy()
        assert _fused.attention_softmax(t, np.float32(0.5), None, 8, m) is None
        np.testing.assert_array_equal(t, before)
    # a -inf or NaN score the mask hides does not matter: hidden keys are never read
    t = s.copy()
    t[:, 0, 9:] = np.nan  # row 0 sees keys [0, 9)
    vis = (np.zeros(8, np.int64), np.array([9] + [16] * 7))
    m_new, psum = _fused.attention_softmax(t, np.float32(0.5), vis, 8, m)
    assert (t[:, 0, 9:] == 0).all() and np.isfinite(psum).all()
    expect = np.exp(s[:, 0, :9] * np.float32(0.5) - (s[:, 0, :9] * np.float32(0.5)).max(-1, keepdims=True))
    np.testing.assert_allclose(t[:, 0, :9], expect, rtol=3e-7)


def test_attention_grad_loop_zeroes_rows_that_see_nothing_and_declines_non_finite_gradients():
    rng = np.random.default_rng(2)
    s = rng.standard_normal((1, 4, 8)).astype(np.float32)
    lse = np.array([[[3.0], [np.inf], [2.5], [4.0]]], np.float32)  # row 1: no visible key (the kernel sets +inf)
    dp, big_d = rng.standard_normal((1, 4, 8)), rng.standard_normal((1, 4, 1))
    t = s.copy()
    ds = _fused.attention_grad_scores(t, np.float32(1.0), None, 4, lse, dp, big_d)
    assert (t[0, 1] == 0).all() and (ds[0, 1] == 0).all()
    p = np.exp(s[0, 0] - np.float32(3.0))
    np.testing.assert_allclose(t[0, 0], p, rtol=3e-7)
    np.testing.assert_allclose(ds[0, 0], (dp[0, 0] - big_d[0, 0]).astype(np.float32) * p, rtol=1e-6)
    dp[0, 2, 3] = np.nan
    t = s.copy()
    assert _fused.attention_grad_scores(t, np.float32(1.0), None, 4, lse, dp, big_d) is None
    np.testing.assert_array_equal(t, s)
