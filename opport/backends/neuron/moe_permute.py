"""moe_permute on NKI: tokens on the partitions, experts on the free dim; expert counts and in-tile ranks by TensorE
matmuls of one-hot tiles, offsets by a VectorE scan, rows and source written by indirect-DMA scatters."""

from __future__ import annotations

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron._tiles import PSUM_FMAX, spans
from opport.backends.neuron.moe_unpermute import FMAX, MAX_ROWS, _inverse_rows, _token_rows
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.dispatch import impl
from opport.ops.moe_permute import moe_permute as spec

E_MAX = 2048  # experts: about six [128, E] float32 tiles live (8 KiB per partition each at E = 2048)


def _one_hot_sum(idxf_sb, ids_sb, p, E, K):
    """[p, E] float32: per token, how many of its K slots chose each expert (0/1 for distinct experts)."""
    cnt_sb = nl.ndarray((p, E), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=cnt_sb, value=0.0)
    for j in range(K):
        hot_sb = nl.ndarray((p, E), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=hot_sb, data=ids_sb[0:p, 0:E], op0=nl.equal, operand0=idxf_sb[0:p, j:j + 1])
        nisa.tensor_tensor(dst=cnt_sb, data1=cnt_sb, data2=hot_sb, op=nl.add)
    return cnt_sb


def _load_experts(idx_hbm, t0, p, K):
    """[p, K] float32: the tokens' expert indices (exact: E <= E_MAX)."""
    idx_sb = nl.ndarray((p, K), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx_sb, src=idx_hbm[t0:t0 + p, 0:K])
    idxf_sb = nl.ndarray((p, K), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=idxf_sb, src=idx_sb)
    return idxf_sb


def _add_column_sums(acc_sb, cnt_sb, ones_sb, p, E):
    """acc [1, E] += the column sums of cnt [p, E] (a ones [p, 1] stationary on TensorE, 512 columns per bank)."""
    for e0, f in spans(E, PSUM_FMAX):
        col_psum = nl.ndarray((1, f), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=col_psum, stationary=ones_sb[0:p, 0:1], moving=cnt_sb[0:p, e0:e0 + f])
        nisa.tensor_tensor(dst=acc_sb[0:1, e0:e0 + f], data1=acc_sb[0:1, e0:e0 + f], data2=col_psum, op=nl.add)


