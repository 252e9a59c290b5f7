"""paged_varlen_attention: a mixed batch in one call equals the decode steps it stands for (paged_attention), cached
prefixes shared between sequences, windows and soft caps, bad batches refused, and the cuda and neuron kernels."""

import numpy as np
import pytest

import opport
from opport.errors import ArgumentError
from opport.ops.paged_varlen_attention import make_inputs


def inputs(ctx, new, hq=4, hkv=2, d=32, bs=16, dtype="float64", seed=0, **kw):
    return make_inputs(np.random.default_rng(seed), dtype, ctx, new, hq, hkv, d, bs, **kw)


def as_decodes(q, kc, vc, bt, cuq, lens, backend="cpu", **kw):
    """Each new token as its own paged_attention decode step: token i of a sequence sees context ctx - n + i + 1."""
    out = np.empty((q.shape[0], q.shape[1], vc.shape[3]), q.dtype)
    for b in range(len(lens)):
        n = int(cuq[b + 1] - cuq[b])
        for i in range(n):
            t = int(cuq[b]) + i
            ctx = np.array([int(lens[b]) - n + i + 1], np.int32)
            out[t] = opport.paged_attention(q[t:t + 1], kc, vc, bt[b:b + 1], ctx, backend=backend, **kw)[0]
    return out


@pytest.mark.parametrize("kw", [{}, {"sliding_window": 7}, {"softcap": 3.0, "scale": 0.4}, {"sliding_window": 1}])
def test_a_mixed_batch_is_its_decode_steps(kw):
    args = inputs([17, 40, 5, 33, 0], [1, 16, 5, 3, 0], shared=((3, 1, 2),))
    out = opport.paged_varlen_attention(*args, backend="cpu", **kw)
    assert np.allclose(out, as_decodes(*args, **kw), rtol=1e-12, atol=1e-12)


def test_one_new_token_each_is_paged_attention():
    q, kc, vc, bt, cuq, lens = inputs([9, 30, 1, 64], [1, 1, 1, 1])
    want = opport.paged_attention(q, kc, vc, bt, lens, backend="cpu")
    assert np.allclose(opport.paged_varlen_attention(q, kc, vc, bt, cuq, lens, backend="cpu"), want, rtol=1e-12)


def test_a_shared_prefix_reads_the_same_blocks():
    """Two sequences whose tables share their first two blocks (a cached prompt) and whose last new tokens have the
    same context, token and values: the same output, although each has its own last block."""
    q, kc, vc, bt, cuq, lens = inputs([32, 32], [4, 1], shared=((1, 0, 2),))
    assert (bt[0, :2] == bt[1, :2]).all()
    out = opport.paged_varlen_attention(np.concatenate([q[:4], q[3:4]]), kc, vc, bt, cuq, lens, backend="cpu")
    assert np.array_equal(out[3], out[4])


@pytest.mark.parametrize("t,cu,lens,constraint", [
    (9, [0, 4, 9], [20, 3], "paged_varlen_attention.query_range"),  # 5 new tokens, a context of 3
    (5, [0, 5, 4], [20, 3], "paged_varlen_attention.cu_values"),
    (5, [0, 4, 5], [33, 3], "paged_varlen_attention.context_range"),
])
def test_bad_batches_raise_before_any_kernel(t, cu, lens, constraint):
    q, cache = np.zeros((t, 4, 16), np.float32), np.zeros((5, 16, 2, 16), np.float32)
    with pytest.raises(ArgumentError) as e:
        opport.paged_varlen_attention(q, cache, cache, np.array([[0, 1], [2, 3]], np.int32), np.array(cu, np.int32),
                                      np.array(lens, np.int32), backend="cpu")
    assert e.value.constraint == constraint and e.value.op == "paged_varlen_attention"


@pytest.mark.parametrize("backend", ["cuda", "neuron"])
def test_kernels_match_the_decode_steps(backend):
    """A prefill chunk longer than a neuron row tile (130 > 128 tokens) with GQA 4, a decode and a shared prefix."""
    args = inputs([150, 40, 33], [130, 1, 9], hq=8, hkv=2, dtype="float32", shared=((2, 1, 2),))
    if backend == "cuda":
        import torch

        got = opport.paged_varlen_attention(*map(torch.from_numpy, args), sliding_window=100, backend="cuda").numpy()
    else:
        got = opport.paged_varlen_attention(*args, sliding_window=100, backend="neuron")
    want = as_decodes(*(a.astype(np.float64) if a.dtype == np.float32 else a for a in args), sliding_window=100)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_on_a_device_the_tables_are_not_read_back_and_the_cuda_kernels_stay_in_bounds():
    """The serving ops' value checks run on host arrays only (OPPORT_CHECK_VALUES=1 adds device arrays: a host read
    per call would break CUDA-graph capture), so the cuda kernels meet bad tables themselves: nothing outside the
    caches and the output is touched, and the sequence that named a stray block or an impossible length is NaN."""
    torch = pytest.importorskip("torch")
    from opport.backends.cuda.kv_cache_write import kv_cache_write as write_kernel
    from opport.backends.cuda.paged_attention import paged_attention as decode_kernel
    from opport.backends.cuda.paged_varlen_attention import paged_varlen_attention as mixed_kernel

    for op in ("kv_cache_write", "paged_attention", "paged_varlen_attention"):
        assert opport.get_op(op)._value_check[1].on_device is False
    q, kc, vc, bt, cuq, lens = (torch.from_numpy(a) for a in inputs([20, 40, 9], [3, 1, 9], dtype="float32"))
    room = torch.full((kc.shape[0] + 2, *kc.shape[1:]), 7.0)  # the caches inside a larger buffer: its ends must stay
    room[1:-1] = kc
    kc = room[1:-1]
    bt[1, 1], lens[2] = 10_000, 1_000  # a stray block for sequence 1, an impossible length for sequence 2
    out = mixed_kernel(q, kc, vc, bt, cuq, lens, None, None, None)
    assert torch.isnan(out[3]).all() and torch.isnan(out[4:]).all() and not torch.isnan(out[:3]).any()
    decode = decode_kernel(q[[2, 3, 12]], kc, vc, bt, lens, None, None, None)
    assert not torch.isnan(decode[0]).any() and torch.isnan(decode[1:]).all()
    k_new, before = torch.ones(2, kc.shape[2], kc.shape[3]), room.clone()
    write_kernel(k_new, k_new, kc, vc, torch.tensor([-5, kc.shape[0] * kc.shape[1] + 3]))  # both out of range: skipped
    assert torch.equal(room.view(torch.int32), before.view(torch.int32))  # bitwise: NaN slots included
