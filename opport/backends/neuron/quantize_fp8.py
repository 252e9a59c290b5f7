"""quantize_fp8 on NKI: one scaling group per partition, amax on VectorE, the quotient cast to fp8 on the write.

float8_e4m3fn exists on NeuronCore-v4 (trn3) only: on trn1/trn2 the compiler refuses F8E4M3FN operands
(neuronx-cc error NCC_EVRF051; Neuron's own `float8_e4m3` is another format, with inf and a 240 maximum), so
`supports()` declines it there with that reason. float8_e5m2 runs on every generation.
"""

from __future__ import annotations

import os

import numpy as np

from opport.arraymath import FP8_MAX, SCALE_FLOOR, grouped, scales_shape
from opport.backends.neuron import _host, nki_compat
from opport.backends.neuron._tiles import spans
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.dispatch import impl
from opport.ops.quantize_fp8 import quantize_fp8 as spec

FMAX = 4096  # free-dim chunk: the input, |x|, a predicate and the quotient <= 56 KiB per partition (fp32)


def target_version() -> int:
    """The NeuronCore version kernels are built for: the emulator's target, else the SDK's override variable
    (trn2, NeuronCore-v3, when unset: the generation the project's kernels are written for)."""
    if nki_compat.EMULATED:
        return nki_compat._emulator.current_target().version
    name = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2").lower()
    return {"trn1": 2, "inf2": 2, "gen2": 2, "trn3": 4, "gen4": 4}.get(name, 3)


def fp8_unsupported(dtype: str) -> str | None:
    if dtype == "float8_e4m3fn" and target_version() < 4:
        return ("float8_e4m3fn needs NeuronCore-v4 (trn3): trn1/trn2 have Neuron's float8_e4m3 instead "
                "(neuronx-cc NCC_EVRF051)")
    return None


@nki.jit
def _quantize_fp8_kernel(x_hbm, fmax, static_scale, fp8):
    """Quantise each row of x (one scaling group) to fp8.

    Dimensions:
        G: groups, on partitions (tiled by 128); L: elements per group, on the free dimension (chunks of FMAX).

    Args:
        x_hbm: [G, L] input in HBM, float32/float16/bfloat16.
        fmax: the fp8 format's largest finite value; static_scale: a float (every group) or None (dynamic);
        fp8: the nl dtype of q.

    Returns:
        q_hbm: [G, L] in fp8; s_hbm: [G, 1] float32 scales.

    Notes:
        amax skips NaN and +-inf: |x| (abs_max with 0) is copied under the predicate |x| < inf into a zeroed
        tile before the max-reduce. The scale is max(amax * (1 / fmax), 2^-126) and x / s is x * (1 / s):
        hardware has no divide (`nl.divide` is emulator-only), and the two float32 roundings (<= 2^-23
        relative each) stay inside q's tolerance (docs/numerics.md 3.7). The quotient is clamped to +-fmax in
        float32 (IEEE min/max keep NaN) and rounded to fp8 by the write's cast. Dynamic scaling reads x twice (the
        amax pass, then the quotient pass: tiles are not kept between them), static scaling once.

    Pseudocode:
        for each group: s = max(max(|x| finite) / fmax, 2^-126); q = fp8(max(min(x * (1/s), fmax), -fmax))
    """
    G, L = x_hbm.shape
    q_hbm = nl.ndarray((G, L), dtype=fp8, buffer=nl.shared_hbm)
    s_hbm = nl.ndarray((G, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    PMAX = nl.tile_size.pmax
    for r0, p in spans(G, PMAX):
        s_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        if static_scale is None:
            scale_of(s_sb, group_amax(x_hbm, r0, p), fmax)
        else:
            nisa.memset(dst=s_sb, value=static_scale)
        quantize_rows(q_hbm, x_hbm, r0, p, s_sb, fmax)
        nisa.dma_copy(dst=s_hbm[r0:r0 + p, 0:1], src=s_sb)
    return q_hbm, s_hbm


def group_amax(x_hbm, r0, p):
    """[p, 1] float32: the largest finite |x| of rows r0:r0+p, over chunks of FMAX."""
    L = x_hbm.shape[1]
    amax_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=amax_sb, value=0.0)
    for c0, f in spans(L, FMAX):
        x_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_sb, src=x_hbm[r0:r0 + p, c0:c0 + f])
        abs_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=abs_sb, data=x_sb, op0=nl.abs_max, operand0=0.0)
        fin_sb = nl.ndarray((p, f), dtype=nl.uint8, buffer=nl.sbuf)  # 1 where x is finite
        nisa.tensor_scalar(dst=fin_sb, data=abs_sb, op0=nl.less, operand0=float("inf"))
        a_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=a_sb, value=0.0)
        nisa.tensor_copy_predicated(dst=a_sb, src=abs_sb, predicate=fin_sb)
        cmax_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=cmax_sb, op=nl.maximum, data=a_sb, axis=1)
        nisa.tensor_tensor(dst=amax_sb, data1=amax_sb, data2=cmax_sb, op=nl.maximum)
    return amax_sb


