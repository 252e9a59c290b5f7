"""moe_unpermute in Triton: the inverse permutation by a scatter of row numbers, then one program per token tile
gathering each token's k rows through it (a fixed j order, no atomics). The backward is one launch over y's rows."""

import torch

from opport.backends.cuda._launch import INTERPRET, cdiv, f32, narrow, next_pow2, tile_elements, tl, triton, warps_for
from opport.dispatch import impl
from opport.ops.moe_unpermute import moe_unpermute as spec

GPU_COLS = 1024  # columns per chunk on a GPU: a [4, 1024] float32 tile is 4K elements, 32 per thread over 4 warps
MAX_GRID_Y = 65535  # CUDA's limit on grid axis 1 (the forward's column tiles)
MAX_ROWS = 2**31 - 1  # the inverse permutation is int32 (moe_permute's source is int32 too)


@triton.jit
def _moe_unpermute_inverse_kernel(
    # pointers
    src_ptr, row_ptr,
    # shapes, strides
    n_rows, src_s,
    # meta-parameters
    BLOCK: tl.constexpr,
):
    """row[source[r]] = r: the inverse of the permutation source (checked before the launch).

    Dimensions: source [T*k] (any integer dtype, strided), row [T*k] int32.
    Args: src_ptr: the flat slot of each row of y; row_ptr: written, each slot's row of y.
    Returns: nothing; row is written in place.
    Notes: source is a permutation, so every store has its own address: no two programs write the same element.
    The values were checked before the launch; the range mask only keeps a wrong view of source (garbage values)
    from storing outside row.
    Pseudocode: for r in the program's rows: row[source[r]] = r
    """
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = r < n_rows
    s = tl.load(src_ptr + r * src_s, mask=live, other=0).to(tl.int64)
    tl.store(row_ptr + s, r.to(tl.int32), mask=live & (s >= 0) & (s < n_rows))


