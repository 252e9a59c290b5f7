"""moe_experts in Triton: grouped GEMMs over every expert at once from a tile schedule of the picks sorted by expert.

Schedule (torch ops on the device, no read of the index on the host, no sync): the T * k picks (flat slot
s = t * k + j) sorted by expert, stably (`order`); each expert's row range in that order (`offsets` [E + 1]); its
row blocks of BLOCK_M and their prefix sums (`blocks` [E + 1]); and by `torch.searchsorted` each program's expert
(`block_expert`). The grid is the upper bound cdiv(T k, BLOCK_M) + min(E, T k) of the blocks; a program past the
last one (expert E) does nothing. A program reads only its expert's weights and its rows' tokens: experts no token
picks are never read.

Forward, three launches:
1. `_moe_gate_up_kernel`, programs (row block, I tile): x rows gathered by token, h = x gate_up_proj[e]^T for the
   gate and up halves of the tile in two float32 accumulators, the SwiGLU epilogue a = silu(gate) * up (swiglu's
   limits), stored per slot in a [T k, I] buffer of x's dtype (the tensor cores' operand dtype, as transformers
   rounds it).
2. `_moe_down_kernel`, programs (row block, H tile): y = a down_proj[e]^T times the slot's router weight, stored per
   slot in a float32 [T k, H] buffer (no atomics: each slot's row is written by one program).
3. `_moe_sum_k_kernel`: out[t] = the sum over j of row t k + j, in pick order, rounded once to x's dtype.
The backward (moe_experts_backward.py) reuses the schedule and launches 2 and 3 for dx.
"""

import torch

from opport.backends.cuda._launch import (
    INTERPRET,
    cdiv,
    dot_operand,
    f32,
    narrow,
    next_pow2,
    tl,
    triton,
    warps_for,
)
from opport.backends.cuda.swiglu import _swiglu_f32
from opport.dispatch import impl
from opport.ops.moe_experts import moe_experts as spec


