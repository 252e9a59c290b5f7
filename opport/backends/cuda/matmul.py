"""matmul in Triton: a persistent, grouped-tile GEMM with float32 accumulation and a fused bias.

Batch dims of a (and of a batched b) are read by strides, up to three after merging dims that are
contiguous in a, b and out together; more than that copies a and b to contiguous first (the only copy).
"""

import torch

from opport.backends.cuda._launch import (
    INTERPRET,
    Layout,
    cdiv,
    dot_operand,
    f32,
    lead_index,
    narrow,
    next_pow2,
    sm_count,
    tl,
    triton,
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
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[z] = a[z] @ b[z] (+ bias) for every batch entry z; float32 accumulation, one rounding.

    Dimensions: a [Z, M, K], b [Z, K, N] (batch strides 0 for a shared b), out [Z, M, N], bias [N].
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
    for tile in range(tl.program_id(0), n_batch * per_batch, tl.num_programs(0)):
        z = tile // per_batch
        t = tile % per_batch
        band = t // (GROUP_M * tiles_n)
        first_m = band * GROUP_M
        rows_in_band = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (t % (GROUP_M * tiles_n)) % rows_in_band
        pid_n = (t % (GROUP_M * tiles_n)) // rows_in_band
        z0, z1, z2 = lead_index(z, n1, n2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = (a_ptr + (z0 * a_s0 + z1 * a_s1 + z2 * a_s2) + offs_m.to(tl.int64)[:, None] * a_sm
                  + offs_k.to(tl.int64)[None, :] * a_sk)
        b_ptrs = (b_ptr + (z0 * b_s0 + z1 * b_s1 + z2 * b_s2) + offs_k.to(tl.int64)[:, None] * b_sk
                  + offs_n.to(tl.int64)[None, :] * b_sn)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < K - k), other=0.0)
            b = tl.load(b_ptrs, mask=(offs_k[:, None] < K - k) & (offs_n[None, :] < N), other=0.0)
            acc = tl.dot(dot_operand(a), dot_operand(b), acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * a_sk
            b_ptrs += BLOCK_K * b_sk
        if HAS_BIAS:
            acc += f32(tl.load(bias_ptr + offs_n.to(tl.int64) * bias_s, mask=offs_n < N, other=0.0))[None, :]
        o_ptrs = (out_ptr + (z0 * o_s0 + z1 * o_s1 + z2 * o_s2) + offs_m.to(tl.int64)[:, None] * o_sm
                  + offs_n.to(tl.int64)[None, :] * o_sn)
        tl.store(o_ptrs, narrow(acc, out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


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


@impl(spec, "cuda", dtypes=("float32", "float16", "bfloat16"))
def matmul(a: torch.Tensor, b: torch.Tensor, bias) -> torch.Tensor:
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    out = torch.empty((*a.shape[:-2], m, n), dtype=a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    lay = _batch_layout(a, b, out)
    if lay is None:  # more than three irregular batch dims: the documented copy
        a, b = a.contiguous(), b.contiguous()
        lay = _batch_layout(a, b, out)
    cfg = _config(m, n, k, a.dtype)
    tiles = lay.n_rows * cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"])
    while not INTERPRET and tiles < 0.8 * sm_count(a.device) and _shrink(cfg):
        # few output tiles (small M: decode, GEMV-like; short N): smaller tiles put every SM to work
        tiles = lay.n_rows * cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"])
    grid = (tiles if INTERPRET else min(tiles, sm_count(a.device)),)
    bias_t, bias_s = (bias, bias.stride(0)) if bias is not None else (a, 0)
    _matmul_kernel[grid](
        a, b, bias_t, out, lay.n_rows, lay.sizes[1], lay.sizes[2], m, n, k,
        *lay.args(0)[:3], a.stride(-2), a.stride(-1), *lay.args(1)[:3], b.stride(-2), b.stride(-1),
        *lay.args(2)[:3], out.stride(-2), out.stride(-1), bias_s,
        HAS_BIAS=bias is not None, PRECISION="ieee" if a.dtype == torch.float32 else "tf32", **cfg,
    )
    return out