@triton.jit
def _moe_unpermute_kernel(
    # pointers
    y_ptr, row_ptr, w_ptr, out_ptr,
    # shapes, strides
    n_tokens, n_cols, k, y_sr, y_sc, w_st, w_sk, o_st, o_sc,
    # meta-parameters
    WEIGHTED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out[t] = sum_j w[t, j] * y[row[t*k + j]] for a [BLOCK_T tokens, BLOCK_N columns] tile (WEIGHTED=False: the
    plain sum over j, moe_permute's backward; w_ptr is then unused).

    Dimensions: y [T*k, N], weights [T, k], out [T, N], all strided; row [T*k] int32 (contiguous).
    Args: row_ptr: the inverse permutation (_moe_unpermute_inverse_kernel's).
    Returns: nothing; out is written.
    Notes: each token's k rows are gathered one slot j at a time and accumulated in float32 in the order
    j = 0..k-1, so the sum is deterministic and the same on every run; every output element is written by
    exactly one program (no atomics). y is read once, out written once; the weights and the row indices are
    read once per column tile. A row index outside y (never, for a checked source) reads as a masked row.
    Pseudocode: acc = 0; for j in 0..k-1: acc += w[t, j] * y[row[t*k + j], cols]; out[t, cols] = acc
    """
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = t < n_tokens
    mask = live[:, None] & (c < n_cols)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
    for j in range(0, k):
        r = tl.load(row_ptr + t * k + j, mask=live, other=0).to(tl.int64)
        inside = ((r >= 0) & (r < n_tokens * k))[:, None]
        y = f32(tl.load(y_ptr + r[:, None] * y_sr + c[None, :] * y_sc, mask=mask & inside, other=0.0))
        if WEIGHTED:
            w = f32(tl.load(w_ptr + t * w_st + j * w_sk, mask=live, other=0.0))
            acc += w[:, None] * y
        else:
            acc += y
    tl.store(out_ptr + t[:, None] * o_st + c[None, :] * o_sc, narrow(acc, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _moe_unpermute_backward_kernel(
    # pointers
    grad_ptr, y_ptr, src_ptr, w_ptr, dy_ptr, dw_ptr,
    # shapes, strides
    n_rows, n_cols, k, g_st, g_sc, y_sr, y_sc, src_s, w_st, w_sk,
    # meta-parameters
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dy[r] = w[t, j] * grad[t] and dweights[t, j] = grad[t] . y[r] for BLOCK_R rows r of y, s = source[r] = t*k + j.

    Dimensions: grad [T, N], y [T*k, N], weights [T, k], source [T*k], all strided; dy [T*k, N] and dweights [T, k]
    contiguous.
    Args: src_ptr: the flat slot of each row (no inverse needed: each row finds its token through it).
    Returns: nothing; dy and dweights are written.
    Notes: one pass over N in BLOCK_N chunks reads grad's row of the token and y's row once, writes dy's row and
    adds the chunk's products to a float32 dot product; dweights[s] is written once, by the row's program (s is a
    permutation: no two programs write the same element, no atomics, a fixed order). A slot outside [0, T*k) (never,
    for a checked source: only a wrong view of it) is masked off rather than addressed.
    Pseudocode: s = source[r]; t, j = s // k, s % k; for cols: dy[r, cols] = w[t, j] g; dot += sum(g * y[r, cols]);
        dweights[t, j] = dot
    """
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    s = tl.load(src_ptr + r * src_s, mask=r < n_rows, other=0).to(tl.int64)
    live = (r < n_rows) & (s >= 0) & (s < n_rows)
    t = s // k
    w = f32(tl.load(w_ptr + t * w_st + (s - t * k) * w_sk, mask=live, other=0.0))
    dot = tl.zeros((BLOCK_R,), tl.float32)
    for c0 in range(0, n_cols, BLOCK_N):
        c = c0 + tl.arange(0, BLOCK_N).to(tl.int64)
        mask = live[:, None] & (c < n_cols)[None, :]
        g = f32(tl.load(grad_ptr + t[:, None] * g_st + c[None, :] * g_sc, mask=mask, other=0.0))
        y = f32(tl.load(y_ptr + r[:, None] * y_sr + c[None, :] * y_sc, mask=mask, other=0.0))
        tl.store(dy_ptr + r[:, None] * n_cols + c[None, :], narrow(w[:, None] * g, dy_ptr.dtype.element_ty), mask=mask)
        dot += tl.sum(g * y, axis=1)
    tl.store(dw_ptr + s, narrow(dot, dw_ptr.dtype.element_ty), mask=live)


def _tile(n_rows: int, n_cols: int) -> tuple:
    """(rows per program, columns per chunk): about tile_elements() per tile (GPU: loads in flight; interpreter:
    few, large NumPy ops)."""
    block_n = min(next_pow2(n_cols), tile_elements() if INTERPRET else GPU_COLS)
    return max(1, min(next_pow2(n_rows), tile_elements() // block_n)), block_n


def _supports(y, source, weights):
    if y.shape[0] > MAX_ROWS:
        return f"T*k = {y.shape[0]} rows: the inverse permutation is int32"
    if cdiv(y.shape[1], _tile(weights.shape[0], y.shape[1])[1]) > MAX_GRID_Y:
        return f"N = {y.shape[1]} needs more than {MAX_GRID_Y} column tiles (grid axis 1)"
    return None


@impl(spec, "cuda", supports=_supports)
def moe_unpermute(y: torch.Tensor, source: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return combine(y, source, weights.shape[0], weights.shape[1], weights)


def combine(y: torch.Tensor, source: torch.Tensor, t: int, k: int, weights=None) -> torch.Tensor:
    """out [T, N]: each token's k rows of y (through the inverse of source) summed in order j, weighted when weights
    [T, k] are given (moe_unpermute) or not (moe_permute's backward). Two launches: the inverse, the gather."""
    n = y.shape[1]
    out = torch.empty((t, n), dtype=y.dtype, device=y.device)
    if out.numel() == 0:
        return out
    rows = torch.empty(t * k, dtype=torch.int32, device=y.device)
    block = min(next_pow2(t * k), tile_elements())
    _moe_unpermute_inverse_kernel[(cdiv(t * k, block),)](source, rows, t * k, source.stride(0), BLOCK=block,
                                                         num_warps=warps_for(block))
    block_t, block_n = _tile(t, n)
    w, w_strides = (weights, weights.stride()) if weights is not None else (y, (0, 0))
    _moe_unpermute_kernel[(cdiv(t, block_t), cdiv(n, block_n))](
        y, rows, w, out, t, n, k, *y.stride(), *w_strides, *out.stride(),
        WEIGHTED=weights is not None, BLOCK_T=block_t, BLOCK_N=block_n, num_warps=warps_for(block_t * block_n))
    return out


@impl(spec.backward_op, "cuda", supports=lambda grad, y, source, weights: _supports(y, source, weights))
def moe_unpermute_backward(grad: torch.Tensor, y: torch.Tensor, source: torch.Tensor, weights: torch.Tensor):
    dy = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    dw = torch.empty(weights.shape, dtype=weights.dtype, device=y.device)
    n_rows, n = y.shape
    if n_rows == 0:
        return dy, dw
    if n == 0:  # no columns: every dot product is empty
        return dy, dw.zero_()
    block_r, block_n = _tile(n_rows, n)
    _moe_unpermute_backward_kernel[(cdiv(n_rows, block_r),)](
        grad, y, source, weights, dy, dw, n_rows, n, weights.shape[1], *grad.stride(), *y.stride(), source.stride(0),
        *weights.stride(), BLOCK_R=block_r, BLOCK_N=block_n, num_warps=warps_for(block_r * block_n))
    return dy, dw
