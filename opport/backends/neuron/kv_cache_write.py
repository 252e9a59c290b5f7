"""kv_cache_write on NKI: each token's K and V rows DMA'd from HBM straight to their cache slots."""

from __future__ import annotations

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron._tiles import spans
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.dispatch import impl
from opport.ops.kv_cache_write import kv_cache_write as spec

P = _host.P  # tokens per scatter: the slot indices sit one per partition


@nki.jit
def _kv_cache_write_kernel(key_hbm, value_hbm, slots_hbm, kc_hbm, vc_hbm):
    """Scatter token rows into the caches at their slots.

    Dimensions:
        T: tokens (128 per scatter, one slot index per partition); K = Hkv * D, V = Hkv * Dv: a token's row.

    Args:
        key_hbm: [T, K]; value_hbm: [T, V]; slots_hbm: [T, 1] int32 (-1: skip); kc_hbm: [slots, K] and
        vc_hbm: [slots, V], the caches [num_blocks, block_size, Hkv, D/Dv] viewed as rows, written in place.

    Returns:
        Nothing: the caches are written in place.

    Notes:
        The only on-chip data is the slot index tile: each scatter is one HBM -> HBM DMA whose destination
        rows are picked by `vector_offset`; a slot of -1 lands out of bounds and `oob_mode=skip` drops it. So
        the DMA traffic is the rows themselves (plus the indices), with no SBUF round trip.

    Pseudocode:
        for each 128 tokens: idx = slots[t0:t1]; k_cache[idx] = key[t0:t1]; v_cache[idx] = value[t0:t1]
    """
    T, K = key_hbm.shape
    V = value_hbm.shape[1]
    for t0, n in spans(T, P):
        idx_sb = nl.ndarray((n, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=idx_sb, src=slots_hbm[t0:t0 + n, 0:1])
        nisa.dma_copy(dst=kc_hbm.ap([[K, n], [1, K]], offset=0, vector_offset=idx_sb, indirect_dim=0),
                      src=key_hbm[t0:t0 + n, 0:K], oob_mode=nisa.oob_mode.skip)
        nisa.dma_copy(dst=vc_hbm.ap([[V, n], [1, V]], offset=0, vector_offset=idx_sb, indirect_dim=0),
                      src=value_hbm[t0:t0 + n, 0:V], oob_mode=nisa.oob_mode.skip)


@impl(spec, "neuron")
def kv_cache_write(key: np.ndarray, value: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                   slot_mapping: np.ndarray) -> None:
    """Host side: rows as [T, Hkv * D], caches as [slots, Hkv * D] over their own memory (a strided cache is
    written through a contiguous copy, copied back), slots as int32 [T, 1]."""
    t = key.shape[0]
    if t == 0:
        return None
    kc, vc = _host.contiguous(k_cache), _host.contiguous(v_cache)
    slots = np.ascontiguousarray(slot_mapping, dtype=np.int32).reshape(t, 1)
    _host.run(_kv_cache_write_kernel, _host.contiguous(key).reshape(t, -1), _host.contiguous(value).reshape(t, -1), slots,
              kc.reshape(-1, kc.shape[2] * kc.shape[3]), vc.reshape(-1, vc.shape[2] * vc.shape[3]))
    for cache, dense in ((k_cache, kc), (v_cache, vc)):
        if dense is not cache:
            cache[...] = dense
    return None
