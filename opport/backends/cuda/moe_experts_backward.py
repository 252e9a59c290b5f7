"""moe_experts' backward in Triton: the forward's schedule and grouped GEMMs, activations recomputed, no atomics.

Saved from the forward: its inputs only. Six launches:
1. `_moe_bwd_rows_kernel`, programs (row block, I tile): gate and up recomputed as in the forward, and in the same
   loop over H dA = grad[token] down_proj[e] (the upstream gradient through the down projection, before the router
   weight). Then a = silu(gate) up, the router weight's gradient partial sum(dA * a) over the tile's I columns
   (dw = grad . y = (down^T grad) . a: no second GEMM for y), da = w dA, dgate = da up silu'(gate),
   dup = da silu(gate); a and dh = [dgate, dup] stored per slot in x's dtype, the dw partials per (I tile, slot)
   in float32.
2. `_moe_weight_grad_kernel` for ddown_proj[e] = sum over e's rows of (w grad[token])^T a[slot], and again for
   dgate_up_proj[e] = sum of dh[slot]^T x[token]: programs (expert, tile), each looping over its expert's rows in
   sorted order into one float32 accumulator (deterministic; an expert without rows is never visited: the
   gradients are zeroed first).
3. dx per slot = dh[slot] gate_up_proj[e] (the forward's `_moe_down_kernel`), summed over k in pick order (its
   `_moe_sum_k_kernel`): two launches; dtop_k_weights: the dw partials summed over I tiles in order (`sum_partials`).
"""

import torch

from opport.backends.cuda._launch import INTERPRET, cdiv, dot_operand, f32, narrow, sum_partials, tl, triton
from opport.backends.cuda.moe_experts import Schedule, block_m, down, gemm_config, precision, sum_k
from opport.backends.cuda.swiglu import _swiglu_f32
from opport.dispatch import impl
from opport.ops.moe_experts import moe_experts as spec


