"""NumPy, torch and JAX arrays in, the same kind out: dtype, device, values and inputs preserved."""

from __future__ import annotations

import numpy as np
import pytest

import opport
from opport.dtypes import np_dtype

torch = pytest.importorskip("torch")

DTYPES = ("float32", "float16", "bfloat16", "float64")


def _np(shape, dtype, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np_dtype(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_in_torch_out_bitwise_equal_to_numpy_path(dtype):
    x, w = _np((5, 33), dtype), _np((33,), dtype, 1)
    ref = opport.rmsnorm(x, w)
    t = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) if dtype == "bfloat16" else torch.from_numpy(x)
    tw = torch.from_numpy(w.view(np.int16)).view(torch.bfloat16) if dtype == "bfloat16" else torch.from_numpy(w)
    out = opport.rmsnorm(t, tw)
    assert isinstance(out, torch.Tensor) and out.dtype == getattr(torch, dtype) and out.device.type == "cpu"
    got = out.view(torch.int16).numpy().view(np_dtype("bfloat16")) if dtype == "bfloat16" else out.numpy()
    np.testing.assert_array_equal(got.view(np.uint8), ref.view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_jax_in_jax_out(dtype):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    x = _np((4, 16), dtype)
    out = opport.rmsnorm(jax.numpy.asarray(x))
    assert isinstance(out, jax.Array) and str(out.dtype) == dtype
    ran = opport.explain("rmsnorm", jax.numpy.asarray(x)).backend  # the jax backend: rmsnorm's jnp kernel
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8), opport.rmsnorm(x, backend=ran).view(np.uint8))


def test_numpy_in_numpy_out_and_input_untouched():
    x = _np((8, 64), "bfloat16")
    before = x.tobytes()
    out = opport.rmsnorm(x)
    assert type(out) is np.ndarray and out.dtype == x.dtype and out.shape == x.shape
    assert x.tobytes() == before


def test_strided_torch_inputs_match_contiguous():
    base = torch.randn(64, 48, dtype=torch.float32)
    views = {"transposed": base.t(), "sliced": base[::2, 1:], "expanded": base[:1].expand(7, 48), "offset": base[3:9]}
    for name, v in views.items():
        before = base.clone()
        out = opport.rmsnorm(v)
        torch.testing.assert_close(out, opport.rmsnorm(v.contiguous()), rtol=0, atol=0, msg=name)
        assert torch.equal(base, before), f"{name}: input mutated"


def test_bfloat16_round_trip_torch_numpy_is_lossless():
    from opport.dispatch.adapters import NumpyAdapter, TorchAdapter

    t = torch.randn(1000).to(torch.bfloat16)
    back = NumpyAdapter.to_torch(TorchAdapter.to_numpy(t), "cpu")
    assert back.dtype == torch.bfloat16 and torch.equal(back, t)


def test_read_only_numpy_input_works_on_torch_kind_backends():
    from opport.dispatch.adapters import NumpyAdapter

    x = _np((3, 3), "float32")
    x.setflags(write=False)
    t = NumpyAdapter.to_torch(x, "cpu")
    assert torch.equal(t, torch.from_numpy(x.copy()))


def test_requires_grad_tensor_is_accepted_and_not_mutated():
    t = torch.randn(4, 8, requires_grad=True)
    before = t.detach().clone()
    out = opport.rmsnorm(t)
    assert out.shape == t.shape and torch.equal(t.detach(), before)
