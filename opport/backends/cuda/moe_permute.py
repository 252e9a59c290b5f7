"""moe_permute in Triton: per-block expert counts, one scan to offsets and block bases, then each block's slots
placed at base + their rank among the block's earlier slots of the same expert (deterministic: no atomics)."""

import torch

from opport.backends.cuda._launch import H200_SMS, INTERPRET, cdiv, next_pow2, tile_elements, tl, triton, warps_for
from opport.backends.cuda.moe_unpermute import MAX_ROWS, combine
from opport.dispatch import impl
from opport.ops.moe_permute import moe_permute as spec

GPU_SLOTS = 256  # slots per program on a GPU: T*k / 256 programs (64 at Qwen3-MoE's 2048 tokens x 8), 1 KiB of indices
MAX_EXPERTS = 4096  # a [chunk, E] one-hot tile per step: at least one slot per chunk at the 4K-element tile
GPU_CHUNK = 32  # slots per step on a GPU: [32, E] one-hot tiles, [32, 128] row copies (16 values per thread, 8 warps)
INTERP_CHUNK = 256  # the interpreter's: a [256, 256] same-expert compare is one 64K-element NumPy op


@triton.jit
def _onehot_chunk(idx_ptr, s, live, k, i_st, i_sk, BLOCK_E: tl.constexpr):
    """The experts of flat slots s ([CHUNK], int64) and their [CHUNK, BLOCK_E] int32 one-hot rows (0 where not live)."""
    e = tl.load(idx_ptr + (s // k) * i_st + (s % k) * i_sk, mask=live, other=-1).to(tl.int32)
    hot = (e[:, None] == tl.arange(0, BLOCK_E)[None, :]).to(tl.int32)
    return e, hot


@triton.jit
def _moe_permute_count_kernel(
    # pointers
    idx_ptr, counts_ptr,
    # shapes, strides
    n_slots, k, n_exp, i_st, i_sk,
    # meta-parameters
    SLOTS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """counts[b, e]: how many of block b's SLOTS flat slots chose expert e.

    Dimensions: top_k_index [T, k] (strided, any integer dtype), counts [blocks, E] int32.
    Args: the flat slot s = t*k + j reads top_k_index[t, j].
    Returns: nothing; counts row b is written.
    Notes: one-hot rows of CHUNK slots summed down the slots, chunk after chunk: every count is written once by one
    program (no atomics).
    Pseudocode: counts[b, :] = sum over s in block b of onehot(expert[s])
    """
    b = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK_E,), tl.int32)
    for c0 in range(0, SLOTS, CHUNK):
        s = b * SLOTS + c0 + tl.arange(0, CHUNK).to(tl.int64)
        _, hot = _onehot_chunk(idx_ptr, s, s < n_slots, k, i_st, i_sk, BLOCK_E)
        acc += tl.sum(hot, axis=0)
    e = tl.arange(0, BLOCK_E)
    tl.store(counts_ptr + b * n_exp + e, acc, mask=e < n_exp)


@triton.jit
def _moe_permute_scan_kernel(
    # pointers
    counts_ptr, offsets_ptr,
    # shapes, strides
    n_blocks, n_exp,
    # meta-parameters
    ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """offsets = [0, cumsum(total per expert)] and, in place of counts, each block's first row per expert.

    Dimensions: counts [blocks, E] int32 (overwritten with the bases), offsets [E + 1] int32.
    Args: ROWS: blocks per step of the first pass over counts.
    Returns: nothing; offsets and the bases are written.
    Notes: one program: a first pass sums every expert's count over the blocks, an exclusive scan over the experts
    gives offsets, a second pass writes base[b, e] = offsets[e] + the counts of e in blocks before b (a running sum
    down the blocks). Integer sums: exact and in a fixed order.
    Pseudocode: total = sum_b counts[b]; offsets = [0, cumsum(total)]; base[b] = offsets[:E] + sum_{b' < b} counts[b']
    """
    e = tl.arange(0, BLOCK_E)
    emask = e < n_exp
    total = tl.zeros((BLOCK_E,), tl.int32)
    for b0 in range(0, n_blocks, ROWS):
        b = b0 + tl.arange(0, ROWS)
        m = (b < n_blocks)[:, None] & emask[None, :]
        total += tl.sum(tl.load(counts_ptr + b[:, None].to(tl.int64) * n_exp + e[None, :], mask=m, other=0), axis=0)
    ends = tl.cumsum(total, axis=0)
    tl.store(offsets_ptr + 1 + e, ends, mask=emask)
    tl.store(offsets_ptr + e, 0, mask=e == 0)
    running = ends - total  # exclusive: each expert's first row
    for b in range(0, n_blocks):  # (T*k / 256 rows of E: a short walk, and no 2-D scan to lower)
        ptrs = counts_ptr + b * n_exp + e
        c = tl.load(ptrs, mask=emask, other=0)
        tl.store(ptrs, running, mask=emask)
        running += c


@triton.jit
def _moe_permute_kernel(
    # pointers
    x_ptr, idx_ptr, base_ptr, perm_ptr, src_ptr, offsets_ptr,
    # shapes, strides
    n_slots, k, n_exp, n_cols, i_st, i_sk, x_st, x_sc,
    # meta-parameters
    SINGLE: tl.constexpr, SLOTS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Block b's slots to their rows: row = base[b, e] + the slot's rank among the block's earlier slots of expert e;
    source[row] = slot and permuted[row] = x[slot // k].

    Dimensions: x [T, H] (strided), top_k_index [T, k] (strided), base [blocks, E] int32, permuted [T*k, H] and
    source [T*k] int32 (contiguous), offsets [E + 1] int32 (zeros on entry).
    Args: base_ptr: _moe_permute_scan_kernel's bases; SINGLE: one block holds every slot (decode, small batches):
    this program counts them itself and writes offsets, and the count and scan launches are skipped.
    Returns: nothing; permuted and source (and with SINGLE, offsets) are written.
    Notes: a slot's rank is the number of earlier slots of its chunk with the same expert (a [CHUNK, CHUNK] compare
    of the experts, summed), plus what earlier chunks of the block counted (a running [E] vector): a stable order. Rows
    are distinct, so each program writes its own rows; x's row is read once per chosen expert and copied as it is
    (bit for bit).
    Pseudocode: run = base[b]; for each chunk: row = run[e] + #{earlier slots of e}; run += sum(onehot);
        source[row] = s; permuted[row, :] = x[s // k, :]
    """
    b = tl.program_id(0).to(tl.int64)
    ex = tl.arange(0, BLOCK_E)
    if SINGLE:
        total = tl.zeros((BLOCK_E,), tl.int32)
        for c0 in range(0, SLOTS, CHUNK):
            s = c0 + tl.arange(0, CHUNK).to(tl.int64)
            _, hot = _onehot_chunk(idx_ptr, s, s < n_slots, k, i_st, i_sk, BLOCK_E)
            total += tl.sum(hot, axis=0)
        ends = tl.cumsum(total, axis=0)
        tl.store(offsets_ptr + 1 + ex, ends, mask=ex < n_exp)
        run = ends - total
    else:
        run = tl.load(base_ptr + b * n_exp + ex, mask=ex < n_exp, other=0)
    for c0 in range(0, SLOTS, CHUNK):
        s = b * SLOTS + c0 + tl.arange(0, CHUNK).to(tl.int64)
        live = s < n_slots
        e, hot = _onehot_chunk(idx_ptr, s, live, k, i_st, i_sk, BLOCK_E)
        i = tl.arange(0, CHUNK)
        earlier = (e[:, None] == e[None, :]) & (i[None, :] < i[:, None])  # same expert, earlier slot of the chunk
        row = (tl.sum(hot * run[None, :], axis=1) + tl.sum(earlier.to(tl.int32), axis=1)).to(tl.int64)
        run += tl.sum(hot, axis=0)
        tl.store(src_ptr + row, s.to(tl.int32), mask=live)
        t = s // k
        for h0 in range(0, n_cols, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H).to(tl.int64)
            m = live[:, None] & (h < n_cols)[None, :]
            v = tl.load(x_ptr + t[:, None] * x_st + h[None, :] * x_sc, mask=m)
            tl.store(perm_ptr + row[:, None] * n_cols + h[None, :], v, mask=m)


def _config(n_slots: int, n_exp: int, n_cols: int) -> tuple:
    """(slots per program, slots per chunk, padded experts, copy columns): a chunk's [CHUNK, E] one-hot and its
    [CHUNK, BLOCK_H] row copy hold about tile_elements() each (GPU: registers; interpreter: one program, few large
    NumPy ops)."""
    block_e = next_pow2(n_exp)
    chunk = max(1, min(next_pow2(n_slots), tile_elements() // block_e, INTERP_CHUNK if INTERPRET else GPU_CHUNK))
    fill = next_pow2(max(1, n_slots // H200_SMS))  # fewer slots per program where GPU_SLOTS would leave SMs idle
    slots = max(chunk, next_pow2(n_slots) if INTERPRET else min(GPU_SLOTS, fill))
    return slots, chunk, block_e, max(1, min(next_pow2(n_cols), tile_elements() // chunk))


def _supports(x, top_k_index, num_experts):
    n = top_k_index.shape[0] * top_k_index.shape[1]
    if num_experts > MAX_EXPERTS:
        return f"E = {num_experts} experts: a one-hot tile holds at most {MAX_EXPERTS}"
    if n > MAX_ROWS:
        return f"T*k = {n} rows: source is int32"
    return None


@impl(spec, "cuda", supports=_supports)
def moe_permute(x: torch.Tensor, top_k_index: torch.Tensor, num_experts: int):
    t, k = top_k_index.shape
    n, h = t * k, x.shape[1]
    permuted = torch.empty((n, h), dtype=x.dtype, device=x.device)
    source = torch.empty(n, dtype=torch.int32, device=x.device)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=x.device)
    if n == 0:
        return permuted, source, offsets
    slots, chunk, block_e, block_h = _config(n, num_experts, h)
    blocks = cdiv(n, slots)
    warps = warps_for(chunk * block_e)
    counts = offsets  # (unread with one block)
    if blocks > 1:
        counts = torch.empty((blocks, num_experts), dtype=torch.int32, device=x.device)
        _moe_permute_count_kernel[(blocks,)](top_k_index, counts, n, k, num_experts, *top_k_index.stride(),
                                             SLOTS=slots, CHUNK=chunk, BLOCK_E=block_e, num_warps=warps)
        rows = max(1, min(next_pow2(blocks), tile_elements() // block_e))
        _moe_permute_scan_kernel[(1,)](counts, offsets, blocks, num_experts, ROWS=rows, BLOCK_E=block_e,
                                       num_warps=warps_for(rows * block_e))
    _moe_permute_kernel[(blocks,)](x, top_k_index, counts, permuted, source, offsets, n, k, num_experts, h,
                                   *top_k_index.stride(), *x.stride(), SINGLE=blocks == 1, SLOTS=slots, CHUNK=chunk,
                                   BLOCK_E=block_e, BLOCK_H=block_h, num_warps=warps)
    return permuted, source, offsets


@impl(spec.backward_op, "cuda", supports=lambda grad_permuted, x, top_k_index, source, num_experts:
      _supports(x, top_k_index, num_experts))
def moe_permute_backward(grad_permuted: torch.Tensor, x: torch.Tensor, top_k_index: torch.Tensor,
                         source: torch.Tensor, num_experts: int):
    """dx: moe_unpermute's kernels unweighted (the inverse of source, then each token's k rows summed in order j)."""
    return (combine(grad_permuted, source, *top_k_index.shape),)
