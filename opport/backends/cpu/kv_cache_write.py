"""kv_cache_write on NumPy: one fancy-index assignment per cache."""

import numpy as np

from opport.dispatch import impl
from opport.ops.kv_cache_write import kv_cache_write as spec
from opport.ops.kv_cache_write import written_rows


@impl(spec, "cpu")
def kv_cache_write(key: np.ndarray, value: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                   slot_mapping: np.ndarray) -> None:
    """k_cache[s // bs, s % bs] = key[t] and v_cache likewise for every token t with s = slot_mapping[t] != -1.

    Dimensions: key [T, Hkv, D], value [T, Hkv, Dv], caches [num_blocks, bs, Hkv, D/Dv] (any strides).
    Notes: the rows are copied bit for bit (same dtype); slots were checked (in range, distinct) before
    the kernel runs, so the scatter has no conflicts.
    """
    tokens, blocks, offsets = written_rows(slot_mapping, k_cache.shape[1])
    if tokens.size:
        k_cache[blocks, offsets] = key[tokens]
        v_cache[blocks, offsets] = value[tokens]
