"""varlen_attention on NumPy: each packed sequence through the cpu attention kernel, as [1, H, S, D] views."""

import numpy as np

from opport.arraymath import sequences
from opport.backends.cpu.attention import _attention
from opport.dispatch import impl
from opport.ops.varlen_attention import varlen_attention as spec


@impl(spec, "cpu")
def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool, scale, softcap, sliding_window) -> np.ndarray:
    """out [Tq, Hq, Dv]: per sequence b, attention of q[cu_q[b]:cu_q[b+1]] over k, v[cu_k[b]:cu_k[b+1]].

    Notes: the token-major slices are viewed head-major ([T, H, D] -> [1, H, T, D], no copy) and run through
    the dense kernel's blocks, so each sequence reads only its own keys; a sequence without queries is
    skipped, one without keys writes zeros (the dense kernel's rule for rows that see no key).
    """
    out = np.empty((q.shape[0], q.shape[1], v.shape[2]), q.dtype)
    for qs, ks in sequences(cu_seqlens_q, cu_seqlens_k):
        if qs.stop == qs.start:
            continue
        o = _attention(_heads(q[qs]), _heads(k[ks]), _heads(v[ks]), causal, scale, None, softcap, sliding_window)
        out[qs] = o[0].transpose(1, 0, 2)
    return out


def _heads(x: np.ndarray) -> np.ndarray:
    return x.transpose(1, 0, 2)[None]
