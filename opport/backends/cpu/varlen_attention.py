"""varlen_attention on NumPy: each packed sequence through the cpu attention kernel, as [1, H, S, D] views."""

import numpy as np

from opport.arraymath import as_heads, sequences
from opport.backends.cpu._common import uses_blas
from opport.backends.cpu.attention import _attention
from opport.dispatch import impl
from opport.dtypes import acc_of
from opport.ops.varlen_attention import varlen_attention as spec


@impl(spec, "cpu")
@uses_blas()
def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool, scale, softcap, sliding_window) -> np.ndarray:
    """out [Tq, Hq, Dv]: per sequence b, attention of q[cu_q[b]:cu_q[b+1]] over k, v[cu_k[b]:cu_k[b+1]].

    Notes: the token-major slices are viewed head-major ([T, H, D] -> [1, H, T, D], no copy) and run through
    the dense kernel's blocks, so each sequence reads only its own keys; a sequence without queries is
    skipped, one without keys writes zeros (the dense kernel's rule for rows that see no key).
    """
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, softcap, sliding_window, None)


@impl(spec.train_forward, "cpu")
@uses_blas()
def varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool, scale, softcap, sliding_window) -> tuple:
    """The forward plus each token's log-sum-exp per query head, lse [Hq, Tq] (float32; float64 for float64 inputs),
    from the dense kernel's online softmax: -inf for tokens that see no key or only -inf scores."""
    lse = np.full((q.shape[1], q.shape[0]), -np.inf, acc_of(q.dtype))
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, softcap, sliding_window, lse), lse


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, softcap, window, lse):
    out = np.empty((q.shape[0], q.shape[1], v.shape[2]), q.dtype)
    for qs, ks in sequences(cu_seqlens_q, cu_seqlens_k):
        if qs.stop == qs.start:
            continue
        rows = None if lse is None else np.empty((1, q.shape[1], qs.stop - qs.start), lse.dtype)
        o = _attention(as_heads(q[qs]), as_heads(k[ks]), as_heads(v[ks]), causal, scale, rows, softcap, window)
        out[qs] = o[0].transpose(1, 0, 2)
        if lse is not None:
            lse[:, qs] = rows[0]
    return out
