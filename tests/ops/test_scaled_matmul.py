"""scaled_matmul: the cpu kernel on every declared case, the semantics the gate's tolerance does not pin (shape-chosen
granularity, float32 accumulation, scales as data), the fp8 kernels of cuda and neuron (trn3 for e4m3fn), and fp8
torch tensors in and out."""

from __future__ import annotations

import numpy as np
import pytest

import opport
from opport import accuracy
from opport.dispatch import clear_cache
from opport.dispatch.adapters import NumpyAdapter
from opport.dispatch.context import strict
from opport.dtypes import FP8, np_dtype
from opport.errors import OpError
from opport.ops.scaled_matmul import OUT_DTYPES, quantize_a, quantize_b
from opport.ops.scaled_matmul import scaled_matmul as spec
from tests.ops import _check

BACKENDS = ("cpu", "cuda", "neuron")
E4, E5 = np_dtype("float8_e4m3fn"), np_dtype("float8_e5m2")


@pytest.fixture
def trn3():
    """The neuron emulator as NeuronCore-v4, where float8_e4m3fn is a matmul input (trn2 declines it)."""
    from opport.backends.neuron import nki_compat

    if not nki_compat.EMULATED:
        pytest.skip("the emulator's target switch")
    clear_cache()
    with nki_compat._emulator.use_target("trn3"):
        yield
    clear_cache()


def _backend_ok(backend: str):
    if backend == "cuda":
        pytest.importorskip("torch")
        pytest.importorskip("triton")


def _case(name: str, dtype: str):
    return next(c for c in spec.get_cases(dtype) if c.name == name)


@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_fixed_cases(dtype):
    cases = list(spec.get_cases(dtype))
    assert len(cases) >= 12 and len({c.name for c in cases}) == len(cases)
    for case in cases:
        assert sum(a.size for a in case.args if isinstance(a, np.ndarray)) <= 1 << 20, case.name
        _check.check_case(spec, case, dtype, signed_zero=False)


test_hypothesis_cases = _check.hypothesis_test(spec, signed_zero=False, dtypes=OUT_DTYPES)


