"""kv_cache_write_fp8 on NKI: each token's K and V rows quantised on chip (tokens on the partitions, quantize_fp8's
conversion), then the fp8 codes and the per-(token, head) scales DMA'd to their cache slots by indirect scatter.

float8_e4m3fn caches need NeuronCore-v4 (trn3): on trn1 / trn2 the compiler refuses F8E4M3FN operands (neuronx-cc
NCC_EVRF051, quantize_fp8.py), so there the quantised rows are encoded to e4m3fn bytes on VectorE (`e4m3fn_bytes`)
and scattered into the cache's uint8 view. float8_e5m2 is an operand on every generation.
"""

from __future__ import annotations

import numpy as np

from opport.arraymath import FP8_MAX, SCALE_FLOOR, per_token_scales
from opport.backends.neuron import _host
from opport.backends.neuron._tiles import load_row_broadcast, spans
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.backends.neuron.quantize_fp8 import target_version
from opport.dispatch import impl
from opport.ops.kv_cache_write_fp8 import kv_cache_write_fp8 as spec

P = _host.P  # tokens per tile: the slot indices sit one per partition
FMAX = 4096  # elements per partition per chunk (whole heads): x, |x|, a predicate and the quotient <= 56 KiB (fp32)
W_MAX = FMAX  # a head's row is not split: D and Dv up to one chunk
E4M3FN_MIN_NORMAL = 2.0 ** -6  # below it e4m3fn codes are subnormal: multiples of 2^-9
E4M3FN_BIAS_SHIFT = (127 - 7) << 3  # float32 bits >> 20 of a normal e4m3fn value minus its code (exponent bias 127 vs 7)
E4M3FN_NAN = 0x7F  # the e4m3fn NaN code (the sign bit is added after)


