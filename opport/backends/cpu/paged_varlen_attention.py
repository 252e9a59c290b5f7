"""paged_varlen_attention on NumPy: each sequence's new tokens through the cpu attention kernel over its gathered
context."""

import numpy as np

from opport.arraymath import as_heads, paged_spans
from opport.backends.cpu._common import uses_blas
from opport.backends.cpu.attention import _attention
from opport.backends.cpu.paged_attention import decode_rows, gather_kv
from opport.dispatch import impl
from opport.dtypes import acc_of
from opport.ops.paged_varlen_attention import paged_varlen_attention as spec


@impl(spec, "cpu")
@uses_blas()
def paged_varlen_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, softcap,
                           sliding_window, k_scale=None, v_scale=None) -> np.ndarray:
    """out [T, Hq, Dv]: per sequence, attention(causal=True) of its n new tokens over positions lo .. ctx - 1.

    Notes: the sequences with one new token (decodes) run together through paged_attention's `decode_rows`
    (groups of sequences, one batched problem per chunk of positions); each other sequence on its own: only the
    positions some new token sees are gathered (from the first token's window start to the
    context's end), so unseen slots never enter; the dense kernel's bottom-right causal mask over those keys is
    exactly "token i sees positions <= ctx - n + i" (and its window), in its 128-query x 256-key blocks. An fp8
    cache is gathered as codes x scales in the accumulation dtype.
    """
    dt = acc_of(q.dtype)
    out = np.empty((q.shape[0], q.shape[1], v_cache.shape[3]), q.dtype)
    decodes = []  # (token, sequence, first position, context) of the sequences with one new token
    for b, (ts, lo, ctx) in enumerate(paged_spans(cu_seqlens_q, context_lens, sliding_window)):
        if ts.stop - ts.start == 1:
            decodes.append((ts.start, b, lo, ctx))
        elif ts.stop > ts.start:
            k = gather_kv(k_cache, k_scale, block_tables[b], lo, ctx, dt)
            v = gather_kv(v_cache, v_scale, block_tables[b], lo, ctx, dt)
            o = _attention(as_heads(q[ts]), as_heads(k), as_heads(v), True, scale, None, softcap, sliding_window)
            out[ts] = o[0].transpose(1, 0, 2)
    if decodes:
        t, b, lo, ctx = (np.array(c, np.int64) for c in zip(*decodes))
        rows = np.empty((len(t), q.shape[1], v_cache.shape[3]), q.dtype)
        decode_rows(rows, q[t], k_cache, v_cache, np.asarray(block_tables)[b], lo, ctx, scale, softcap, k_scale, v_scale)
        out[t] = rows
    return out
