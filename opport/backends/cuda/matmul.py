"""matmul in Triton: a persistent, grouped-tile GEMM with float32 accumulation and a fused bias.

Batch dims of a (and of a batched b) are read by strides, up to three after merging dims that are
contiguous in a, b and out together; more than that copies a and b to contiguous first (the only copy).
"""

import torch

from opport.backends.cuda._launch import (
    INTERPRET,
    Layout,
    at,
    cdiv,
    dot_operand,
    f32,
    lead_index,
    narrow,
    next_pow2,
    sm_count,
    tile_elements,
    tl,
    triton,
    warps_for,
)
from opport.dispatch import impl
from opport.ops.matmul import matmul as spec


@triton.jit
def _matmul_kernel(
    # pointers
    a_ptr, b_ptr, bias_ptr, out_ptr,
    # shapes, strides
    n_batch, n1, n2, M, N, K,
    a_s0, a_s1, a_s2, a_sm, a_sk,
    b_s0, b_s1, b_s2, b_sk, b_sn,
    o_s0, o_s1, o_s2, o_sm, o_sn,
    bias_s,
    # meta-parameters
    HAS_BIAS: tl.constexpr, REDUCE_BATCH: tl.constexpr, PRECISION: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[z] = a[z] @ b[z] (+ bias) for every batch entry z; float32 accumulation, one rounding.

    Dimensions: a [Z, M, K], b [Z, K, N] (batch strides 0 for a shared b), out [Z, M, N], bias [N].
    REDUCE_BATCH: out [M, N] = sum_z a[z] @ b[z] instead (the backward's db of a shared b), every batch
    entry summed into the same float32 accumulator, in batch order.
    Notes: persistent: program p takes output tiles p, p + P, ... (P = grid size: the SM count on a
    GPU, so tiles stream through resident programs without launch tails). Tiles are ordered in
    GROUP_M-row bands so consecutive tiles reuse A rows and B columns from L2. Each K step loads a
    [BLOCK_M, BLOCK_K] and a [BLOCK_K, BLOCK_N] tile (masked loads pad with 0, neutral for the dot;
    the compiler pipelines them with num_stages) into tl.dot (wgmma on Hopper for 16-bit inputs;
    float32 inputs use IEEE FMA, never TF32). The bias is added in float32 before the single rounding.
    Pseudocode: for tile: acc = 0; for k: acc += a[tile_m, k] @ b[k, tile_n]; out[tile] = acc + bias
    """
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_batch = tiles_m * tiles_n
    n_tiles = per_batch if REDUCE_BATCH else n_batch * per_batch
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        z = tile // per_batch  # 0 with REDUCE_BATCH
        t = tile % per_batch
        band = t // (GROUP_M * tiles_n)
        first_m = band * GROUP_M
        rows_in_band = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (t % (GROUP_M * tiles_n)) % rows_in_band
        pid_n = (t % (GROUP_M * tiles_n)) // rows_in_band
        z0, z1, z2 = lead_index(z, n1, n2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        if REDUCE_BATCH:
            for zr in range(0, n_batch):  # z + zr: z is 0 here, and a tensor (the interpreter's range gives ints)
                r0, r1, r2 = lead_index(z + zr, n1, n2)
                acc = _k_loop(acc, a_ptr + (r0 * a_s0 + r1 * a_s1 + r2 * a_s2), b_ptr + (r0 * b_s0 + r1 * b_s1 + r2 * b_s2),
                              a_sm, a_sk, b_sk, b_sn, offs_m, offs_n, M, N, K, PRECISION, BLOCK_K)
        else:
            acc = _k_loop(acc, a_ptr + (z0 * a_s0 + z1 * a_s1 + z2 * a_s2), b_ptr + (z0 * b_s0 + z1 * b_s1 + z2 * b_s2),
                          a_sm, a_sk, b_sk, b_sn, offs_m, offs_n, M, N, K, PRECISION, BLOCK_K)
        if HAS_BIAS:
            acc += f32(tl.load(bias_ptr + offs_n.to(tl.int64) * bias_s, mask=offs_n < N, other=0.0))[None, :]
        o_ptrs = (out_ptr + (z0 * o_s0 + z1 * o_s1 + z2 * o_s2) + offs_m.to(tl.int64)[:, None] * o_sm
                  + offs_n.to(tl.int64)[None, :] * o_sn)
        tl.store(o_ptrs, narrow(acc, out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _k_loop(acc, a_base, b_base, a_sm, a_sk, b_sk, b_sn, offs_m, offs_n, M, N, K,
            PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + a[offs_m, :] @ b[:, offs_n] for one batch entry's a and b (their base pointers), in BLOCK_K steps."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_base + offs_m.to(tl.int64)[:, None] * a_sm + offs_k.to(tl.int64)[None, :] * a_sk
    b_ptrs = b_base + offs_k.to(tl.int64)[:, None] * b_sk + offs_n.to(tl.int64)[None, :] * b_sn
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < K - k), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < K - k) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(dot_operand(a), dot_operand(b), acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * a_sk
        b_ptrs += BLOCK_K * b_sk
    return acc


@triton.jit
def _column_sum_kernel(
    x_ptr, out_ptr,
    n_rows, n_cols, n1, n2, x_s0, x_s1, x_s2, x_sc, rows_per_program,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out[p, cols] = sum of x's rows [p * rows_per_program, (p + 1) * rows_per_program) (axis 1 of the grid: p).

    Dimensions: x [n_rows, n_cols] with up to three strided leading dims; out [programs on axis 1, n_cols] contiguous.
    Notes: float32 accumulator tiles [BLOCK_R, BLOCK_N] added in row order, then one tree sum over BLOCK_R: a
    fixed order for fixed shapes, so two runs give the same bits (no atomics). The backward's dbias.
    """
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    first = tl.program_id(1) * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    acc = tl.zeros((BLOCK_R, BLOCK_N), tl.float32)
    for r0 in range(first, last, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        i0, i1, i2 = lead_index(rows, n1, n2)
        mask = (rows < last)[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_ptr + at(i0[:, None], i1[:, None], i2[:, None], cols[None, :], x_s0, x_s1, x_s2, x_sc),
                    mask=mask, other=0.0)
        acc += f32(x)
    out = out_ptr + tl.program_id(1).to(tl.int64) * n_cols + cols
    tl.store(out, narrow(tl.sum(acc, 0), out_ptr.dtype.element_ty), mask=cols < n_cols)


def _config(m: int, n: int, k: int, dtype: torch.dtype) -> dict:
    """Tile shape per problem. GPU numbers are design choices for Hopper, not yet tuned on hardware (docs/cuda.md)."""
    if INTERPRET:  # few, large programs: each tl.dot is one NumPy matmul
        return {"BLOCK_M": _fit(m, 128), "BLOCK_N": _fit(n, 128), "BLOCK_K": _fit(k, 128), "GROUP_M": 8,
                "num_warps": 4, "num_stages": 1}
    if dtype == torch.float32:  # IEEE FMA path: register-bound, small tiles
        return {"BLOCK_M": _fit(m, 64), "BLOCK_N": _fit(n, 64), "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4,
                "num_stages": 3}
    if m <= 64:  # decode / GEMV-like: narrow M tile, wide K steps to keep loads in flight
        return {"BLOCK_M": _fit(m, 64), "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 4}
    # 128x256x64 bf16 wgmma tiles, 3 stages: (128*64 + 64*256) * 2 B * 3 = 144 KB of shared memory
    return {"BLOCK_M": 128, "BLOCK_N": 256 if n >= 256 else 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8,
            "num_stages": 3}


def _fit(n: int, cap: int) -> int:
    """The smallest power of two >= n, between 16 (tl.dot's minimum) and cap."""
    return max(16, min(cap, next_pow2(n)))


def _shrink(cfg: dict) -> bool:
    """Halve a tile dimension (N first, down to 64; then M, down to wgmma's 64; then N to 32); False at the floor."""
    for dim, floor in (("BLOCK_N", 64), ("BLOCK_M", 64), ("BLOCK_N", 32)):
        if cfg[dim] > floor:
            cfg[dim] //= 2
            return True
    return False


def _batch_layout(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor):
    """Sizes and per-tensor strides of the batch dims (b's are 0 when b is 2-d), merged to at most 3."""
    batch = tuple(a.shape[:-2])
    b_strides = tuple(b.stride()[:-2]) if b.dim() > 2 else (0,) * len(batch)
    lay = Layout.of(batch + (1,), tuple(a.stride()[:-2]) + (0,), b_strides + (0,), tuple(out.stride()[:-2]) + (0,))
    return lay


@impl(spec, "cuda")
def matmul(a: torch.Tensor, b: torch.Tensor, bias) -> torch.Tensor:
    out = torch.empty((*a.shape[:-2], a.shape[-2], b.shape[-1]), dtype=a.dtype, device=a.device)
    return _gemm(a, b, bias, out)


@impl(spec.backward_op, "cuda")
def matmul_backward(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias):
    """da = grad b^T and db = a^T grad through the forward's GEMM kernel on transposed views (no copies);
    a shared b's db sums every batch entry inside one accumulator (REDUCE_BATCH); dbias is a two-stage
    column sum. All three are deterministic: fixed tiles and orders, no atomics."""
    da = _gemm(grad, b.transpose(-1, -2), None, torch.empty(a.shape, dtype=a.dtype, device=a.device))
    db = torch.empty(b.shape, dtype=b.dtype, device=b.device)
    if b.dim() == 2:
        _shared_db(a, grad, db)
    else:
        _gemm(a.transpose(-1, -2), grad, None, db)
    dbias = None if bias is None else _column_sum(grad, bias.dtype)
    return da, db, dbias


def _gemm(a: torch.Tensor, b: torch.Tensor, bias, out: torch.Tensor) -> torch.Tensor:
    """out[..., M, N] = a[..., M, K] @ b ([K, N] or [..., K, N]) (+ bias), every operand read by its strides."""
    if out.numel() == 0:
        return out
    lay = _batch_layout(a, b, out)
    if lay is None:  # more than three irregular batch dims: the documented copy
        a, b = a.contiguous(), b.contiguous()
        lay = _batch_layout(a, b, out)
    _launch(a, b, bias, out, lay, (a.shape[-2], b.shape[-1], a.shape[-1]),
            (a.stride(-2), a.stride(-1), b.stride(-2), b.stride(-1), out.stride(-2), out.stride(-1)), reduce=False)
    return out


def _shared_db(a: torch.Tensor, grad: torch.Tensor, db: torch.Tensor) -> None:
    """db [K, N] = sum over every row r of a[r]^T grad[r] (b shared by the batch): one GEMM whose reduction
    runs over all rows. The rows' leading dims merge as far as a's and grad's strides allow; the innermost
    is the GEMM's K loop, the others (at most two) are summed into the same accumulator (REDUCE_BATCH)."""
    if db.numel() == 0:
        return
    lead = tuple(a.shape[:-1]) + (1,)
    lay = Layout.of(lead, tuple(a.stride()[:-1]) + (0,), tuple(grad.stride()[:-1]) + (0,))
    if lay is None:  # more than three irregular leading dims: the documented copy
        a, grad = a.contiguous(), grad.contiguous()
        lay = Layout.of(lead, tuple(a.stride()[:-1]) + (0,), tuple(grad.stride()[:-1]) + (0,))
    (n0, n1, inner), (sa, sg) = lay.sizes, lay.strides
    # summed batch z over (n0, n1) through the kernel's lead_index(z, 1, n1): strides (s0, 0, s1)
    summed = Layout(n0 * n1, 1, (n0, 1, n1), ((sa[0], 0, sa[1], 0), (sg[0], 0, sg[1], 0), (0, 0, 0, 0)))
    k, n = db.shape
    _launch(a, grad, None, db, summed, (k, n, inner),
            (a.stride(-1), sa[2], sg[2], grad.stride(-1), db.stride(0), db.stride(1)), reduce=True)


def _launch(a, b, bias, out, lay: Layout, dims: tuple, strides: tuple, reduce: bool) -> None:
    """One persistent GEMM launch: dims (M, N, K); strides (a_sm, a_sk, b_sk, b_sn, o_sm, o_sn)."""
    m, n, k = dims
    a_sm, a_sk, b_sk, b_sn, o_sm, o_sn = strides
    cfg = _config(m, n, k, a.dtype)
    batches = 1 if reduce else lay.n_rows
    tiles = batches * cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"])
    while not INTERPRET and tiles < 0.8 * sm_count(a.device) and _shrink(cfg):
        # few output tiles (small M: decode, GEMV-like; short N): smaller tiles put every SM to work
        tiles = batches * cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"])
    grid = (tiles if INTERPRET else min(tiles, sm_count(a.device)),)
    bias_t, bias_s = (bias, bias.stride(0)) if bias is not None else (a, 0)
    _matmul_kernel[grid](
        a, b, bias_t, out, lay.n_rows, lay.sizes[1], lay.sizes[2], m, n, k,
        *lay.args(0)[:3], a_sm, a_sk, *lay.args(1)[:3], b_sk, b_sn, *lay.args(2)[:3], o_sm, o_sn, bias_s,
        HAS_BIAS=bias is not None, REDUCE_BATCH=reduce, PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        **cfg,
    )


def _column_sum(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x's rows summed [N] in `dtype`: float32 partial sums per row chunk, then one program per column block
    adds the chunks in order (deterministic; the partials are chunks x N float32, never rows x N)."""
    n = x.shape[-1]
    out = torch.empty((n,), dtype=dtype, device=x.device)
    lay = Layout.of(tuple(x.shape), tuple(x.stride()))
    if lay is None:  # more than three irregular leading dims: the documented copy
        x = x.contiguous()
        lay = Layout.of(tuple(x.shape), tuple(x.stride()))
    if n == 0 or lay.n_rows == 0:
        return out.zero_()
    block_n, block_r, per_program = _sum_config(lay.n_rows, n, x.device)
    chunks = cdiv(lay.n_rows, per_program)
    partial = out if chunks == 1 else torch.empty((chunks, n), dtype=torch.float32, device=x.device)
    _column_sum_kernel[(cdiv(n, block_n), chunks)](x, partial, lay.n_rows, n, lay.sizes[1], lay.sizes[2],
                                                   *lay.args(0), per_program, BLOCK_R=block_r, BLOCK_N=block_n,
                                                   num_warps=warps_for(block_r * block_n))
    if chunks > 1:
        block_r = min(next_pow2(chunks), max(1, tile_elements() // block_n))
        _column_sum_kernel[(cdiv(n, block_n), 1)](partial, out, chunks, n, 1, 1, n, 0, 0, 1, chunks,
                                                  BLOCK_R=block_r, BLOCK_N=block_n, num_warps=warps_for(block_r * block_n))
    return out


def _sum_config(rows: int, n: int, device) -> tuple:
    """(BLOCK_N, BLOCK_R, rows per program) of the column sum's first stage.

    GPU: 64 x 64 tiles; rows are split into chunks of >= 4 row tiles so that the grid holds about two
    programs per SM. Interpreter: large tiles, but chunks of at most a quarter of the rows (>= 32), so
    that CI's small cases run the second stage too.
    """
    if INTERPRET:
        block_n = min(next_pow2(n), 1024)
        per_program = max(32, cdiv(rows, 4))
        return block_n, max(1, min(next_pow2(per_program), tile_elements() // block_n)), per_program
    block_n, block_r = 64, 64
    target = max(1, cdiv(2 * sm_count(device), cdiv(n, block_n)))
    return block_n, block_r, max(4 * block_r, cdiv(rows, target))
