"""varlen_attention: the cpu kernel against the reference, dense attention per sequence, the cu_seqlens value
check (typed errors on every call, before any kernel, any array kind) and the cost per sequence."""

import numpy as np
import pytest

import opport
from opport.arraymath import sequences
from opport.backends.cpu.attention import attention as dense_kernel
from opport.backends.cpu.varlen_attention import varlen_attention as kernel
from opport.backends.cpu.varlen_attention import varlen_attention_forward as train_kernel
from opport.backends.cpu.varlen_attention_backward import varlen_attention_backward as backward_kernel
from opport.dispatch import call
from opport.dispatch.adapters import NumpyAdapter
from opport.errors import ArgumentError
from opport.ops.varlen_attention import cu
from opport.ops.varlen_attention import varlen_attention as spec
from tests.ops import _check

test_fixed_cases = _check.fixed_cases_test(spec, signed_zero=False, min_cases=10)
test_hypothesis_cases = _check.hypothesis_test(spec, signed_zero=False)


def packed(lq, lk, hq=4, hkv=2, d=16, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((sum(lq), hq, d)).astype(dtype)
    k = rng.standard_normal((sum(lk), hkv, d)).astype(dtype)
    v = rng.standard_normal((sum(lk), hkv, d)).astype(dtype)
    return q, k, v, cu(lq), cu(lk)


@pytest.mark.parametrize("kw", [dict(causal=False), dict(causal=True), dict(causal=True, softcap=7.0, sliding_window=5)])
def test_each_sequence_is_dense_attention_alone(kw):
    lq, lk = [9, 0, 14, 3], [9, 4, 20, 0]
    q, k, v, cq, ck = packed(lq, lk)
    out = kernel(q, k, v, cq, ck, kw["causal"], None, kw.get("softcap"), kw.get("sliding_window"))
    for b in range(len(lq)):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        alone = dense_kernel(q[qs].transpose(1, 0, 2)[None], k[ks].transpose(1, 0, 2)[None],
                             v[ks].transpose(1, 0, 2)[None], kw["causal"], None, kw.get("softcap"), kw.get("sliding_window"))
        assert np.array_equal(out[qs], alone[0].transpose(1, 0, 2))
    assert np.array_equal(out[cq[3]:], np.zeros_like(out[cq[3]:]))  # the sequence without keys outputs 0


def test_other_sequences_values_never_leak():
    q, k, v, cq, ck = packed([6, 6], [6, 6])
    clean = kernel(q, k, v, cq, ck, False, None, None, None)
    k2, v2 = k.copy(), v.copy()
    k2[6:], v2[6:] = np.nan, np.inf
    dirty = kernel(q, k2, v2, cq, ck, False, None, None, None)
    assert np.array_equal(dirty[:6], clean[:6]) and np.isnan(dirty[6:]).all()


@pytest.mark.parametrize("bad_q, constraint_arg", [
    (np.array([1, 6, 12], np.int32), "cu_seqlens_q"),  # does not start at 0
    (np.array([0, 7, 6], np.int32), "cu_seqlens_q"),  # decreasing, and not ending at Tq
    (np.array([0, 6, 11], np.int32), "cu_seqlens_q"),  # ends before Tq
])
def test_bad_values_are_refused_on_every_call_not_only_the_first(bad_q, constraint_arg):
    """The selection cache keys on shapes: a valid call first must not let a later bad one through."""
    q, k, v, cq, ck = packed([6, 6], [6, 6])
    call(spec, spec.bind(q, k, v, cq, ck), "cpu")
    with pytest.raises(ArgumentError) as info:
        call(spec, spec.bind(q, k, v, bad_q, ck), "cpu")
    assert (info.value.constraint, info.value.arg, info.value.op) == ("varlen_attention.cu_values", constraint_arg,
                                                                     "varlen_attention")


def test_bad_values_in_torch_tensors_are_refused():
    torch = pytest.importorskip("torch")
    q, k, v, cq, ck = packed([6, 6], [6, 6])
    args = [torch.from_numpy(a) for a in (q, k, v, cq)] + [torch.tensor([0, 8, 12], dtype=torch.int32) - 1]
    with pytest.raises(ArgumentError, match="cu_values"):
        opport.varlen_attention(*args, backend="cpu")
    good = opport.varlen_attention(*[torch.from_numpy(a) for a in (q, k, v, cq, ck)], backend="cpu")
    assert np.array_equal(good.numpy(), kernel(q, k, v, cq, ck, False, None, None, None))


def test_cost_counts_each_sequences_pairs():
    q, k, v, cq, ck = packed([4, 2], [4, 6], hq=2, hkv=1, d=8)
    causal = spec.get_cost(q, k, v, cq, ck, causal=True)
    assert causal.flops == 2 * 2 * (4 * 5 // 2 + (5 + 6)) * (8 + 8)  # 10 pairs, then rows seeing 5 and 6 keys
    metas = [NumpyAdapter.meta(a) for a in (q, k, v, cq, ck)]
    assert spec.get_cost(*metas).flops >= spec.get_cost(q, k, v, cq, ck).flops  # without values: an upper bound


def test_dispatch_reaches_cpu_kernel():
    q, k, v, cq, ck = packed([3, 5], [3, 5])
    assert opport.explain("varlen_attention", q, k, v, cq, ck, backend="cpu").kernel == "cpu.varlen_attention"


# --------------------------------------------------------------------------- backward

BWD, TRAIN = spec.backward_op, spec.train_forward
SEQS = ([9, 0, 14, 3, 6], [9, 4, 20, 0, 2])  # an empty query side, an empty key side, Sq > Sk and Sq < Sk


def _dense_backward(*args):
    from opport.dispatch import get_backend, kernels
    from opport.ops.attention import attention as dense

    return kernels(dense.backward_op, get_backend("cpu"))[0].fn(*args)


def _grad_inputs(kw, seed=0, dtype=np.float32):
    """(grad, q, k, v, out, lse, cu_q, cu_k) from the cpu training forward on SEQS."""
    q, k, v, cq, ck = packed(*SEQS, seed=seed, dtype=dtype)
    out, lse = train_kernel(q, k, v, cq, ck, kw["causal"], None, kw.get("softcap"), kw.get("sliding_window"))
    g = np.random.default_rng(seed + 1).standard_normal(out.shape).astype(dtype)
    return g, q, k, v, out, lse, cq, ck


KWS = [dict(causal=False), dict(causal=True), dict(causal=True, softcap=7.0, sliding_window=5)]


@pytest.mark.parametrize("kw", KWS)
def test_training_forward_and_backward_are_dense_attention_per_sequence(kw):
    """lse[:, seq] and each sequence's gradients are the dense kernels' on that sequence alone, bit for bit; the keys
    of the sequence without queries get dk = dv = 0, the queries of the one without keys dq = 0."""
    g, q, k, v, out, lse, cq, ck = _grad_inputs(kw)
    scalars = (kw["causal"], None, kw.get("softcap"), kw.get("sliding_window"))
    assert np.array_equal(out, kernel(q, k, v, cq, ck, *scalars)) and lse.shape == (4, 32) and lse.dtype == np.float32
    dq, dk, dv = backward_kernel(g, q, k, v, out, lse, cq, ck, *scalars)
    heads = lambda x: x.transpose(1, 0, 2)[None]  # noqa: E731
    for qs, ks in sequences(cq, ck):
        if qs.stop > qs.start and ks.stop > ks.start:
            want = _dense_backward(heads(g[qs]), heads(q[qs]), heads(k[ks]), heads(v[ks]), heads(out[qs]),
                                   lse[None, :, qs], *scalars)
            for got, w in zip((dq[qs], dk[ks], dv[ks]), want):
                assert np.array_equal(got, w[0].transpose(1, 0, 2))
    assert not dk[9:13].any() and not dv[9:13].any()  # sequence 1: keys, no queries
    assert not dq[23:26].any() and np.isneginf(lse[:, 23:26]).all()  # sequence 3: queries, no keys


@pytest.mark.parametrize("fn", (backward_kernel, BWD.run_reference), ids=("kernel", "reference"))
def test_other_sequences_and_dead_tokens_never_reach_a_gradient(fn):
    """NaN/inf in the keys of sequence 1 (no queries), in q and dO of sequence 3 (no keys) and of sequence 4's first
    four tokens (causal with Sq = 6 > Sk = 2: they see no key) change no gradient anywhere, bit for bit."""
    g, q, k, v, out, lse, cq, ck = _grad_inputs(dict(causal=True), seed=3)
    clean = fn(g, q, k, v, out, lse, cq, ck, True, None, None, None)
    g2, q2, k2, v2 = g.copy(), q.copy(), k.copy(), v.copy()
    k2[9:13], v2[9:13] = np.nan, np.inf
    q2[23:30], g2[23:30] = np.nan, np.inf
    assert np.isneginf(lse[:, 23:30]).all()
    for a, b in zip(clean, fn(g2, q2, k2, v2, out, lse, cq, ck, True, None, None, None)):
        assert np.isfinite(b).all()
        np.testing.assert_array_equal(b, a)


def test_numpy_vjp_runs_the_training_forward_and_backward():
    q, k, v, cq, ck = packed(*SEQS, seed=5, dtype=np.float64)
    out, pullback = opport.vjp("varlen_attention", q, k, v, cq, ck, causal=True, backend="cpu")
    g = np.random.default_rng(6).standard_normal(out.shape)
    got = pullback(g)
    (lse,) = TRAIN.run_stats(q, k, v, cq, ck, True, None, None, None)
    want = BWD.run_reference(g, q, k, v, out, lse, cq, ck, True, None, None, None)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_torch_autograd_treats_cu_seqlens_as_integer_constants():
    torch = pytest.importorskip("torch")
    q, k, v, cq, ck = packed(*SEQS, seed=7, dtype=np.float64)
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    out = opport.varlen_attention(tq, tk, tv, torch.from_numpy(cq), torch.from_numpy(ck), causal=True, softcap=3.0,
                                  sliding_window=4, backend="cpu")
    g = torch.from_numpy(np.random.default_rng(8).standard_normal(tuple(out.shape)))
    got = torch.autograd.grad(out, (tq, tk, tv), g)
    (lse,) = TRAIN.run_stats(q, k, v, cq, ck, True, None, 3.0, 4)
    want = BWD.run_reference(g.numpy(), q, k, v, out.detach().numpy(), lse, cq, ck, True, None, 3.0, 4)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.numpy(), b, rtol=1e-10, atol=1e-12)


def test_jax_grad_through_varlen_attention():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    q, k, v, cq, ck = packed(*SEQS, seed=9)
    w = np.random.default_rng(10).standard_normal((q.shape[0], q.shape[1], v.shape[2])).astype(np.float32)

    def loss(q, k, v):
        return jnp.sum(opport.varlen_attention(q, k, v, jnp.asarray(cq), jnp.asarray(ck), causal=True, backend="cpu") * w)

    out, pullback = opport.vjp("varlen_attention", q, k, v, cq, ck, causal=True, backend="cpu")
    want = pullback(w)
    for how, grad in (("eager", jax.grad(loss, (0, 1, 2))), ("jit", jax.jit(jax.grad(loss, (0, 1, 2))))):
        got = grad(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a), b, err_msg=how)


def test_cuda_backward_is_deterministic():
    """Two runs of the Triton backward (the interpreter here) agree bit for bit (no atomics), and with the cpu kernel
    within float32 rounding."""
    torch = pytest.importorskip("torch")
    from opport.dispatch import get_backend

    if get_backend("cuda").unavailable():
        pytest.skip("no cuda backend here")
    from opport.backends.cuda.varlen_attention_backward import varlen_attention_backward as cuda_kernel

    args = _grad_inputs(dict(causal=True), seed=11)
    t = [torch.from_numpy(a) for a in args]
    first = cuda_kernel(*t, True, None, None, None)
    second = cuda_kernel(*t, True, None, None, None)
    want = backward_kernel(*args, True, None, None, None)
    for a, b, w in zip(first, second, want):
        assert torch.equal(a, b)
        np.testing.assert_allclose(a.numpy(), w, rtol=1e-4, atol=1e-5)