@nki.jit
def _kv_cache_write_fp8_kernel(key_hbm, value_hbm, slots_hbm, kc_hbm, vc_hbm, ks_hbm, vs_hbm, fmax, fp8, bits):
    """Quantise token rows to fp8 and scatter them (and per-token scales) into the caches at their slots.

    Dimensions:
        T: tokens (128 per tile, one slot index per partition); Hkv heads of D (key) / Dv (value) elements, on
        the free dimension in chunks of whole heads (<= FMAX elements).

    Args:
        key_hbm: [T, Hkv, D]; value_hbm: [T, Hkv, Dv] (float32/float16/bfloat16); slots_hbm: [T, 1] int32 (-1: skip);
        kc_hbm: [slots, Hkv * D] and vc_hbm: [slots, Hkv * Dv], the caches viewed as rows (fp8, or their uint8
        bytes when bits), written in place; ks_hbm, vs_hbm: float32 scales, [1] per tensor (read) or
        [slots, Hkv] per token and head (written in place).
        fmax: the format's largest finite value; fp8: the nl dtype of the codes; bits: e4m3fn encoded as bytes.

    Returns:
        Nothing: the caches (and per-token scales) are written in place.

    Notes:
        Per token and head s = max(amax * (1 / fmax), 2^-126) with amax over the row's finite |x| (|x| as
        abs_max with 0, copied under |x| < inf into a zeroed tile, max-reduced over the head's last axis), and
        q = fp8(max(min(x * (1 / s), fmax), -fmax)), the [P, Hkv] reciprocal broadcast along D by a stride-0
        view; per tensor the static scale is broadcast to the partitions once and its reciprocal is a [P, 1]
        operand. NaN stays NaN (IEEE min/max), +-inf saturates. x / s is x * (1 / s), two float32 roundings
        (quantize_fp8's; no divide on hardware). Each tile's codes (and scales) leave SBUF in one indirect DMA
        per chunk whose destination rows are picked by `vector_offset`; a slot of -1 lands out of bounds and
        `oob_mode=skip` drops it. Traffic: the rows read once, codes (1 byte) and scales written once.

    Pseudocode:
        for each 128 tokens: idx = slots[t0:t1]
            for x, cache, scale in (key, k), (value, v): s = max(amax(|x| finite) / fmax, 2^-126) per head
                (or the static scale); cache[idx] = fp8(clamp(x * (1 / s), +-fmax)); scale[idx] = s (per token)
    """
    T, Hkv, _ = key_hbm.shape
    PMAX = nl.tile_size.pmax
    token = len(ks_hbm.shape) == 2
    rs = (None, None)
    if not token:
        rs = (_static_reciprocal(ks_hbm, PMAX), _static_reciprocal(vs_hbm, PMAX))
    for t0, n in spans(T, P):
        idx_sb = nl.ndarray((n, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=idx_sb, src=slots_hbm[t0:t0 + n, 0:1])
        for x_hbm, c_hbm, s_hbm, r_sb in ((key_hbm, kc_hbm, ks_hbm, rs[0]), (value_hbm, vc_hbm, vs_hbm, rs[1])):
            W = x_hbm.shape[2]
            for h0, hn in spans(Hkv, max(1, FMAX // W)):
                x_sb = nl.ndarray((n, hn, W), dtype=x_hbm.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=x_sb, src=x_hbm[t0:t0 + n, h0:h0 + hn, 0:W])
                v_sb = nl.ndarray((n, hn, W), dtype=nl.float32, buffer=nl.sbuf)
                if token:
                    s_sb = _head_scales(x_sb, fmax)
                    r_sb = nl.ndarray((n, hn, 1), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.reciprocal(dst=r_sb, data=s_sb)
                    nisa.tensor_tensor(dst=v_sb, data1=x_sb, data2=r_sb.broadcast(2, W), op=nl.multiply)
                    nisa.dma_copy(dst=s_hbm.ap([[Hkv, n], [1, hn]], offset=h0, vector_offset=idx_sb, indirect_dim=0),
                                  src=s_sb, oob_mode=nisa.oob_mode.skip)
                else:
                    nisa.tensor_scalar(dst=v_sb, data=x_sb, op0=nl.multiply, operand0=r_sb[0:n, 0:1])
                q_sb = nl.ndarray((n, hn, W), dtype=nl.uint8 if bits else fp8, buffer=nl.sbuf)
                if bits:
                    c_sb = nl.ndarray((n, hn, W), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.tensor_scalar(dst=c_sb, data=v_sb, op0=nl.minimum, operand0=fmax, op1=nl.maximum,
                                       operand1=-fmax)
                    e4m3fn_bytes(q_sb, c_sb)
                else:
                    nisa.tensor_scalar(dst=q_sb, data=v_sb, op0=nl.minimum, operand0=fmax, op1=nl.maximum,
                                       operand1=-fmax)
                HW = Hkv * W
                nisa.dma_copy(dst=c_hbm.ap([[HW, n], [1, hn * W]], offset=h0 * W, vector_offset=idx_sb, indirect_dim=0),
                              src=q_sb, oob_mode=nisa.oob_mode.skip)


def _static_reciprocal(s_hbm, p):
    """[p, 1] float32: 1 / the per-tensor scale s_hbm [1] on every partition (one DMA, a K = 1 matmul: exact)."""
    s_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    load_row_broadcast(s_sb, s_hbm, 0, 1, p)
    r_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=r_sb, data=s_sb)
    return r_sb


def _head_scales(x_sb, fmax):
    """[n, hn, 1] float32: max(amax * (1 / fmax), 2^-126) per token and head, amax over the head's finite |x|."""
    n, hn, W = x_sb.shape
    abs_sb = nl.ndarray((n, hn, W), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=abs_sb, data=x_sb, op0=nl.abs_max, operand0=0.0)
    fin_sb = nl.ndarray((n, hn, W), dtype=nl.uint8, buffer=nl.sbuf)  # 1 where x is finite
    nisa.tensor_scalar(dst=fin_sb, data=abs_sb, op0=nl.less, operand0=float("inf"))
    a_sb = nl.ndarray((n, hn, W), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=a_sb, value=0.0)
    nisa.tensor_copy_predicated(dst=a_sb, src=abs_sb, predicate=fin_sb)
    amax_sb = nl.ndarray((n, hn, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=amax_sb, op=nl.maximum, data=a_sb, axis=2, keepdims=True)
    s_sb = nl.ndarray((n, hn, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=s_sb, data=amax_sb, op0=nl.multiply, operand0=1.0 / fmax, op1=nl.maximum,
                       operand1=SCALE_FLOOR)
    return s_sb


def e4m3fn_bytes(q_sb, v_sb):
    """q_sb (uint8) = the float8_e4m3fn codes of v_sb (float32, |v| <= 448 or NaN), rounded to nearest even, for
    NeuronCore-v2/v3, which have no e4m3fn operands.

    v is first rounded onto the e4m3fn grid in float32: the grid step of |v|'s binade, 2^(e - 3) (its exponent
    bits minus 3, at least 2^-9: the subnormal step), gives M = 1.5 * 2^23 * step, and (v + M) - M rounds v to
    a multiple of the step, nearest even (one float32 addition whose ulp is the step). The rounded |r| is then a
    code: (bits(|r|) >> 20) - (120 << 3) for normal values (exponent bias 127 vs 7, 3 mantissa bits), |r| * 2^9
    below 2^-6; NaN gets 0x7F; the sign bit of v becomes bit 7. Every intermediate integer is small or a
    multiple of 2^23, exact through float32 ALUs."""
    n, hn, W = v_sb.shape
    f32, u32 = nl.float32, nl.uint32
    ab_sb = nl.ndarray((n, hn, W), dtype=u32, buffer=nl.sbuf)  # bits of |v|
    nisa.tensor_scalar(dst=ab_sb, data=v_sb.view(u32), op0=nl.bitwise_and, operand0=0x7FFFFFFF)
    st_sb = nl.ndarray((n, hn, W), dtype=u32, buffer=nl.sbuf)  # bits of 2^(e - 3): exponent bits minus 3 << 23
    nisa.tensor_scalar(dst=st_sb, data=ab_sb, op0=nl.bitwise_and, operand0=0x7F800000)
    nisa.tensor_scalar(dst=st_sb, data=st_sb, op0=nl.subtract, operand0=float(3 << 23), op1=nl.maximum,
                       operand1=float((127 - 9) << 23))
    m_sb = nl.ndarray((n, hn, W), dtype=f32, buffer=nl.sbuf)  # M = 1.5 * 2^23 * step
    nisa.tensor_scalar(dst=m_sb, data=st_sb.view(f32), op0=nl.multiply, operand0=1.5 * 2.0 ** 23)
    r_sb = nl.ndarray((n, hn, W), dtype=f32, buffer=nl.sbuf)  # |v| rounded to the grid
    nisa.tensor_tensor(dst=r_sb, data1=ab_sb.view(f32), data2=m_sb, op=nl.add)
    nisa.tensor_tensor(dst=r_sb, data1=r_sb, data2=m_sb, op=nl.subtract)
    code_sb = nl.ndarray((n, hn, W), dtype=u32, buffer=nl.sbuf)  # normal codes
    nisa.tensor_scalar(dst=code_sb, data=r_sb.view(u32), op0=nl.right_shift, operand0=20)
    nisa.tensor_scalar(dst=code_sb, data=code_sb, op0=nl.subtract, operand0=float(E4M3FN_BIAS_SHIFT), op1=nl.maximum,
                       operand1=0.0)
    sub_sb = nl.ndarray((n, hn, W), dtype=u32, buffer=nl.sbuf)  # subnormal codes
    nisa.tensor_scalar(dst=sub_sb, data=r_sb, op0=nl.multiply, operand0=2.0 ** 9)
    pred_sb = nl.ndarray((n, hn, W), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=pred_sb, data=r_sb, op0=nl.less, operand0=E4M3FN_MIN_NORMAL)
    nisa.tensor_copy_predicated(dst=code_sb, src=sub_sb, predicate=pred_sb)
    nisa.tensor_tensor(dst=pred_sb, data1=v_sb, data2=v_sb, op=nl.not_equal)  # NaN
    nisa.tensor_copy_predicated(dst=code_sb, src=E4M3FN_NAN, predicate=pred_sb)
    sign_sb = nl.ndarray((n, hn, W), dtype=u32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=sign_sb, data=v_sb.view(u32), op0=nl.right_shift, operand0=24, op1=nl.bitwise_and,
                       operand1=0x80)
    nisa.tensor_tensor(dst=code_sb, data1=code_sb, data2=sign_sb, op=nl.bitwise_or)
    nisa.tensor_copy(dst=q_sb, src=code_sb)


def _supports(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    for arg, w in (("key", key.shape[2]), ("value", value.shape[2])):
        if w > W_MAX:
            return f"{arg} head size {w} > {W_MAX}: a head's row is one tile's free dim"
    return None


@impl(spec, "neuron", supports=_supports)
def kv_cache_write_fp8(key: np.ndarray, value: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                       slot_mapping: np.ndarray, k_scale: np.ndarray, v_scale: np.ndarray) -> None:
    """Host side: rows as [T, Hkv, D], caches as [slots, Hkv * D] over their own memory (a strided cache or scale
    array is written through a contiguous copy, copied back; float8_e4m3fn before NeuronCore-v4 as its uint8
    bytes, a view), per-token scales as [slots, Hkv], a per-tensor scale as [1] float32, slots as int32 [T, 1]."""
    t = key.shape[0]
    if t == 0:
        return None
    fmt = k_cache.dtype.name
    kc, vc = _host.contiguous(k_cache), _host.contiguous(v_cache)
    token = per_token_scales(k_scale)
    if token:
        ks, vs = _host.contiguous(k_scale), _host.contiguous(v_scale)
        ks_arg, vs_arg = ks.reshape(-1, ks.shape[2]), vs.reshape(-1, vs.shape[2])
    else:
        ks = vs = None
        ks_arg = np.ascontiguousarray(k_scale, np.float32).reshape(1)
        vs_arg = np.ascontiguousarray(v_scale, np.float32).reshape(1)
    bits = fmt == "float8_e4m3fn" and target_version() < 4
    kc_rows = kc.reshape(kc.shape[0] * kc.shape[1], -1)
    vc_rows = vc.reshape(vc.shape[0] * vc.shape[1], -1)
    if bits:
        kc_rows, vc_rows = kc_rows.view(np.uint8), vc_rows.view(np.uint8)
    slots = np.ascontiguousarray(slot_mapping, dtype=np.int32).reshape(t, 1)
    _host.run(_kv_cache_write_fp8_kernel, _host.contiguous(key), _host.contiguous(value), slots, kc_rows, vc_rows,
              ks_arg, vs_arg, float(FP8_MAX[fmt]), getattr(nl, fmt), bits)
    for cache, dense in ((k_cache, kc), (v_cache, vc), (k_scale, ks), (v_scale, vs)):
        if dense is not None and dense is not cache:
            cache[...] = dense
    return None
