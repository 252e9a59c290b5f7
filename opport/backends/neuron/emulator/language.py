"""nki.language: dtypes, buffers, tile sizes, tensor creation, loops, and the high-level nl ops.

The high-level ops (nl.load/store/add/exp/matmul/sum, ...) allocate their result tile and run the
matching nisa instruction, so they validate and count exactly like hand-written nisa code.
"""

from __future__ import annotations

import contextlib
import math
import os

import numpy as np

from opport.backends.neuron.emulator import dtypes as _dt
from opport.backends.neuron.emulator import isa as _isa
from opport.backends.neuron.emulator import runtime as _rt
from opport.backends.neuron.emulator.dtypes import (  # noqa: F401  (re-exported NKI names)
    bfloat16,
    bool_,
    float4_e2m1fn_x4,
    float8_e4m3,
    float8_e4m3fn,
    float8_e4m3fn_x4,
    float8_e5m2,
    float8_e5m2_x4,
    float8_e8m0fnu,
    float16,
    float32,
    int8,
    int16,
    int32,
    tfloat32,
    uint8,
    uint16,
    uint32,
)
from opport.backends.neuron.emulator.errors import NkiValidationError, check
from opport.backends.neuron.emulator.operands import _fp32_in, _reduce_axes
from opport.backends.neuron.emulator.ops import OPS, Op, bypass  # noqa: F401
from opport.backends.neuron.emulator.target import PMAX, PSUM_BANK_BYTES, PSUM_BANKS
from opport.backends.neuron.emulator.tensor import (  # noqa: F401
    DynSlice,
    NkiTensor,
    allocate,
    ds,
    hbm,
    private_hbm,
    psum,
    sbuf,
    shared_hbm,
)


class NKIObject:
    """Base class of kernel dataclasses and configuration objects; `NKIObject(**fields)` sets the fields
    (the documented `__init__(self, **kwargs)`); dataclass subclasses bring their own __init__."""

    def __init__(self, **kwargs):
        for key, value in kwargs.items():
            setattr(self, key, value)


# -- tile sizes (per target) --------------------------------------------------------------------------------
class _TileSize:
    pmax = PMAX
    psum_fmax = psum_bank_fmax = PSUM_BANK_BYTES // 4
    psum_bank_fmax_bytes = PSUM_BANK_BYTES
    psum_num_banks = PSUM_BANKS
    gemm_stationary_fmax = PMAX
    bn_stats_fmax = 512
    psum_min_align = 4
    sbuf_min_align = 1

    @property
    def gemm_moving_fmax(self) -> int:
        return _rt.current().target.matmul_moving_fmax

    @property
    def total_available_sbuf_size(self) -> int:
        return _rt.current().target.sbuf_partition_bytes

    sbuf_fmax_bytes = total_available_sbuf_size

    @property
    def sbuf_size_bytes(self) -> int:
        return PMAX * self.sbuf_fmax_bytes

    @property
    def sbuf_fmax(self) -> int:
        return self.sbuf_fmax_bytes // 4


tile_size = _TileSize()

# -- creation -------------------------------------------------------------------------------------------------


def ndarray(shape, dtype, buffer=None, name="", address=None):
    """A new, uninitialised tensor (NaN-filled in the emulator so stray reads show); `address` =
    (partition_offset, free_offset in bytes) places an SBUF/PSUM tile explicitly (tensor._placed)."""
    return _track_shared(allocate(shape, dtype, buffer, name, address=address))


def _track_shared(t: NkiTensor) -> NkiTensor:
    """LNC programs see the same shared_hbm tensors: program 1 reuses program 0's, in allocation order."""
    if t.buffer is not shared_hbm:
        return t
    run = _rt.current()
    if run.shared_from is not None:
        i = len(run.shared_allocs)
        check(i < len(run.shared_from), "nl.ndarray", "LNC programs must allocate the same shared_hbm tensors")
        prev = run.shared_from[i]
        check(prev.shape == t.shape and prev.dtype == t.dtype, "nl.ndarray",
              "LNC programs must allocate the same shared_hbm tensors in the same order")
        t = prev
    run.shared_allocs.append(t)
    return t


def _filled(shape, dtype, buffer, name, value, op):
    t = _track_shared(allocate(shape, dtype, buffer, name, op=op))
    if t.onchip:
        _isa.memset(t, value)
    else:
        t.write(np.full(t.shape, value))
    return t


def zeros(shape, dtype, buffer=None, name=""):
    return _filled(shape, dtype, buffer, name, 0, "nl.zeros")


