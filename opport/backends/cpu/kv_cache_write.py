"""kv_cache_write on NumPy: one fancy-index assignment per cache."""

import numpy as np

from opport.arraymath import PAD
from opport.dispatch import impl
from opport.ops.kv_cache_write import kv_cache_write as spec


@impl(spec, "cpu")
def kv_cache_write(key: np.ndarray, value: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                   slot_mapping: np.ndarray) -> None:
    """k_cache[s // bs, s % bs] = key[t] and v_cache likewise for every token t with s = slot_mapping[t] != -1.

    Dimensions: key [T, Hkv, D], value [T, Hkv, Dv], caches [num_blocks, bs, Hkv, D/Dv] (any strides).
    Notes: the rows are copied bit for bit (same dtype); slots were checked (in range, distinct) before
    the kernel runs, so the scatter has no conflicts. Without padding the rows are scattered as they are
    (no gathered copy), and a contiguous cache is indexed by slot as [slots, Hkv, D] (one index, not two).
    """
    slots = np.asarray(slot_mapping)
    keep = slots != PAD
    if not keep.all():
        key, value, slots = key[keep], value[keep], slots[keep]
    if slots.size:
        _scatter(k_cache, slots, key)
        _scatter(v_cache, slots, value)


def _scatter(cache: np.ndarray, slots: np.ndarray, rows: np.ndarray):
    if cache.flags.c_contiguous:
        cache.reshape(-1, *cache.shape[2:])[slots] = rows  # a view of the cache: writes land in place
    else:
        cache[slots // cache.shape[1], slots % cache.shape[1]] = rows