@nki.jit
def _moe_permute_kernel(x_hbm, idx_hbm, E):
    """Rows of x grouped by expert, stably: (permuted, source, offsets); tokens on the partitions.

    Dimensions:
        T: tokens (tiled by 128 onto the partitions); K: experts per token; E: experts (free dim, <= E_MAX);
        H: row length; N = T*K slots, s = t*K + j.

    Args:
        x_hbm: [T, H] rows, float32/float16/bfloat16.
        idx_hbm: [T, K] int32 expert indices (in [0, E), checked on the host).
        E: compile-time number of experts.

    Returns:
        perm_hbm: [N, H] in x's dtype; src_hbm: [N, 1] int32; off_hbm: [1, E + 1] int32.

    Notes:
        Slot s's row is offsets[e] + the number of earlier slots (in s order) of the same expert e. Pass 1 counts
        each expert over all tokens: per tile the K one-hot rows ([p, E] compares of an expert-id iota with the
        indices) summed, then summed over the partitions by a ones-vector matmul (exact: integers < 2^24 in
        float32). A VectorE scan along the experts gives offsets. Pass 2 per token tile: a strictly lower
        triangular [p, p] ones matrix times the tile's one-hot sums counts the earlier tokens' slots of every
        expert, and a second matmul accumulating into the same PSUM tile adds the running base (offsets plus
        the earlier tiles' counts) broadcast to the partitions; slot j of a token adds its own earlier slots
        j' < j. The row of each slot is the dot of its one-hot row with that, turned into an int32 index per
        partition: source[row] = s (an iota) and permuted[row] = x[t] leave by indirect-DMA scatters, x's rows
        straight from HBM to HBM (bit for bit, no SBUF round trip). [U] fp32 TensorE matmuls of 0/1 and integer
        operands are taken to be exact.

    Pseudocode:
        counts = sum over tokens of onehot(idx); offsets = [0, cumsum(counts)]; base = offsets[:E]
        for each 128-token tile: before = L @ onehot_sum + base; for j < K: row = (before + earlier j)[idx_j]
            source[row] = t*K + j; permuted[row] = x[t]; base += column sums of the tile's one-hot sums
    """
    T, H = x_hbm.shape
    K = idx_hbm.shape[1]
    P = nl.tile_size.pmax
    perm_hbm = nl.ndarray((T * K, H), dtype=x_hbm.dtype, buffer=nl.shared_hbm)
    src_hbm = nl.ndarray((T * K, 1), dtype=nl.int32, buffer=nl.shared_hbm)
    off_hbm = nl.ndarray((1, E + 1), dtype=nl.int32, buffer=nl.shared_hbm)
    ids_sb = nl.ndarray((P, E), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=ids_sb, pattern=[[1, E]], offset=0, channel_multiplier=0)
    ones_sb = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones_sb, value=1.0)
    ones_row_sb = nl.ndarray((1, P), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones_row_sb, value=1.0)
    lower_sb = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)  # [p', m] = 1 where p' < m
    nisa.iota(dst=lower_sb, pattern=[[1, P]], offset=0, channel_multiplier=-1)
    nisa.tensor_scalar(dst=lower_sb, data=lower_sb, op0=nl.greater, operand0=0.0)

    counts_sb = nl.ndarray((1, E), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=counts_sb, value=0.0)
    for t0, p in spans(T, P):
        cnt_sb = _one_hot_sum(_load_experts(idx_hbm, t0, p, K), ids_sb, p, E, K)
        _add_column_sums(counts_sb, cnt_sb, ones_sb, p, E)
    ones_e_sb = nl.ndarray((1, E), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones_e_sb, value=1.0)
    off_sb = nl.ndarray((1, E + 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=off_sb, value=0.0)
    nisa.tensor_tensor_scan(dst=off_sb[0:1, 1:E + 1], data0=ones_e_sb, data1=counts_sb, initial=0.0, op0=nl.multiply,
                            op1=nl.add)
    offi_sb = nl.ndarray((1, E + 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=offi_sb, src=off_sb)
    nisa.dma_copy(dst=off_hbm, src=offi_sb)
    base_sb = nl.ndarray((1, E), dtype=nl.float32, buffer=nl.sbuf)  # each expert's next free row
    nisa.tensor_copy(dst=base_sb, src=off_sb[0:1, 0:E])

    for t0, p in spans(T, P):
        idxf_sb = _load_experts(idx_hbm, t0, p, K)
        cnt_sb = _one_hot_sum(idxf_sb, ids_sb, p, E, K)
        before_sb = nl.ndarray((p, E), dtype=nl.float32, buffer=nl.sbuf)
        for e0, f in spans(E, PSUM_FMAX):
            before_psum = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=before_psum, stationary=lower_sb[0:p, 0:p], moving=cnt_sb[0:p, e0:e0 + f])
            nisa.nc_matmul(dst=before_psum, stationary=ones_row_sb[0:1, 0:p], moving=base_sb[0:1, e0:e0 + f])
            nisa.tensor_copy(dst=before_sb[0:p, e0:e0 + f], src=before_psum)
        for j in range(K):
            hot_sb = nl.ndarray((p, E), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=hot_sb, data=ids_sb[0:p, 0:E], op0=nl.equal, operand0=idxf_sb[0:p, j:j + 1])
            prod_sb = nl.ndarray((p, E), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=prod_sb, data1=hot_sb, data2=before_sb, op=nl.multiply)
            row_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=row_sb, op=nl.add, data=prod_sb, axis=1)
            nisa.tensor_tensor(dst=before_sb, data1=before_sb, data2=hot_sb, op=nl.add)  # slot j' < j come first
            rowi_sb = nl.ndarray((p, 1), dtype=nl.int32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=rowi_sb, src=row_sb)
            slot_sb = nl.ndarray((p, 1), dtype=nl.int32, buffer=nl.sbuf)
            nisa.iota(dst=slot_sb, pattern=[[0, 1]], offset=t0 * K + j, channel_multiplier=K)
            nisa.dma_copy(dst=src_hbm.ap([[1, p], [1, 1]], offset=0, vector_offset=rowi_sb, indirect_dim=0), src=slot_sb)
            if H > 0:
                nisa.dma_copy(dst=perm_hbm.ap([[H, p], [1, H]], offset=0, vector_offset=rowi_sb, indirect_dim=0),
                              src=x_hbm[t0:t0 + p, 0:H])
        _add_column_sums(base_sb, cnt_sb, ones_sb, p, E)
    return perm_hbm, src_hbm, off_hbm


