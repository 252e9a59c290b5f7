"""The operand checks and moves every nki.isa instruction shares (isa.py, isa_matmul.py, isa_more.py).

Validation of tiles against docs/nki.md section 2 (partitions, access-pattern dims, engines, start
partitions), DMA sides and indirect reads, reduction axes, the engines' accumulator registers and the
per-engine instruction count: what the instruction modules import, so that none imports another.
"""

from __future__ import annotations

import numpy as np

from opport.backends.neuron.emulator import dtypes as dt
from opport.backends.neuron.emulator import runtime
from opport.backends.neuron.emulator.constants import dge_mode, engine, enum_arg, oob_mode, reduce_cmd
from opport.backends.neuron.emulator.errors import NkiValidationError, check, fail, warn
from opport.backends.neuron.emulator.ops import ALU_UNARY, OPS, Op
from opport.backends.neuron.emulator.target import PMAX
from opport.backends.neuron.emulator.tensor import NkiTensor, psum, sbuf


# -- validation helpers -------------------------------------------------------------------------------------
def _tensor(t, op, role) -> NkiTensor:
    if not isinstance(t, NkiTensor):
        raise NkiValidationError(f"{op}: {role} must be an NKI tensor, got {type(t).__name__}")
    return t


def _tile(t, op, role, eng=None) -> NkiTensor:
    """An on-chip operand of a compute instruction, legal for engine `eng` (messages built only on failure: this
    runs for every operand of every instruction)."""
    _tensor(t, op, role)
    if not t.onchip:
        fail(op, f"{role} must be in SBUF or PSUM, got {t.buffer} (only DMA instructions access HBM)")
    if t.shape[0] > PMAX:
        fail(op, f"{role} partition dimension {t.shape[0]} exceeds maximum {PMAX}")
    if eng == "gpsimd" and t.buffer is psum:
        fail(op, f"the GpSimd engine cannot access PSUM ({role} is in PSUM)")
    if (free := _free_dims(t)) > 4:
        fail(op, f"{role} access pattern has {free} free dims; instructions take at most 4")
    if eng in ("vector", "scalar"):
        limit = 65535 if t.buffer is sbuf else 4096
        if t.per_partition() > limit:
            fail(op, f"{role} has {t.per_partition()} elements per partition; the {eng} engine takes at most {limit} "
                     f"from {t.buffer.name.upper()}")
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
    if len(set(ps.values())) > 1:
        fail(op, "operands must use the same number of partitions, got " + ", ".join(f"{k} {p}" for k, p in ps.items()))


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





# -- reductions ----------------------------------------------------------------------------------------------
def _reduce_axes(axis, data: NkiTensor, op) -> tuple:
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    axes = tuple(sorted(int(a) + (data.ndim if a < 0 else 0) for a in axes))
    check(axes and 0 not in axes, op, f"cannot reduce the partition axis 0 (axis={axis}); transpose or use a matmul")
    check(axes == tuple(range(axes[0], data.ndim)), op, f"axis={axis} must be the last contiguous free dims of a "
          f"{data.ndim}-D tile, ending at the final dim")
    return axes




# -- engine accumulators --------------------------------------------------------------------------------------
def _accumulate(regs, cmd, partial, p, op_name, init=None):
    """Apply a reduce_cmd to engine accumulator registers (lanes 0..p-1)."""
    if cmd in (reduce_cmd.reset, reduce_cmd.reset_reduce):
        regs[:p] = {"maximum": -np.inf, "minimum": np.inf, "multiply": 1.0}.get(op_name, 0.0)
    if cmd is reduce_cmd.load_reduce:
        regs[:p] = init
    if cmd in (reduce_cmd.reduce, reduce_cmd.reset_reduce, reduce_cmd.load_reduce) and partial is not None:
        regs[:p] = OPS[op_name].apply(regs[:p], partial)
