"""rmsnorm's offset (Gemma's `(1 + weight)`): validation, the cpu kernel against the reference, training through the
torch and JAX integrations against each framework's own formula, and the cuda and neuron kernels' multi-pass paths
(rows longer than a tile), which the conformance cases' row lengths do not reach on the emulating backends."""

from __future__ import annotations

import numpy as np
import pytest

import opport
from opport import casegen as cg
from opport.accuracy import compare
from opport.dispatch import get_backend
from opport.errors import ArgumentError
from opport.ops.rmsnorm import rmsnorm as spec


def _gemma(dtype: str, shape=(6, 40), seed: int = 0):
    """x and a weight near 0 (Gemma's init), rounded to `dtype`."""
    rng = np.random.default_rng(seed)
    return cg.array(shape, dtype, rng, "normal", 2.0), cg.array(shape[-1:], dtype, rng, "uniform", 0.05)


@pytest.mark.parametrize("offset", [float("inf"), float("nan"), True, "1", None])
def test_offset_must_be_a_finite_number(offset):
    x, w = _gemma("float32")
    with pytest.raises(ArgumentError) as info:
        opport.rmsnorm(x, w, 1e-6, offset=offset, backend="cpu")
    assert (info.value.constraint, info.value.arg, info.value.op) == ("rmsnorm.offset", "offset", "rmsnorm")


def test_offset_needs_a_weight():
    x, _ = _gemma("float32")
    with pytest.raises(ArgumentError) as info:
        opport.rmsnorm(x, None, offset=1.0, backend="cpu")
    assert info.value.constraint == "rmsnorm.offset"
    np.testing.assert_array_equal(opport.rmsnorm(x, None, offset=0, backend="cpu"), opport.rmsnorm(x, backend="cpu"))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_offset_scales_by_offset_plus_weight(dtype):
    """The reference is rmsnorm with weight offset + w (in float64); the cpu kernel meets it under the op's tolerance,
    and offset 0 is the plain op bit for bit."""
    x, w = _gemma(dtype)
    ref = spec.run_reference(x, w, 1e-6, 1.0)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    np.testing.assert_allclose(ref, spec.run_reference(x64, 1.0 + w64, 1e-6), rtol=1e-15)
    out = opport.rmsnorm(x, w, 1e-6, offset=1.0, backend="cpu")
    verdict = compare(out, ref, spec.tolerances[dtype], dtype)
    assert verdict.ok, verdict.message
    np.testing.assert_array_equal(opport.rmsnorm(x, w, 1e-6, offset=0.0, backend="cpu"), opport.rmsnorm(x, w, 1e-6))


def _backends() -> list:
    return [b for b in ("cpu", "cuda", "neuron") if not get_backend(b).unavailable()]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_offset_plus_weight_is_never_rounded_to_the_dtype(dtype):
    """1 + w in a 16-bit dtype loses w's low bits (w ~ 0.05: 2^-9 relative in bfloat16), which moves about a quarter
    of the outputs and input gradients by one unit of the dtype. Every backend's kernels forms it in float32: its
    16-bit y and dx are the correctly rounded reference almost everywhere (a float32 rounding can straddle a
    16-bit tie: under 1% of elements)."""
    from opport.public import function

    bwd = spec.backward_op
    x, w = _gemma(dtype, (8, 512), seed=7)
    g = cg.array(x.shape, dtype, np.random.default_rng(8), "normal", 1.0)
    rounded = cg.cast(1.0 + w.astype(np.float64), dtype)  # what a kernel holding 1 + w in the weight's dtype uses

    def wrong(a, b):
        return float(np.mean(np.asarray(a).astype(np.float64) != np.asarray(b).astype(np.float64)))

    want_y = cg.cast(spec.run_reference(x, w, 1e-6, 1.0), dtype)
    want_dx = cg.cast(bwd.run_reference(g, x, w, 1e-6, 1.0)[0], dtype)
    assert wrong(cg.cast(spec.run_reference(x, rounded, 1e-6), dtype), want_y) > 0.1  # the test can tell
    assert wrong(cg.cast(bwd.run_reference(g, x, rounded, 1e-6)[0], dtype), want_dx) > 0.1
    for backend in _backends():
        with opport.strict():
            y = opport.rmsnorm(x, w, 1e-6, offset=1.0, backend=backend)
            dx, _ = function(bwd)(g, x, w, 1e-6, 1.0, backend=backend)
        assert wrong(y, want_y) < 0.01, backend
        assert wrong(dx, want_dx) < 0.01, backend


