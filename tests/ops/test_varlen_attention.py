"""varlen_attention: the cpu kernel against the reference, dense attention per sequence, the cu_seqlens value
check (typed errors on every call, before any kernel, any array kind) and the cost per sequence."""

import numpy as np
import pytest

import opport
from opport.backends.cpu.attention import attention as dense_kernel
from opport.backends.cpu.varlen_attention import varlen_attention as kernel
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
