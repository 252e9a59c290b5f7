"""varlen_attention's backward on NumPy: each packed sequence through the cpu attention backward, as [1, H, S, D] views."""

import numpy as np

from opport.arraymath import as_heads, sequences
from opport.backends.cpu._common import uses_blas
from opport.backends.cpu.attention import attention_backward as dense_backward  # the dense kernel, per sequence
from opport.dispatch import impl
from opport.ops.varlen_attention import varlen_attention as spec


@impl(spec.backward_op, "cpu")
@uses_blas()
def varlen_attention_backward(grad, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal: bool, scale, softcap=None,
                              sliding_window=None) -> tuple:
    """dq [Tq, Hq, D], dk [Tk, Hkv, D], dv [Tk, Hkv, Dv]: per sequence, attention's blocked NumPy backward.

    Dimensions: grad, out [Tq, Hq, Dv]; lse [Hq, Tq] (float32; float64 for float64 inputs); q, k, v as the forward.
    Notes: each sequence's token-major slices are viewed head-major ([T, H, D] -> [1, H, T, D], lse[:, seq] as
    [1, Hq, S]; no copy) and run through the dense backward's blocks (FlashAttention-2's recomputation of P from
    lse, dK and dV accumulated over the query blocks and each KV head's query heads, float32 for 16-bit inputs),
    so a sequence reads only its own keys and its memory stays O(block) as the dense kernel's. Keys of a sequence
    without queries get dk = dv = 0; queries of a sequence without keys dq = 0 (they see nothing).
    Pseudocode: for each sequence b: dq[b], dk[b], dv[b] = attention_backward(sequence b's views)
    """
    dq, dk, dv = np.zeros(q.shape, q.dtype), np.zeros(k.shape, k.dtype), np.zeros(v.shape, v.dtype)
    for qs, ks in sequences(cu_seqlens_q, cu_seqlens_k):
        if qs.stop == qs.start or ks.stop == ks.start:  # no query or no key: every sum is empty
            continue
        views = (as_heads(a) for a in (grad[qs], q[qs], k[ks], v[ks], out[qs]))
        grads = dense_backward(*views, lse[None, :, qs], causal, scale, softcap, sliding_window)
        for into, at, r in zip((dq, dk, dv), (qs, ks, ks), grads):
            into[at] = r[0].transpose(1, 0, 2)
    return dq, dk, dv