@nki.jit
def _moe_permute_backward_kernel(g_hbm, src_hbm, K):
    """dx[t] = sum_j grad_permuted[row of slot t*K + j]: moe_unpermute's gather without weights; tokens on partitions.

    Dimensions:
        T = N / K tokens (tiled by 128 onto the partitions); K: slots per token; H: columns (chunks of FMAX).

    Args:
        g_hbm: [N, H] upstream gradient of permuted, float32/float16/bfloat16.
        src_hbm: [N, 1] int32 the forward's source (a permutation, checked on the host).
        K: compile-time slots per token.

    Returns:
        dx_hbm: [T, H] in g's dtype.

    Notes:
        The inverse permutation by an indirect-DMA scatter into an HBM scratch, then per token tile its [128, K] rows
        and one indirect-DMA gather per slot (a row per partition), summed on VectorE in float32 in the order
        j = 0..K-1 and rounded once. g read once, dx written once.

    Pseudocode:
        row[source[r]] = r; for each 128-token tile, column chunk: acc = sum_j g[row[t*K + j]]; dx = acc
    """
    N, H = g_hbm.shape
    T = N // K
    dx_hbm = nl.ndarray((T, H), dtype=g_hbm.dtype, buffer=nl.shared_hbm)
    row_hbm = nl.ndarray((N, 1), dtype=nl.int32, buffer=nl.shared_hbm)  # scratch: the inverse permutation
    _inverse_rows(src_hbm, row_hbm)
    for t0, p in spans(T, nl.tile_size.pmax):
        idx_sb = _token_rows(row_hbm, t0, p, K)
        for h0, f in spans(H, FMAX):
            acc_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
            for j in range(K):
                g_sb = nl.ndarray((p, f), dtype=g_hbm.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=g_sb, src=g_hbm.ap([[H, p], [1, f]], offset=h0, vector_offset=idx_sb[0:p, j:j + 1],
                                                     indirect_dim=0))
                if j == 0:
                    nisa.tensor_copy(dst=acc_sb, src=g_sb)
                else:
                    nisa.tensor_tensor(dst=acc_sb, data1=acc_sb, data2=g_sb, op=nl.add)
            out_sb = nl.ndarray((p, f), dtype=g_hbm.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=out_sb, src=acc_sb)
            nisa.dma_copy(dst=dx_hbm[t0:t0 + p, h0:h0 + f], src=out_sb)
    return dx_hbm


def _supports(x, top_k_index, num_experts):
    n = top_k_index.shape[0] * top_k_index.shape[1]
    if num_experts > E_MAX:
        return f"E = {num_experts} experts: [128, E] float32 one-hot tiles are held in SBUF (at most {E_MAX})"
    if n > MAX_ROWS:
        return f"T*k = {n} rows: the indirect DMA offsets are int32"
    return None


@impl(spec, "neuron", supports=_supports)
def moe_permute(x: np.ndarray, top_k_index: np.ndarray, num_experts: int):
    """Host side: contiguous x, the indices as int32 (checked in range), launch."""
    t, k = top_k_index.shape
    if t == 0:
        return np.empty((0, x.shape[1]), x.dtype), np.empty(0, np.int32), np.zeros(num_experts + 1, np.int32)
    perm, src, off = _host.run(_moe_permute_kernel, _host.contiguous(x), np.ascontiguousarray(top_k_index, np.int32),
                               int(num_experts))
    n = t * k
    return (_host.as_dtype(perm, x.dtype.name, (n, x.shape[1])), _host.as_dtype(src, "int32", (n,)),
            _host.as_dtype(off, "int32", (num_experts + 1,)))


@impl(spec.backward_op, "neuron", supports=lambda grad_permuted, x, top_k_index, source, num_experts:
      _supports(x, top_k_index, num_experts))
def moe_permute_backward(grad_permuted: np.ndarray, x: np.ndarray, top_k_index: np.ndarray, source: np.ndarray,
                         num_experts: int):
    """Host side: contiguous grad_permuted, source as int32 [N, 1], launch."""
    t, k = top_k_index.shape
    if t * x.shape[1] == 0:
        return (np.zeros(x.shape, x.dtype),)
    dx = _host.run(_moe_permute_backward_kernel, _host.contiguous(grad_permuted),
                   np.ascontiguousarray(source, np.int32).reshape(-1, 1), int(k))
    return (_host.as_dtype(dx, x.dtype.name, x.shape),)
