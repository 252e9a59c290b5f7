"""nki.isa instructions beyond the subset opport's own kernels use (scan, shuffle, top-8, gathers, DMA compute).

Each follows its NKI API docstring (current API: `dst` first, partition dim first) and validates the
documented constraints before it runs; isa.py re-exports them. Semantics notes that the docstrings leave
open are marked [U] here and in docs/nki.md section 7.
"""

from __future__ import annotations

import numpy as np

from opport.backends.neuron.emulator import constants, runtime
from opport.backends.neuron.emulator import dtypes as dt
from opport.backends.neuron.emulator.constants import enum_arg, reduce_cmd
from opport.backends.neuron.emulator.errors import check, warn
from opport.backends.neuron.emulator.operands import (
    _accumulate,
    _arith_or_bitvec,
    _count,
    _dma_side,
    _fp32_in,
    _indirect_read,
    _same_count,
    _same_partitions,
    _tile,
    _vector_operand,
)
from opport.backends.neuron.emulator.ops import OPS, resolve
from opport.backends.neuron.emulator.tensor import NkiTensor, psum

FP32_MIN = float(np.finfo(np.float32).min)  # range_select's only legal on_false_value
_INDEX_DTYPES = (dt.uint16, dt.uint32)
_COMPARES = ("equal", "less", "less_equal", "greater", "greater_equal")


def _rows(t: NkiTensor, values=None) -> np.ndarray:
    """[partitions, elements per partition] float32 view of a tile's values."""
    return (_fp32_in(t) if values is None else values).reshape(t.shape[0], -1)


def _per_partition(value, p: int) -> np.ndarray:
    """A scalar or [P, 1] operand (already float32) as one value per partition."""
    return np.zeros(p, np.float32) + np.asarray(value, np.float32).reshape(-1)


# -- VectorE ------------------------------------------------------------------------------------------------------
def tensor_tensor_scan(dst, data0, data1, initial, op0, op1, reverse0=False, reverse1=False, name=None):
    """Per partition: r[i] = op1(op0(data0[i], r[i-1]), data1[i]) with r[-1] = initial, in float32."""
    op = "tensor_tensor_scan"
    o0, o1 = resolve(op0, op), resolve(op1, op)
    for role, t in (("dst", dst), ("data0", data0), ("data1", data1)):
        _tile(t, op, role, "vector")
    check(not (data0.buffer is psum and data1.buffer is psum), op, "data0 and data1 cannot both be in PSUM")
    _same_partitions(op, dst=dst, data0=data0, data1=data1)
    _same_count(op, dst=dst, data0=data0, data1=data1)
    for role, o in (("op0", o0), ("op1", o1)):
        check(not _arith_or_bitvec(o, op, role, ()) and o.arity == 2, op, f"{role} must be a binary arithmetic operator")
    p = data0.shape[0]
    a, b = _rows(data0), _rows(data1)
    state = _per_partition(_vector_operand(initial, data0, op, "initial", fp32=False), p)
    out = np.empty_like(a)
    for i in range(a.shape[1]):  # [U] the carried state stays float32 (not rounded to dst.dtype) between steps
        t = o0.apply(state, a[:, i]) if reverse0 else o0.apply(a[:, i], state)
        state = out[:, i] = o1.apply(b[:, i], t) if reverse1 else o1.apply(t, b[:, i])
    dst.write(out.reshape(dst.shape))
    _count("vector")


def nc_stream_shuffle(dst, src, shuffle_mask, name=None):
    """Within each 32-partition quadrant, dst partition i copies src partition shuffle_mask[i] (255: unchanged)."""
    op = "nc_stream_shuffle"
    _tile(dst, op, "dst", "vector")
    _tile(src, op, "src", "vector")
    check(dst.dtype == src.dtype, op, f"dst dtype {dst.dtype} must equal src dtype {src.dtype}")
    _same_count(op, dst=dst, src=src)
    mask = list(shuffle_mask)
    check(len(mask) == 32 and all(isinstance(m, (int, np.integer)) and (0 <= m < 32 or m == 255) for m in mask), op,
          f"shuffle_mask must be 32 ints in 0..31 or 255, got {mask}")
    _shuffle_start_partitions(op, dst, src)
    values = np.array(src.read()).reshape(src.shape[0], -1)  # a copy: in-place shuffles read the old src
    out = np.array(dst.read()).reshape(dst.shape[0], -1)
    for q in range(0, dst.shape[0], 32):
        for i, m in enumerate(mask):
            if m == 255 or q + i >= dst.shape[0]:
                continue
            check(q + m < src.shape[0], op, f"shuffle_mask[{i}]={m} reads src partition {q + m}; src has "
                                            f"{src.shape[0]}")
            out[q + i] = values[q + m]
    dst.write(out.reshape(dst.shape))
    _count("vector")


