"""nki.isa's TensorE instructions: nc_matmul (PSUM accumulation, banks, tiling positions) and nc_transpose.

isa.py re-exports them; the operand checks come from operands.py.
"""

from __future__ import annotations

import numpy as np

from opport.backends.neuron.emulator import dtypes as dt
from opport.backends.neuron.emulator import runtime
from opport.backends.neuron.emulator.constants import engine, enum_arg, matmul_perf_mode
from opport.backends.neuron.emulator.errors import check, fail, warn
from opport.backends.neuron.emulator.operands import _engine, _tile
from opport.backends.neuron.emulator.target import PMAX, PSUM_BANK_BYTES
from opport.backends.neuron.emulator.tensor import NkiTensor, psum, sbuf


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
        if t.dtype not in dt.MATMUL_INPUTS:  # messages built only on failure: every matmul checks these
            fail(op, f"{role} dtype {t.dtype} is not a matmul input type (fp8, bf16, fp16, fp32)")
        if t.dtype == dt.float8_e4m3fn and run.target.version < 4:
            fail(op, f"{role} is float8_e4m3fn (OCP FP8), a matmul input only from NeuronCore-v4 (trn3); "
                     f"{run.target.name} takes float8_e4m3 / float8_e5m2")
    kinds = {stationary.dtype, moving.dtype}
    check(not {dt.float8_e4m3, dt.float8_e4m3fn} <= kinds, op,
          "legacy float8_e4m3 and OCP float8_e4m3fn cannot be mixed in one matmul")
    if (stationary.dtype == dt.float32) != (moving.dtype == dt.float32):
        fail(op, f"float32 may only pair with float32, got {stationary.dtype} x {moving.dtype}")


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
