"""quantize_fp8 / dequantize_fp8: the semantics the conformance tolerance cannot pin (ties to even, scales of
all-zero groups, saturation, NaN), on every backend, and fp8 torch tensors in and out."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import opport
from opport import accuracy
from opport.dispatch import clear_cache
from opport.dtypes import FP8, np_dtype
from opport.ops.quantize_fp8 import FP8_MAX, Q_TOLERANCE, SCALE_FLOOR, _ties
from opport.ops.quantize_fp8 import quantize_fp8 as spec

BACKENDS = ("cpu", "cuda", "neuron")


@pytest.fixture
def trn3():
    """The neuron emulator as NeuronCore-v4, where float8_e4m3fn exists (trn2 declines it)."""
    from opport.backends.neuron import nki_compat

    if not nki_compat.EMULATED:
        pytest.skip("the emulator's target switch")
    clear_cache()
    with nki_compat._emulator.use_target("trn3"):
        yield
    clear_cache()


def _bits(a) -> np.ndarray:
    import torch

    if isinstance(a, torch.Tensor):
        a = a.view(torch.uint8).numpy()
    return np.asarray(a).view(np.uint8)


def _backend_ok(backend: str):
    pytest.importorskip("torch") if backend == "cuda" else None
    if backend == "cuda":
        pytest.importorskip("triton")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp8", FP8)
def test_ties_round_to_even_bit_exact(backend, fp8, trn3):
    """Midpoints between fp8 neighbours, at scale 1 (exact quotients): round-half-to-even, bit for bit as
    ml_dtypes' cast (the conformance tolerance accepts either neighbour at an exact tie)."""
    _backend_ok(backend)
    x = _ties(fp8, "float32")
    q, s = opport.quantize_fp8(x, dtype=fp8, scale=1.0, backend=backend)
    want = x.astype(np_dtype(fp8))
    assert np.array_equal(_bits(q), want.view(np.uint8))
    assert s.shape == (1, 1) and s[0, 0] == 1.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp8", FP8)
def test_zero_groups_saturation_and_nan(backend, fp8, trn3):
    _backend_ok(backend)
    fmax = FP8_MAX[fp8]
    x = np.zeros((3, 256), np.float32)
    x[0, :128] = np.linspace(-3, 5, 128)
    x[0, 5], x[0, 6], x[0, 7] = np.inf, -np.inf, np.nan  # excluded from amax; inf saturates, NaN stays
    x[2, 200] = 1e-3
    q, s = opport.quantize_fp8(x, granularity="block", dtype=fp8, backend=backend)
    q = q.astype(np.float64)
    assert s.dtype == np.float32 and s.shape == (3, 2)
    assert s[0, 0] == np.float32(5.0 / fmax)  # amax over finite values only
    assert (s[0, 1], s[1, 0], s[1, 1], s[2, 0]) == (SCALE_FLOOR,) * 4  # all-zero blocks: never 0
    assert s[2, 1] == np.float32(1e-3) / np.float32(fmax)
    assert q[0, 5] == fmax and q[0, 6] == -fmax and np.isnan(q[0, 7])
    assert not np.isnan(np.delete(q, 7, axis=1)).any() and (q[1] == 0).all()
    assert np.isfinite(s).all() and (s > 0).all()


def test_static_scale_saturates_instead_of_overflowing():
    x = np.array([[1000.0, -1000.0, 447.0, 1e-9]], np.float32)
    q, _ = opport.quantize_fp8(x, scale=1.0)
    assert q.astype(np.float64).tolist() == [[448.0, -448.0, 448.0, 0.0]]


def test_tolerance_catches_truncation():
    """A kernel that rounds toward zero (or a float32 -> fp8 cast without nearest rounding) fails the gate."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 256)).astype(np.float32)
    ref_q, _ = spec.run_reference(x, "token", 128, "float8_e4m3fn", None)
    good = ref_q.astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    assert accuracy.compare(good, ref_q, Q_TOLERANCE, "float8_e4m3fn").ok
    g64 = good.astype(np.float64)
    codes = good.view(np.uint8).copy()
    up = np.abs(g64) > np.abs(ref_q)  # rounded away from zero: step one code toward zero
    codes[up & (g64 != 0)] -= 1
    trunc = codes.view(ml_dtypes.float8_e4m3fn)
    assert up.any() and not accuracy.compare(trunc, ref_q, Q_TOLERANCE, "float8_e4m3fn").ok


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_fp8_round_trip(backend, trn3):
    torch = pytest.importorskip("torch")
    _backend_ok(backend)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    for fp8 in FP8:
        q, s = opport.quantize_fp8(x, granularity="token", dtype=fp8, backend=backend)
        assert q.dtype == getattr(torch, fp8) and s.dtype == torch.float32 and s.shape == (4, 1)
        y = opport.dequantize_fp8(q, s, granularity="token", out_dtype="bfloat16", backend=backend)
        assert y.dtype == torch.bfloat16
        tol = 2.0 ** -(3 if fp8 == "float8_e4m3fn" else 2)  # half an fp8 ulp, relative, plus bf16 rounding
        err = (y.float() - x.float()).abs() <= tol * x.float().abs() + s * 2.0 ** -9 + 1e-2 * x.float().abs()
        assert bool(err.all())


def test_not_differentiable():
    torch = pytest.importorskip("torch")
    with pytest.raises(opport.UnsupportedError):
        opport.quantize_fp8(torch.randn(2, 128, requires_grad=True))
    with pytest.raises(opport.UnsupportedError):
        opport.vjp("quantize_fp8", np.ones((2, 128), np.float32))


def test_neuron_declines_e4m3fn_before_trn3():
    from opport.backends.neuron import nki_compat
    from opport.backends.neuron.quantize_fp8 import fp8_unsupported

    if not nki_compat.EMULATED:
        pytest.skip("the emulator's target switch")
    with nki_compat._emulator.use_target("trn2"):
        assert "NeuronCore-v4" in fp8_unsupported("float8_e4m3fn")
        assert fp8_unsupported("float8_e5m2") is None


@pytest.mark.parametrize("fp8", FP8)
def test_neuron_per_tensor_amax_across_row_tiles(fp8, trn3):
    """Per-tensor scaling over more rows than partitions: the amax (here in the third row tile) reaches every
    tile through the transpose and the K = 1 broadcast; codes bit-equal to the cpu kernel's."""
    x = np.random.default_rng(1).standard_normal((300, 600)).astype(np.float32)
    x[290, 7] = 40.0
    qn, sn = opport.quantize_fp8(x, dtype=fp8, backend="neuron")
    qc, sc = opport.quantize_fp8(x, dtype=fp8, backend="cpu")
    assert sn[0, 0] == np.float32(40.0) / np.float32(FP8_MAX[fp8]) or abs(sn[0, 0] / sc[0, 0] - 1) < 3e-7
    assert (qn.view(np.uint8) != qc.view(np.uint8)).mean() < 1e-4  # x * (1/s) vs x / s: near-ties only
