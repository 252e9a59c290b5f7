"""kv_cache_write in Triton: each program stores the K and V rows (all heads) of a few tokens at their slots."""

import torch

from opport.backends.cuda._launch import INTERPRET, cdiv, next_pow2, tile_elements, tl, triton
from opport.dispatch import impl
from opport.ops.kv_cache_write import kv_cache_write as spec

MAX_ROW = 16384  # Hkv x max(D, Dv) elements per program: one [BLOCK_H, BLOCK_D] tile in registers


@triton.jit
def _kv_cache_write_kernel(
    # pointers
    key_ptr, value_ptr, kc_ptr, vc_ptr, slot_ptr,
    # shapes, strides
    n_tokens, n_slots, block_size, hkv, d, dv, slot_s,
    key_st, key_sh, key_sd, val_st, val_sh, val_sd,
    kc_sb, kc_so, kc_sh, kc_sd, vc_sb, vc_so, vc_sh, vc_sd,
    # meta-parameters
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Copy BLOCK_T tokens' key and value rows into k_cache and v_cache at slots s = slot_mapping[t] (-1: skipped).

    Dimensions: key [T, Hkv, D], value [T, Hkv, Dv], caches [num_blocks, block_size, Hkv, D/Dv]; all strided.
    Args: slot_ptr: int32 or int64 slots, checked (in range, distinct) before the launch on host arrays; on a GPU
        only under OPPORT_CHECK_VALUES=1 (a host read would break CUDA-graph capture), so the kernel itself skips
        a slot outside [0, n_slots) as it skips -1: nothing outside the caches is ever written.
    Returns: nothing; the caches are written in place.
    Notes: a plain load and store in the inputs' dtype: the rows arrive bit for bit (NaN payloads too, as
    integer-free moves keep them); a padding token's rows are masked off, neither read nor stored. Slots
    are distinct, so programs never conflict.
    Pseudocode: for t in the program's tokens: s = slot[t]; if s >= 0: k_cache[s // bs, s % bs] = key[t]; v likewise
    """
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    slot = tl.load(slot_ptr + t * slot_s, mask=t < n_tokens, other=-1).to(tl.int64)
    live = ((slot >= 0) & (slot < n_slots))[:, None, None]
    blk = (slot // block_size)[:, None, None]
    off = (slot % block_size)[:, None, None]
    tt = t[:, None, None]
    h = tl.arange(0, BLOCK_H)[None, :, None]
    c = tl.arange(0, BLOCK_D)[None, None, :]
    km = live & (h < hkv) & (c < d)
    k = tl.load(key_ptr + tt * key_st + h * key_sh + c * key_sd, mask=km)
    tl.store(kc_ptr + blk * kc_sb + off * kc_so + h * kc_sh + c * kc_sd, k, mask=km)
    vm = live & (h < hkv) & (c < dv)
    v = tl.load(value_ptr + tt * val_st + h * val_sh + c * val_sd, mask=vm)
    tl.store(vc_ptr + blk * vc_sb + off * vc_so + h * vc_sh + c * vc_sd, v, mask=vm)


def row_tiles(t: int, hkv: int, width: int) -> tuple:
    """(BLOCK_T, BLOCK_H, BLOCK_D, warps) of a program storing whole token rows (kv_cache_write, kv_cache_write_fp8):
    tokens per program make a tile of about tile_elements() (GPU: loads in flight; interpreter: few NumPy ops)."""
    block_h, block_d = next_pow2(hkv), next_pow2(width)
    block_t = min(next_pow2(t), max(1, tile_elements() // (block_h * block_d)))
    return block_t, block_h, block_d, 4 if INTERPRET or block_t * block_h * block_d <= 2048 else 8


def _supports(key, value, k_cache, v_cache, slot_mapping):
    row = next_pow2(key.shape[1]) * next_pow2(max(key.shape[2], value.shape[2]))
    if row > MAX_ROW:
        return f"Hkv x max(D, Dv) padded to {row} elements exceeds one program's tile ({MAX_ROW})"
    return None


@impl(spec, "cuda", supports=_supports)
def kv_cache_write(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    t, hkv, d = key.shape
    dv = value.shape[2]
    if t == 0:
        return None
    block_t, block_h, block_d, warps = row_tiles(t, hkv, max(d, dv))
    _kv_cache_write_kernel[(cdiv(t, block_t),)](
        key, value, k_cache, v_cache, slot_mapping, t, k_cache.shape[0] * k_cache.shape[1], k_cache.shape[1], hkv, d,
        dv, slot_mapping.stride(0),
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=warps)
    return None
