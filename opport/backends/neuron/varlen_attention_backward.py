"""varlen_attention's backward on NKI: each packed sequence through attention's NKI backward kernel (one launch per
sequence, as the forward).

Cost, per sequence: the host copies its q, k, v, O, dO slices head-major ([1, H, S, D], contiguous: the dense
kernel's DMA layout) and its gradients back (a read and a write of every input and gradient, beside the kernel's
own), plus one launch; the kernel's shapes are compile-time, so on hardware each distinct (Sq, Sk) pair compiles
once and is cached after. Within a sequence the kernel is attention's FlashAttention-2 backward (docs/neuron.md).
"""

import numpy as np

from opport.arraymath import as_heads, sequences
from opport.backends.neuron.attention_backward import attention_backward as dense_backward  # the dense kernel, per sequence
from opport.backends.neuron.varlen_attention import _supports as _forward_supports
from opport.dispatch import impl
from opport.ops.varlen_attention import varlen_attention as spec


def _supports(grad, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, scale, softcap=None, sliding_window=None):
    return _forward_supports(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, softcap, sliding_window)


@impl(spec.backward_op, "neuron", supports=_supports)
def varlen_attention_backward(grad, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal: bool, scale, softcap=None,
                              sliding_window=None) -> tuple:
    """dq, dk, dv: attention's NKI backward on each sequence's [1, H, S, D] views (lse[:, seq] as [1, Hq, S]).

    Keys of a sequence without queries get dk = dv = 0, queries of a sequence without keys dq = 0 (nothing is
    launched for either). The host picks the dense kernel's data-dependent variants per sequence (exact one-row
    tiles where its q, k or dO holds inf/NaN under a causal mask, dead-row handling where some lse is -inf), so
    one sequence's special values never change another's launch.
    """
    dq, dk, dv = np.zeros(q.shape, q.dtype), np.zeros(k.shape, k.dtype), np.zeros(v.shape, v.dtype)
    for qs, ks in sequences(cu_seqlens_q, cu_seqlens_k):
        if qs.stop == qs.start or ks.stop == ks.start:
            continue
        views = (as_heads(a) for a in (grad[qs], q[qs], k[ks], v[ks], out[qs]))
        grads = dense_backward(*views, lse[None, :, qs], causal, scale, softcap, sliding_window)
        for into, at, r in zip((dq, dk, dv), (qs, ks, ks), grads):
            into[at] = r[0].transpose(1, 0, 2)
    return dq, dk, dv