def _shuffle_start_partitions(op, dst, src):
    active = -(-max(src.shape[0], dst.shape[0]) // 32) * 32
    legal = {32: (0, 32, 64, 96), 64: (0, 64)}.get(active, (0,))
    for role, t in (("src", src), ("dst", dst)):
        check(t.partition_start in legal, op, f"{role} starts at partition {t.partition_start}; with {active} active "
                                              f"partitions it must start at {' or '.join(map(str, legal))}")


def _top8_operands(op, dst, data, dims):
    _tile(dst, op, "dst", "vector")
    _tile(data, op, "data", "vector")
    _same_partitions(op, dst=dst, data=data)
    n = data.per_partition()
    check(data.ndim <= dims, op, f"data may be up to {dims}-D, got shape {data.shape}")
    check(8 <= n <= 16384, op, f"data must have 8 to 16384 elements per partition, got {n}")
    check(dst.ndim == 2 and dst.shape[1] == 8, op, f"dst must be a 2-D [P, 8] tile, got {dst.shape}")


def max8(dst, src, name=None):
    """The 8 largest values per partition in descending order, compared in float32."""
    op = "max8"
    _top8_operands(op, dst, src, 3)
    x = _rows(src)
    dst.write(np.sort(x, axis=1)[:, ::-1][:, :8])  # [U] NaN sorts as the largest value (NaN-propagating max)
    _count("vector")


def _vals(op, vals, p):
    _tile(vals, op, "vals", "vector")
    check(vals.shape[0] == p and vals.per_partition() == 8 and vals.ndim <= 3, op,
          f"vals must hold 8 elements in each of the {p} partitions (up to 3-D), got {vals.shape}")
    return _rows(vals)


def nc_find_index8(dst, data, vals, name=None):
    """Index of the first occurrence of each of the 8 vals per partition; duplicates take ascending positions;
    a value not present gives the all-ones sentinel (SDK 2.32 docstring)."""
    op = "nc_find_index8"
    _top8_operands(op, dst, data, 3)
    check(dst.dtype in _INDEX_DTYPES, op, f"dst must be uint16 or uint32, got {dst.dtype}")
    x, v = _rows(data), _vals(op, vals, data.shape[0])
    out = np.full(v.shape, np.iinfo(dst.dtype).max, np.int64)
    for r in range(x.shape[0]):
        used: set = set()
        for j in range(8):
            pos = next((int(i) for i in np.flatnonzero(x[r] == v[r, j]) if i not in used), None)
            if pos is not None:
                used.add(pos)
                out[r, j] = pos
    dst.write(out.astype(dst.dtype))
    _count("vector")


def nc_match_replace8(dst, data, vals, imm, dst_idx=None, name=None):
    """dst = data with the first occurrence of each of the 8 vals replaced by imm; vals are taken in reverse order
    (7..0), so duplicate vals pair with descending positions (SDK 2.32 docstring); dst_idx gets the positions."""
    op = "nc_match_replace8"
    for role, t in (("dst", dst), ("data", data)):
        _tile(t, op, role, "vector")
    _same_partitions(op, dst=dst, data=data)
    _same_count(op, dst=dst, data=data)
    check(data.ndim <= 5 and data.per_partition() <= 16384, op, f"data may be up to 5-D with at most 16384 elements "
                                                                f"per partition, got {data.shape}")
    check(isinstance(imm, (int, float, np.integer, np.floating)), op, f"imm must be a float constant, got {imm!r}")
    x, v = np.array(_rows(data)), _vals(op, vals, data.shape[0])
    idx = np.full(v.shape, -1, np.int64)
    for r in range(x.shape[0]):
        for j in range(7, -1, -1):
            hits = np.flatnonzero(x[r] == v[r, j])
            if hits.size:
                idx[r, j], x[r, hits[0]] = hits[0], np.float32(imm)
    if (idx < 0).any():
        warn(op, "a value in vals is not in data: undefined behaviour on hardware (dst_idx gets all ones here)")
    dst.write(x.reshape(dst.shape))
    _count("vector")
    if dst_idx is not None:
        _match_indices(op, dst_idx, idx, data.shape[0])


def _match_indices(op, dst_idx, idx, p):
    _tile(dst_idx, op, "dst_idx", "vector")
    check(dst_idx.shape[0] == p and dst_idx.per_partition() == 8, op, f"dst_idx must hold 8 elements in each of the "
                                                                      f"{p} partitions, got {dst_idx.shape}")
    # [U] the docstring names no dtype for dst_idx; nc_find_index8's uint16 / uint32 are assumed
    check(dst_idx.dtype in _INDEX_DTYPES, op, f"dst_idx must be uint16 or uint32, got {dst_idx.dtype}")
    dst_idx.write(np.where(idx < 0, np.iinfo(dst_idx.dtype).max, idx).astype(dst_idx.dtype).reshape(dst_idx.shape))


def range_select(dst, on_true_tile, comp_op0, comp_op1, bound0, bound1, reduce_cmd=reduce_cmd.reset_reduce,
                 reduce_res=None, reduce_op=OPS["maximum"], range_start=0, on_false_value=FP32_MIN, name=None):
    """Keep on_true where comp_op0(i, bound0) and comp_op1(i, bound1) for i = range_start + free index, else
    on_false_value (FP32_MIN only); max-reduce into the Vector engine accumulators."""
    op = "range_select"
    cmd = enum_arg(reduce_cmd, constants.reduce_cmd, op, "reduce_cmd")
    check(cmd is not constants.reduce_cmd.load_reduce, op, "reduce_cmd=load_reduce needs an initial value, which "
                                                          "range_select does not take")
    run = runtime.current()
    check(run.target.version >= 3, op, "nisa.range_select needs NeuronCore-v3 or newer")
    _range_select_operands(op, dst, on_true_tile, comp_op0, comp_op1, reduce_op, on_false_value)
    p, n = on_true_tile.shape[0], on_true_tile.per_partition()
    check(isinstance(range_start, (int, np.integer)) and 0 <= range_start and range_start + n <= 2 ** 24, op,
          f"range_start must be a compile-time int with range_start + {n} <= 2^24, got {range_start!r}")
    i = np.float32(range_start) + np.arange(n, dtype=np.float32)
    b0, b1 = (_bound(op, b, on_true_tile, role) for role, b in (("bound0", bound0), ("bound1", bound1)))
    keep = (resolve(comp_op0, op).apply(i, b0) != 0) & (resolve(comp_op1, op).apply(i, b1) != 0)
    y = np.where(keep, _rows(on_true_tile), np.float32(on_false_value)).astype(np.float32)
    _accumulate(run.vec_regs, cmd, y.max(axis=1), p, "maximum")
    dst.write(y.reshape(dst.shape))
    if reduce_res is not None:
        _tile(reduce_res, op, "reduce_res", "vector")
        check(reduce_res.shape[0] == p and reduce_res.per_partition() == 1, op, f"reduce_res must be a ({p}, 1) tile")
        reduce_res.write(run.vec_regs[:p].reshape(reduce_res.shape))
    run.count("vector")


def _range_select_operands(op, dst, on_true, comp_op0, comp_op1, reduce_op, on_false_value):
    _tile(dst, op, "dst", "vector")
    _tile(on_true, op, "on_true_tile", "vector")
    _same_partitions(op, dst=dst, on_true_tile=on_true)
    _same_count(op, dst=dst, on_true_tile=on_true)
    check(dt.is_float(on_true.dtype), op, f"on_true_tile must have a float dtype, got {on_true.dtype}")
    for role, c in (("comp_op0", comp_op0), ("comp_op1", comp_op1)):
        check(resolve(c, op).name in _COMPARES, op, f"{role} must be one of nl.{', nl.'.join(_COMPARES)}, got {c!r}")
    check(resolve(reduce_op, op).name == "maximum", op, "reduce_op must be nl.maximum")
    check(on_false_value == FP32_MIN, op, f"on_false_value must be FP32_MIN ({FP32_MIN}), a hardware constraint; got "
                                          f"{on_false_value!r}")


def _bound(op, bound, data, role) -> np.ndarray:
    check(isinstance(bound, NkiTensor), op, f"{role} must be a ({data.shape[0]}, 1) float32 tile, got {bound!r}")
    return _vector_operand(bound, data, op, role).reshape(-1, 1)


# -- GpSimdE ------------------------------------------------------------------------------------------------------
def nonzero_with_count(dst, src, index_offset=0, padding_val=-1, name=None):
    """On partitions 0, 16, ..., 112 only: positions of nonzero src elements (+ index_offset), padding_val, count."""
    op = "nonzero_with_count"
    check(runtime.current().target.version >= 3, op, "nisa.nonzero_with_count needs NeuronCore-v3 or newer")
    _tile(dst, op, "dst", "gpsimd")
    _tile(src, op, "src", "gpsimd")
    _same_partitions(op, dst=dst, src=src)
    check(src.dtype in (dt.float32, dt.int32), op, f"src must be float32 or int32, got {src.dtype}")
    check(dst.dtype == dt.int32, op, f"dst must be int32, got {dst.dtype}")
    n = src.per_partition()
    check(dst.per_partition() == n + 1, op, f"dst must hold one more element per partition than src ({n + 1}), got "
                                            f"{dst.per_partition()}")
    for role, v in (("index_offset", index_offset), ("padding_val", padding_val)):
        check(isinstance(v, (int, np.integer)) and -2 ** 31 <= v < 2 ** 31, op, f"{role} must be an int32, got {v!r}")
    x = np.asarray(src.read()).reshape(src.shape[0], n)
    out = np.array(dst.read()).reshape(dst.shape[0], n + 1)
    for r in range(x.shape[0]):
        if (src.partition_start + r) % 16:  # each GpSimd core reads and writes its first partition only
            continue
        nz = np.flatnonzero(x[r] != 0)
        out[r] = padding_val
        out[r, :nz.size], out[r, n] = nz + index_offset, nz.size
    dst.write(out.reshape(dst.shape))
    _count("gpsimd")


def nc_n_gather(dst, data, indices, name=None):
    """Per partition, dst[p, k] = data[p, indices[p, k]] over the flattened free dims (uint32 indices)."""
    op = "nc_n_gather"
    for role, t in (("dst", dst), ("data", data), ("indices", indices)):
        _tile(t, op, role, "gpsimd")
    _same_partitions(op, dst=dst, data=data, indices=indices)
    _same_count(op, dst=dst, indices=indices)
    check(dst.dtype == data.dtype, op, f"dst dtype {dst.dtype} must equal data dtype {data.dtype}")
    check(indices.dtype == dt.uint32, op, f"indices must be uint32, got {indices.dtype}")
    n = data.per_partition()
    idx = np.asarray(indices.read()).reshape(indices.shape[0], -1).astype(np.int64)
    check(idx.max() < n, op, f"indices must lie in [0, {n}), got {int(idx.max())}")
    values = np.asarray(data.read()).reshape(data.shape[0], n)
    dst.write(np.take_along_axis(values, idx, axis=1).reshape(dst.shape))
    _count("gpsimd")


def local_gather(dst, src_buffer, index, num_elem_per_idx=1, num_valid_indices=None, name=None):
    """Each GpSimd core (16 partitions) flattens its index slice partition-first and, in every one of its
    partitions, gathers num_elem_per_idx elements starting at each index (the docstring's NumPy equivalent)."""
    op = "local_gather"
    for role, t in (("dst", dst), ("src_buffer", src_buffer), ("index", index)):
        _tile(t, op, role, "gpsimd")
    num_valid = _local_gather_shapes(op, dst, src_buffer, index, num_elem_per_idx, num_valid_indices)
    p, n = src_buffer.shape[0], src_buffer.per_partition()
    idx = np.asarray(index.read()).reshape(p, -1).astype(np.int64)
    values = np.asarray(src_buffer.read()).reshape(p, n)
    out = np.empty((p, num_valid * num_elem_per_idx), values.dtype)
    for c in range(0, p, 16):
        starts = idx[c:c + 16].flatten(order="F")[:num_valid]
        pos = (starts[:, None] + np.arange(num_elem_per_idx)).reshape(-1)
        check(pos.max() < n, op, f"index {int(starts.max())} + {num_elem_per_idx} runs past the {n} elements of a "
                                 "partition (undefined behaviour on hardware)")
        out[c:c + 16] = values[c:c + 16, pos]
    dst.write(out.reshape(dst.shape))
    _count("gpsimd")


def _local_gather_shapes(op, dst, src, index, num_elem, num_valid) -> int:
    p = src.shape[0]
    check(index.shape[0] == p and p % 16 == 0, op, f"src_buffer and index must share a partition count that is a "
                                                   f"multiple of 16, got {p} and {index.shape[0]}")
    # derived from the wiring the docstring describes: each core owns 16 partitions from a multiple of 16
    check(src.partition_start % 16 == 0 and index.partition_start % 16 == 0, op,
          "src_buffer and index must start on a GpSimd core boundary (a multiple of 16 partitions)")
    check(index.dtype == dt.uint16, op, f"index must be uint16, got {index.dtype}")
    check(dst.dtype == src.dtype, op, f"dst dtype {dst.dtype} must equal src_buffer dtype {src.dtype} (no casting)")
    check(num_elem in (1, 2, 4, 8, 16, 32), op, f"num_elem_per_idx must be 1, 2, 4, 8, 16 or 32, got {num_elem}")
    per_core = 16 * index.per_partition()
    num_valid = per_core if num_valid is None else int(num_valid)
    check(0 < num_valid <= min(per_core, 4096), op, f"num_valid_indices must be 1..{min(per_core, 4096)} (the "
                                                    f"core's {per_core} indices, at most 4096), got {num_valid}")
    check(dst.shape[0] == p and dst.per_partition() == num_valid * num_elem, op,
          f"dst must be ({p}, {num_valid * num_elem} elements per partition), got {dst.shape}")
    return num_valid


# -- DMA ------------------------------------------------------------------------------------------------------
def dma_compute(dst, srcs, reduce_op, scales=None, unique_indices=True, oob_mode=constants.oob_mode.error, name=None):
    """dst = srcs[0] + srcs[1] + ... in float32 inside the DMA engines (add and unit scales only, as documented);
    a vector_offset on dst or one source makes it a scatter / gather read-modify-write of exactly two sources."""
    op = "dma_compute"
    oob = enum_arg(oob_mode, constants.oob_mode, op, "oob_mode")
    srcs = _dma_compute_operands(op, dst, srcs, reduce_op, scales, unique_indices)
    total, skipped = np.zeros(dst.shape, np.float32), np.zeros(dst.shape, bool)
    for s in srcs:
        values, bad = _indirect_read(s, oob, op)
        total += dt.to_f32(values).reshape(dst.shape)
        skipped |= False if bad is None else bad.reshape(dst.shape)
    _dma_compute_write(op, dst, total, skipped, oob)
    hbm_read = sum(s.size * s.itemsize for s in srcs if not s.onchip)
    runtime.current().dma(dst.size * dst.itemsize, hbm_read, 0 if dst.onchip else dst.size * dst.itemsize)


def _dma_compute_operands(op, dst, srcs, reduce_op, scales, unique_indices) -> list:
    check(isinstance(srcs, (list, tuple)) and 1 <= len(srcs) <= 16, op, "srcs must be a list of 1 to 16 tensors")
    srcs = list(srcs)
    _dma_side(dst, op, "dst")
    for i, s in enumerate(srcs):
        _dma_side(s, op, f"srcs[{i}]")
        check(s.size == dst.size, op, f"srcs[{i}] has {s.size} elements, dst has {dst.size}")
    check(resolve(reduce_op, op).name == "add", op, f"reduce_op must be nl.add (the only one supported), got {reduce_op!r}")
    check(scales is None or (len(scales) == len(srcs) and all(float(x) == 1.0 for x in scales)), op,
          "scales must be None or one 1.0 per source (other scales are not supported)")
    views = [dst, *srcs]
    check(all(t.indirection is None or t.indirection[0] == "vector" for t in views), op,
          "dst and srcs need compile-time addresses; only vector_offset indirection is allowed")
    if any(t.indirection is not None for t in views):
        check(len(srcs) == 2, op, "read-modify-write with vector_offset takes exactly 2 sources")
        check(unique_indices is True, op, "unique_indices must be True with vector_offset (non-unique not supported)")
    return srcs


def _dma_compute_write(op, dst, total, skipped, oob):
    if dst.indirection is None:
        old = np.array(dst.read())
        dst.write(np.where(skipped, old, dt.cast(total, dst.dtype).reshape(old.shape)))
        return
    idx = dst._flat_index()
    bad = (idx < 0) | (idx >= dst._st.data.size)
    check(not bad.any() or oob is constants.oob_mode.skip, op, "indirect destination index out of bounds")
    keep = ~(bad | skipped)
    check(np.unique(idx[keep]).size == int(keep.sum()), op, "unique_indices=True but the scatter indices repeat")
    dst._st.data[idx[keep]] = dt.cast(total, dst.dtype)[keep]


# -- trn3 MX instructions (documented, not emulated) ------------------------------------------------------------
def nc_matmul_mx(dst, stationary, moving, stationary_scale, moving_scale, tile_position=None, tile_size=None,
                 accumulate=None, name=None):
    raise NotImplementedError("nc_matmul_mx: MXFP8/MXFP4 matmul with x4 packed types (NeuronCore-v4) is not "
                              "emulated by opport")


def quantize_mx(dst, src, dst_scale, name=None):
    raise NotImplementedError("quantize_mx: MXFP8 quantization into x4 packed types (NeuronCore-v4) is not "
                              "emulated by opport")