def ones(shape, dtype, buffer=None, name=""):
    return _filled(shape, dtype, buffer, name, 1, "nl.ones")


def full(shape, fill_value, dtype, buffer=None, name=""):
    return _filled(shape, dtype, buffer, name, fill_value, "nl.full")


def zeros_like(a, dtype=None, buffer=None, name=""):
    return zeros(a.shape, dtype or a.dtype, buffer or a.buffer, name)


def empty_like(a, dtype=None, buffer=None, name=""):
    return ndarray(a.shape, dtype or a.dtype, buffer or a.buffer, name)


def shared_constant(constant, dtype=None):
    """A shared_hbm tensor holding trace-time constant data: a NumPy array or the path of a `.npy` file."""
    if isinstance(constant, (str, os.PathLike)):
        check(str(constant).endswith(".npy"), "nl.shared_constant", f"a path must name a .npy file, got {constant!r}")
        constant = np.load(constant, allow_pickle=False)
    arr = np.asarray(constant)
    t = allocate(arr.shape, dtype or arr.dtype, shared_hbm, op="nl.shared_constant")
    t.write(arr if arr.dtype == t.dtype else arr.astype(np.float64) if _dt.is_float(t.dtype) else arr)
    return t


def shared_identity_matrix(n, dtype=uint8, dst=None):
    """An n x n identity in SBUF (documented since NKI 0.3; into `dst` when given), loaded by one DMA."""
    n, op = int(n), "nl.shared_identity_matrix"
    if dst is None:
        dst = allocate((n, n), dtype, sbuf, op=op)
    check(isinstance(dst, NkiTensor) and dst.buffer is sbuf and dst.shape == (n, n), op,
          f"dst must be an SBUF ({n}, {n}) tile, got {dst!r}")
    dst.write(np.eye(n))
    item = dst.itemsize  # the constant is embedded in the binary and DMAed in: count that transfer
    _rt.current().dma(n * n * item, n * n * item, 0)
    return dst


# -- program / control -----------------------------------------------------------------------------------------
def program_id(axis=0):
    check(axis == 0, "nl.program_id", f"the launch grid has one axis, got axis={axis}")
    return _rt.current().program_id


def num_programs(axes=0):
    return _rt.current().num_programs


def program_ndim():
    return _rt.current().grid_ndim


def affine_range(start, stop=None, step=1):
    """All NKI loops are unrolled at trace time (NKI >= 0.3): these are `range`."""
    return range(start, stop, step) if stop is not None else range(start)


sequential_range = static_range = affine_range


def fori_loop(lower, upper, body, init_val=None):
    val = init_val
    for i in range(lower, upper):
        val = body(i) if init_val is None else body(i, val)
    return val


def no_reorder():
    return contextlib.nullcontext()


def device_print(prefix, x):
    print(prefix, x.read() if isinstance(x, NkiTensor) else x)


# -- high-level ops ------------------------------------------------------------------------------------------
def load(src, dtype=None):
    """DMA an HBM tensor into a new SBUF tile of the same shape."""
    check(isinstance(src, NkiTensor) and not src.onchip, "nl.load", "src must be an HBM tensor")
    check(src.ndim >= 2, "nl.load", f"src {src.shape} needs a partition dim; reshape to (1, n) first")
    t = allocate(src.shape, dtype or src.dtype, sbuf, op="nl.load")
    _isa.dma_copy(t, src)
    return t


def store(dst, value):
    check(isinstance(value, NkiTensor) and value.buffer is sbuf, "nl.store",
          "value must be an SBUF tile (copy PSUM to SBUF first)")
    _isa.dma_copy(dst, value)


def _result(x, dtype):
    return allocate(x.shape, dtype or x.dtype, sbuf)


def _nl_binary(op: Op):
    def fn(x, y, dtype=None):
        if not isinstance(x, NkiTensor):
            check(op.name in ("add", "multiply", "maximum", "minimum", "equal", "not_equal"), f"nl.{op.name}",
                  "the first operand must be a tile")
            x, y = y, x
        out = _result(x, dtype)
        if isinstance(y, NkiTensor):
            check(y.shape == x.shape, f"nl.{op.name}", f"operands must have the same shape (no broadcasting in NKI "
                  f">= 0.3), got {x.shape} and {y.shape}; use nisa.tensor_scalar or .broadcast views")
            _isa.tensor_tensor(out, x, y, op)
        else:
            _isa.tensor_scalar(out, x, op, float(y))
        return out
    return fn


def _nl_unary(op: Op):
    def fn(x, dtype=None):
        out = _result(x, dtype)
        _isa.activation(out, op, x)
        return out
    return fn


