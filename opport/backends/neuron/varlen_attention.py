"""varlen_attention on NKI: each packed sequence through attention's NKI forward kernel (one launch per sequence).

Not yet a single-launch varlen kernel: the host walks cu_seqlens (already read by the dispatcher's value check)
and runs the dense kernel on each sequence's [1, H, S, D] view, so a sequence only ever sees its own keys.
"""

import numpy as np

from opport.arraymath import as_heads, sequences
from opport.backends.neuron.attention import D_MAX, DV_MAX
from opport.backends.neuron.attention import attention as dense
from opport.backends.neuron.attention import attention_forward as dense_forward
from opport.dispatch import impl
from opport.ops.varlen_attention import varlen_attention as spec


def _supports(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, softcap, sliding_window):
    if q.shape[2] > D_MAX:
        return f"head dim {q.shape[2]} > {D_MAX}: q @ k^T contracts over the 128 partitions"
    if v.shape[2] > DV_MAX:
        return f"value dim {v.shape[2]} > {DV_MAX}: the P @ V accumulator is one 2 KiB PSUM bank of float32"
    return None


@impl(spec, "neuron", supports=_supports)
def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool, scale, softcap, sliding_window) -> np.ndarray:
    """out [Tq, Hq, Dv]: attention's NKI forward per sequence (a sequence without keys writes zeros)."""
    out = np.empty((q.shape[0], q.shape[1], v.shape[2]), q.dtype)
    for qs, ks in sequences(cu_seqlens_q, cu_seqlens_k):
        if qs.stop > qs.start:
            o = dense(as_heads(q[qs]), as_heads(k[ks]), as_heads(v[ks]), causal, scale, softcap, sliding_window)
            out[qs] = o[0].transpose(1, 0, 2)
    return out


@impl(spec.train_forward, "neuron", supports=_supports)
def varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool, scale, softcap,
                             sliding_window) -> tuple:
    """The forward plus lse [Hq, Tq] (float32): attention's NKI training forward per sequence, whose single pass
    also writes each row's log-sum-exp (-inf for a row that sees no key)."""
    out = np.empty((q.shape[0], q.shape[1], v.shape[2]), q.dtype)
    lse = np.empty((q.shape[1], q.shape[0]), np.float32)
    for qs, ks in sequences(cu_seqlens_q, cu_seqlens_k):
        if qs.stop > qs.start:
            o, rows = dense_forward(as_heads(q[qs]), as_heads(k[ks]), as_heads(v[ks]), causal, scale, softcap, sliding_window)
            out[qs], lse[:, qs] = o[0].transpose(1, 0, 2), rows[0]
    return out, lse