def test_offset_gradients_in_torch_match_torchs_own_formula():
    torch = pytest.importorskip("torch")
    x0, w0 = _gemma("float32", (8, 64), seed=1)
    g = torch.from_numpy(np.random.default_rng(2).standard_normal((8, 64)).astype(np.float32))

    def run(fn):
        x = torch.from_numpy(x0).requires_grad_(True)
        w = torch.from_numpy(w0).requires_grad_(True)
        y = fn(x, w)
        y.backward(g)
        return y.detach(), x.grad, w.grad

    def own(x, w):  # transformers' Gemma2RMSNorm, in float32
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w)

    got = run(lambda x, w: opport.rmsnorm(x, w, 1e-6, offset=1.0))
    want = run(own)
    for name, a, b in zip(("y", "dx", "dweight"), got, want):
        torch.testing.assert_close(a, b, rtol=1.3e-6, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_offset_under_torch_compile_is_one_custom_op_with_its_gradients():
    torch = pytest.importorskip("torch")
    x0, w0 = _gemma("float32", (4, 32), seed=6)
    x, w = torch.from_numpy(x0).requires_grad_(True), torch.from_numpy(w0).requires_grad_(True)
    fn = torch.compile(lambda x, w: opport.rmsnorm(x, w, 1e-6, offset=1.0), fullgraph=True, backend="aot_eager")
    fn(x, w).sum().backward()
    x2, w2 = torch.from_numpy(x0).requires_grad_(True), torch.from_numpy(w0).requires_grad_(True)
    eager = opport.rmsnorm(x2, w2, 1e-6, offset=1.0)
    eager.sum().backward()
    torch.testing.assert_close(fn(x, w), eager, rtol=0, atol=0)
    torch.testing.assert_close((x.grad, w.grad), (x2.grad, w2.grad), rtol=0, atol=0)
    assert "float offset=0." in str(torch.ops.opport.rmsnorm.default._schema)


def test_offset_gradients_under_jax_grad_match_jaxs_own_formula():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    x0, w0 = _gemma("float32", (8, 64), seed=3)
    g = np.random.default_rng(4).standard_normal((8, 64)).astype(np.float32)

    def loss_opport(x, w):
        return jnp.sum(opport.rmsnorm(x, w, 1e-6, offset=1.0) * g)

    def loss_own(x, w):
        return jnp.sum(x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * (1.0 + w) * g)

    got = jax.grad(loss_opport, argnums=(0, 1))(jnp.asarray(x0), jnp.asarray(w0))
    want = jax.grad(loss_own, argnums=(0, 1))(jnp.asarray(x0), jnp.asarray(w0))
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1.3e-6, atol=1e-5)
    jitted = jax.jit(jax.grad(loss_opport, argnums=(0, 1)))(jnp.asarray(x0), jnp.asarray(w0))
    for a, b in zip(jitted, got):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _judge_forward_and_backward(backend: str, dtype: str, shape, offset: float):
    """The backend's forward and backward with `offset` against the references, each under its tolerance."""
    bwd = spec.backward_op
    x, w = _gemma(dtype, shape, seed=5)
    case = bwd.from_forward(type(next(iter(spec.get_cases(dtype))))("offset-long", (x, w), {"eps": 1e-6, "offset": offset}),
                            dtype)
    with opport.strict():
        out = opport.rmsnorm(x, w, 1e-6, offset=offset, backend=backend)
        grads = opport.public.function(bwd)(*case.args, backend=backend)
    verdict = compare(np.asarray(out), spec.run_reference(x, w, 1e-6, offset), spec.tolerances[dtype], dtype)
    assert verdict.ok, f"{backend} forward: {verdict.message}"
    for i, (got, ref) in enumerate(zip(grads, bwd.run_reference(*case.args))):
        verdict = compare(np.asarray(got), np.asarray(ref, np.float64), bwd.tolerance_for(dtype, i, case), dtype)
        assert verdict.ok, f"{backend} d{bwd.wrt[i]}: {verdict.message}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offset_on_cuda_chunked_rows(dtype, monkeypatch):
    """Rows longer than one tile: the forward's two passes and the backward's chunked path (GPUs past 16K columns)."""
    pytest.importorskip("torch")
    if get_backend("cuda").unavailable():
        pytest.skip(f"cuda backend unavailable: {get_backend('cuda').unavailable()}")
    from opport.backends.cuda import _launch

    monkeypatch.setattr(_launch, "INTERP_TILE", 128)
    monkeypatch.setattr(_launch, "ROW_MAX", 128)
    _judge_forward_and_backward("cuda", dtype, (5, 300), 1.0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offset_on_neuron_streamed_rows(dtype, monkeypatch):
    """Rows too long to keep in SBUF: the weight chunk (offset + w) is replicated again in each pass."""
    from opport.backends.neuron import rmsnorm as kernels

    monkeypatch.setattr(kernels, "FMAX", 128)
    monkeypatch.setattr(kernels, "SUB", 64)
    monkeypatch.setattr(kernels, "RESIDENT", 128)
    monkeypatch.setattr(kernels, "GRAD_RESIDENT", 128)
    _judge_forward_and_backward("neuron", dtype, (5, 300), 1.0)