def _operands(fp8="float8_e4m3fn", m=24, k=256, n=160, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((m, k)), rng.standard_normal((k, n)) * k**-0.5, fp8


def test_granularity_follows_the_scale_shapes():
    """One value given per tensor, repeated per row / column, and repeated per 128-block is the same product."""
    x, w, fp8 = _operands()
    a_q, _ = quantize_a(x, "tensor", fp8)
    b_q, _ = quantize_b(w, "tensor", fp8)
    m, k = a_q.shape
    n = b_q.shape[1]
    s = np.float32(0.375)
    shapes = [((1, 1), (1, 1)), ((m, 1), (1, n)), ((m, k // 128), (k // 128, -(-n // 128)))]
    outs = [opport.scaled_matmul(a_q, b_q, np.full(sa, s), np.full(sb, s), out_dtype="float32", backend="cpu")
            for sa, sb in shapes]
    ref = spec.run_reference(a_q, b_q, np.full((1, 1), s), np.full((1, 1), s), out_dtype="float32")
    for out in outs:
        assert accuracy.compare(out, ref, spec.tolerances["float32"], "float32").ok


@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulates_in_float32(backend, trn3):
    """4096 products of 1 x 1.25 (exact in both formats): 5120 in float32; a 16-bit accumulator stalls below it."""
    _backend_ok(backend)
    for fp8 in FP8:
        a = np.ones((1, 4096), np_dtype(fp8))
        b = np.full((4096, 8), 1.25, np.float32).astype(np_dtype(fp8))
        one = np.ones((1, 1), np.float32)
        out = _call(backend, a, b, one, one, None, "float32")
        assert np.array_equal(out, np.full((1, 8), 5120.0, np.float32)), (backend, fp8)


def _call(backend, a, b, sa, sb, bias, out_dtype):
    """opport.scaled_matmul on `backend` in strict mode, NumPy in and out (torch tensors for cuda)."""
    if backend != "cuda":
        with strict():
            return opport.scaled_matmul(a, b, sa, sb, bias, out_dtype=out_dtype, backend=backend)
    import torch

    t = [None if v is None else NumpyAdapter.to_torch(v, "cpu") for v in (a, b, sa, sb, bias)]
    with strict():
        out = opport.scaled_matmul(*t, out_dtype=out_dtype, backend="cuda")
    return out.float().numpy().astype(np_dtype(out_dtype)) if out.dtype == torch.bfloat16 else out.numpy()


@pytest.mark.parametrize("backend", ("cuda", "neuron"))
@pytest.mark.parametrize("name", ["e4m3-block-block-64x256x192", "e4m3-row-col-64x256x192", "e5m2-tensor-tensor-64x256x192",
                                  "e4m3-saturated-block", "e4m3-zero-blocks", "e4m3-nan-row",
                                  "e4m3-batched-block", "e4m3-row-block-33x128x300", "e4m3-row-tensor-130x17x130"])
def test_kernels_on_cases(backend, name, trn3):
    """The accelerator kernels (cuda's interpreter, neuron's emulator as trn3) on the cases that exercise each scale
    layout, saturation, zero blocks and NaN, judged like the gate."""
    _backend_ok(backend)
    dtype = "bfloat16"
    case = _case(name, dtype)
    out = _call(backend, *case.args, dtype)
    _check.assert_matches(spec, case, dtype, out)


def test_neuron_declines_e4m3fn_before_trn3():
    from opport.backends.neuron import nki_compat

    if not nki_compat.EMULATED:
        pytest.skip("the emulator's target switch")
    a, b, one = np.ones((4, 128), E4), np.ones((128, 8), E4), np.ones((1, 1), np.float32)
    with nki_compat._emulator.use_target("trn2"):
        clear_cache()
        with strict(), pytest.raises(opport.UnsupportedError, match="NeuronCore-v4"):
            opport.scaled_matmul(a, b, one, one, backend="neuron")
        with strict():
            out = opport.scaled_matmul(a.astype(np.float32).astype(E5), b.astype(np.float32).astype(E5), one, one,
                                       out_dtype="float32", backend="neuron")
    clear_cache()
    assert np.array_equal(out, np.full((4, 8), 128.0, np.float32))


def test_cuda_reads_a_column_major_weight():
    """b as nn.Linear's weight.t() (the bench's layout, K-major for fp8 wgmma), 128-block scales and a bias."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    x, w, fp8 = _operands(m=40, k=384, n=200, seed=3)
    a_q, sa = quantize_a(x, "block", fp8)
    b_q, sb = quantize_b(w, "block", fp8)
    bias = np.linspace(-1, 1, 200).astype(np.float32)
    wt = NumpyAdapter.to_torch(np.ascontiguousarray(b_q.T), "cpu")
    args = [NumpyAdapter.to_torch(v, "cpu") for v in (a_q, sa, sb, bias)]
    with strict():
        out = opport.scaled_matmul(args[0], wt.t(), args[1], args[2], args[3], out_dtype="float32", backend="cuda")
    assert out.dtype == torch.float32 and out.shape == (40, 200)
    ref = spec.run_reference(a_q, b_q, sa, sb, bias, out_dtype="float32")
    assert accuracy.compare(out.numpy(), ref, spec.tolerances["float32"], "float32").ok


def test_tolerance_catches_a_dropped_block_scale():
    """A kernel that applies only the first K group's scales (per-tensor thinking on block scales) fails."""
    case = _case("e4m3-block-block-64x256x192", "float32")
    a_q, b_q, sa, sb, bias = case.args
    good = spec.run_reference(*case.args, out_dtype="float32").astype(np.float32)
    bad = spec.run_reference(a_q, b_q, np.repeat(sa[:, :1], sa.shape[1], 1), np.repeat(sb[:1], sb.shape[0], 0), bias,
                             out_dtype="float32").astype(np.float32)
    ref = spec.run_reference(*case.args, out_dtype="float32")
    tol = spec.tolerances["float32"]
    assert accuracy.compare(good, ref, tol, "float32").ok and not accuracy.compare(bad, ref, tol, "float32").ok


def test_tolerance_catches_16bit_dequantised_operands():
    """Dequantising into bfloat16 before a float32 GEMM (a scale product rounded to 8 bits) fails float32 output."""
    import ml_dtypes

    case = _case("e4m3-row-col-64x256x192", "float32")
    a_q, b_q, sa, sb, bias = case.args
    a = (a_q.astype(np.float32) * sa).astype(ml_dtypes.bfloat16).astype(np.float32)
    b = (b_q.astype(np.float32) * sb).astype(ml_dtypes.bfloat16).astype(np.float32)
    bad = a @ b + bias
    ref = spec.run_reference(*case.args, out_dtype="float32")
    assert not accuracy.compare(bad, ref, spec.tolerances["float32"], "float32").ok


@pytest.mark.parametrize("backend", ("cpu", "cuda", "neuron"))
@pytest.mark.parametrize("value", [0.0, -1.0, np.nan, np.inf])
def test_bad_scale_values_are_refused_before_any_kernel(backend, value):
    """A zero, negative, NaN or infinite scale (of a or b, any granularity): the typed error names the argument."""
    _backend_ok(backend)
    a, b = np.ones((3, 128), E5), np.ones((128, 2), E5)
    sa, sb = np.ones((3, 1), np.float32), np.ones((1, 1), np.float32)
    for name, args in (("scale_a", (a, b, np.where(np.arange(3)[:, None] == 1, value, sa).astype(np.float32), sb)),
                       ("scale_b", (a, b, sa, np.full((1, 1), value, np.float32)))):
        with pytest.raises(OpError) as e:
            opport.scaled_matmul(*args, out_dtype="float32", backend=backend)
        assert (e.value.constraint, e.value.arg) == ("scaled_matmul.scale_values", name)


@pytest.mark.parametrize("bad", ["block_k", "shape", "mixed", "bias"])
def test_typed_errors_name_the_argument(bad):
    a, b, one = np.ones((4, 100), E4), np.ones((100, 8), E4), np.ones((1, 1), np.float32)
    args = {"block_k": (a, b, np.ones((4, 2), np.float32), one),
            "shape": (a, b, np.ones((3, 1), np.float32), one),
            "mixed": (a, b.astype(np.float32).astype(E5), one, one),
            "bias": (a, b, one, one, np.ones(8, np.float16))}[bad]
    with pytest.raises(OpError) as e:
        opport.scaled_matmul(*args, backend="cpu")
    want = {"block_k": "block_divides", "shape": "scale_a_shape", "mixed": "dtype_mismatch", "bias": "bias_dtype"}[bad]
    assert e.value.constraint == f"scaled_matmul.{want}"


def test_torch_fp8_in_bf16_out():
    torch = pytest.importorskip("torch")
    x, w, fp8 = _operands(m=8, k=128, n=16, seed=5)
    a_q, sa = quantize_a(x, "row", fp8)
    b_q, sb = quantize_b(w, "col", fp8)
    t = [NumpyAdapter.to_torch(v, "cpu") for v in (a_q, b_q, sa, sb)]
    assert t[0].dtype == torch.float8_e4m3fn
    out = opport.scaled_matmul(*t, backend="cpu")
    assert out.dtype == torch.bfloat16 and out.shape == (8, 16)
    ref = spec.run_reference(a_q, b_q, sa, sb, None, out_dtype="bfloat16")
    assert accuracy.compare(out.float().numpy().astype(np_dtype("bfloat16")), ref, spec.tolerances["bfloat16"],
                            "bfloat16").ok


def test_not_differentiable():
    assert spec.backward_op is None


def test_cost():
    metas = [NumpyAdapter.meta(v) for v in (np.ones((2, 3, 256), E4), np.ones((256, 100), E4),
                                            np.ones((2, 3, 2), np.float32), np.ones((2, 1), np.float32))]
    c = spec.get_cost(*metas, None, "bfloat16")
    assert c.flops == 2 * 6 * 100 * 256
    assert c.bytes == 6 * 256 + 256 * 100 + 4 * (12 + 2) + 2 * 600
