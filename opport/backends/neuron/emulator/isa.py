"""nki.isa: the instructions, `dst` first, validated against docs/nki.md section 2 before they run.

Every instruction counts itself on its engine in the current run's statistics (runtime.py).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from opport.backends.neuron.emulator import constants, runtime
from opport.backends.neuron.emulator import dtypes as dt
from opport.backends.neuron.emulator.constants import (
    dge_mode,
    dma_engine,
    engine,
    enum_arg,
    matmul_perf_mode,
    nc_version,
    oob_mode,
    reduce_cmd,
)
from opport.backends.neuron.emulator.errors import NkiValidationError, check, warn
from opport.backends.neuron.emulator.ops import ALU_UNARY, OPS, Op, resolve
from opport.backends.neuron.emulator.target import PMAX, PSUM_BANK_BYTES
from opport.backends.neuron.emulator.tensor import NkiTensor, psum, sbuf

__all__ = ["NkiValidationError", "constants", "dma_engine", "dge_mode", "engine", "matmul_perf_mode", "nc_version",
           "oob_mode", "reduce_cmd"]


tensor_engine, vector_engine, scalar_engine = engine.tensor, engine.vector, engine.scalar
gpsimd_engine, unknown_engine = engine.gpsimd, engine.unknown


def get_nc_version() -> nc_version:
    return nc_version(runtime.current().target.version)


# -- validation helpers -------------------------------------------------------------------------------------
def _tensor(t, op, role) -> NkiTensor:
    if not isinstance(t, NkiTensor):
        raise NkiValidationError(f"{op}: {role} must be an NKI tensor, got {type(t).__name__}")
    return t


def _tile(t, op, role, eng=None) -> NkiTensor:
    """An on-chip operand of a compute instruction, legal for engine `eng`."""
    _tensor(t, op, role)
    check(t.onchip, op, f"{role} must be in SBUF or PSUM, got {t.buffer} (only DMA instructions access HBM)")
    check(t.shape[0] <= PMAX, op, f"{role} partition dimension {t.shape[0]} exceeds maximum {PMAX}")
    if eng == "gpsimd":
        check(t.buffer is not psum, op, f"the GpSimd engine cannot access PSUM ({role} is in PSUM)")
    check(_free_dims(t) <= 4, op, f"{role} access pattern has {_free_dims(t)} free dims; instructions take at most 4")
    if eng in ("vector", "scalar"):
        limit = 65535 if t.buffer is sbuf else 4096
        check(t.per_partition() <= limit, op, f"{role} has {t.per_partition()} elements per partition; the {eng} engine "
              f"takes at most {limit} from {t.buffer.name.upper()}")
    _check_start_partition(t, op, role)
    return t


def _check_start_partition(t: NkiTensor, op, role):
    """Hardware start-partition rule (docs/nki.md 2.4): >64 partitions start at 0, 33-64 at 0/64, <=32 at 0/32/64/96."""
    n, start = t.shape[0], t.partition_start
    legal = start == 0 or (n <= 64 and start == 64) or (n <= 32 and start in (32, 96))
    if not legal:
        msg = (f"{role} covers {n} partitions starting at partition {start}; hardware needs start 0 (n > 64), "
               "0/64 (n <= 64) or 0/32/64/96 (n <= 32)")
        if runtime.strict_enabled():
            raise NkiValidationError(f"{op}: {msg}")
        warn(op, msg + " (an error under emulator.strict())")


def _free_dims(t: NkiTensor) -> int:
    """Free dims of the access pattern once size-1 dims are dropped and contiguous neighbours merged."""
    dims = [(n, s) for n, s in zip(t.shape[1:], t.strides[1:]) if n > 1]
    merged = 0
    for i, (_n, s) in enumerate(dims):
        if i == 0 or dims[i - 1][1] != s * dims[i][0]:
            merged += 1
    return merged


def _same_partitions(op, **tiles):
    ps = {k: v.shape[0] for k, v in tiles.items() if v is not None}
    check(len(set(ps.values())) <= 1, op, "operands must use the same number of partitions, got "
          + ", ".join(f"{k} {p}" for k, p in ps.items()))


def _same_count(op, **tiles):
    cs = {k: v.per_partition() for k, v in tiles.items() if v is not None}
    check(len(set(cs.values())) <= 1, op, "operands must have the same number of elements per partition, got "
          + ", ".join(f"{k} {c}" for k, c in cs.items()))


def _engine(value, op, default: str, allowed) -> str:
    name = enum_arg(value, engine, op, "engine").value
    name = default if name == "unknown" else name
    check(name in allowed, op, f"cannot run on the {name} engine (allowed: {', '.join(allowed)})")
    return name


def _vector_operand(x, data: NkiTensor, op, role, fp32=True):
    """A scalar constant, or a [P, 1] tile broadcast along the free dims; returns an fp32 array/number."""
    if isinstance(x, NkiTensor):
        _tile(x, op, role)
        check(x.shape[0] == data.shape[0] and x.per_partition() == 1, op,
              f"{role} must be a scalar or a ({data.shape[0]}, 1) tile, got {x.shape}")
        if fp32:
            check(x.dtype == dt.float32, op, f"{role} tile must be float32, got {x.dtype}")
        return dt.to_f32(x.read()).reshape((x.shape[0],) + (1,) * (data.ndim - 1))
    check(isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool), op,
          f"{role} must be a scalar constant or a tile, got {type(x).__name__}")
    return np.float32(x)


def _fp32_in(t: NkiTensor) -> np.ndarray:
    return dt.to_f32(t.read())


def _arith_or_bitvec(op: Op, name, role, tiles) -> bool:
    """True for bitvec ops (which need integer tiles); rejects activation functions as ALU ops."""
    check(op.kind in ("arith", "compare", "logical", "bitvec") or op.name in ALU_UNARY, name,
          f"{role}={op!r} is not an ALU operator")
    if op.kind == "bitvec":
        for t in tiles:
            check(dt.is_int(t.dtype), name, f"bitvec operator {op!r} needs integer tiles, got {t.dtype}")
        return True
    return False


def _count(eng: str):
    runtime.current().count(eng)


# -- DMA ---------------------------------------------------------------------------------------------------
def _dma_side(t, op, role):
    _tensor(t, op, role)
    check(t.buffer is not psum, op, f"{role} is in PSUM; DMA cannot access PSUM (evict with nisa.tensor_copy or "
          "nisa.activation first)")
    if t.onchip:
        check(t.shape[0] <= PMAX, op, f"{role} partition dimension {t.shape[0]} exceeds maximum {PMAX}")


def _dma_move(op, dst: NkiTensor, src: NkiTensor, values: np.ndarray, skip_mask=None):
    n = dst.size
    if skip_mask is None:
        dst.write(values if src.dtype == dst.dtype else dt.to_f32(values))
    else:  # oob_mode.skip: rows whose indirect index is out of bounds are not transferred
        old = np.array(dst.read())
        new = dt.cast(values if src.dtype == dst.dtype else dt.to_f32(values), dst.dtype).reshape(old.shape)
        dst.write(np.where(skip_mask.reshape(old.shape), old, new))
    runtime.current().dma(n * dst.itemsize, 0 if src.onchip else n * src.itemsize, 0 if dst.onchip else n * dst.itemsize)


def _indirect_read(src: NkiTensor, mode, op):
    """Read a (possibly indirect) DMA source; returns values and a mask of skipped elements."""
    if src.indirection is None:
        return src.read(), None
    idx = src._flat_index()
    bad = (idx < 0) | (idx >= src._st.data.size)
    if bad.any():
        check(mode is oob_mode.skip, op, f"indirect DMA index out of bounds ({int(bad.sum())} elements); "
              "pass oob_mode=nisa.oob_mode.skip to skip them")
    return src._st.data[np.where(bad, 0, idx)], (bad if bad.any() else None)


def _dma_modes(op, oob, dge):
    return enum_arg(oob, oob_mode, op, "oob_mode"), enum_arg(dge, dge_mode, op, "dge_mode")


def _dma_engine(op, eng, dge):
    """`engine` picks the HWDGE trigger engine: sync or scalar, with dge_mode=hwdge only."""
    eng = enum_arg(eng, engine, op, "engine")
    if eng is not engine.unknown:
        check(dge is dge_mode.hwdge and eng in (engine.sync, engine.scalar), op,
              f"engine={eng} is only valid with dge_mode=hwdge, as nisa.engine.sync or nisa.engine.scalar")


def dma_copy(dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown, engine=engine.unknown,
             name=None):
    op = "dma_copy"
    oob_mode, dge_mode = _dma_modes(op, oob_mode, dge_mode)
    _dma_engine(op, engine, dge_mode)
    _dma_side(dst, op, "dst")
    _dma_side(src, op, "src")
    check(dst.size == src.size, op, f"element counts differ: dst {dst.shape} has {dst.size}, src {src.shape} has {src.size}")
    if dge_mode is constants.dge_mode.hwdge:
        check(runtime.current().target.version >= 3, op, "hardware DGE needs NeuronCore-v3 or newer")
        check(dst.dtype == src.dtype, op, f"dge_mode=hwdge cannot convert dtypes ({src.dtype} -> {dst.dtype})")
    if dst.indirection is not None:  # scatter
        idx = dst._flat_index()
        bad = (idx < 0) | (idx >= dst._st.data.size)
        check(not bad.any() or oob_mode is constants.oob_mode.skip, op, "indirect DMA destination index out of bounds")
        vals = dt.cast(src.read() if src.dtype == dst.dtype else _fp32_in(src), dst.dtype)
        dst._st.data[idx[~bad]] = np.broadcast_to(vals.reshape(dst.shape), dst.shape)[~bad]
        runtime.current().dma(dst.size * dst.itemsize, 0 if src.onchip else src.size * src.itemsize, dst.size * dst.itemsize)
        return
    values, skipped = _indirect_read(src, oob_mode, op)
    _dma_move(op, dst, src, values, skipped)


def dma_transpose(dst, src, axes=None, priority=None, dge_mode=dge_mode.unknown, oob_mode=oob_mode.error, name=None):
    op = "dma_transpose"
    oob_mode, dge_mode = _dma_modes(op, oob_mode, dge_mode)
    check(runtime.current().target.version >= 3, op, "DMA transpose needs NeuronCore-v3 or newer")
    _dma_side(dst, op, "dst")
    _dma_side(src, op, "src")
    check(dst.buffer is sbuf, op, f"dst must be in SBUF, got {dst.buffer}")
    check(src.dtype == dst.dtype, op, f"src.dtype {src.dtype} must equal dst.dtype {dst.dtype}")
    check(src.itemsize == 2, op, f"DMA transpose moves 2-byte dtypes, got {src.dtype}")
    default = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}
    axes = tuple(axes) if axes is not None else default.get(src.ndim)
    check(axes in default.values() and len(axes) == src.ndim, op, f"axes must be (1, 0), (2, 1, 0) or (3, 1, 2, 0) "
          f"matching a {src.ndim}-D src, got {axes}")
    values, skipped = _indirect_read(src, oob_mode, op)
    out = np.transpose(values, axes)
    check(out.shape == dst.shape, op, f"dst shape {dst.shape} must be the transposed src shape {out.shape}")
    _dma_move(op, dst, src, out, None if skipped is None else np.transpose(skipped, axes))


# -- copies and constants --------------------------------------------------------------------------------------
def tensor_copy(dst, src, engine=engine.unknown, name=None):
    op = "tensor_copy"
    eng = _engine(engine, op, "vector", ("vector", "scalar", "gpsimd"))
    if eng == "scalar":
        check(runtime.current().target.version >= 3, op, "ScalarE tensor_copy is not available on NeuronCore-v2; "
              "use nisa.activation(op=nl.copy)")
    _tile(dst, op, "dst", eng)
    _tile(src, op, "src", eng)
    _same_partitions(op, dst=dst, src=src)
    _same_count(op, dst=dst, src=src)
    values = src.read() if src.dtype == dst.dtype and eng != "scalar" else _fp32_in(src)
    dst.write(values)
    _count(eng)


def memset(dst, value, engine=engine.unknown, name=None):
    op = "memset"
    eng = _engine(engine, op, "vector", ("vector", "gpsimd"))
    _tile(dst, op, "dst", eng)
    if dt.is_packed(dst.dtype):  # the instruction fills one u32 with no notion of the packed lanes (NKI 0.3 guide)
        check(value == 0, op, f"x4 packed types ({dt.name(dst.dtype)}) only take value=0, got {value!r}")
        dst.write(np.zeros(dst.shape, dst.dtype))
        _count(eng)
        return
    if dt.is_int(dst.dtype):
        check(float(value) == int(value), op, f"value {value!r} does not match the integer dtype {dst.dtype}")
    dst.write(np.full(dst.shape, value, np.float64 if dt.is_float(dst.dtype) else np.int64))
    _count(eng)


def _affine(pattern, offset, channel_multiplier, partitions, count, op):
    pattern = [tuple(int(v) for v in p) for p in pattern]
    check(1 <= len(pattern) <= 4 and all(len(p) == 2 for p in pattern), op,
          f"pattern must be 1 to 4 [step, num] pairs, got {pattern}")
    nums = [n for _, n in pattern]
    check(math.prod(nums) == count, op, f"pattern covers {math.prod(nums)} elements but dst has {count} per partition")
    value = np.full(tuple(nums), int(offset), np.int64)
    for d, (step, n) in enumerate(pattern):
        shape = [1] * len(pattern)
        shape[d] = n
        value = value + step * np.arange(n, dtype=np.int64).reshape(shape)
    chan = int(channel_multiplier) * np.arange(partitions, dtype=np.int64)
    return (chan.reshape(-1, 1) + value.reshape(1, -1)).astype(np.int32)  # int32 math, as the engine does


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    op = "iota"
    _tile(dst, op, "dst", "gpsimd")
    check(dst.buffer is sbuf, op, "dst must be in SBUF")
    v = _affine(pattern, offset, channel_multiplier, dst.shape[0], dst.per_partition(), op)
    dst.write(v.astype(np.float64) if dt.is_float(dst.dtype) else v)
    _count("gpsimd")


def affine_select(dst, pattern, channel_multiplier, on_true_tile, on_false_value, cmp_op=OPS["equal"], offset=0,
                  name=None):
    op = "affine_select"
    _tile(dst, op, "dst", "gpsimd")
    _tile(on_true_tile, op, "on_true_tile", "gpsimd")
    check(dst.buffer is sbuf and on_true_tile.buffer is sbuf, op, "dst and on_true_tile must be in SBUF")
    _same_partitions(op, dst=dst, on_true_tile=on_true_tile)
    _same_count(op, dst=dst, on_true_tile=on_true_tile)
    cmp = resolve(cmp_op, op)
    check(cmp.kind == "compare", op, f"cmp_op must be a comparison such as nl.greater_equal, got {cmp!r}")
    check(isinstance(on_false_value, (int, float, np.floating, np.integer)), op, "on_false_value must be a float32 scalar")
    aff = _affine(pattern, offset, channel_multiplier, dst.shape[0], dst.per_partition(), op)
    pred = cmp.apply(aff.astype(np.float64), 0.0) != 0
    src = on_true_tile.read().reshape(aff.shape)
    if on_true_tile.dtype != dst.dtype:
        src = dt.to_f32(src)
    out = np.where(pred, dt.to_f32(src) if src.dtype != dst.dtype else src, np.float32(on_false_value))
    dst.write(out)
    _count("gpsimd")


# -- VectorE / GpSimd arithmetic --------------------------------------------------------------------------------
def tensor_tensor(dst, data1, data2, op, engine=engine.unknown, name=None):
    name_ = "tensor_tensor"
    o = resolve(op, name_)
    all_int32 = all(t.dtype in (dt.int32, dt.uint32) for t in (dst, data1, data2) if isinstance(t, NkiTensor))
    any_psum = any(isinstance(t, NkiTensor) and t.buffer is psum for t in (dst, data1, data2))
    default = "gpsimd" if o.name == "power" or (all_int32 and not any_psum) else "vector"
    eng = _engine(engine, name_, default, ("vector", "gpsimd"))
    if o.name == "power":
        check(eng == "gpsimd", name_, "nl.power runs on the GpSimd engine")
    for role, t in (("dst", dst), ("data1", data1), ("data2", data2)):
        _tile(t, name_, role, eng)
    check(not (data1.buffer is psum and data2.buffer is psum), name_, "data1 and data2 cannot both be in PSUM")
    _same_partitions(name_, dst=dst, data1=data1, data2=data2)
    _same_count(name_, dst=dst, data1=data1, data2=data2)
    check(o.arity == 2 and o.kind != "act", name_, f"op={o!r} is not a binary ALU operator")
    if o.name == "divide":
        warn(name_, "nl.divide is not supported on hardware; multiply by nisa.reciprocal instead")
    if _arith_or_bitvec(o, name_, "op", (dst, data1, data2)):
        a, b = data1.read(), data2.read().reshape(data1.shape)
    else:
        a, b = _fp32_in(data1), _fp32_in(data2).reshape(data1.shape)
    dst.write(o.apply(a, b))
    _count(eng)


def _ts_apply(o: Op, x, operand, reverse, bitvec):
    if o.arity == 1 or o.kind == "act":
        return o.apply(x)
    if bitvec:
        operand = np.asarray(operand).astype(x.dtype)
    return o.apply(operand, x) if reverse else o.apply(x, operand)


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=engine.unknown, name=None):
    name_ = "tensor_scalar"
    o0 = resolve(op0, name_)
    o1 = None if op1 is None else resolve(op1, name_)
    eng = _engine(engine, name_, "vector", ("vector", "scalar", "gpsimd"))
    _tile(dst, name_, "dst", eng)
    _tile(data, name_, "data", eng)
    _same_partitions(name_, dst=dst, data=data)
    _same_count(name_, dst=dst, data=data)
    bit0 = _arith_or_bitvec(o0, name_, "op0", (dst, data))
    if o1 is None:
        check(operand1 is None, name_, "operand1 must be None when op1 is None")
    else:
        check(_arith_or_bitvec(o1, name_, "op1", (dst, data)) == bit0, name_,
              "op0 and op1 must both be bitvec or both arithmetic operators")
    if eng == "scalar":
        combo = (o0.name, None if o1 is None else o1.name)
        check(combo in (("multiply", "add"), ("multiply", None), ("add", None)), name_,
              f"the Scalar engine supports only multiply+add, multiply or add, got {combo}")
    if eng == "gpsimd":
        check(o0.name == "rsqrt" and o1 is None, name_, "the GpSimd engine runs tensor_scalar only for nl.rsqrt")
    if bit0:
        check(eng == "vector", name_, "bitvec tensor_scalar runs on the Vector engine")
    x = data.read() if bit0 else _fp32_in(data)
    ops = [(o0, operand0, reverse0, "operand0")] + ([] if o1 is None else [(o1, operand1, reverse1, "operand1")])
    for o, operand, rev, role in ops:
        if o.arity == 1 or o.kind == "act":
            check(operand is None or (not isinstance(operand, NkiTensor) and operand == 0), name_,
                  f"{role} must be None or 0 for the unary operator {o!r}")
            x = o.apply(x)
        elif bit0:
            _vector_operand(operand, data, name_, role, fp32=False)  # shape checks
            val = operand.read().reshape((data.shape[0],) + (1,) * (data.ndim - 1)) \
                if isinstance(operand, NkiTensor) else operand
            x = _ts_apply(o, x, val, rev, True)
        else:
            x = _ts_apply(o, x, _vector_operand(operand, data, name_, role), rev, False)
    dst.write(x)
    _count(eng)


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None):
    name_ = "scalar_tensor_tensor"
    o0, o1 = resolve(op0, name_), resolve(op1, name_)
    for role, t in (("dst", dst), ("data", data), ("operand1", operand1)):
        _tile(t, name_, role, "vector")
    check(not (data.buffer is psum and operand1.buffer is psum), name_, "data and operand1 cannot both be in PSUM")
    _same_partitions(name_, dst=dst, data=data, operand1=operand1)
    _same_count(name_, dst=dst, data=data, operand1=operand1)
    for role, o in (("op0", o0), ("op1", o1)):
        check(not _arith_or_bitvec(o, name_, role, ()) and o.arity == 2, name_, f"{role} must be a binary arithmetic operator")
    s = _vector_operand(operand0, data, name_, "operand0", fp32=False)
    x = _ts_apply(o0, _fp32_in(data), s, reverse0, False)
    y = _fp32_in(operand1).reshape(data.shape)
    dst.write(o1.apply(y, x) if reverse1 else o1.apply(x, y))
    _count("vector")


def _reduce_axes(axis, data: NkiTensor, op) -> tuple:
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    axes = tuple(sorted(int(a) + (data.ndim if a < 0 else 0) for a in axes))
    check(axes and 0 not in axes, op, f"cannot reduce the partition axis 0 (axis={axis}); transpose or use a matmul")
    check(axes == tuple(range(axes[0], data.ndim)), op, f"axis={axis} must be the last contiguous free dims of a "
          f"{data.ndim}-D tile, ending at the final dim")
    return axes


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    name_ = "tensor_reduce"
    o = resolve(op, name_)
    _tile(dst, name_, "dst", "vector")
    _tile(data, name_, "data", "vector")
    _same_partitions(name_, dst=dst, data=data)
    check(o.reducible, name_, f"{o!r} is not a reduction operator (add, subtract, multiply, maximum, minimum, "
          "logical/bitwise and/or/xor)")
    bit = _arith_or_bitvec(o, name_, "op", (dst, data))
    check(not (negate and bit), name_, "negate applies to arithmetic reductions only")
    axes = _reduce_axes(axis, data, name_)
    kept = math.prod(n for d, n in enumerate(data.shape[1:], 1) if d not in axes)
    check(dst.per_partition() == kept, name_, f"dst must hold {kept} elements per partition after reducing axes {axes} "
          f"of {data.shape}, got {dst.shape}")
    r = o.reduce(data.read() if bit else _fp32_in(data), axes)
    dst.write(-r if negate else r)
    _count("vector")


def tensor_partition_reduce(dst, op, data, name=None):
    name_ = "tensor_partition_reduce"
    o = resolve(op, name_)
    _tile(dst, name_, "dst", "gpsimd")
    _tile(data, name_, "data", "gpsimd")
    check(o.name in ("add", "maximum", "bitwise_or", "bitwise_and"), name_, f"op must be add, maximum, bitwise_or or "
          f"bitwise_and, got {o!r}")
    check(dst.shape[0] == 1 and dst.per_partition() == data.per_partition(), name_,
          f"dst must be (1, {data.per_partition()}) elements, got {dst.shape}")
    bit = o.kind == "bitvec"
    dst.write(o.reduce(data.read() if bit else _fp32_in(data), 0))
    _count("gpsimd")


def reciprocal(dst, data, name=None):
    name_ = "reciprocal"
    _tile(dst, name_, "dst", "vector")
    _tile(data, name_, "data", "vector")
    _same_partitions(name_, dst=dst, data=data)
    _same_count(name_, dst=dst, data=data)
    dst.write(OPS["reciprocal"].apply(_fp32_in(data)))
    _count("vector")


def bn_stats(dst, data, name=None):
    name_ = "bn_stats"
    _tile(dst, name_, "dst", "vector")
    _tile(data, name_, "data", "vector")
    _same_partitions(name_, dst=dst, data=data)
    n = data.per_partition()
    check(n <= 512, name_, f"data has {n} elements per partition; bn_stats takes at most 512 (nl.tile_size.bn_stats_fmax)")
    check(dst.per_partition() == 6, name_, f"dst must hold 6 elements per partition, got {dst.shape}")
    x = _fp32_in(data).reshape(data.shape[0], n).astype(np.float64)
    out = []
    for part in (x[:, 0::2], x[:, 1::2]):
        c = part.shape[1]
        mean = part.mean(axis=1) if c else np.zeros(x.shape[0])
        m2 = ((part - mean[:, None]) ** 2).sum(axis=1) if c else np.zeros(x.shape[0])
        out += [np.full(x.shape[0], c, np.float64), mean, m2]
    dst.write(np.stack(out, axis=1).astype(np.float32))
    _count("vector")


def bn_aggr(dst, data, name=None):
    name_ = "bn_aggr"
    _tile(dst, name_, "dst", "vector")
    _tile(data, name_, "data", "vector")
    _same_partitions(name_, dst=dst, data=data)
    n = data.per_partition()
    check(n % 3 == 0, name_, f"data must hold (count, mean, variance*count) triples, got {n} elements per partition")
    check(dst.per_partition() == 2, name_, f"dst must hold 2 elements per partition (mean, variance), got {dst.shape}")
    t = _fp32_in(data).reshape(data.shape[0], n // 3, 3).astype(np.float64)
    count, mean, m2 = t[..., 0], t[..., 1], t[..., 2]
    total = count.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        mu = (count * mean).sum(axis=1) / total
        var = (m2 + count * (mean - mu[:, None]) ** 2).sum(axis=1) / total
    dst.write(np.stack([mu, var], axis=1).astype(np.float32))
    _count("vector")


# -- ScalarE ----------------------------------------------------------------------------------------------------
def _accumulate(regs, cmd, partial, p, op_name, init=None):
    """Apply a reduce_cmd to engine accumulator registers (lanes 0..p-1)."""
    if cmd in (reduce_cmd.reset, reduce_cmd.reset_reduce):
        regs[:p] = {"maximum": -np.inf, "minimum": np.inf, "multiply": 1.0}.get(op_name, 0.0)
    if cmd is reduce_cmd.load_reduce:
        regs[:p] = init
    if cmd in (reduce_cmd.reduce, reduce_cmd.reset_reduce, reduce_cmd.load_reduce) and partial is not None:
        regs[:p] = OPS[op_name].apply(regs[:p], partial)


def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=reduce_cmd.idle,
               engine=engine.scalar, name=None):
    if enum_arg(engine, constants.engine, "activation", "engine") is not constants.engine.scalar:
        # SDK 2.33 documents GpSimd activations on NeuronCore-v4; their function set is not modelled here
        raise NotImplementedError(f"activation: engine={engine} (GpSimd activation, NeuronCore-v4) is not emulated; "
                                  "use the default Scalar engine")
    _activation("activation", dst, op, data, bias, scale, reduce_op, reduce_res, reduce_cmd)


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None):
    _activation("activation_reduce", dst, op, data, bias, scale, reduce_op, reduce_res, reduce_cmd.reset_reduce)


def _activation(name_, dst, op, data, bias, scale, reduce_op, reduce_res, cmd):
    cmd = enum_arg(cmd, reduce_cmd, name_, "reduce_cmd")
    o = resolve(op, name_)
    check(o.kind == "act", name_, f"op={o!r} is not an activation function (nl.exp, nl.copy, nl.gelu, ...)")
    _tile(dst, name_, "dst", "scalar")
    _tile(data, name_, "data", "scalar")
    _same_partitions(name_, dst=dst, data=data)
    _same_count(name_, dst=dst, data=data)
    run = runtime.current()
    s = _vector_operand(scale, data, name_, "scale")
    if bias is None:
        b = np.float32(0.0)
    else:
        if not isinstance(bias, NkiTensor):
            check(run.target.version >= 3, name_, "a scalar bias needs NeuronCore-v3 or newer; pass a [P, 1] tile")
        b = _vector_operand(bias, data, name_, "bias", fp32=False)
    x = _fp32_in(data)
    y = o.apply((x * s).astype(np.float32) + b)
    p = data.shape[0]
    partial = None
    if reduce_op is not None:
        r = resolve(reduce_op, name_)
        allowed = ("add",) if run.target.version == 2 or name_ == "activation" else ("add", "maximum", "minimum")
        check(r.name in allowed, name_, f"reduce_op must be {' or '.join('nl.' + a for a in allowed)}, got {r!r}")
        partial = r.reduce(y.reshape(p, -1), 1)
        if cmd is reduce_cmd.idle:
            warn(name_, "reduce_op has no effect with reduce_cmd=idle; pass reduce_cmd=nisa.reduce_cmd.reset_reduce")
        _accumulate(run.act_regs, cmd, partial, p, r.name)
    elif cmd is not reduce_cmd.idle:
        _accumulate(run.act_regs, cmd, None, p, "add")
    dst.write(y)
    run.count("scalar")
    if reduce_res is not None:
        _tile(reduce_res, name_, "reduce_res")
        check(reduce_res.shape[0] == p and reduce_res.per_partition() == 1, name_,
              f"reduce_res must be a ({p}, 1) tile, got {reduce_res.shape}")
        reduce_res.write(run.act_regs[:p].reshape(reduce_res.shape))
        run.count("scalar")  # reading the registers out is a second instruction


def tensor_scalar_reduce(dst, data, op0, operand0, reduce_op, reduce_res, reverse0=False,
                         reduce_cmd=reduce_cmd.reset_reduce, reduce_init=None, name=None):
    name_ = "tensor_scalar_reduce"
    enum_arg(reduce_cmd, constants.reduce_cmd, name_, "reduce_cmd")
    o0, r = resolve(op0, name_), resolve(reduce_op, name_)
    _tile(dst, name_, "dst", "vector")
    _tile(data, name_, "data", "vector")
    _tile(reduce_res, name_, "reduce_res", "vector")
    _same_partitions(name_, dst=dst, data=data, reduce_res=reduce_res)
    _same_count(name_, dst=dst, data=data)
    check(not _arith_or_bitvec(o0, name_, "op0", ()), name_, "op0 must be an arithmetic operator")
    check(r.name in ("add", "multiply", "maximum", "minimum"), name_, f"reduce_op must be add, multiply, max or min, got {r!r}")
    check(reduce_res.per_partition() == 1, name_, f"reduce_res must be a ({data.shape[0]}, 1) tile, got {reduce_res.shape}")
    check((reduce_init is not None) == (reduce_cmd is constants.reduce_cmd.load_reduce), name_,
          "reduce_init is given exactly when reduce_cmd is load_reduce")
    val = _vector_operand(operand0, data, name_, "operand0")
    y = _ts_apply(o0, _fp32_in(data), val, reverse0, False)
    p = data.shape[0]
    run = runtime.current()
    init = None if reduce_init is None else _vector_operand(reduce_init, data, name_, "reduce_init").reshape(-1)[:p]
    _accumulate(run.vec_regs, reduce_cmd, r.reduce(y.reshape(p, -1), 1), p, r.name, init)
    dst.write(y)
    reduce_res.write(run.vec_regs[:p].reshape(reduce_res.shape))
    run.count("vector")


def exponential(dst, src, max_value=0.0, reduce_res=None, reduce_cmd=reduce_cmd.idle, reduce_init=0.0, name=None):
    name_ = "exponential"
    enum_arg(reduce_cmd, constants.reduce_cmd, name_, "reduce_cmd")
    run = runtime.current()
    check(run.target.version >= 4, name_, "nisa.exponential is available on NeuronCore-v4 (trn3) only")
    _tile(dst, name_, "dst", "vector")
    _tile(src, name_, "src", "vector")
    _same_partitions(name_, dst=dst, src=src)
    _same_count(name_, dst=dst, src=src)
    m = _vector_operand(max_value, src, name_, "max_value")
    y = OPS["exp"].apply(_fp32_in(src) - m)
    p = src.shape[0]
    _accumulate(run.vec_regs, reduce_cmd, y.reshape(p, -1).sum(axis=1, dtype=np.float32), p, "add", reduce_init)
    dst.write(y)
    if reduce_res is not None:
        _tile(reduce_res, name_, "reduce_res", "vector")
        check(reduce_res.shape[0] == p and reduce_res.per_partition() == 1, name_, "reduce_res must be a (P, 1) tile")
        reduce_res.write(run.vec_regs[:p].reshape(reduce_res.shape))
    run.count("vector")


# -- TensorE ----------------------------------------------------------------------------------------------------
def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False, is_transpose=False,
              accumulate=None, tile_position=(), tile_size=(), perf_mode=matmul_perf_mode.none, name=None):
    """dst[M, N] (PSUM) = stationary[K, M].T @ moving[K, N], accumulating in float32."""
    op = "nc_matmul"
    run = runtime.current()
    _tile(stationary, op, "stationary")
    _tile(moving, op, "moving")
    _tile(dst, op, "dst")
    check(stationary.buffer is sbuf and moving.buffer is sbuf, op, "stationary and moving must be in SBUF")
    check(dst.buffer is psum, op, f"dst must be in PSUM, got {dst.buffer}")
    double = enum_arg(perf_mode, matmul_perf_mode, op, "perf_mode") is matmul_perf_mode.double_row
    rows_per_k = 2 if double else 1  # double_row: K split as [partition, 2] in both operands
    if double:
        check(run.target.version >= 3, op, "perf_mode=double_row needs NeuronCore-v3 or newer")
        check(not is_transpose, op, "perf_mode=double_row cannot transpose")
        for role, t in (("stationary", stationary), ("moving", moving)):
            check(t.dtype in (dt.float8_e4m3, dt.float8_e5m2, dt.float8_e4m3fn), op, f"double_row takes fp8 {role}")
            check(t.ndim == 3 and t.shape[1] == 2, op, f"double_row {role} must be [K, 2, *], got {t.shape}")
    k = stationary.shape[0]
    m, n = stationary.per_partition() // rows_per_k, moving.per_partition() // rows_per_k
    check(moving.shape[0] == k, op, f"stationary and moving must share the contraction (partition) size K, got "
          f"{k} and {moving.shape[0]}")
    rows = _tiling(tile_position, tile_size, op)
    check(k <= rows, op, f"contraction size K={k} exceeds {rows}")
    check(m <= PMAX, op, f"stationary free size M={m} exceeds 128 (nl.tile_size.gemm_stationary_fmax)")
    check(dst.shape[0] == m and dst.per_partition() == n, op, f"dst must be [M={m}, N={n}], got {dst.shape}")
    _matmul_dtypes(stationary, moving, op, run)
    if is_transpose:
        check(dst.dtype == stationary.dtype, op, f"a transpose keeps the dtype: dst {dst.dtype}, stationary {stationary.dtype}")
    else:
        allowed = (dt.float32,) if run.target.version < 4 else (dt.float32, dt.bfloat16)
        check(dst.dtype in allowed, op, f"dst must be {' or '.join(map(str, allowed))} on {run.target.name}, got {dst.dtype}")
    limit = run.target.matmul_moving_fmax * (2 if dst.dtype == dt.bfloat16 else 1)
    check(n <= limit, op, f"moving free size N={n} exceeds {limit} (one PSUM bank of float32 on {run.target.name})")
    _check_bank(dst, op, run)
    if is_transpose:
        result = _exact_transpose_product(stationary, moving, op)
    else:
        a = dt.to_f32(stationary.read()).reshape(k * rows_per_k, m)
        b = dt.to_f32(moving.read()).reshape(k * rows_per_k, n)
        with np.errstate(all="ignore"):
            result = np.matmul(a.T, b)
    _accumulate_psum(dst, result, accumulate, op)
    run.count("tensor")


def _matmul_dtypes(stationary, moving, op, run):
    """Input dtype rules of nc_matmul (docs/nki.md 2.6; the nc_matmul docstring's "Data types")."""
    for role, t in (("stationary", stationary), ("moving", moving)):
        if dt.is_packed(t.dtype):
            raise NotImplementedError(f"{op}: {role} is {dt.name(t.dtype)}; packed x4 MX types feed nisa.nc_matmul_mx "
                                      "(NeuronCore-v4), which the opport emulator does not emulate")
        check(t.dtype in dt.MATMUL_INPUTS, op, f"{role} dtype {t.dtype} is not a matmul input type (fp8, bf16, fp16, fp32)")
        check(t.dtype != dt.float8_e4m3fn or run.target.version >= 4, op,
              f"{role} is float8_e4m3fn (OCP FP8), a matmul input only from NeuronCore-v4 (trn3); {run.target.name} "
              "takes float8_e4m3 / float8_e5m2")
    kinds = {stationary.dtype, moving.dtype}
    check(not {dt.float8_e4m3, dt.float8_e4m3fn} <= kinds, op,
          "legacy float8_e4m3 and OCP float8_e4m3fn cannot be mixed in one matmul")
    fp32 = [t.dtype == dt.float32 for t in (stationary, moving)]
    check(all(fp32) or not any(fp32), op, f"float32 may only pair with float32, got {stationary.dtype} x {moving.dtype}")


def _tiling(tile_position, tile_size, op) -> int:
    if not tile_position and not tile_size:
        return PMAX
    check(bool(tile_position) and bool(tile_size), op, "tile_position and tile_size must be set together")
    row, col = (int(v) for v in tile_size)
    check(row in (32, 64, 128) and col in (32, 64, 128), op, f"tile_size values must be 32, 64 or 128, got {tile_size}")
    if runtime.current().target.version == 2:
        check(row in (64, 128) and col in (64, 128), op, "NeuronCore-v2 tiles the PE array in halves only")
    r0, c0 = (int(v) for v in tile_position)
    check(r0 % row == 0 and c0 % col == 0 and r0 + row <= PMAX and c0 + col <= PMAX, op,
          f"tile_position {tile_position} must be a multiple of tile_size {tile_size} inside the 128x128 array")
    return row


def _check_bank(dst: NkiTensor, op, run):
    """v2/v3: a matmul writes within one 2 KiB PSUM bank (emulator-allocated tiles start on a bank boundary,
    placed ones where their address says)."""
    if run.target.version >= 4:
        return
    item = dst.itemsize
    first = dst.free_byte_offset
    last = first + sum((n - 1) * s for n, s in zip(dst.shape[1:], dst.strides[1:])) * item + item - 1
    check(first // PSUM_BANK_BYTES == last // PSUM_BANK_BYTES, op,
          f"dst spans bytes {first}..{last} of each partition, crossing a 2 KiB PSUM bank")


def _exact_transpose_product(stationary, moving, op):
    """is_transpose: moving is a permutation (identity) matrix, so the product is a bit-exact column gather."""
    k, m = stationary.shape[0], stationary.per_partition()
    mv = dt.to_f32(moving.read()).reshape(k, -1)
    check(np.all((mv == 0) | (mv == 1)) and np.all(mv.sum(axis=0) == 1), op,
          "is_transpose=True needs a moving operand with a single 1 per column (an identity matrix)")
    a = stationary.read().reshape(k, m)
    return a.T[:, np.argmax(mv, axis=0)]


def _accumulate_psum(dst: NkiTensor, result, accumulate, op):
    result = np.asarray(result).reshape(dst.shape)
    written = dst.matmul_written().copy()
    if accumulate is False:
        add = np.zeros(dst.shape, bool)
    elif accumulate is True:
        if not written.all():
            warn(op, "accumulate=True onto PSUM that no matmul wrote is undefined behaviour on hardware")
        add = np.ones(dst.shape, bool)
    else:
        add = written
    old = dt.to_f32(dst.read())
    out = np.where(add, old + dt.to_f32(result), result) if add.any() else result
    dst.write(out, from_matmul=True)


def nc_transpose(dst, data, engine=engine.unknown, name=None):
    """dst[F, P] = data[P, F] (free dims flattened), bit-exact."""
    op = "nc_transpose"
    _tile(dst, op, "dst")
    _tile(data, op, "data")
    p, f = data.shape[0], data.per_partition()
    check(dst.shape[0] == f and dst.per_partition() == p, op, f"dst must be [{f}, {p}] for data {data.shape}, got {dst.shape}")
    check(dst.dtype == data.dtype, op, f"dst dtype {dst.dtype} must equal data dtype {data.dtype}")
    tensor_ok = data.buffer is sbuf and dst.buffer is psum
    default = "tensor" if tensor_ok and (p > 32 or f > 32) else ("vector" if p <= 32 and f <= 32 else "tensor")
    eng = _engine(engine, op, default, ("tensor", "vector"))
    if eng == "tensor":
        check(tensor_ok, op, "the Tensor engine transposes from SBUF into PSUM")
        check(p <= 128 and f <= 128, op, f"Tensor engine transpose takes at most [128, 128], got [{p}, {f}]")
    else:
        check(p <= 32 and f <= 32, op, f"Vector engine transpose takes at most [32, 32], got [{p}, {f}]")
    dst.write(data.read().reshape(p, f).T.copy(), from_matmul=eng == "tensor")
    runtime.current().count(eng)


# -- predicated VectorE ops ----------------------------------------------------------------------------------------
_PRED_TYPES = (dt.uint8, dt.uint16, dt.uint32)


def tensor_copy_predicated(dst, src, predicate, reverse_pred=False, name=None):
    """dst = src where predicate != 0 (== 0 with reverse_pred); dst keeps its values elsewhere."""
    op = "tensor_copy_predicated"
    _tile(dst, op, "dst", "vector")
    _tile(predicate, op, "predicate", "vector")
    check(predicate.dtype in _PRED_TYPES, op, f"predicate must be uint8, uint16 or uint32, got {predicate.dtype}")
    if isinstance(src, NkiTensor):
        _tile(src, op, "src", "vector")
        check(not (src.buffer is psum and predicate.buffer is psum), op, "src and predicate cannot both be in PSUM")
        check(src.dtype == dst.dtype, op, f"src dtype {src.dtype} must equal dst dtype {dst.dtype}")
        _same_partitions(op, dst=dst, src=src, predicate=predicate)
        _same_count(op, dst=dst, src=src, predicate=predicate)
        values = src.read().reshape(dst.shape)
    else:
        check(isinstance(src, (int, float, np.integer, np.floating)), op, "src must be a tile or a scalar")
        _same_partitions(op, dst=dst, predicate=predicate)
        _same_count(op, dst=dst, predicate=predicate)
        values = np.full(dst.shape, src, np.float64 if dt.is_float(dst.dtype) else np.int64)
    take = (predicate.read().reshape(dst.shape) != 0) ^ bool(reverse_pred)
    old = np.array(dst.read())
    dst.write(np.where(take, dt.cast(values, dst.dtype), old))
    _count("vector")


def select_reduce(dst, predicate, on_true, on_false, reduce_res=None, reduce_cmd=reduce_cmd.idle,
                  reduce_op=OPS["maximum"], reverse_pred=False, name=None):
    """dst = where(predicate, on_true, on_false); optionally max-reduce dst into the VectorE accumulators."""
    op = "select_reduce"
    enum_arg(reduce_cmd, constants.reduce_cmd, op, "reduce_cmd")
    for role, t in (("dst", dst), ("predicate", predicate), ("on_true", on_true)):
        _tile(t, op, role, "vector")
    check(not (on_true.buffer is psum and predicate.buffer is psum), op, "on_true and predicate cannot both be in PSUM")
    _same_partitions(op, dst=dst, predicate=predicate, on_true=on_true)
    _same_count(op, dst=dst, predicate=predicate, on_true=on_true)
    check(predicate.dtype in (dt.int8, dt.uint8, dt.int16, dt.uint16), op,
          f"predicate must be int8, uint8, int16 or uint16, got {predicate.dtype}")
    check(on_true.dtype not in (dt.int32, dt.uint32), op, f"on_true cannot be {on_true.dtype}")
    check(resolve(reduce_op, op).name == "maximum", op, "reduce_op must be nl.maximum")
    if isinstance(on_false, NkiTensor):
        f = _vector_operand(on_false, on_true, op, "on_false", fp32=False)
    else:
        f = _vector_operand(on_false, on_true, op, "on_false")
    take = (predicate.read().reshape(on_true.shape) != 0) ^ bool(reverse_pred)
    y = np.where(take, _fp32_in(on_true), f).astype(np.float32)
    run = runtime.current()
    p = on_true.shape[0]
    _accumulate(run.vec_regs, reduce_cmd, y.reshape(p, -1).max(axis=1), p, "maximum")
    dst.write(y)
    if reduce_res is not None:
        _tile(reduce_res, op, "reduce_res", "vector")
        check(reduce_res.shape[0] == p and reduce_res.per_partition() == 1, op, f"reduce_res must be a ({p}, 1) tile")
        check(dt.is_float(reduce_res.dtype), op, "reduce_res must have a float dtype")
        if reduce_cmd is constants.reduce_cmd.idle:
            warn(op, "reduce_res with reduce_cmd=idle reads stale accumulators; pass reduce_cmd=nisa.reduce_cmd.reset_reduce")
        reduce_res.write(run.vec_regs[:p].reshape(reduce_res.shape))
    run.count("vector")


# -- the rest of the documented instruction set, and empty operands ------------------------------------------------
from opport.backends.neuron.emulator.isa_more import (  # noqa: E402  (isa_more builds on the helpers above)
    dma_compute,
    local_gather,
    max8,
    nc_find_index8,
    nc_match_replace8,
    nc_matmul_mx,
    nc_n_gather,
    nc_stream_shuffle,
    nonzero_with_count,
    quantize_mx,
    range_select,
    tensor_tensor_scan,
)

INSTRUCTIONS = (
    "dma_copy", "dma_transpose", "dma_compute", "tensor_copy", "memset", "iota", "affine_select", "tensor_tensor",
    "tensor_scalar", "scalar_tensor_tensor", "tensor_reduce", "tensor_partition_reduce", "reciprocal", "bn_stats",
    "bn_aggr", "activation", "activation_reduce", "tensor_scalar_reduce", "exponential", "nc_matmul", "nc_transpose",
    "tensor_copy_predicated", "select_reduce", "tensor_tensor_scan", "nc_stream_shuffle", "max8", "nc_find_index8",
    "nc_match_replace8", "nonzero_with_count", "range_select", "nc_n_gather", "local_gather",
)


def _is_empty(value) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_is_empty(v) for v in value)
    return isinstance(value, NkiTensor) and value.size == 0


def _skips_empty(fn):
    """An instruction given an empty view (from nl.ds(start, 0)) moves nothing: the emulator issues nothing for it."""
    @functools.wraps(fn)
    def instruction(*args, **kwargs):
        if any(_is_empty(v) for v in (*args, *kwargs.values())):
            return None
        return fn(*args, **kwargs)
    return instruction


for _name in INSTRUCTIONS:
    globals()[_name] = _skips_empty(globals()[_name])
__all__ += ["dma_compute", "local_gather", "max8", "nc_find_index8", "nc_match_replace8", "nc_matmul_mx", "nc_n_gather",
            "nc_stream_shuffle", "nonzero_with_count", "quantize_mx", "range_select", "tensor_tensor_scan"]