@triton.jit
def _moe_gate_up_kernel(
    # pointers
    x_ptr, w1_ptr, order_ptr, offsets_ptr, blocks_ptr, expert_ptr, a_ptr,
    # shapes, strides
    n_experts, k, H, n_inter,
    x_st, x_sh, w1_se, w1_sn, w1_sh, a_ss, a_si,
    # meta-parameters
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """a[slot, cols] = silu(x[token] W1g[e, cols]^T) * (x[token] W1u[e, cols]^T) for one row block of expert e.

    Dimensions: x [T, H]; gate_up_proj [E, 2I, H] (gate rows 0..I-1, up rows I..2I-1); a [T k, I] in x's dtype;
    order [T k] int32 (slots sorted by expert), offsets, blocks [E + 1] int32, block_expert [programs] int32.
    Notes: the row block's slots are read from `order`, their tokens are slot // k: x rows are gathered, a rows
    scattered, both by pointer (no permuted copy of x). Masked rows and columns load 0 (neutral for the dots)
    and are not stored. Both halves share each loaded x tile; float32 accumulation, one rounding of a.
    Pseudocode: for h tiles: g += x[tok, h] @ W1[e, cols, h]^T; u += x[tok, h] @ W1[e, I + cols, h]^T;
                a[slot, cols] = silu(g) * u
    """
    pid = tl.program_id(0)
    e = tl.load(expert_ptr + pid)
    if e < n_experts:
        slot, row_ok = _block_rows(order_ptr, offsets_ptr, blocks_ptr, e, pid, BLOCK_M)
        token = slot // k
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n_inter
        offs_k = tl.arange(0, BLOCK_K)
        # pointer tiles advanced by BLOCK_K per step (recomputing them from the row and column offsets every step held
        # more of them live across the pipeline's stages: spills at sm_90)
        x_ptrs = x_ptr + token[:, None] * x_st + offs_k.to(tl.int64)[None, :] * x_sh
        g_ptrs = w1_ptr + e.to(tl.int64) * w1_se + cols.to(tl.int64)[None, :] * w1_sn + offs_k.to(tl.int64)[:, None] * w1_sh
        u_ptrs = g_ptrs + n_inter * w1_sn
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for h0 in range(0, H, BLOCK_K):
            h_ok = offs_k < H - h0
            xt = dot_operand(tl.load(x_ptrs, mask=row_ok[:, None] & h_ok[None, :], other=0.0))
            w_mask = h_ok[:, None] & col_ok[None, :]
            bg = tl.load(g_ptrs, mask=w_mask, other=0.0)
            bu = tl.load(u_ptrs, mask=w_mask, other=0.0)
            acc_g = tl.dot(xt, dot_operand(bg), acc_g, input_precision=PRECISION)
            acc_u = tl.dot(xt, dot_operand(bu), acc_u, input_precision=PRECISION)
            x_ptrs += BLOCK_K * x_sh
            g_ptrs += BLOCK_K * w1_sh
            u_ptrs += BLOCK_K * w1_sh
        a = _swiglu_f32(acc_g, acc_u)
        tl.store(a_ptr + slot[:, None] * a_ss + cols.to(tl.int64)[None, :] * a_si, narrow(a, a_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _moe_down_kernel(
    # pointers
    a_ptr, w_ptr, scale_ptr, order_ptr, offsets_ptr, blocks_ptr, expert_ptr, y_ptr,
    # shapes, strides
    n_experts, k, K, N,
    a_ss, a_sk, w_se, w_sk, w_sn, s_st, s_sj, y_ss, y_sn,
    # meta-parameters
    SCALED: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """y[slot, cols] = scale[slot] * (a[slot, :] @ w[e][:, cols]) for one row block of expert e, float32 out.

    Dimensions: a [T k, K] per slot; w [E, ...] read as w[e][kk, n] = w_ptr + e w_se + kk w_sk + n w_sn (the
    forward: down_proj[e]^T, K = I, N = H; the backward's dx: gate_up_proj[e], K = 2I, N = H); scale: the router
    weights [T, k] (SCALED), slot s at (s // k, s % k); y [T k, N] float32.
    Notes: every slot's row is written by exactly one program (its expert's block, each H tile once): no
    atomics, and the sum over a token's picks is left to `_moe_sum_k_kernel`, in a fixed order.
    Pseudocode: for kk tiles: acc += a[slot, kk] @ w[e][kk, cols]; y[slot, cols] = scale[slot] * acc
    """
    pid = tl.program_id(0)
    e = tl.load(expert_ptr + pid)
    if e < n_experts:
        slot, row_ok = _block_rows(order_ptr, offsets_ptr, blocks_ptr, e, pid, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + slot[:, None] * a_ss + offs_k.to(tl.int64)[None, :] * a_sk  # advanced per step (gate_up's)
        w_ptrs = w_ptr + e.to(tl.int64) * w_se + cols.to(tl.int64)[None, :] * w_sn + offs_k.to(tl.int64)[:, None] * w_sk
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            a_t = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wt = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(dot_operand(a_t), dot_operand(wt), acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * a_sk
            w_ptrs += BLOCK_K * w_sk
        if SCALED:
            token = slot // k
            s = f32(tl.load(scale_ptr + token * s_st + (slot - token * k) * s_sj, mask=row_ok, other=0.0))
            acc = acc * s[:, None]
        tl.store(y_ptr + slot[:, None] * y_ss + cols.to(tl.int64)[None, :] * y_sn, acc,
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _block_rows(order_ptr, offsets_ptr, blocks_ptr, e, pid, BLOCK_M: tl.constexpr):
    """(slots [BLOCK_M] int64, valid mask) of program pid's row block of expert e: rows offsets[e] + BLOCK_M (pid -
    blocks[e]) onward in the sorted order, up to the expert's last row."""
    first = tl.load(offsets_ptr + e) + (pid - tl.load(blocks_ptr + e)) * BLOCK_M
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(offsets_ptr + e + 1)
    slot = tl.load(order_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    return slot, row_ok


@triton.jit
def _moe_sum_k_kernel(
    # pointers
    y_ptr, out_ptr,
    # shapes, strides
    T, k, N, o_st, o_sn,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out[t, cols] = sum over j of y[t k + j, cols] (float32, pick order j = 0, 1, ...), rounded once.

    Dimensions: y [T k, N] float32 contiguous (per slot); out [T, N] strided, x's dtype.
    Notes: a fixed order per element: the same bits every run, where atomics would add in arrival order.
    Pseudocode: out[t] = narrow(y[t k] + y[t k + 1] + ... + y[t k + k - 1])
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < T)[:, None] & (cols < N)[None, :]
    base = y_ptr + (rows.to(tl.int64) * k)[:, None] * N + cols.to(tl.int64)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for j in range(0, k):
        acc += tl.load(base + j * N, mask=mask, other=0.0)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * o_st + cols.to(tl.int64)[None, :] * o_sn,
             narrow(acc, out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- host side


def _fit(n: int, cap: int) -> int:
    """The smallest power of two >= n, between 16 (tl.dot's minimum) and cap."""
    return max(16, min(cap, next_pow2(n)))


def block_m(rows: int) -> int:
    """Rows per program: the interpreter takes few large blocks (one NumPy matmul each); a GPU 64 (wgmma's M, and
    per-expert row counts of decode batches are small)."""
    return _fit(rows, 64) if INTERPRET else 64


def gemm_config(n: int, kdim: int, dtype: torch.dtype, accs: int = 1) -> dict:
    """Tile of a grouped GEMM with N output columns, contraction K and `accs` [BLOCK_M, BLOCK_N] float32 accumulators
    (gate_up: 2, the backward's rows: 3). GPU numbers are design choices for Hopper, checked for registers and spills
    by tools/cuda_aot.py (sm_90) but not timed on hardware: gathered rows make every K step a [BLOCK_M, BLOCK_K]
    tile of 64-bit pointers, so the tiles stay below matmul's."""
    if INTERPRET:
        return {"BLOCK_N": _fit(n, 128), "BLOCK_K": _fit(kdim, 128), "num_warps": 4, "num_stages": 1}
    # 8 warps (4 spilled: the gathered rows' 64-bit pointer tiles stay live across the stages), at least 32 columns
    # (16-wide tiles of a tiny N spilled where 32-wide ones did not)
    if dtype == torch.float32:  # IEEE FMA path: operands and accumulators in registers, one stage fewer
        return {"BLOCK_N": max(32, _fit(n, 64 if accs == 1 else 32)), "BLOCK_K": 32, "num_warps": 8,
                "num_stages": 3 if accs == 1 else 2}
    return {"BLOCK_N": max(32, _fit(n, 64 if accs < 3 else 32)), "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


def precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


class Schedule:
    """The picks sorted by expert and the row-block table of one call (module docstring), all on the device."""

    def __init__(self, top_k_index: torch.Tensor, n_experts: int, bm: int):
        t, k = top_k_index.shape
        dev = top_k_index.device
        flat = top_k_index.reshape(-1).to(torch.int64)
        experts, order = torch.sort(flat, stable=True)
        self.order = order.to(torch.int32)
        # each expert's first sorted row: a binary search of the sorted picks (no atomics, and defined on meta tensors
        # for tools/cuda_aot.py, where bincount is not)
        bounds = torch.searchsorted(experts, torch.arange(n_experts + 1, device=dev))
        self.offsets = bounds.to(torch.int32)
        counts = bounds[1:] - bounds[:-1]
        self.blocks = torch.zeros(n_experts + 1, dtype=torch.int32, device=dev)
        torch.cumsum((counts + (bm - 1)) // bm, 0, out=self.blocks[1:])
        # an upper bound of sum cdiv(count_e, bm); the interpreter's tensors are in host memory, where the exact count
        # costs no sync and saves the programs that would exit at once
        self.programs = int(self.blocks[-1]) if INTERPRET else cdiv(t * k, bm) + min(n_experts, t * k)
        starts = torch.arange(self.programs, dtype=torch.int32, device=dev)
        self.expert = torch.searchsorted(self.blocks[1:], starts, right=True).to(torch.int32)  # E: past the last
        self.n_experts, self.k, self.bm = n_experts, k, bm

    def args(self) -> tuple:
        return self.order, self.offsets, self.blocks, self.expert


def gate_up(x: torch.Tensor, gate_up_proj: torch.Tensor, sched: Schedule) -> torch.Tensor:
    """a [T k, I] per slot in x's dtype (launch 1)."""
    i = gate_up_proj.shape[1] // 2
    a = torch.empty((x.shape[0] * sched.k, i), dtype=x.dtype, device=x.device)
    cfg = gemm_config(i, x.shape[1], x.dtype, accs=2)
    _moe_gate_up_kernel[(sched.programs, cdiv(i, cfg["BLOCK_N"]))](
        x, gate_up_proj, *sched.args(), a, sched.n_experts, sched.k, x.shape[1], i, *x.stride(), *gate_up_proj.stride(),
        *a.stride(), PRECISION=precision(x.dtype), BLOCK_M=sched.bm, **cfg)
    return a


def down(a: torch.Tensor, w: torch.Tensor, w_strides: tuple, n: int, scale, sched: Schedule) -> torch.Tensor:
    """y [T k, n] float32 per slot: scale[slot] * a[slot] @ w[e] (launch 2), w[e][kk, col] at w_strides (e, kk, col)."""
    y = torch.empty((a.shape[0], n), dtype=torch.float32, device=a.device)
    cfg = gemm_config(n, a.shape[1], a.dtype)
    s_args = (scale, *scale.stride()) if scale is not None else (a, 0, 0)
    _moe_down_kernel[(sched.programs, cdiv(n, cfg["BLOCK_N"]))](
        a, w, s_args[0], *sched.args(), y, sched.n_experts, sched.k, a.shape[1], n, *a.stride(), *w_strides,
        *s_args[1:], *y.stride(), SCALED=scale is not None, PRECISION=precision(a.dtype), BLOCK_M=sched.bm, **cfg)
    return y


def sum_k(y: torch.Tensor, out: torch.Tensor, k: int) -> torch.Tensor:
    """out [T, N] = y [T k, N] summed over each token's k rows in pick order (launch 3)."""
    t, n = out.shape
    bn = min(next_pow2(n), 1024 if INTERPRET else 128)
    bm = max(1, min(next_pow2(t), (1 << 16 if INTERPRET else 4096) // bn))
    _moe_sum_k_kernel[(cdiv(t, bm), cdiv(n, bn))](y, out, t, k, n, *out.stride(), BLOCK_M=bm, BLOCK_N=bn,
                                                  num_warps=warps_for(bm * bn))
    return out


@impl(spec, "cuda")
def moe_experts(x, gate_up_proj, down_proj, top_k_index, top_k_weights) -> torch.Tensor:
    """Three launches (module docstring); T = 0 returns at once. Extra memory: a [T k, I] in x's dtype and the
    per-slot outputs [T k, H] in float32."""
    t, h = x.shape
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    k = top_k_index.shape[1]
    sched = Schedule(top_k_index, gate_up_proj.shape[0], block_m(t * k))
    a = gate_up(x, gate_up_proj, sched)
    ws = down_proj.stride()
    y = down(a, down_proj, (ws[0], ws[2], ws[1]), h, top_k_weights, sched)  # down_proj[e]^T: [I, H]
    return sum_k(y, out, k)