for _op in OPS.values():
    _op.nl_impl = _nl_binary(_op) if _op.arity == 2 and _op.kind != "act" else _nl_unary(_op) \
        if _op.kind == "act" else None
    globals()[_op.name] = _op


def _nl_rsqrt(x, dtype=None):
    """nl.rsqrt runs on the GpSimd engine since NKI 0.5 (for precision) and so refuses PSUM inputs."""
    check(isinstance(x, NkiTensor) and x.buffer is not psum, "nl.rsqrt", "runs on the GpSimd engine since NKI 0.5 "
          "and no longer accepts PSUM inputs; use nisa.activation(op=nl.rsqrt) for PSUM data")
    out = _result(x, dtype)
    _isa.tensor_scalar(out, x, OPS["rsqrt"], None, engine=_isa.engine.gpsimd)
    return out


OPS["rsqrt"].nl_impl = _nl_rsqrt


def _nl_reduce(op_name, token_alias=None):
    def fn(x, axis, dtype=None, keepdims=False):
        axes = _reduce_axes(axis, x, f"nl.{op_name}")
        kept = tuple(1 if d in axes else n for d, n in enumerate(x.shape))
        shape = kept if keepdims else tuple(n for d, n in enumerate(x.shape) if d not in axes)
        out = allocate(shape if len(shape) >= 2 else (x.shape[0], 1), dtype or x.dtype, sbuf)
        _isa.tensor_reduce(out, OPS[token_alias or op_name], x, axes, keepdims=keepdims)
        return out
    fn._alu_alias = token_alias
    fn.__name__ = op_name
    return fn


sum = _nl_reduce("sum", "add")  # noqa: A001
max = _nl_reduce("max", "maximum")  # noqa: A001
min = _nl_reduce("min", "minimum")  # noqa: A001
prod = _nl_reduce("prod", "multiply")


def mean(x, axis, dtype=None, keepdims=False):
    """Sum in float32, then scale by 1/count (nl.mean computes in float32)."""
    s = sum(x, axis, dtype=float32, keepdims=keepdims)
    axes = _reduce_axes(axis, x, "nl.mean")
    out = allocate(s.shape, dtype or x.dtype, sbuf)
    _isa.tensor_scalar(out, s, OPS["multiply"], 1.0 / math.prod(x.shape[d] for d in axes))
    return out


def matmul(x, y, transpose_x=False):
    """x[K, M] (transpose_x=True), y[K, N] -> a new float32 PSUM tile [M, N]."""
    check(transpose_x, "nl.matmul", "transpose_x=False is not supported (NKI known issue); pass x as [K, M] with "
          "transpose_x=True")
    out = allocate((x.per_partition(), y.per_partition()), float32, psum, op="nl.matmul")
    _isa.nc_matmul(out, x, y)
    return out


def transpose(x, dtype=None):
    """x[P, F] -> a new PSUM tile [F, P] through the Tensor engine."""
    check(dtype is None or _dt.as_dtype(dtype) == x.dtype, "nl.transpose", "dtype must equal the input dtype")
    out = allocate((x.per_partition(), x.shape[0]), x.dtype, psum, op="nl.transpose")
    _isa.nc_transpose(out, x, engine=_isa.engine.tensor)
    return out


def where(condition, x, y, dtype=None):
    """condition is a float 1.0/0.0 tile; x, y tiles of its shape or scalars."""
    out = _result(condition, dtype or (x.dtype if isinstance(x, NkiTensor) else float32))
    c = _fp32_in(condition) != 0
    xv = _fp32_in(x) if isinstance(x, NkiTensor) else np.float32(x)
    yv = _fp32_in(y) if isinstance(y, NkiTensor) else np.float32(y)
    out.write(np.where(c, xv, yv))
    _rt.current().count("vector")
    return out


def broadcast_to(x, shape):
    """Same rank; size-1 dims repeat. The partition dim is repeated by a copy across partitions (GpSimd)."""
    shape = tuple(shape)
    check(len(shape) == x.ndim and all(a in (1, b) for a, b in zip(x.shape, shape)), "nl.broadcast_to",
          f"cannot broadcast {x.shape} to {shape}")
    out = allocate(shape, x.dtype, sbuf, op="nl.broadcast_to")
    out.write(np.broadcast_to(x.read(), shape))
    _rt.current().count("gpsimd" if x.shape[0] != shape[0] else "vector")
    return out


__all__ = [n for n in dir() if not n.startswith("_")] + ["NkiValidationError"]
