"""nki.isa: the instructions, `dst` first, validated against docs/nki.md section 2 before they run.

Every instruction counts itself on its engine in the current run's statistics (runtime.py). This module
holds DMA, copies, VectorE/GpSimd/ScalarE arithmetic and the predicated ops, and re-exports TensorE's
(isa_matmul.py) and the rest of the documented set (isa_more.py); all three take their operand checks
from operands.py.
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
from opport.backends.neuron.emulator.isa_matmul import nc_matmul, nc_transpose
from opport.backends.neuron.emulator.isa_more import (
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
from opport.backends.neuron.emulator.operands import (
    _accumulate,
    _arith_or_bitvec,
    _count,
    _dma_engine,
    _dma_modes,
    _dma_move,
    _dma_side,
    _engine,
    _fp32_in,
    _indirect_read,
    _reduce_axes,
    _same_count,
    _same_partitions,
    _tile,
    _vector_operand,
)
from opport.backends.neuron.emulator.ops import OPS, Op, resolve
from opport.backends.neuron.emulator.tensor import NkiTensor, psum, sbuf

__all__ = ["NkiValidationError", "constants", "dma_engine", "dge_mode", "engine", "matmul_perf_mode", "nc_version",
           "oob_mode", "reduce_cmd", "nc_matmul", "nc_transpose", "dma_compute", "local_gather", "max8",
           "nc_find_index8", "nc_match_replace8", "nc_matmul_mx", "nc_n_gather", "nc_stream_shuffle",
           "nonzero_with_count", "quantize_mx", "range_select", "tensor_tensor_scan"]


tensor_engine, vector_engine, scalar_engine = engine.tensor, engine.vector, engine.scalar
gpsimd_engine, unknown_engine = engine.gpsimd, engine.unknown


def get_nc_version() -> nc_version:
    return nc_version(runtime.current().target.version)


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


# -- empty operands ---------------------------------------------------------------------------------------------
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