@triton.jit
def _moe_bwd_rows_kernel(
    # pointers
    x_ptr, g_ptr, w1_ptr, w2_ptr, rw_ptr, order_ptr, offsets_ptr, blocks_ptr, expert_ptr, a_ptr, dh_ptr, dw_ptr,
    # shapes, strides
    n_experts, k, H, n_inter, n_slots,
    x_st, x_sh, g_st, g_sh, w1_se, w1_sn, w1_sh, w2_se, w2_sh, w2_si, rw_st, rw_sj, a_ss, a_si, dh_ss, dh_si,
    # meta-parameters
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Per slot of one row block of expert e and I columns: a, dh = [dgate, dup] and dw's partial sum.

    Dimensions: x, grad [T, H]; gate_up_proj [E, 2I, H]; down_proj [E, H, I]; router weights [T, k]; a [T k, I]
    and dh [T k, 2I] in x's dtype; dw partials [cdiv(I, BLOCK_N), T k] float32 (row: this program's I tile).
    Notes: one loop over H feeds three dots: x against the gate and up rows (recomputing the forward), and grad
    against down_proj[e]'s columns (dA). silu' is q (num + g e q) with e = exp(-|g|), q = 1 / (1 + e), num = 1
    (g >= 0) or e: no overflow, and its limits 0 and 1 at -inf and +inf (g e taken as 0 where e is 0).
    Pseudocode: for h tiles: g += x[tok] W1g^T; u += x[tok] W1u^T; dA += grad[tok] W2[e][h, cols]
                a = silu(g) u; dw[tile, slot] = sum(dA a); da = w dA; dh = [da u silu'(g), silu(g) da]
    """
    pid = tl.program_id(0)
    e = tl.load(expert_ptr + pid)
    if e < n_experts:
        first = tl.load(offsets_ptr + e) + (pid - tl.load(blocks_ptr + e)) * BLOCK_M
        rows = first + tl.arange(0, BLOCK_M)
        row_ok = rows < tl.load(offsets_ptr + e + 1)
        slot = tl.load(order_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        token = slot // k
        tile = tl.program_id(1)
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n_inter
        offs_k = tl.arange(0, BLOCK_K)
        ks = offs_k.to(tl.int64)
        c64 = cols.to(tl.int64)[None, :]
        # pointer tiles advanced by BLOCK_K per step, as in the forward's kernels
        x_ptrs = x_ptr + token[:, None] * x_st + ks[None, :] * x_sh
        g_ptrs = g_ptr + token[:, None] * g_st + ks[None, :] * g_sh
        wg_ptrs = w1_ptr + e.to(tl.int64) * w1_se + c64 * w1_sn + ks[:, None] * w1_sh
        wu_ptrs = wg_ptrs + n_inter * w1_sn
        w2_ptrs = w2_ptr + e.to(tl.int64) * w2_se + c64 * w2_si + ks[:, None] * w2_sh
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_d = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for h0 in range(0, H, BLOCK_K):
            h_ok = offs_k < H - h0
            a_mask = row_ok[:, None] & h_ok[None, :]
            w_mask = h_ok[:, None] & col_ok[None, :]
            xt = dot_operand(tl.load(x_ptrs, mask=a_mask, other=0.0))
            gt = dot_operand(tl.load(g_ptrs, mask=a_mask, other=0.0))
            acc_g = tl.dot(xt, dot_operand(tl.load(wg_ptrs, mask=w_mask, other=0.0)), acc_g, input_precision=PRECISION)
            acc_u = tl.dot(xt, dot_operand(tl.load(wu_ptrs, mask=w_mask, other=0.0)), acc_u, input_precision=PRECISION)
            acc_d = tl.dot(gt, dot_operand(tl.load(w2_ptrs, mask=w_mask, other=0.0)), acc_d, input_precision=PRECISION)
            x_ptrs += BLOCK_K * x_sh
            g_ptrs += BLOCK_K * g_sh
            wg_ptrs += BLOCK_K * w1_sh
            wu_ptrs += BLOCK_K * w1_sh
            w2_ptrs += BLOCK_K * w2_sh
        out_mask = row_ok[:, None] & col_ok[None, :]
        a = _swiglu_f32(acc_g, acc_u)
        tl.store(dw_ptr + tile.to(tl.int64) * n_slots + slot, tl.sum(tl.where(out_mask, acc_d * a, 0.0), 1), mask=row_ok)
        rw = f32(tl.load(rw_ptr + token * rw_st + (slot - token * k) * rw_sj, mask=row_ok, other=0.0))
        da = acc_d * rw[:, None]
        ex = tl.exp(-tl.abs(acc_g))
        q = 1.0 / (1.0 + ex)
        ge = tl.where(ex == 0.0, 0.0, acc_g * ex)
        dgate = (da * acc_u) * (q * (tl.where(acc_g >= 0, 1.0, ex) + ge * q))
        dup = _swiglu_f32(acc_g, da)
        tl.store(a_ptr + slot[:, None] * a_ss + c64 * a_si, narrow(a, a_ptr.dtype.element_ty), mask=out_mask)
        dh_rows = dh_ptr + slot[:, None] * dh_ss
        tl.store(dh_rows + c64 * dh_si, narrow(dgate, dh_ptr.dtype.element_ty), mask=out_mask)
        tl.store(dh_rows + (c64 + n_inter) * dh_si, narrow(dup, dh_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _moe_weight_grad_kernel(
    # pointers
    l_ptr, r_ptr, rw_ptr, order_ptr, offsets_ptr, hit_ptr, n_hit_ptr, dw_ptr,
    # shapes, strides
    k, N, M,
    l_s0, l_s1, r_s0, r_s1, rw_st, rw_sj, d_se, d_sn, d_sm,
    # meta-parameters
    L_BY_TOKEN: tl.constexpr, R_BY_TOKEN: tl.constexpr, WEIGHTED: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """dw[e, n tile, m tile] = sum over expert e's rows r (sorted order) of L[r, n]^T R[r, m], for the expert hit_ptr[pid].

    Dimensions: L and R are read per row by token (x, grad: [T, .]) or by slot (a, dh: [T k, .]); WEIGHTED scales
    L's rows by the slot's router weight (ddown_proj: (w grad)^T a). dw [E, N, M] in x's dtype.
    hit [E] int32: the experts with rows first (their number in n_hit [1], both on the device: no sync).
    Notes: one program owns an expert's output tile and walks all of that expert's rows in order, accumulating in
    float32: a fixed summation order, no atomics. Programs past the number of experts hit (the grid being its
    upper bound E) do nothing; the host zeroed dw, so experts without rows read no weights and get zeros. WEIGHTED
    rounds w * grad to the dtype of R (a), the dot's operand dtype, as a is.
    Pseudocode: for rows r0.. of expert e: acc += L[rows, n]^T @ R[rows, m]; dw[e, n, m] = acc
    """
    pid = tl.program_id(0)
    if pid < tl.load(n_hit_ptr):
        e = tl.load(hit_ptr + pid)
        start = tl.load(offsets_ptr + e)
        end = tl.load(offsets_ptr + e + 1)
        ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ms = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        n_ok = ns < N
        m_ok = ms < M
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for r0 in range(start, end, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            r_ok = rows < end
            slot = tl.load(order_ptr + rows, mask=r_ok, other=0).to(tl.int64)
            token = slot // k
            li = token if L_BY_TOKEN else slot
            ri = token if R_BY_TOKEN else slot
            lt = tl.load(l_ptr + li[None, :] * l_s0 + ns.to(tl.int64)[:, None] * l_s1, mask=n_ok[:, None] & r_ok[None, :],
                         other=0.0)  # L^T tile [BLOCK_N, BLOCK_R]
            if WEIGHTED:
                w = f32(tl.load(rw_ptr + token * rw_st + (slot - token * k) * rw_sj, mask=r_ok, other=0.0))
                lt = narrow(f32(lt) * w[None, :], r_ptr.dtype.element_ty)  # R's dtype: both dot operands alike
            rt = tl.load(r_ptr + ri[:, None] * r_s0 + ms.to(tl.int64)[None, :] * r_s1, mask=r_ok[:, None] & m_ok[None, :],
                         other=0.0)
            acc = tl.dot(dot_operand(lt), dot_operand(rt), acc, input_precision=PRECISION)
        tl.store(dw_ptr + e.to(tl.int64) * d_se + ns.to(tl.int64)[:, None] * d_sn + ms.to(tl.int64)[None, :] * d_sm,
                 narrow(acc, dw_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


# --------------------------------------------------------------------------- host side


def _weight_grad(left, right, rw, sched: Schedule, hit, n_hit, dw, l_by_token: bool, r_by_token: bool, programs: int):
    """dw[e] = sum over e's rows of left[row]^T right[row] for every expert hit (dw zeroed by the caller)."""
    n, m = dw.shape[1], dw.shape[2]
    cfg = gemm_config(m, 0, right.dtype)
    bn = gemm_config(n, 0, right.dtype)["BLOCK_N"]  # the [bn, bm] accumulator's rows
    # the rows summed per step: the transposed L tile [bn, rows] is loaded against its layout (64 rows spilled)
    rows = sched.bm if INTERPRET else 32
    rw_args = (rw, *rw.stride()) if rw is not None else (right, 0, 0)
    _moe_weight_grad_kernel[(programs, cdiv(n, bn), cdiv(m, cfg["BLOCK_N"]))](
        left, right, rw_args[0], sched.order, sched.offsets, hit, n_hit, dw, sched.k, n, m, *left.stride(),
        *right.stride(), *rw_args[1:], *dw.stride(), L_BY_TOKEN=l_by_token, R_BY_TOKEN=r_by_token,
        WEIGHTED=rw is not None, PRECISION=precision(right.dtype), BLOCK_R=rows, BLOCK_N=bn, BLOCK_M=cfg["BLOCK_N"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


@impl(spec.backward_op, "cuda")
def moe_experts_backward(grad, x, gate_up_proj, down_proj, top_k_index, top_k_weights):
    """dx, dgate_up_proj, ddown_proj, dtop_k_weights by the six launches of the module docstring. Extra memory: a
    [T k, I] and dh [T k, 2I] in x's dtype, per-slot dx rows [T k, H] float32, dw partials [I tiles, T k] float32."""
    t, h = x.shape
    n_experts, i = gate_up_proj.shape[0], down_proj.shape[2]
    k = top_k_index.shape[1]
    dev, dt = x.device, x.dtype
    dx = torch.empty((t, h), dtype=dt, device=dev)
    dw1 = torch.zeros(gate_up_proj.shape, dtype=dt, device=dev)
    dw2 = torch.zeros(down_proj.shape, dtype=dt, device=dev)
    dw = torch.empty((t, k), dtype=dt, device=dev)
    if t == 0:
        return dx, dw1, dw2, dw
    sched = Schedule(top_k_index, n_experts, block_m(t * k))
    rows = t * k
    cfg = gemm_config(i, h, dt, accs=3)
    tiles = cdiv(i, cfg["BLOCK_N"])
    a = torch.empty((rows, i), dtype=dt, device=dev)
    dh = torch.empty((rows, 2 * i), dtype=dt, device=dev)
    partial = torch.empty((tiles, rows), dtype=torch.float32, device=dev)
    _moe_bwd_rows_kernel[(sched.programs, tiles)](
        x, grad, gate_up_proj, down_proj, top_k_weights, *sched.args(), a, dh, partial, n_experts, k, h, i, rows,
        *x.stride(), *grad.stride(), *gate_up_proj.stride(), *down_proj.stride(), *top_k_weights.stride(), *a.stride(),
        *dh.stride(), PRECISION=precision(dt), BLOCK_M=sched.bm, **cfg)
    sum_partials(partial, dw.view(-1))
    counts = sched.offsets[1:] - sched.offsets[:-1]
    hit = torch.argsort((counts == 0).to(torch.int8), stable=True).to(torch.int32)  # experts with rows first, in order
    n_hit = (counts > 0).sum().to(torch.int32).reshape(1)
    programs = int(n_hit) if INTERPRET else n_experts  # (host memory in the interpreter: no sync)
    if programs:
        _weight_grad(grad, a, top_k_weights, sched, hit, n_hit, dw2, True, False, programs)
        _weight_grad(dh, x, None, sched, hit, n_hit, dw1, False, True, programs)
    ws = gate_up_proj.stride()
    per_slot = down(dh, gate_up_proj, (ws[0], ws[1], ws[2]), h, None, sched)  # dh [T k, 2I] @ gate_up_proj[e]
    return sum_k(per_slot, dx, k), dw1, dw2, dw
