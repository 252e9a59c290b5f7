"""grouped_matmul in Triton: one persistent launch over every expert's row tiles, from a tile schedule built on
the device (no host sync); the backward's dx is the same kernel on w's other layout, dw one launch whose programs
each own an output tile of some experts and sum each expert's rows in order (deterministic, no atomics).
"""

import torch

from opport.backends.cuda._launch import INTERPRET, cdiv, f32, narrow, next_pow2, sm_count, tl, triton
from opport.dispatch import impl
from opport.ops.grouped_matmul import grouped_matmul as spec


@triton.jit
def _grouped_matmul_kernel(
    # pointers
    x_ptr, w_ptr, out_ptr, offsets_ptr, tile_starts_ptr, tile_expert_ptr,
    # shapes, strides
    n_experts, N, K,
    x_sm, x_sk,
    w_se, w_sk, w_sn,
    o_sm, o_sn,
    # meta-parameters
    PRECISION: tl.constexpr, BF16_BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[r] = x[r] @ w[e] for every row r of every expert e (rows offsets[e]:offsets[e+1]); float32 accumulation.

    Dimensions: x [M, K], w [E, K, N] read through strides (w_sk along the contraction, w_sn along the output
    columns: trans_w and the backward's transposed weights are strides only), out [M, N]; offsets [E + 1] int64
    (validated: 0 = offsets[0] <= ... <= offsets[E] = M); tile_starts [E + 1] int64, the prefix sums of each
    expert's row tiles cdiv(rows, BLOCK_M); tile_expert [>= tile_starts[E]] int64, the expert of each row tile.
    Notes: persistent: program p takes tiles p, p + P, ... of tile_starts[E] x cdiv(N, BLOCK_N), a count read
    from device memory, so the grid is fixed by M and E alone (no host sync on the offsets, as in a CUDA graph).
    A row tile never straddles two experts: it starts at its expert's first row plus a multiple of BLOCK_M and
    masks rows past the expert's last (loaded as 0, neutral for the dot, never stored); an empty expert has no
    tiles, so its weights are never read. Each K step loads masked [BLOCK_M, BLOCK_K] and [BLOCK_K, BLOCK_N]
    tiles into tl.dot, as matmul's K loop (float32 inputs use IEEE FMA, never TF32). BF16_BITS: the interpreter's
    bfloat16 conversions (_launch.py: f32, narrow) are called only where they apply, since every call of a
    jitted helper costs the interpreter ~1 ms of patching, more than a tile's arithmetic.
    Pseudocode: for tile: e = tile_expert[rt]; rows = offsets[e] + (rt - tile_starts[e]) * BLOCK_M + arange;
    acc = 0; for k: acc += x[rows, k] @ w[e, k, cols]; out[rows, cols] = acc (rows < offsets[e + 1])
    """
    tiles_n = (N + BLOCK_N - 1) // BLOCK_N  # (tl.cdiv is a jitted helper: see BF16_BITS)
    n_tiles = tl.load(tile_starts_ptr + n_experts) * tiles_n
    rows = tl.arange(0, BLOCK_M).to(tl.int64)
    cols = tl.arange(0, BLOCK_N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    k_row = offs_k[None, :] * x_sk
    k_col = offs_k[:, None] * w_sk
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        rt = tile // tiles_n
        e = tl.load(tile_expert_ptr + rt)  # int64, as every index below: 64-bit offsets past 2^31 elements
        offs_m = tl.load(offsets_ptr + e) + (rt - tl.load(tile_starts_ptr + e)) * BLOCK_M + rows
        offs_n = (tile % tiles_n) * BLOCK_N + cols
        row_ok = (offs_m < tl.load(offsets_ptr + e + 1))[:, None]
        col_ok = (offs_n < N)[None, :]
        x_ptrs = x_ptr + (offs_m[:, None] * x_sm + k_row)
        w_ptrs = w_ptr + (e * w_se + k_col + offs_n[None, :] * w_sn)
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # (tl.zeros is a jitted helper)
        for k in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k
            a = tl.load(x_ptrs, mask=row_ok & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok, other=0.0)
            if BF16_BITS:
                a, b = f32(a), f32(b)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            x_ptrs += BLOCK_K * x_sk
            w_ptrs += BLOCK_K * w_sk
        o_ptrs = out_ptr + (offs_m[:, None] * o_sm + offs_n[None, :] * o_sn)
        if BF16_BITS:
            tl.store(o_ptrs, narrow(acc, out_ptr.dtype.element_ty), mask=row_ok & col_ok)
        else:
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok & col_ok)


@triton.jit
def _grouped_matmul_backward_kernel(
    # pointers
    a_ptr, b_ptr, out_ptr, offsets_ptr,
    # shapes, strides
    n_experts, P, Q,
    a_sr, a_sp,
    b_sr, b_sq,
    o_se, o_sp, o_sq,
    # meta-parameters
    PRECISION: tl.constexpr, BF16_BITS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """out[e] = a_e^T @ b_e, a sum over the rows of expert e only: the backward's dw.

    Dimensions: a [M, P] and b [M, Q] (x and grad: dw[e] = x_e^T grad_e [K, N]; grad and x with trans_w:
    grad_e^T x_e [N, K]), strided; out [E, P, Q]; offsets [E + 1] int64 (validated). Grid: (cdiv(P, BLOCK_P) x
    cdiv(Q, BLOCK_Q) output tiles, G): the program (t, g) computes tile t of experts g, g + G, ...
    Notes: each expert's rows are walked in BLOCK_R steps: a^T tiles are loaded transposed by strides ([BLOCK_P,
    BLOCK_R], no copy) and b tiles [BLOCK_R, BLOCK_Q] go into tl.dot with a float32 accumulator, rows past the
    expert's last masked to 0. A fixed order, no atomics: the same bits every run; an expert without rows writes
    zeros. With G = 1 (large P x Q: enough tiles to fill the GPU) every program sums all M rows, whatever the
    routing, so a skewed router (one expert holding every row) loads no program more than another; small outputs
    spread the experts over G programs instead. BF16_BITS as in the forward kernel.
    Pseudocode: for e in g, g + G, ...: acc = 0; for r in offsets[e]..offsets[e+1] step BLOCK_R: acc += a[r, p]^T @ b[r, q]
    out[e, tile] = acc
    """
    tiles_q = (Q + BLOCK_Q - 1) // BLOCK_Q  # (tl.cdiv is a jitted helper: see the forward's BF16_BITS)
    t = tl.program_id(0)
    offs_p = (t // tiles_q) * BLOCK_P + tl.arange(0, BLOCK_P).to(tl.int64)
    offs_q = (t % tiles_q) * BLOCK_Q + tl.arange(0, BLOCK_Q).to(tl.int64)
    p_ok = (offs_p < P)[:, None]
    q_ok = (offs_q < Q)[None, :]
    a_cols = offs_p[:, None] * a_sp
    b_cols = offs_q[None, :] * b_sq
    o_tile = out_ptr + (offs_p[:, None] * o_sp + offs_q[None, :] * o_sq)
    tile_ok = p_ok & q_ok
    steps = tl.arange(0, BLOCK_R).to(tl.int64)
    # an int64 expert index on a GPU (the loop takes its start's type): e * o_se passes 2^31 in large layers
    for e in range(tl.program_id(1).to(tl.int64), n_experts, tl.num_programs(1)):
        bounds = offsets_ptr + e
        hi = tl.load(bounds + 1)  # int64, as every row index below
        acc = tl.full((BLOCK_P, BLOCK_Q), 0.0, tl.float32)  # (tl.zeros is a jitted helper)
        for r in range(tl.load(bounds), hi, BLOCK_R):
            rows = r + steps
            row_ok = rows < hi
            a_t = tl.load(a_ptr + (a_cols + rows[None, :] * a_sr), mask=p_ok & row_ok[None, :], other=0.0)
            b = tl.load(b_ptr + (rows[:, None] * b_sr + b_cols), mask=row_ok[:, None] & q_ok, other=0.0)
            if BF16_BITS:
                a_t, b = f32(a_t), f32(b)
            acc = tl.dot(a_t, b, acc, input_precision=PRECISION)
        if BF16_BITS:
            tl.store(o_tile + e * o_se, narrow(acc, out_ptr.dtype.element_ty), mask=tile_ok)
        else:
            tl.store(o_tile + e * o_se, acc.to(out_ptr.dtype.element_ty), mask=tile_ok)


INTERP_PROGRAMS = 2  # persistent programs in the interpreter: enough to exercise the tile stride; each runs a prologue


def _fit(n: int, cap: int) -> int:
    """The smallest power of two >= n, between 16 (tl.dot's minimum) and cap."""
    return max(16, min(cap, next_pow2(n)))


def _config(m: int, n: int, k: int, rows: int, dtype: torch.dtype) -> dict:
    """Tiles of the forward (and dx) launch, for groups of about `rows` rows (`_group_rows`): decode-like groups of
    a few rows get 16-row tiles instead of 128 mostly masked ones. GPU numbers are design choices for Hopper, not
    yet tuned on hardware (docs/cuda.md)."""
    if INTERPRET:  # few, large programs: each tl.dot is one NumPy matmul
        return {"BLOCK_M": _fit(rows, 128), "BLOCK_N": _fit(n, 128), "BLOCK_K": _fit(k, 128), "num_warps": 4,
                "num_stages": 1}
    if dtype == torch.float32:  # IEEE FMA path: register-bound, small tiles (BLOCK_K = 32 spilled on unaligned strides)
        return {"BLOCK_M": _fit(rows, 64), "BLOCK_N": 64, "BLOCK_K": 16, "num_warps": 4, "num_stages": 3}
    bm = _fit(rows, 128)
    # 128x128x32 16-bit wgmma tiles, 3 stages: (128*32 + 32*128) * 2 B * 3 = 48 KB of shared memory. BLOCK_K = 64 and
    # 4 warps at BLOCK_M = 64 spilled up to 3 KB of registers on unaligned strides (element-wise 64-bit addresses)
    return {"BLOCK_M": bm, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 8 if bm >= 64 else 4, "num_stages": 3}


def _dw_config(p: int, q: int, rows: int, dtype: torch.dtype, aligned: bool) -> dict:
    """Tiles of the dw launch: output tiles [BLOCK_P, BLOCK_Q], the expert's rows contracted BLOCK_R at a time.
    128 x 128 16-bit tiles only where every row stride is a multiple of 16 elements (vectorized loads): unaligned
    ones load element by element, whose 64-bit addresses spilled registers at that size (ptxas, sm_90)."""
    if INTERPRET:
        return {"BLOCK_P": _fit(p, 128), "BLOCK_Q": _fit(q, 128), "BLOCK_R": _fit(rows, 128), "num_warps": 4,
                "num_stages": 1}
    if dtype == torch.float32:
        return {"BLOCK_P": 64, "BLOCK_Q": 64, "BLOCK_R": 16, "num_warps": 8, "num_stages": 3}
    if not aligned:
        return {"BLOCK_P": 64, "BLOCK_Q": 64, "BLOCK_R": 32, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_P": 128, "BLOCK_Q": 128, "BLOCK_R": 32, "num_warps": 8, "num_stages": 3}


def _group_rows(offsets: torch.Tensor, m: int) -> int:
    """Rows per group the tiles are sized for. GPU: the mean M / E, known without reading the offsets (no host sync,
    graph-safe). Interpreter: the largest group, since the offsets are in host memory there (reading them costs
    nothing) and every tile is a program step of fixed overhead: one tile per expert where it fits."""
    experts = max(offsets.shape[0] - 1, 1)
    if INTERPRET and m:
        return int((offsets[1:] - offsets[:-1]).max())
    return cdiv(max(m, 1), experts)


def _meta(dtype: torch.dtype) -> dict:
    """IEEE FMA for float32 (never TF32); the interpreter's bfloat16 conversions by bits where they apply."""
    return {"PRECISION": "ieee" if dtype == torch.float32 else "tf32", "BF16_BITS": INTERPRET and dtype == torch.bfloat16}


def _bounds(offsets: torch.Tensor, m: int) -> torch.Tensor:
    """The offsets as contiguous int64 on the device, clamped to [0, M] and made non-decreasing (cummax): a no-op on
    validated offsets (the dispatcher checks them before any kernel), and what keeps every row index a kernel forms
    inside x, whatever it is handed (the tile table's size below relies on the groups summing to at most M)."""
    o = offsets.to(device=offsets.device, dtype=torch.int64).clamp(0, m)
    return torch.cummax(o, 0).values.contiguous()


def _schedule(offsets: torch.Tensor, block_m: int, m: int) -> tuple:
    """(offsets (`_bounds`), tile_starts [E + 1], tile_expert [cdiv(M, BLOCK_M) + E]) on the device, from the offsets
    values without reading them on the host: tile_starts holds the prefix sums of cdiv(rows_e, BLOCK_M), and
    tile_expert[t] the expert whose tiles cover t (searchsorted over tile_starts[1:]; entries past the last tile
    are never read). cdiv(M, BLOCK_M) + E bounds the tile count (each expert adds at most one partial tile)."""
    o = _bounds(offsets, m)
    starts = torch.zeros(o.shape[0], dtype=torch.int64, device=o.device)
    torch.cumsum((o[1:] - o[:-1] + (block_m - 1)) // block_m, 0, out=starts[1:])
    bound = cdiv(m, block_m) + o.shape[0] - 1
    expert = torch.searchsorted(starts[1:], torch.arange(bound, dtype=torch.int64, device=o.device), right=True)
    return o, starts, expert


def _grouped(x: torch.Tensor, w: torch.Tensor, w_strides: tuple, offsets: torch.Tensor, out: torch.Tensor) -> None:
    """out = x_e @ W_e per expert e, W_e [K, N] read from w[e] by w_strides = (along K, along N)."""
    m, k = x.shape
    n = out.shape[1]
    if out.numel() == 0:
        return
    cfg = _config(m, n, k, _group_rows(offsets, m), x.dtype)
    o, starts, expert = _schedule(offsets, cfg["BLOCK_M"], m)
    bound = expert.shape[0] * cdiv(n, cfg["BLOCK_N"])
    # GPU: one program per SM; interpreter: a few (programs run one after another, and each idle one still runs
    # its prologue, while the tiles are the same work whoever takes them)
    grid = (min(bound, INTERP_PROGRAMS if INTERPRET else sm_count(x.device)),)
    _grouped_matmul_kernel[grid](
        x, w, out, o, starts, expert, w.shape[0], n, k, x.stride(0), x.stride(1), w.stride(0), *w_strides,
        out.stride(0), out.stride(1), **_meta(x.dtype), **cfg,
    )


@impl(spec, "cuda")
def grouped_matmul(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, trans_w: bool) -> torch.Tensor:
    """One persistent launch over every expert's row tiles; w's layout (trans_w) is a pair of strides."""
    n = w.shape[1] if trans_w else w.shape[2]
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    _grouped(x, w, (w.stride(2), w.stride(1)) if trans_w else (w.stride(1), w.stride(2)), offsets, out)
    return out


@impl(spec.backward_op, "cuda")
def grouped_matmul_backward(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                            trans_w: bool):
    """dx_e = grad_e w[e]^T through the forward's kernel on w's transposed strides (no copy); dw[e] = x_e^T grad_e
    (grad_e^T x_e with trans_w) from programs that each own one output tile of every G-th expert and sum that
    expert's rows (G = E: one program per expert and tile, for small layers; G = 1 once the tiles fill the GPU).
    Both deterministic; empty experts get dw[e] = 0 (stored from an untouched accumulator)."""
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    # W_e^T [N, K]: along the contraction (N) and along dx's columns (K)
    _grouped(grad, w, (w.stride(1), w.stride(2)) if trans_w else (w.stride(2), w.stride(1)), offsets, dx)
    dw = torch.empty(w.shape, dtype=w.dtype, device=w.device)
    if dw.numel() == 0:
        return dx, dw
    a, b = (grad, x) if trans_w else (x, grad)
    p, q = a.shape[1], b.shape[1]
    aligned = all(t.stride(1) == 1 and t.stride(0) % 16 == 0 for t in (a, b, dw[0]))
    cfg = _dw_config(p, q, _group_rows(offsets, x.shape[0]), x.dtype, aligned)
    o = _bounds(offsets, x.shape[0])
    tiles = cdiv(p, cfg["BLOCK_P"]) * cdiv(q, cfg["BLOCK_Q"])
    # experts over G programs per tile: GPU, about two programs per SM in all; interpreter, a few (as the forward)
    groups = min(w.shape[0], INTERP_PROGRAMS if INTERPRET else max(1, 2 * sm_count(x.device) // tiles))
    _grouped_matmul_backward_kernel[(tiles, groups)](
        a, b, dw, o, w.shape[0], p, q, a.stride(0), a.stride(1), b.stride(0), b.stride(1), *dw.stride(),
        **_meta(x.dtype), **cfg,
    )
    return dx, dw