def scale_of(s_sb, amax_sb, fmax):
    """s = max(amax * (1 / fmax), 2^-126), elementwise over a [p, 1] tile."""
    nisa.tensor_scalar(dst=s_sb, data=amax_sb, op0=nl.multiply, operand0=1.0 / fmax, op1=nl.maximum,
                       operand1=SCALE_FLOOR)


def quantize_rows(q_hbm, x_hbm, r0, p, s_sb, fmax):
    """q rows r0:r0+p = fp8(clamp(x * (1 / s), +-fmax)), s a [p, 1] tile of scales."""
    L = x_hbm.shape[1]
    r_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=r_sb, data=s_sb)
    for c0, f in spans(L, FMAX):
        x_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_sb, src=x_hbm[r0:r0 + p, c0:c0 + f])
        v_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=v_sb, data=x_sb, op0=nl.multiply, operand0=r_sb, op1=nl.minimum, operand1=fmax)
        q_sb = nl.ndarray((p, f), dtype=q_hbm.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=q_sb, data=v_sb, op0=nl.maximum, operand0=-fmax)
        nisa.dma_copy(dst=q_hbm[r0:r0 + p, c0:c0 + f], src=q_sb)


@nki.jit
def _quantize_fp8_tensor_kernel(x_hbm, fmax, fp8):
    """Quantise x with one dynamic scale for the whole tensor.

    Dimensions:
        R: rows, on partitions (tiled by 128); C: elements per row, on the free dimension (chunks of FMAX).

    Args:
        x_hbm: [R, C] input in HBM, float32/float16/bfloat16; fmax: the format's largest finite value;
        fp8: the nl dtype of q.

    Returns:
        q_hbm: [R, C] in fp8; s_hbm: [1, 1] float32 scale.

    Notes:
        Pass 1 takes each row tile's per-partition amax (`group_amax`), moves it onto one partition
        (`nc_transpose`, bit-exact) and reduces it there into a running [1, 1] maximum. The scale goes back to
        all 128 partitions by a K = 1 matmul against a ones row (1.0 * s in float32: exact). Pass 2 quantises
        every row tile with it (`quantize_rows`): x is read twice.

    Pseudocode:
        s = max(max(|x| finite) / fmax, 2^-126); q = fp8(max(min(x * (1/s), fmax), -fmax))
    """
    R, C = x_hbm.shape
    q_hbm = nl.ndarray((R, C), dtype=fp8, buffer=nl.shared_hbm)
    s_hbm = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    PMAX = nl.tile_size.pmax
    amax_sb = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=amax_sb, value=0.0)
    for r0, p in spans(R, PMAX):
        rows_sb = group_amax(x_hbm, r0, p)
        t_psum = nl.ndarray((1, p), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_transpose(dst=t_psum, data=rows_sb)
        row_sb = nl.ndarray((1, p), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=row_sb, src=t_psum)
        m_sb = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=m_sb, op=nl.maximum, data=row_sb, axis=1)
        nisa.tensor_tensor(dst=amax_sb, data1=amax_sb, data2=m_sb, op=nl.maximum)
    s1_sb = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    scale_of(s1_sb, amax_sb, fmax)
    nisa.dma_copy(dst=s_hbm[0:1, 0:1], src=s1_sb)
    ones_sb = nl.ndarray((1, PMAX), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones_sb, value=1.0)
    s_psum = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=s_psum, stationary=ones_sb, moving=s1_sb)
    s_sb = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=s_sb, src=s_psum)
    for r0, p in spans(R, PMAX):
        quantize_rows(q_hbm, x_hbm, r0, p, s_sb[0:p, 0:1], fmax)
    return q_hbm, s_hbm


def _supports(x, granularity, block, dtype, scale):
    return fp8_unsupported(dtype)


@impl(spec, "neuron", supports=_supports)
def quantize_fp8(x: np.ndarray, granularity: str, block: int, dtype: str, scale):
    """Host side: x as [groups, group elements] (rows for "tensor": one scale for all, static or from
    `_quantize_fp8_tensor_kernel`),
    contiguous (a copy only for a strided view); the kernel's [G, 1] scales reshaped to the declared shape."""
    sshape = scales_shape(x.shape, granularity, block)
    g = _host.contiguous(x).reshape(-1, x.shape[-1]) if granularity == "tensor" else None
    if g is None:
        gx = grouped(_host.contiguous(x), granularity, block)
        g = gx.reshape(-1, gx.shape[-1])
    if g.size == 0:
        q = np.empty(x.shape, _np_fp8(dtype))
        return q, np.full(sshape, SCALE_FLOOR if scale is None else scale, np.float32)
    if granularity == "tensor" and scale is None:
        q, s = _host.run(_quantize_fp8_tensor_kernel, g, FP8_MAX[dtype], getattr(nl, dtype))
        return _host.as_dtype(q, dtype, x.shape), np.asarray(s).reshape(sshape)
    q, s = _host.run(_quantize_fp8_kernel, g, FP8_MAX[dtype], None if scale is None else float(scale),
                     getattr(nl, dtype))
    q = _host.as_dtype(q, dtype, x.shape)
    s = np.asarray(s)
    return q, (np.full(sshape, scale, np.float32) if granularity == "tensor" else s.reshape(sshape))


def _np_fp8(dtype: str):
    from opport.dtypes import np_dtype

    return np_dtype(dtype)
