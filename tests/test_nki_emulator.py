"""opport's NKI emulator: every enforced constraint rejects a small illegal kernel; legal ops match NumPy.

Kernels here are written against the documented NKI >= 0.3 API only (docs/nki.md section 3).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import ml_dtypes
import numpy as np
import pytest

from opport.backends.neuron import emulator as nki
from opport.backends.neuron import nki_compat

nl, nisa = nki.language, nki.isa
BF16 = ml_dtypes.bfloat16
rng = np.random.default_rng(0)


def sb(shape, dtype=nl.float32):
    return nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf)


def ps(shape, dtype=nl.float32):
    return nl.ndarray(shape, dtype=dtype, buffer=nl.psum)


def loaded(x):
    t = sb(x.shape, x.dtype)
    nisa.dma_copy(dst=t, src=x)
    return t


def hbm_out(t):
    out = nl.ndarray(t.shape, dtype=t.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def run(body, *arrays):
    """Run `body(*hbm_tensors) -> SBUF tile` as a kernel whose output is that tile."""
    return nki.jit(lambda *a: hbm_out(body(*a)))(*arrays)


def f32(*shape):
    return rng.standard_normal(shape).astype(np.float32)


# --------------------------------------------------------------------------------------------------------------
# Negative tests: one illegal kernel per enforced constraint, with the message it must give.
# --------------------------------------------------------------------------------------------------------------
def _k_partition_alloc():
    sb((256, 4))


def _k_partition_operand():
    a = nl.ndarray((256, 4), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.tensor_copy(dst=sb((128, 4)), src=a)


def _k_partition_mismatch():
    nisa.tensor_tensor(dst=sb((64, 4)), data1=sb((64, 4)), data2=sb((32, 8)), op=nl.add)


def _k_count_mismatch():
    nisa.tensor_copy(dst=sb((64, 4)), src=sb((64, 8)))


def _k_matmul_k():
    nisa.nc_matmul(ps((64, 64)), sb((128, 64)), sb((64, 64)))


def _k_matmul_m():
    nisa.nc_matmul(ps((128, 64)), sb((128, 129)), sb((128, 64)))


def _k_matmul_n():
    nisa.nc_matmul(ps((128, 1024)), sb((128, 128)), sb((128, 1024)))


def _k_matmul_dst_dtype():
    nisa.nc_matmul(ps((128, 64), nl.bfloat16), sb((128, 128), nl.bfloat16), sb((128, 64), nl.bfloat16))


def _k_matmul_dst_sbuf():
    nisa.nc_matmul(sb((128, 64)), sb((128, 128)), sb((128, 64)))


def _k_matmul_input_psum():
    nisa.nc_matmul(ps((128, 64)), ps((128, 128)), sb((128, 64)))


def _k_matmul_fp32_pairing():
    nisa.nc_matmul(ps((128, 64)), sb((128, 128), nl.float32), sb((128, 64), nl.bfloat16))


def _k_matmul_int_input():
    nisa.nc_matmul(ps((128, 64)), sb((128, 128), nl.int32), sb((128, 64), nl.int32))


def _k_matmul_bank_cross():
    big = ps((128, 1024))
    nisa.nc_matmul(big[:, 256:768], sb((128, 128)), sb((128, 512)))


def _k_psum_tile_too_big():
    ps((128, 4097))


def _k_sbuf_tile_too_big():
    sb((128, 212984 // 4 + 1))


def _k_dma_from_psum():
    out = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=ps((128, 4)))


def _k_dma_into_psum():
    a = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=ps((128, 4)), src=a)


def _k_dma_count():
    a = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=sb((128, 8)), src=a)


def _k_dma_hwdge_cast():
    a = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=sb((128, 4), nl.bfloat16), src=a, dge_mode=nisa.dge_mode.hwdge)


def _k_store_psum():
    nl.store(nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.shared_hbm), ps((128, 4)))


def _k_compute_on_hbm():
    a = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.activation(dst=sb((128, 4)), op=nl.exp, data=a)


def _k_gpsimd_psum_copy():
    nisa.tensor_copy(dst=ps((128, 4)), src=sb((128, 4)), engine=nisa.gpsimd_engine)


def _k_gpsimd_iota_psum():
    nisa.iota(ps((128, 4), nl.int32), [[1, 4]])


def _k_gpsimd_memset_psum():
    nisa.memset(ps((128, 4)), 0.0, engine=nisa.engine.gpsimd)


def _k_affine_select_psum():
    nisa.affine_select(sb((128, 4)), [[-1, 4]], 1, ps((128, 4)), -np.inf, cmp_op=nl.greater_equal)


def _k_power_psum():
    nisa.tensor_tensor(dst=ps((128, 4)), data1=sb((128, 4)), data2=sb((128, 4)), op=nl.power)


def _k_both_psum():
    nisa.tensor_tensor(dst=sb((128, 4)), data1=ps((128, 4)), data2=ps((128, 4)), op=nl.add)


def _k_reduce_partition_axis():
    nisa.tensor_reduce(dst=sb((128, 1)), op=nl.add, data=sb((128, 4)), axis=0)


def _k_reduce_not_trailing():
    nisa.tensor_reduce(dst=sb((128, 8)), op=nl.add, data=sb((128, 4, 8)), axis=1)


def _k_reduce_dst_count():
    nisa.tensor_reduce(dst=sb((128, 2)), op=nl.add, data=sb((128, 4, 8)), axis=(1, 2))


def _k_reduce_bad_op():
    nisa.tensor_reduce(dst=sb((128, 1)), op=nl.exp, data=sb((128, 4)), axis=1)


def _k_output_not_shared_hbm():
    return sb((128, 4))


def _k_output_private_hbm():
    return nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.private_hbm)


def _k_tensor_scalar_operand_dtype():
    nisa.tensor_scalar(dst=sb((128, 4)), data=sb((128, 4)), op0=nl.add, operand0=sb((128, 1), nl.bfloat16))


def _k_tensor_scalar_operand_shape():
    nisa.tensor_scalar(dst=sb((128, 4)), data=sb((128, 4)), op0=nl.add, operand0=sb((128, 2)))


def _k_tensor_scalar_mixed_kinds():
    nisa.tensor_scalar(dst=sb((128, 4), nl.int32), data=sb((128, 4), nl.int32), op0=nl.add, operand0=1.0,
                       op1=nl.bitwise_and, operand1=3)


def _k_tensor_scalar_scalar_engine_combo():
    nisa.tensor_scalar(dst=sb((128, 4)), data=sb((128, 4)), op0=nl.subtract, operand0=1.0, engine=nisa.scalar_engine)


def _k_bitvec_on_float():
    nisa.tensor_tensor(dst=sb((128, 4)), data1=sb((128, 4)), data2=sb((128, 4)), op=nl.bitwise_and)


def _k_activation_not_act():
    nisa.activation(dst=sb((128, 4)), op=nl.add, data=sb((128, 4)))


def _k_activation_scale_dtype():
    nisa.activation(dst=sb((128, 4)), op=nl.exp, data=sb((128, 4)), scale=sb((128, 1), nl.bfloat16))


def _k_activation_reduce_op():
    nisa.activation(dst=sb((128, 4)), op=nl.exp, data=sb((128, 4)), reduce_op=nl.maximum, reduce_res=sb((128, 1)),
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)


def _k_activation_reduce_res_shape():
    nisa.activation(dst=sb((128, 4)), op=nl.exp, data=sb((128, 4)), reduce_op=nl.add, reduce_res=sb((128, 2)),
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)


def _k_memset_int_value():
    nisa.memset(sb((128, 4), nl.int32), 0.5)


def _k_transpose_dtype():
    nisa.nc_transpose(ps((4, 128), nl.float32), sb((128, 4), nl.bfloat16))


def _k_transpose_vector_size():
    nisa.nc_transpose(sb((64, 64)), sb((64, 64)), engine=nisa.vector_engine)


def _k_transpose_shape():
    nisa.nc_transpose(ps((8, 128)), sb((128, 4)))


def _k_bn_stats_width():
    nisa.bn_stats(sb((128, 6)), sb((128, 513)))


def _k_bn_aggr_triples():
    nisa.bn_aggr(sb((128, 2)), sb((128, 7)))


def _k_iota_pattern_count():
    nisa.iota(sb((128, 8), nl.int32), [[1, 4]])


def _k_affine_select_cmp():
    nisa.affine_select(sb((128, 4)), [[-1, 4]], 1, sb((128, 4)), -np.inf, cmp_op=nl.add)


def _k_slice_oob():
    sb((128, 4))[0:256, :]


def _k_hbm_slice_oob():
    nl.ndarray((10, 4), dtype=nl.float32, buffer=nl.shared_hbm)[0:12]


def _k_int_oob():
    sb((128, 4))[:, 4]


def _k_item_assignment():
    t = sb((128, 4))
    t[0:1, :] = 0


def _k_permute_partition():
    sb((128, 4, 8)).permute((1, 0, 2))


def _k_broadcast_partition():
    sb((1, 4)).broadcast(0, 128)


def _k_reshape_partition():
    sb((128, 4)).reshape((64, 8))


def _k_reshape_count():
    nl.ndarray((8, 4), dtype=nl.float32, buffer=nl.shared_hbm).reshape((3, 10))


def _k_write_broadcast_view():
    nisa.memset(sb((128, 1)).broadcast(1, 8), 0.0)


def _k_string_buffer():
    nl.ndarray((128, 4), dtype=nl.float32, buffer="sbuf")


def _k_bad_dtype():
    nl.ndarray((128, 4), dtype=np.float64, buffer=nl.sbuf)


def _k_tfloat32():
    nl.ndarray((128, 4), dtype=nl.tfloat32, buffer=nl.sbuf)


def _k_onchip_1d():
    nl.ndarray((128,), dtype=nl.float32, buffer=nl.sbuf)


def _k_too_many_free_dims():
    src = sb((2, 64)).ap(pattern=[[64, 2], [1, 2], [8, 2], [2, 2], [32, 2], [4, 2]])  # 5 unmergeable free dims
    nisa.tensor_copy(dst=sb((2, 32)), src=src)


def _k_nl_broadcasting():
    nl.add(sb((128, 4)), sb((128, 1)))


def _k_nl_matmul_no_transpose():
    nl.matmul(sb((128, 128)), sb((128, 64)))


def _k_nl_load_psum_store():
    nl.store(nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.shared_hbm), ps((4, 4)))


def _k_scalar_free_size():
    t = sb((1, 65536), nl.bfloat16)
    nisa.activation(dst=t, op=nl.exp, data=t)


def _k_tensor_copy_scalar_v2():
    with nki.use_target("trn1"):
        nisa.tensor_copy(dst=sb((128, 4)), src=sb((128, 4)), engine=nisa.scalar_engine)


def _k_scalar_bias_v2():
    with nki.use_target("trn1"):
        nisa.activation(dst=sb((128, 4)), op=nl.exp, data=sb((128, 4)), bias=1.0)


def _k_exponential_v3():
    nisa.exponential(sb((128, 4)), sb((128, 4)))


def _k_predicate_dtype():
    nisa.tensor_copy_predicated(dst=sb((4, 4)), src=sb((4, 4)), predicate=sb((4, 4)))


def _k_select_reduce_op():
    nisa.select_reduce(dst=sb((4, 4)), predicate=sb((4, 4), nl.uint8), on_true=sb((4, 4)), on_false=0.0,
                       reduce_op=nl.add)


def _k_lnc_grid():
    nki.jit(lambda: None)[2, 2]


def _k_raw_int_dge_mode():
    a = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=sb((4, 4)), src=a, dge_mode=2)


def _k_raw_int_engine():
    nisa.tensor_copy(dst=sb((4, 4)), src=sb((4, 4)), engine=5)


def _k_raw_int_reduce_cmd():
    nisa.activation(dst=sb((4, 4)), op=nl.exp, data=sb((4, 4)), reduce_op=nl.add, reduce_res=sb((4, 1)), reduce_cmd=3)


def _k_raw_int_perf_mode():
    nisa.nc_matmul(ps((4, 4)), sb((4, 4)), sb((4, 4)), perf_mode=1)


def _k_dma_engine_without_hwdge():
    a = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=sb((4, 4)), src=a, engine=nisa.engine.sync)


NEGATIVE = [
    (_k_partition_alloc, "partition dimension 256 exceeds maximum 128"),
    (_k_partition_operand, "src must be in SBUF or PSUM"),
    (_k_partition_mismatch, "same number of partitions"),
    (_k_count_mismatch, "same number of elements per partition"),
    (_k_matmul_k, "share the contraction"),
    (_k_matmul_m, r"M=129 exceeds 128"),
    (_k_matmul_n, r"N=1024 exceeds 512"),
    (_k_matmul_dst_dtype, "dst must be float32 on trn2"),
    (_k_matmul_dst_sbuf, "dst must be in PSUM"),
    (_k_matmul_input_psum, "stationary and moving must be in SBUF"),
    (_k_matmul_fp32_pairing, "float32 may only pair with float32"),
    (_k_matmul_int_input, "not a matmul input type"),
    (_k_matmul_bank_cross, "crossing a 2 KiB PSUM bank"),
    (_k_psum_tile_too_big, "PSUM tile of 16388 bytes per partition exceeds"),
    (_k_sbuf_tile_too_big, "SBUF tile of 212988 bytes per partition exceeds"),
    (_k_dma_from_psum, "DMA cannot access PSUM"),
    (_k_dma_into_psum, "DMA cannot access PSUM"),
    (_k_dma_count, "element counts differ"),
    (_k_dma_hwdge_cast, "hwdge cannot convert dtypes"),
    (_k_store_psum, "must be an SBUF tile"),
    (_k_compute_on_hbm, "only DMA instructions access HBM"),
    (_k_gpsimd_psum_copy, "GpSimd engine cannot access PSUM"),
    (_k_gpsimd_iota_psum, "GpSimd engine cannot access PSUM"),
    (_k_gpsimd_memset_psum, "GpSimd engine cannot access PSUM"),
    (_k_affine_select_psum, "GpSimd engine cannot access PSUM"),
    (_k_power_psum, "GpSimd engine cannot access PSUM"),
    (_k_both_psum, "cannot both be in PSUM"),
    (_k_reduce_partition_axis, "cannot reduce the partition axis"),
    (_k_reduce_not_trailing, "last contiguous free dims"),
    (_k_reduce_dst_count, "dst must hold 1 elements per partition"),
    (_k_reduce_bad_op, "not a reduction operator"),
    (_k_tensor_scalar_operand_dtype, "operand0 tile must be float32"),
    (_k_tensor_scalar_operand_shape, r"operand0 must be a scalar or a \(128, 1\) tile"),
    (_k_tensor_scalar_mixed_kinds, "must both be bitvec or both arithmetic"),
    (_k_tensor_scalar_scalar_engine_combo, "Scalar engine supports only"),
    (_k_bitvec_on_float, "needs integer tiles"),
    (_k_activation_not_act, "not an activation function"),
    (_k_activation_scale_dtype, "scale tile must be float32"),
    (_k_activation_reduce_op, "reduce_op must be nl.add"),
    (_k_activation_reduce_res_shape, r"reduce_res must be a \(128, 1\) tile"),
    (_k_memset_int_value, "does not match the integer dtype"),
    (_k_transpose_dtype, "must equal data dtype"),
    (_k_transpose_vector_size, r"Vector engine transpose takes at most \[32, 32\]"),
    (_k_transpose_shape, r"dst must be \[4, 128\]"),
    (_k_bn_stats_width, "at most 512"),
    (_k_bn_aggr_triples, "triples"),
    (_k_iota_pattern_count, "pattern covers 4 elements but dst has 8"),
    (_k_affine_select_cmp, "cmp_op must be a comparison"),
    (_k_slice_oob, "out of bounds"),
    (_k_hbm_slice_oob, "out of bounds"),
    (_k_int_oob, "index 4 out of bounds"),
    (_k_item_assignment, "item assignment is not part of the NKI"),
    (_k_permute_partition, "partition dim must stay first"),
    (_k_broadcast_partition, "cannot broadcast the partition dim"),
    (_k_reshape_partition, "must keep the partition dim"),
    (_k_reshape_count, "cannot reshape"),
    (_k_write_broadcast_view, "broadcast"),
    (_k_string_buffer, "strings are rejected"),
    (_k_bad_dtype, "unsupported dtype"),
    (_k_tfloat32, "tfloat32 tiles are not supported"),
    (_k_onchip_1d, "at least 2-D"),
    (_k_too_many_free_dims, "at most 4"),
    (_k_nl_broadcasting, "no broadcasting"),
    (_k_nl_matmul_no_transpose, "transpose_x=False is not supported"),
    (_k_nl_load_psum_store, "must be an SBUF tile"),
    (_k_scalar_free_size, "at most 65535"),
    (_k_tensor_copy_scalar_v2, "not available on NeuronCore-v2"),
    (_k_scalar_bias_v2, "scalar bias needs NeuronCore-v3"),
    (_k_exponential_v3, "NeuronCore-v4"),
    (_k_lnc_grid, "launch grid is one integer"),
    (_k_predicate_dtype, "predicate must be uint8, uint16 or uint32"),
    (_k_select_reduce_op, "reduce_op must be nl.maximum"),
    (_k_raw_int_dge_mode, r"dge_mode=2 is a raw integer enum constant"),
    (_k_raw_int_engine, r"engine=5 is a raw integer enum constant"),
    (_k_raw_int_reduce_cmd, r"reduce_cmd=3 is a raw integer enum constant"),
    (_k_raw_int_perf_mode, r"perf_mode=1 is a raw integer enum constant"),
    (_k_dma_engine_without_hwdge, "only valid with dge_mode=hwdge"),
]


@pytest.mark.parametrize("body, message", NEGATIVE, ids=[f.__name__[3:] for f, _ in NEGATIVE])
def test_illegal_kernel_is_rejected(body, message):
    kernel = nki.jit(body)
    with pytest.raises(nki.NkiValidationError, match=message) as info:
        kernel()
    assert isinstance(info.value, AssertionError)  # as the real simulator's validation errors


def test_output_must_be_shared_hbm():
    for body in (_k_output_not_shared_hbm, _k_output_private_hbm):
        with pytest.raises(nki.NkiValidationError, match="must be allocated in nl.shared_hbm"):
            nki.jit(body)()


def test_list_argument_rejected():
    with pytest.raises(nki.NkiValidationError, match="use a tuple"):
        nki.jit(lambda xs: None)([1, 2])


def test_capacity_oversubscription_warns_then_fails_in_strict_mode():
    def body():
        tiles = [ps((128, 512)) for _ in range(9)]  # 9 live full banks, PSUM has 8
        del tiles

    with pytest.warns(nki.NkiCapacityWarning, match="PSUM tiles need 18432 bytes"):
        nki.jit(body)()
    assert nki.last_stats().peak_psum_bytes == 9 * 2048
    with nki.strict(), pytest.raises(nki.NkiValidationError, match="more than the 16384 bytes"):
        nki.jit(body)()

    def sbuf_body():
        tiles = [sb((128, 30000)) for _ in range(2)]  # 2 x 120000 B > 212984 B per partition
        del tiles

    with nki.strict(), pytest.raises(nki.NkiValidationError, match="SBUF tiles need 240000 bytes"):
        nki.jit(sbuf_body)()


def test_freed_tiles_release_capacity():
    def body():
        for _ in range(20):
            t = ps((128, 512))  # one bank, dropped every iteration
            del t

    with nki.strict():
        nki.jit(body)()
    assert nki.last_stats().peak_psum_bytes == 2048


def test_start_partition_rule():
    def body():
        t = sb((128, 4))
        nisa.memset(t[16:48, :], 0.0)

    with pytest.warns(nki.NkiWarning, match="starting at partition 16"):
        nki.jit(body)()
    with nki.strict(), pytest.raises(nki.NkiValidationError, match="starting at partition 16"):
        nki.jit(body)()


def test_accumulate_true_on_unwritten_psum_warns():
    def body():
        nisa.nc_matmul(ps((4, 4)), sb((4, 4)), sb((4, 4)), accumulate=True)

    with pytest.warns(nki.NkiWarning, match="undefined behaviour"):
        nki.jit(body)()


def test_activation_reduce_with_idle_cmd_warns():
    def body():
        nisa.activation(dst=sb((4, 4)), op=nl.exp, data=sb((4, 4)), reduce_op=nl.add, reduce_res=sb((4, 1)))

    with pytest.warns(nki.NkiWarning, match="reduce_cmd=idle"):
        nki.jit(body)()


def test_indirect_dma_out_of_bounds():
    data = f32(8, 4)

    def body(d, idx):
        i = loaded(idx)
        dst = sb((4, 4))
        nisa.dma_copy(dst=dst, src=d.ap(pattern=[[4, 4], [1, 4]], vector_offset=i, indirect_dim=0))
        return dst

    with pytest.raises(nki.NkiValidationError, match="out of bounds"):
        run(body, data, np.array([[0], [9], [1], [2]], np.int32))


# --------------------------------------------------------------------------------------------------------------
# Positive tests: each op matches NumPy semantics on legal inputs.
# --------------------------------------------------------------------------------------------------------------
def test_fresh_allocations_are_nan_and_ints_four():
    out = run(lambda: sb((4, 4)))
    assert np.isnan(out).all()
    assert (run(lambda: sb((2, 2), nl.int32)) == 4).all()


def test_dma_copy_casts_through_fp32_and_keeps_strided_views():
    x = f32(6, 10)
    y = run(lambda a: loaded(a[1:5, 0:10:2]).view(nl.float32), x)
    np.testing.assert_array_equal(y, x[1:5, 0:10:2])
    z = run(lambda a: _cast_tile(a, nl.bfloat16), x)
    assert z.dtype == BF16
    np.testing.assert_array_equal(z, x.astype(BF16))


def _cast_tile(a, dtype):
    t = sb(a.shape, dtype)
    nisa.dma_copy(dst=t, src=a)
    return t


def test_kernel_mutating_an_input_writes_back():
    x = np.zeros((4, 4), np.float32)

    @nki.jit
    def fill(a):
        t = sb((4, 4))
        nisa.memset(t, 7.0)
        nisa.dma_copy(dst=a, src=t)

    fill(x)
    assert (x == 7).all()


def test_hbm_integer_index_drops_dim_and_onchip_keeps_partition():
    x = f32(3, 8)

    def body(a):
        row = a[1]  # HBM: 1-D of 8
        assert row.shape == (8,)
        t = sb((1, 8))
        nisa.dma_copy(dst=t, src=row)
        col = sb((4, 8))[:, 3]
        assert col.shape == (4, 1) and sb((4, 8))[2].shape == (1, 8)
        return t

    np.testing.assert_array_equal(run(body, x), x[1:2])


def test_ds_and_views():
    x = f32(4, 12)

    def body(a):
        t = loaded(a)
        out = sb((4, 3, 2))
        v = t[:, nl.ds(0, 12)].reshape((4, 2, 3, 2)).select(1, 1).permute((0, 1, 2))
        nisa.tensor_copy(dst=out, src=v)
        return out

    np.testing.assert_array_equal(run(body, x), x.reshape(4, 2, 3, 2)[:, 1])


def test_ap_and_broadcast_views():
    x = f32(4, 6)
    g = f32(1, 6)

    def body(a, gam):
        t, gt = loaded(a), sb((4, 6))
        nisa.dma_copy(dst=gt, src=gam.ap(pattern=[[0, 4], [1, 6]]))  # partition-broadcast DMA of a row
        col = sb((4, 1))
        nisa.tensor_copy(dst=col, src=t[:, 2])
        out = sb((4, 6))
        nisa.tensor_tensor(dst=out, data1=gt, data2=col.broadcast(1, 6), op=nl.multiply)
        return out

    np.testing.assert_allclose(run(body, x, g), g * x[:, 2:3], rtol=1e-6)


@pytest.mark.parametrize("op, ref", [
    (nl.add, np.add), (nl.subtract, np.subtract), (nl.multiply, np.multiply), (nl.maximum, np.maximum),
    (nl.minimum, np.minimum), (nl.greater_equal, lambda a, b: (a >= b).astype(np.float32)),
    (nl.equal, lambda a, b: (a == b).astype(np.float32)),
])
def test_tensor_tensor(op, ref):
    a, b = f32(8, 16), f32(8, 16)
    got = run(lambda x, y: _tt(x, y, op), a, b)
    np.testing.assert_allclose(got, ref(a, b), rtol=1e-6)


def _tt(x, y, op):
    out = sb(x.shape)
    nisa.tensor_tensor(dst=out, data1=loaded(x), data2=loaded(y), op=op)
    return out


def test_tensor_tensor_bitvec_and_power():
    a = rng.integers(0, 1000, (4, 8), dtype=np.int32)
    b = rng.integers(0, 1000, (4, 8), dtype=np.int32)

    def body(x, y):
        out = sb(x.shape, nl.int32)
        nisa.tensor_tensor(dst=out, data1=loaded(x), data2=loaded(y), op=nl.bitwise_xor)
        return out

    np.testing.assert_array_equal(run(body, a, b), a ^ b)
    p, q = np.abs(f32(4, 8)) + 0.5, f32(4, 8)
    np.testing.assert_allclose(run(lambda x, y: _tt(x, y, nl.power), p, q), p**q, rtol=1e-5)


def test_tensor_scalar_two_ops_and_reverse():
    x, v = f32(8, 16), f32(8, 1)

    def body(a, s):
        out = sb(a.shape)
        nisa.tensor_scalar(dst=out, data=loaded(a), op0=nl.subtract, operand0=loaded(s), reverse0=True,
                           op1=nl.multiply, operand1=2.0)
        return out

    np.testing.assert_allclose(run(body, x, v), (v - x) * 2.0, rtol=1e-6)


def test_scalar_tensor_tensor():
    x, y = f32(8, 16), f32(8, 16)

    def body(a, b):
        out = sb(a.shape)
        nisa.scalar_tensor_tensor(dst=out, data=loaded(a), op0=nl.multiply, operand0=3.0, op1=nl.add, operand1=loaded(b))
        return out

    np.testing.assert_allclose(run(body, x, y), x * 3 + y, rtol=1e-6)


@pytest.mark.parametrize("op, ref", [
    (nl.add, np.sum), (nl.maximum, np.max), (nl.minimum, np.min), (nl.multiply, np.prod),
])
def test_tensor_reduce(op, ref):
    x = f32(8, 3, 5)

    def body(a):
        out = sb((8, 1))
        nisa.tensor_reduce(dst=out, op=op, data=loaded(a), axis=(1, 2), negate=True)
        return out

    np.testing.assert_allclose(run(body, x), -ref(x, axis=(1, 2)).reshape(8, 1), rtol=1e-5)


def test_tensor_reduce_last_axis_keeps_middle():
    x = f32(4, 3, 5)

    def body(a):
        out = sb((4, 3))
        nisa.tensor_reduce(dst=out, op=nl.max, data=loaded(a), axis=2)
        return out

    np.testing.assert_array_equal(run(body, x), x.max(axis=2))


def test_tensor_partition_reduce():
    x = f32(16, 6)

    def body(a):
        out = sb((1, 6))
        nisa.tensor_partition_reduce(dst=out, op=nl.add, data=loaded(a))
        return out

    np.testing.assert_allclose(run(body, x), x.sum(0, keepdims=True), rtol=1e-5)


@pytest.mark.parametrize("name, ref", [
    ("exp", np.exp), ("tanh", np.tanh), ("sigmoid", lambda x: 1 / (1 + np.exp(-x))),
    ("silu", lambda x: x / (1 + np.exp(-x))), ("square", np.square), ("copy", lambda x: x),
    ("gelu_apprx_tanh", lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))),
    ("relu", lambda x: np.maximum(x, 0)), ("abs", np.abs),
])
def test_activation_with_scale_bias(name, ref):
    x, b = f32(8, 32), f32(8, 1)
    op = getattr(nl, name)

    def body(a, bias):
        out = sb(a.shape)
        nisa.activation(dst=out, op=op, data=loaded(a), bias=loaded(bias), scale=0.5)
        return out

    want = ref(x.astype(np.float64) * 0.5 + b).astype(np.float32)
    np.testing.assert_allclose(run(body, x, b), want, rtol=2e-6, atol=1e-7)


def test_activation_positive_domain_and_gelu():
    from math import erf

    x = np.abs(f32(4, 16)) + 0.1
    for op, ref in ((nl.log, np.log), (nl.sqrt, np.sqrt), (nl.rsqrt, lambda v: 1 / np.sqrt(v)),
                    (nl.reciprocal, lambda v: 1 / v)):
        got = run(lambda a, op=op: _act(a, op), x)
        np.testing.assert_allclose(got, ref(x.astype(np.float64)), rtol=2e-6)
    y = f32(4, 16)
    want = np.vectorize(lambda v: 0.5 * v * (1 + erf(v / np.sqrt(2))))(y.astype(np.float64))
    np.testing.assert_allclose(run(lambda a: _act(a, nl.gelu), y), want, rtol=2e-6, atol=1e-7)
    edge = np.array([[-np.inf, np.inf, 0.0, -0.0]], np.float32)
    got = run(lambda a: _act(a, nl.silu), edge)
    assert got[0, 0] == 0 and np.signbit(got[0, 0]) and got[0, 1] == np.inf


def _act(a, op, dtype=nl.float32):
    out = sb(a.shape, dtype)
    nisa.activation(dst=out, op=op, data=loaded(a))
    return out


def test_activation_reduce_accumulates_across_calls():
    x = f32(8, 64)

    def body(a):
        t = loaded(a)
        e, s = sb((8, 32)), sb((8, 1))
        nisa.activation(dst=e, op=nl.exp, data=t[:, 0:32], reduce_op=nl.add, reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.activation(dst=e, op=nl.exp, data=t[:, 32:64], reduce_op=nl.add, reduce_res=s,
                        reduce_cmd=nisa.reduce_cmd.reduce)
        s2 = sb((8, 1))
        nisa.activation_reduce(dst=e, op=nl.exp, data=t[:, 0:32], reduce_op=nl.add, reduce_res=s2)
        out = sb((8, 2))
        nisa.tensor_copy(dst=out[:, 0:1], src=s)
        nisa.tensor_copy(dst=out[:, 1:2], src=s2)
        return out

    got = run(body, x)
    np.testing.assert_allclose(got[:, 0], np.exp(x).sum(1), rtol=1e-5)
    np.testing.assert_allclose(got[:, 1], np.exp(x[:, :32]).sum(1), rtol=1e-5)


def test_tensor_scalar_reduce_and_reciprocal():
    x = f32(8, 16)

    def body(a):
        out, r, inv = sb(a.shape), sb((8, 1)), sb((8, 1))
        nisa.tensor_scalar_reduce(dst=out, data=loaded(a), op0=nl.multiply, operand0=2.0, reduce_op=nl.maximum,
                                  reduce_res=r)
        nisa.reciprocal(dst=inv, data=r)
        return inv

    np.testing.assert_allclose(run(body, x), 1 / (2 * x).max(1, keepdims=True), rtol=1e-6)


def test_bn_stats_aggr_match_mean_and_population_variance():
    x = f32(8, 1000)

    def body(a):
        t = loaded(a)
        stats = sb((8, 2, 6))
        nisa.bn_stats(dst=stats[:, 0, :], data=t[:, 0:512])
        nisa.bn_stats(dst=stats[:, 1, :], data=t[:, 512:1000])
        mv = sb((8, 2))
        nisa.bn_aggr(dst=mv, data=stats)
        return mv

    got = run(body, x)
    np.testing.assert_allclose(got[:, 0], x.mean(1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[:, 1], x.var(1), rtol=1e-5)


def test_iota_and_affine_select_causal_mask():
    def iota_body():
        t = sb((4, 2, 3), nl.int32)
        nisa.iota(t, [[10, 2], [1, 3]], offset=5, channel_multiplier=100)
        return t

    want = 5 + 100 * np.arange(4)[:, None, None] + 10 * np.arange(2)[None, :, None] + np.arange(3)[None, None, :]
    np.testing.assert_array_equal(run(iota_body), want)
    x = f32(6, 6)

    def mask_body(a):
        out = sb((6, 6))
        # keep key j <= query i: affine value i - j >= 0
        nisa.affine_select(dst=out, pattern=[[-1, 6]], channel_multiplier=1, on_true_tile=loaded(a),
                           on_false_value=-np.inf, cmp_op=nl.greater_equal)
        return out

    np.testing.assert_array_equal(run(mask_body, x), np.where(np.tril(np.ones((6, 6), bool)), x, -np.inf))


def test_memset_and_tensor_copy_cast():
    x = f32(4, 8) * 1000

    def body(a):
        out = sb(a.shape, nl.bfloat16)
        nisa.tensor_copy(dst=out, src=loaded(a))
        i = sb(a.shape, nl.int16)
        nisa.tensor_copy(dst=i, src=loaded(a), engine=nisa.gpsimd_engine)
        return i

    got = run(body, x)
    np.testing.assert_array_equal(got, np.clip(np.rint(x), -32768, 32767).astype(np.int16))


def test_nc_matmul_accumulates_over_k_tiles():
    a, b = f32(256, 64).astype(BF16), f32(256, 512).astype(BF16)

    def body(at, bt):
        acc = ps((64, 512))
        for k in nl.affine_range(2):
            nisa.nc_matmul(dst=acc, stationary=loaded(at[k * 128:(k + 1) * 128, :]),
                           moving=loaded(bt[k * 128:(k + 1) * 128, :]))
        out = sb((64, 512))
        nisa.tensor_copy(dst=out, src=acc)
        return out

    want = a.astype(np.float32).T @ b.astype(np.float32)
    np.testing.assert_allclose(run(body, a, b), want, rtol=1e-4, atol=1e-4)


def test_nc_matmul_accumulate_false_overwrites_and_trn3_wide_n():
    a, b = f32(16, 8), f32(16, 1024)

    def body(at, bt):
        acc = ps((8, 1024))
        s, m = loaded(at), loaded(bt)
        nisa.nc_matmul(acc, s, m)
        nisa.nc_matmul(acc, s, m, accumulate=False)
        out = sb((8, 1024))
        nisa.tensor_copy(dst=out, src=acc)
        return out

    with nki.use_target("trn3"):
        got = run(body, a, b)
    np.testing.assert_allclose(got, a.T @ b, rtol=1e-4, atol=1e-4)


def test_nc_matmul_double_row_fp8():
    fp8 = ml_dtypes.float8_e4m3
    a, b = f32(16, 2, 8).astype(fp8), f32(16, 2, 32).astype(fp8)

    def body(at, bt):
        acc = ps((8, 32))
        nisa.nc_matmul(acc, loaded(at), loaded(bt), perf_mode=nisa.matmul_perf_mode.double_row)
        out = sb((8, 32))
        nisa.tensor_copy(dst=out, src=acc)
        return out

    want = a.astype(np.float32).reshape(32, 8).T @ b.astype(np.float32).reshape(32, 32)
    np.testing.assert_allclose(run(body, a, b), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(nki.NkiValidationError, match="double_row takes fp8"):
        run(body, a.astype(BF16), b.astype(BF16))


def test_transposes_are_bit_exact():
    x = f32(128, 64)
    x[3, 5], x[7, 1] = np.nan, np.inf

    def body(a):
        t = loaded(a)
        tp = ps((64, 128))
        nisa.nc_transpose(dst=tp, data=t)
        ident = sb((128, 128))
        nisa.dma_copy(dst=ident, src=nl.shared_identity_matrix(128, nl.float32))
        tp2 = ps((64, 128))
        nisa.nc_matmul(tp2, t, ident, is_transpose=True)
        out = sb((64, 256))
        nisa.tensor_copy(dst=out[:, 0:128], src=tp)
        nisa.tensor_copy(dst=out[:, 128:256], src=tp2)
        return out

    got = run(body, x)
    np.testing.assert_array_equal(got[:, :128], x.T)
    np.testing.assert_array_equal(got[:, 128:], x.T)
    y = f32(16, 32).astype(BF16)

    def small(a):
        out = sb((32, 16), nl.bfloat16)
        nisa.nc_transpose(dst=out, data=loaded(a), engine=nisa.vector_engine)
        return out

    np.testing.assert_array_equal(run(small, y), y.T)


def test_dma_transpose_and_indirect_gather_scatter():
    x = f32(8, 16).astype(BF16)

    def body(a):
        t = sb((16, 8), nl.bfloat16)
        nisa.dma_transpose(dst=t, src=a)
        return t

    np.testing.assert_array_equal(run(body, x), x.T)
    data, idx = f32(10, 4), np.array([[7], [0], [3]], np.int32)

    def gather(d, i):
        dst = sb((3, 4))
        nisa.dma_copy(dst=dst, src=d.ap(pattern=[[4, 3], [1, 4]], vector_offset=loaded(i), indirect_dim=0))
        return dst

    np.testing.assert_array_equal(run(gather, data, idx), data[idx[:, 0]])

    @nki.jit
    def scatter(d, i, out):
        nisa.dma_copy(dst=out.ap(pattern=[[4, 3], [1, 4]], vector_offset=loaded(i), indirect_dim=0), src=loaded(d))
        return out

    out = np.zeros((10, 4), np.float32)
    scatter(data[:3].copy(), idx, out)
    np.testing.assert_array_equal(out[idx[:, 0]], data[:3])


def test_predicated_copy_and_select_reduce():
    x, y = f32(4, 8), f32(4, 8)
    mask = (rng.random((4, 8)) > 0.5).astype(np.uint8)

    def body(a, b, m):
        out, res = loaded(b), sb((4, 1))
        pred = loaded(m)
        nisa.tensor_copy_predicated(dst=out, src=loaded(a), predicate=pred)
        sel = sb((4, 8))
        nisa.select_reduce(dst=sel, predicate=pred, on_true=loaded(a), on_false=-1e30, reduce_res=res,
                           reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nan_fill = sb((4, 8))
        nisa.memset(nan_fill, 0.0)
        nisa.tensor_copy_predicated(dst=nan_fill, src=float("nan"), predicate=pred, reverse_pred=True)
        cat = sb((4, 25))
        for i, t in enumerate((out, sel, nan_fill)):
            nisa.tensor_copy(dst=cat[:, 8 * i:8 * i + 8], src=t)
        nisa.tensor_copy(dst=cat[:, 24:25], src=res)
        return cat

    got = run(body, x, y, mask)
    m = mask != 0
    np.testing.assert_array_equal(got[:, 0:8], np.where(m, x, y))
    np.testing.assert_array_equal(got[:, 8:16], np.where(m, x, np.float32(-1e30)))
    np.testing.assert_array_equal(np.isnan(got[:, 16:24]), ~m)
    np.testing.assert_array_equal(got[:, 24], np.where(m, x, np.float32(-1e30)).max(1))


def test_nl_high_level_ops():
    x, y = f32(8, 16), f32(8, 16)

    def body(a, b):
        ta, tb = nl.load(a), nl.load(b)
        s = nl.add(nl.exp(ta), nl.multiply(ta, tb))
        m = nl.sum(s, axis=1, keepdims=True)
        mean = nl.mean(ta, axis=1)
        out = sb((8, 18))
        nisa.tensor_copy(dst=out[:, 0:16], src=s)
        nisa.tensor_copy(dst=out[:, 16:17], src=m)
        nisa.tensor_copy(dst=out[:, 17:18], src=mean)
        return out

    got = run(body, x, y)
    s = np.exp(x) + x * y
    np.testing.assert_allclose(got[:, :16], s, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[:, 16], s.sum(1), rtol=1e-5)
    np.testing.assert_allclose(got[:, 17], x.mean(1), rtol=1e-5, atol=1e-6)

    def mm(a, b):
        p = nl.matmul(nl.load(a), nl.load(b), transpose_x=True)
        out = sb(p.shape)
        nisa.tensor_copy(dst=out, src=p)
        return out

    np.testing.assert_allclose(run(mm, x, y), x.T @ y, rtol=1e-5, atol=1e-5)


def test_bfloat16_results_are_rounded_from_fp32():
    x = f32(4, 8).astype(BF16)
    got = run(lambda a: _act(a, nl.exp, nl.bfloat16), x)
    assert got.dtype == BF16
    np.testing.assert_array_equal(got, np.exp(x.astype(np.float64)).astype(np.float32).astype(BF16))


def test_lnc2_programs_share_outputs():
    x = f32(8, 4)

    @nki.jit
    def halves(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        pid, n = nl.program_id(0), nl.num_programs()
        rows = a.shape[0] // n
        t = loaded(a[pid * rows:(pid + 1) * rows, :])
        nisa.dma_copy(dst=out[pid * rows:(pid + 1) * rows, :], src=t)
        return out

    np.testing.assert_array_equal(halves[2](x), x)
    assert nki.last_stats().dma_transfers == 4
    assert halves(x).shape == (8, 4)


def test_targets_change_sizes():
    sizes = {}
    for name in ("trn1", "trn2", "trn3"):
        with nki.use_target(name):
            sizes[name] = (nl.tile_size.total_available_sbuf_size, nisa.get_nc_version())
    assert sizes == {"trn1": (180224, nisa.nc_version.gen2), "trn2": (212984, nisa.nc_version.gen3),
                     "trn3": (245752, nisa.nc_version.gen4)}
    assert nl.tile_size.pmax == 128 and nl.tile_size.psum_fmax == 512 and nl.tile_size.bn_stats_fmax == 512


# --------------------------------------------------------------------------------------------------------------
# Statistics: DMA bytes and instructions per engine for one small kernel.
# --------------------------------------------------------------------------------------------------------------
def test_stats_count_dma_bytes_and_instructions():
    x = f32(128, 256).astype(BF16)

    @nki.jit
    def softmax(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        t = loaded(a)  # DMA in: 128*256*2 bytes
        neg_max, total, inv = sb((128, 1)), sb((128, 1)), sb((128, 1))
        nisa.tensor_reduce(dst=neg_max, op=nl.maximum, data=t, axis=1, negate=True)  # vector
        e = sb((128, 256))
        nisa.activation(dst=e, op=nl.exp, data=t, bias=neg_max, reduce_op=nl.add, reduce_res=total,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)  # scalar x2 (activation + register read-out)
        nisa.reciprocal(dst=inv, data=total)  # vector
        y = sb((128, 256), nl.bfloat16)
        nisa.tensor_scalar(dst=y, data=e, op0=nl.multiply, operand0=inv)  # vector
        nisa.dma_copy(dst=out, src=y)  # DMA out
        return out

    with nki.collect_stats() as total:
        got = softmax(x)
        softmax(x)
    s = nki.last_stats()
    assert s.as_dict() == {
        "kernel": "softmax", "target": "trn2", "calls": 1, "dma_transfers": 2, "dma_bytes": 2 * 65536,
        "hbm_read_bytes": 65536, "hbm_write_bytes": 65536, "hbm_bytes": 131072,
        "instructions": {"tensor": 0, "vector": 3, "scalar": 2, "gpsimd": 0, "dma": 2},
        "peak_sbuf_bytes": 512 + 3 * 4 + 1024 + 512, "peak_psum_bytes": 0,
    }
    assert total.calls == 2 and total.hbm_bytes == 2 * 131072 and total.instructions["vector"] == 6
    xf = x.astype(np.float32)
    ref = np.exp(xf - xf.max(1, keepdims=True))
    np.testing.assert_allclose(got.astype(np.float32), ref / ref.sum(1, keepdims=True), rtol=1e-2, atol=1e-3)


# --------------------------------------------------------------------------------------------------------------
# nki_compat: SDK detection by features, OPPORT_NKI override, modes.
# --------------------------------------------------------------------------------------------------------------
def _fake_nki(tmp_path, monkeypatch, init: str, lang: str = "", isa: str = ""):
    pkg = tmp_path / "nki"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(init))
    (pkg / "language.py").write_text(textwrap.dedent(lang))
    (pkg / "isa.py").write_text(textwrap.dedent(isa))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("nki", "nki.language", "nki.isa"):
        monkeypatch.delitem(sys.modules, name, raising=False)


def test_pypi_placeholder_is_rejected(tmp_path, monkeypatch):
    # nki 0.0.1 on PyPI raises at import: "WRONG PACKAGE. Please install the package from Neuron Repository"
    _fake_nki(tmp_path, monkeypatch, 'raise ImportError("WRONG PACKAGE")')
    mod, why = nki_compat.probe_real_sdk()
    assert mod is None and "WRONG PACKAGE" in why


def test_featureless_nki_is_rejected(tmp_path, monkeypatch):
    _fake_nki(tmp_path, monkeypatch, "def jit(f): return f\n__version__ = '9.9'\n")
    mod, why = nki_compat.probe_real_sdk()
    assert mod is None and "nki.simulate" in why and "nki.isa.nc_matmul" in why


def test_genuine_looking_sdk_is_accepted_and_override(tmp_path, monkeypatch):
    _fake_nki(tmp_path, monkeypatch, "from . import language, isa\ndef jit(f): return f\ndef simulate(k): return k\n",
              "tile_size = object()\n", "def nc_matmul(*a): pass\n")
    mod, why = nki_compat.probe_real_sdk()
    assert why is None and mod.__name__ == "nki"
    monkeypatch.setattr(nki_compat, "neuron_device_present", lambda: False)
    assert nki_compat._resolve()[1:] == ("simulator", None)
    monkeypatch.setenv("OPPORT_NKI", "emu")
    assert nki_compat._resolve() == (nki, "emulator", None)


def test_opport_nki_real_without_sdk_makes_backend_unavailable(monkeypatch):
    monkeypatch.setattr(nki_compat, "probe_real_sdk", lambda: (None, "the NKI SDK (`nki` package) is not installed"))
    monkeypatch.setenv("OPPORT_NKI", "real")
    assert nki_compat._resolve() == (nki, "emulator", "OPPORT_NKI=real but the NKI SDK (`nki` package) is not installed")
    monkeypatch.setenv("OPPORT_NKI", "bogus")
    assert "must be 'real' or 'emu'" in nki_compat._resolve()[2]


def test_compat_exports_and_run():
    assert nki_compat.MODE == "emulator" and nki_compat.nl is nl and nki_compat.nisa is nisa
    x = f32(4, 4)
    got = nki_compat.run(nki.jit(lambda a: hbm_out(loaded(a))), x)
    np.testing.assert_array_equal(got, x)
    assert nki_compat.last_stats().hbm_bytes == 2 * x.nbytes


def test_backend_declaration_and_cheap_import():
    from opport.backends.neuron import BACKEND

    assert (BACKEND.name, BACKEND.array_kind, BACKEND.device_types) == ("neuron", "numpy", ("xla", "neuron"))
    assert BACKEND.dtypes == ("float32", "float16", "bfloat16")
    assert BACKEND.probe() is None and BACKEND.mode() == "emulator"
    assert BACKEND.versions()["nki"] == "opport-emulator"
    code = "import sys, opport.backends.neuron; print(any('emulator' in m or 'nki_compat' in m for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_no_warnings_for_legal_kernel():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        test_stats_count_dma_bytes_and_instructions()


# --------------------------------------------------------------------------------------------------------------
# Fidelity to the documented NKI API (issue 17 part 2): each feature runs on a small kernel against NumPy, and
# each rule the hardware/compiler enforces rejects an illegal kernel with a message naming the rule.
# --------------------------------------------------------------------------------------------------------------
nt = nki.typing
FP32_MIN = float(np.finfo(np.float32).min)


def _k_placed_partitions_out_of_range():
    nl.ndarray((64, 4), dtype=nl.float32, buffer=nl.sbuf, address=(100, 0))


def _k_placed_bytes_out_of_range():
    nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum, address=(0, 15 * 1024))


def _k_placed_psum_misaligned():
    nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.psum, address=(0, 2))


def _k_placed_bad_address():
    nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.sbuf, address=(0,))


def _k_placed_matmul_crosses_bank():
    acc = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum, address=(0, 1024))
    nisa.nc_matmul(acc, sb((128, 128)), sb((128, 512)))


def _k_fp8_e4m3fn_matmul_trn2():
    nisa.nc_matmul(ps((4, 4)), sb((4, 4), nl.float8_e4m3fn), sb((4, 4), nl.float8_e4m3fn))


def _k_fp8_mixed_matmul():
    with nki.use_target("trn3"):
        nisa.nc_matmul(ps((4, 4)), sb((4, 4), nl.float8_e4m3), sb((4, 4), nl.float8_e4m3fn))


def _k_rsqrt_psum():
    nl.rsqrt(ps((4, 4)))


def _k_scan_both_psum():
    nisa.tensor_tensor_scan(sb((4, 8)), ps((4, 8)), ps((4, 8)), 0.0, nl.multiply, nl.add)


def _k_scan_bitvec():
    t = sb((4, 8), nl.int32)
    nisa.tensor_tensor_scan(t, t, t, 0.0, nl.bitwise_and, nl.add)


def _k_shuffle_mask_length():
    nisa.nc_stream_shuffle(sb((32, 4)), sb((32, 4)), list(range(16)))


def _k_shuffle_start_partition():
    t = sb((64, 4))
    nisa.nc_stream_shuffle(t[16:48], t[0:32], list(range(32)))


def _k_shuffle_dtype():
    nisa.nc_stream_shuffle(sb((32, 4), nl.bfloat16), sb((32, 4)), list(range(32)))


def _k_max8_too_few():
    nisa.max8(sb((4, 8)), sb((4, 4)))


def _k_max8_dst_shape():
    nisa.max8(sb((4, 4)), sb((4, 16)))


def _k_find_index8_dtype():
    nisa.nc_find_index8(sb((4, 8)), sb((4, 16)), sb((4, 8)))


def _k_match_replace8_vals():
    nisa.nc_match_replace8(sb((4, 16)), sb((4, 16)), sb((4, 4)), 0.0)


def _k_nonzero_trn1():
    with nki.use_target("trn1"):
        nisa.nonzero_with_count(sb((16, 9), nl.int32), sb((16, 8), nl.int32))


def _k_nonzero_dst_dtype():
    nisa.nonzero_with_count(sb((16, 9)), sb((16, 8)))


def _k_range_select_on_false():
    nisa.range_select(sb((4, 8)), sb((4, 8)), nl.greater_equal, nl.less, sb((4, 1)), sb((4, 1)),
                      on_false_value=-np.inf)


def _k_range_select_cmp():
    nisa.range_select(sb((4, 8)), sb((4, 8)), nl.add, nl.less, sb((4, 1)), sb((4, 1)))


def _k_range_select_trn1():
    with nki.use_target("trn1"):
        nisa.range_select(sb((4, 8)), sb((4, 8)), nl.greater_equal, nl.less, sb((4, 1)), sb((4, 1)))


def _k_n_gather_index_dtype():
    nisa.nc_n_gather(sb((4, 2)), sb((4, 8)), sb((4, 2), nl.int32))


def _k_n_gather_psum():
    nisa.nc_n_gather(sb((4, 2)), ps((4, 8)), sb((4, 2), nl.uint32))


def _k_local_gather_partitions():
    nisa.local_gather(sb((8, 4)), sb((8, 16)), sb((8, 2), nl.uint16))


def _k_local_gather_elem():
    nisa.local_gather(sb((16, 96)), sb((16, 64)), sb((16, 2), nl.uint16), num_elem_per_idx=3)


def _k_dma_compute_op():
    a = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_compute(sb((4, 4)), [a, a], nl.multiply)


def _k_dma_compute_scales():
    a = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_compute(sb((4, 4)), [a, a], nl.add, scales=[2.0, 1.0])


def _k_memset_packed_nonzero():
    nisa.memset(sb((4, 4), nl.float8_e4m3fn_x4), 1)


def _k_ap_dtype_misaligned():
    t = sb((4, 8), nl.bfloat16)
    t[0:4, 1:3].ap([[4, 4], [1, 1]], dtype=nl.float32)


def _k_ds_out_of_bounds():
    sb((4, 4))[0:4, nl.ds(5, 0)]


FIDELITY_NEGATIVE = [
    (_k_placed_partitions_out_of_range, "address partitions 100..163 run past the 128 partitions"),
    (_k_placed_bytes_out_of_range, "address bytes 15360..17407 of each partition run past the 16384 bytes"),
    (_k_placed_psum_misaligned, "not 4-byte aligned"),
    (_k_placed_bad_address, r"address must be a \(partition_offset, free_offset\) pair"),
    (_k_placed_matmul_crosses_bank, r"dst spans bytes 1024..3071 of each partition, crossing a 2 KiB PSUM bank"),
    (_k_fp8_e4m3fn_matmul_trn2, "float8_e4m3fn .* only from NeuronCore-v4"),
    (_k_fp8_mixed_matmul, "float8_e4m3 and OCP float8_e4m3fn cannot be mixed"),
    (_k_rsqrt_psum, "nl.rsqrt: runs on the GpSimd engine since NKI 0.5 and no longer accepts PSUM"),
    (_k_scan_both_psum, "data0 and data1 cannot both be in PSUM"),
    (_k_scan_bitvec, "op0=nl.bitwise_and is not an ALU operator|must be a binary arithmetic operator"),
    (_k_shuffle_mask_length, "shuffle_mask must be 32 ints"),
    (_k_shuffle_start_partition, "dst starts at partition 16; with 32 active partitions it must start at 0 or 32"),
    (_k_shuffle_dtype, "dst dtype bfloat16 must equal src dtype float32"),
    (_k_max8_too_few, "8 to 16384 elements per partition, got 4"),
    (_k_max8_dst_shape, r"dst must be a 2-D \[P, 8\] tile"),
    (_k_find_index8_dtype, "dst must be uint16 or uint32"),
    (_k_match_replace8_vals, "vals must hold 8 elements"),
    (_k_nonzero_trn1, "nonzero_with_count needs NeuronCore-v3"),
    (_k_nonzero_dst_dtype, "dst must be int32"),
    (_k_range_select_on_false, "on_false_value must be FP32_MIN"),
    (_k_range_select_cmp, "comp_op0 must be one of"),
    (_k_range_select_trn1, "range_select needs NeuronCore-v3"),
    (_k_n_gather_index_dtype, "indices must be uint32"),
    (_k_n_gather_psum, "GpSimd engine cannot access PSUM"),
    (_k_local_gather_partitions, "multiple of 16"),
    (_k_local_gather_elem, "num_elem_per_idx must be 1, 2, 4, 8, 16 or 32"),
    (_k_dma_compute_op, "reduce_op must be nl.add"),
    (_k_dma_compute_scales, "scales must be None or one 1.0 per source"),
    (_k_memset_packed_nonzero, "x4 packed types .* only take value=0"),
    (_k_ap_dtype_misaligned, "not on a float32 boundary"),
    (_k_ds_out_of_bounds, r"nl.ds\(5, 0\) out of bounds"),
]


@pytest.mark.parametrize("body, message", FIDELITY_NEGATIVE, ids=[f.__name__[3:] for f, _ in FIDELITY_NEGATIVE])
def test_fidelity_rule_is_enforced(body, message):
    with pytest.raises(nki.NkiValidationError, match=message):
        nki.jit(body)()


# -- 1. explicit placement ----------------------------------------------------------------------------------------
def test_placed_psum_banks_reused_through_addresses_pass_strict_capacity():
    a, b = f32(128, 4), f32(128, 512)

    def body(a_hbm, b_hbm):
        at, bt = loaded(a_hbm), loaded(b_hbm)
        out = sb((4, 512))
        accs = []  # 12 accumulators stay alive: only the 8 banks their addresses name are booked
        for i in range(12):
            acc = nl.ndarray((4, 512), dtype=nl.float32, buffer=nl.psum, address=(0, (i % 8) * 2048))
            nisa.nc_matmul(acc, at, bt)
            accs.append(acc)
        nisa.tensor_copy(dst=out, src=accs[-1])
        return out

    with nki.strict():
        got = run(body, a, b)
    np.testing.assert_allclose(got, a.T @ b, rtol=1e-5, atol=1e-5)
    assert nki.last_stats().peak_psum_bytes == 8 * 2048


def test_placed_tiles_alias_and_count_with_allocated_ones():
    x = f32(4, 8)

    def body(x_hbm):
        first = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf, address=(0, 64))
        nisa.dma_copy(dst=first, src=x_hbm)
        alias = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf, address=(0, 64))  # the same bytes
        out = sb((4, 8))
        nisa.tensor_scalar(dst=out, data=alias, op0=nl.multiply, operand0=2.0)
        return out

    np.testing.assert_array_equal(run(body, x), 2 * x)

    def over():
        placed = nl.ndarray((128, 2048), dtype=nl.float32, buffer=nl.psum, address=(0, 4 * 2048))  # banks 4-7
        tiles = [ps((128, 512)) for _ in range(5)]  # 5 allocated banks + 4 placed > 8
        del placed, tiles

    with nki.strict(), pytest.raises(nki.NkiValidationError, match=r"\(10240 allocated, 8192 placed by address\)"):
        nki.jit(over)()


def test_placed_hbm_is_not_emulated():
    with pytest.raises(NotImplementedError, match="explicit HBM placement is not emulated"):
        nki.jit(lambda: nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.shared_hbm, address=(0,)))()


# -- 2. import-time names -----------------------------------------------------------------------------------------
KERNEL_MODULE = '''
import nki
import nki.isa as nisa
import nki.language as nl
import nki.typing as nt
from nki.dtype import float8_e4m3fn_x4
from nki.isa.constants import dge_mode, oob_mode


@nki.jit
def gather_rows(data: nt.tensor[8, 4], idx):
    p = idx.shape[0]
    i = nl.ndarray((p, 1), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.dma_copy(dst=i, src=idx, dge_mode=dge_mode.none)
    rows = nl.ndarray((p, 4), dtype=data.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=rows, src=data.ap(pattern=[[4, p], [1, 4]], vector_offset=i, indirect_dim=0),
                  oob_mode=oob_mode.skip)
    out = nl.ndarray((p, 4), dtype=data.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=rows)
    return out


PACKED = float8_e4m3fn_x4
'''


def test_aws_style_module_imports_and_runs_under_as_nki():
    data, idx = f32(8, 4), np.array([[5], [0], [7]], np.uint32)
    before = sys.modules.get("nki")
    with nki.as_nki():
        namespace: dict = {}
        exec(compile(KERNEL_MODULE, "aws_kernel.py", "exec"), namespace)
    assert sys.modules.get("nki") is before and namespace["PACKED"] == nl.float8_e4m3fn_x4
    np.testing.assert_array_equal(namespace["gather_rows"](data, idx), data[[5, 0, 7]])
    with pytest.raises(nki.NkiValidationError, match=r"annotated nki.typing.tensor\[8, 4\] but has shape \(6, 4\)"):
        namespace["gather_rows"](f32(6, 4), idx)
    assert nisa.constants.oob_mode is nisa.oob_mode and nki.dtype.float8_e8m0fnu == ml_dtypes.float8_e8m0fnu


def test_packed_mx_types_move_bit_exact_and_refuse_math():
    words = rng.integers(0, 2 ** 32, size=(4, 6), dtype=np.uint32)

    def body(w):
        t = sb((4, 6), nl.float8_e4m3fn_x4)
        nisa.dma_copy(dst=t, src=w.view(nl.float8_e4m3fn_x4), dge_mode=nisa.dge_mode.hwdge)
        z = sb((4, 2), nl.float8_e4m3fn_x4)
        nisa.memset(z, 0)
        nisa.tensor_copy(dst=t[0:4, 4:6], src=z)
        return t.view(nl.uint32)

    want = words.copy()
    want[:, 4:6] = 0
    np.testing.assert_array_equal(run(body, words), want)
    x4 = sb((4, 4), nl.float8_e5m2_x4)
    with pytest.raises(NotImplementedError, match="float8_e5m2_x4: arithmetic and dtype conversion"):
        nisa.tensor_tensor(dst=sb((4, 4)), data1=x4, data2=x4, op=nl.add)
    with pytest.raises(NotImplementedError, match="nc_matmul_mx"):
        nisa.nc_matmul(ps((4, 4)), x4, x4)
    with pytest.raises(NotImplementedError, match="MXFP8/MXFP4 matmul"):
        nisa.nc_matmul_mx(ps((4, 4)), x4, x4, sb((4, 1), nl.uint8), sb((4, 1), nl.uint8))


# -- 3. .ap(dtype=...) ------------------------------------------------------------------------------------------
def test_ap_reinterprets_bytes_as_another_dtype_from_the_view_base():
    x = f32(64, 8)
    bits = x.view(ml_dtypes.bfloat16)  # (64, 16)

    def body(x_hbm):
        t = loaded(x_hbm)
        out = sb((2, 16), nl.bfloat16)  # partitions 32..33: the pattern starts at the view's base offset
        nisa.tensor_copy(dst=out, src=t[32:34].ap(pattern=[[16, 2], [1, 16]], dtype=nl.bfloat16))
        return out

    np.testing.assert_array_equal(run(body, x).view(np.uint16), bits[32:34].view(np.uint16))
    x = x[:4]

    def hbm_body(x_hbm):
        out = sb((4, 8), nl.int32)
        nisa.dma_copy(dst=out, src=x_hbm.ap(pattern=[[8, 4], [1, 8]], dtype=nl.int32))
        return out

    np.testing.assert_array_equal(run(hbm_body, x), x.view(np.int32))


# -- 4. shared_identity_matrix -----------------------------------------------------------------------------------
def test_shared_identity_matrix_is_an_sbuf_tile():
    x = f32(8, 8)

    def body(x_hbm):
        eye = nl.shared_identity_matrix(8, dtype=nl.float32)
        assert eye.buffer is nl.sbuf and eye.shape == (8, 8)
        acc = ps((8, 8))
        nisa.nc_matmul(acc, loaded(x_hbm), eye)  # x.T @ I
        out = sb((8, 8))
        nisa.tensor_copy(dst=out, src=acc)
        return out

    np.testing.assert_array_equal(run(body, x), x.T)
    assert nki.last_stats().instructions["dma"] == 3  # input, the identity constant, output


# -- 5. instructions --------------------------------------------------------------------------------------------
def _scan_ref(d0, d1, init, f0, f1):
    out, state = np.empty_like(d0), np.asarray(init, np.float32).reshape(-1)
    for i in range(d0.shape[1]):
        state = out[:, i] = f1(f0(d0[:, i], state), d1[:, i]).astype(np.float32)
    return out


def test_tensor_tensor_scan():
    d0, d1, init = f32(4, 16), f32(4, 16), f32(4, 1)

    def body(a, b, c):
        out = sb((4, 16))
        nisa.tensor_tensor_scan(out, loaded(a), loaded(b), loaded(c), nl.multiply, nl.add)
        rev = sb((4, 16))
        nisa.tensor_tensor_scan(rev, loaded(a), loaded(b), 0.5, nl.subtract, nl.subtract, reverse0=True, reverse1=True)
        both = sb((8, 16))
        nisa.tensor_copy(dst=both[0:4], src=out)
        nisa.dma_copy(dst=both[4:8], src=rev)
        return both

    got = run(body, d0, d1, init)
    np.testing.assert_allclose(got[:4], _scan_ref(d0, d1, init, np.multiply, np.add), rtol=1e-6)
    rev = _scan_ref(d0, d1, np.full(4, 0.5, np.float32), lambda a, s: s - a, lambda t, b: b - t)
    np.testing.assert_allclose(got[4:], rev, rtol=1e-6)


def test_nc_stream_shuffle_within_quadrants():
    x = f32(64, 4)
    mask = [31 - i for i in range(32)]
    mask[3] = 255  # partition 3 of each quadrant keeps dst

    def body(a):
        out = sb((64, 4))
        nisa.memset(out, -1.0)
        nisa.nc_stream_shuffle(out, loaded(a), mask)
        return out

    want = np.concatenate([x[31::-1], x[63:31:-1]])
    want[[3, 35]] = -1.0
    np.testing.assert_array_equal(run(body, x), want)


def test_max8_find_index8_match_replace8_documented_example():
    data = np.array([[1, 2, 3, 4, 8, 8, 8, 8, 8, 8, 8]], np.float32)
    vals = np.array([[3, 8, 8, 8, 8, 8, 8, 8]], np.float32)

    def body(d, v):
        dt_, vt = loaded(d), loaded(v)
        top, idx, rep, ridx = sb((1, 8)), sb((1, 8), nl.uint32), sb((1, 11)), sb((1, 8), nl.uint16)
        nisa.max8(top, dt_)
        nisa.nc_find_index8(idx, dt_, vt)
        nisa.nc_match_replace8(rep, dt_, vt, -5.0, dst_idx=ridx)
        out = sb((1, 35))
        for k, (t, w) in enumerate(((top, 8), (idx, 8), (rep, 11), (ridx, 8))):
            lo = (0, 8, 16, 27)[k]
            nisa.tensor_copy(dst=out[0:1, lo:lo + w], src=t)
        return out

    got = run(body, data, vals)[0]
    np.testing.assert_array_equal(got[0:8], [8] * 7 + [4])
    np.testing.assert_array_equal(got[8:16], [2, 4, 5, 6, 7, 8, 9, 10])  # duplicates: ascending positions
    np.testing.assert_array_equal(got[16:27], [1, 2, -5, 4] + [-5] * 7)
    np.testing.assert_array_equal(got[27:35], [2, 10, 9, 8, 7, 6, 5, 4])  # duplicates: descending (documented)


def test_find_index8_missing_value_gives_all_ones():
    x = f32(2, 16)

    def body(d):
        t = loaded(d)
        vals, idx = sb((2, 8)), sb((2, 8), nl.uint16)
        nisa.tensor_copy(dst=vals, src=t[0:2, 0:8])
        nisa.memset(vals[0:2, 7:8], 1e30)  # not in data
        nisa.nc_find_index8(idx, t, vals)
        return idx

    got = run(body, x)
    np.testing.assert_array_equal(got[:, :7], np.tile(np.arange(7), (2, 1)))
    assert (got[:, 7] == 0xFFFF).all()


def test_nonzero_with_count_on_core_partitions_only():
    x = (rng.random((32, 8)) < 0.5).astype(np.int32) * rng.integers(1, 9, (32, 8), dtype=np.int32)

    def body(a):
        out = sb((32, 9), nl.int32)
        nisa.memset(out, -7)
        nisa.nonzero_with_count(out, loaded(a), index_offset=16, padding_val=-1)
        return out

    got = run(body, x)
    for r in range(32):
        if r % 16:
            assert (got[r] == -7).all()
            continue
        nz = np.flatnonzero(x[r])
        np.testing.assert_array_equal(got[r], [*(nz + 16), *[-1] * (8 - nz.size), nz.size])


def test_range_select_and_its_max_reduction():
    x = f32(4, 16)
    lo, hi = np.array([[2], [0], [5], [15]], np.float32), np.array([[6], [16], [5], [16]], np.float32)

    def body(a, b0, b1):
        out, red = sb((4, 16)), sb((4, 1))
        nisa.range_select(out, loaded(a), nl.greater_equal, nl.less, loaded(b0), loaded(b1), reduce_res=red,
                          range_start=0)
        both = sb((4, 17))
        nisa.tensor_copy(dst=both[0:4, 0:16], src=out)
        nisa.tensor_copy(dst=both[0:4, 16:17], src=red)
        return both

    got = run(body, x, lo, hi)
    i = np.arange(16)
    want = np.where((i >= lo) & (i < hi), x, FP32_MIN)
    np.testing.assert_array_equal(got[:, :16], want)
    np.testing.assert_array_equal(got[:, 16], want.max(axis=1))


def test_nc_n_gather_and_local_gather():
    data, ids = f32(4, 2, 8), rng.integers(0, 16, (4, 5)).astype(np.uint32)

    def body(d, i):
        out = sb((4, 5))
        nisa.nc_n_gather(out, loaded(d), loaded(i))
        return out

    np.testing.assert_array_equal(run(body, data, ids), np.take_along_axis(data.reshape(4, 16), ids.astype(int), 1))

    src, n, valid = f32(32, 64), 4, 24
    chunks = rng.integers(0, 16, (16, 2)).astype(np.uint16)
    index = np.tile(chunks * n, (2, 1))  # element offsets, the same for both cores

    def gather(s, i):
        out = sb((32, valid * n))
        nisa.local_gather(out, loaded(s), loaded(i), num_elem_per_idx=n, num_valid_indices=valid)
        return out

    order = chunks.flatten(order="F")[:valid]
    want = src.reshape(32, 16, n)[:, order, :].reshape(32, -1)  # the docstring's NumPy equivalent
    np.testing.assert_array_equal(run(gather, src, index), want)


def test_dma_compute_sums_and_scatter_read_modify_write():
    a, b, c = f32(4, 8), f32(4, 8), f32(4, 8)

    def body(x, y, z):
        out = sb((4, 8))
        nisa.dma_compute(out, [x, y, z], nl.add)
        return out

    np.testing.assert_allclose(run(body, a, b, c), a + b + c, rtol=1e-6)
    table, upd, idx = f32(8, 4), f32(3, 4), np.array([[6], [1], [3]], np.int32)

    def scatter(t, u, i):
        it, ut = loaded(i), loaded(u)
        rows = t.ap(pattern=[[4, 3], [1, 4]], vector_offset=it, indirect_dim=0)
        nisa.dma_compute(rows, [rows, ut], nl.add)
        return ut

    want = table.copy()
    want[[6, 1, 3]] += upd
    run(scatter, table, upd, idx)  # the kernel writes its input table in place
    np.testing.assert_allclose(table, want, rtol=1e-6)


# -- 6. zero-size slices, NKIObject, shared_constant --------------------------------------------------------------
def test_zero_size_ds_is_an_empty_view_and_issues_nothing():
    x = f32(4, 8)

    def body(x_hbm):
        t = loaded(x_hbm)
        empty = t[0:4, nl.ds(8, 0)]
        assert empty.shape == (4, 0) and x_hbm[nl.ds(2, 0)].shape == (0, 8)
        nisa.tensor_scalar(dst=empty, data=empty, op0=nl.add, operand0=1.0)
        nisa.dma_copy(dst=x_hbm[nl.ds(4, 0)], src=t[nl.ds(0, 0)])
        return t

    np.testing.assert_array_equal(run(body, x), x)
    assert nki.last_stats().instructions == {"tensor": 0, "vector": 0, "scalar": 0, "gpsimd": 0, "dma": 2}
    with pytest.raises(nki.NkiValidationError, match="size must be >= 0"):
        nl.ds(0, -1)


def test_nkiobject_keyword_construction():
    cfg = nl.NKIObject(tile=128, dtype=nl.bfloat16)
    assert (cfg.tile, cfg.dtype) == (128, nl.bfloat16)
    with pytest.raises(TypeError):
        nl.NKIObject(128)


def test_shared_constant_from_array_and_npy_path(tmp_path):
    const = f32(4, 8)
    path = tmp_path / "const.npy"
    np.save(path, const)

    def body(x_hbm):
        out = sb((4, 8))
        nisa.dma_copy(dst=out, src=nl.shared_constant(str(path)))
        nisa.tensor_tensor(dst=out, data1=out, data2=loaded(nl.shared_constant(const)), op=nl.add)
        return out

    np.testing.assert_array_equal(run(body, const), 2 * const)
    with pytest.raises(nki.NkiValidationError, match="must name a .npy file"):
        nl.shared_constant(str(tmp_path / "const.txt"))


# -- 7. hardware rules (the negative kernels are in FIDELITY_NEGATIVE) --------------------------------------------
def test_fp8_e4m3fn_matmul_on_trn3_and_rsqrt_paths():
    x = rng.standard_normal((4, 4)).astype(ml_dtypes.float8_e4m3fn)

    def body(a):
        acc, out = ps((4, 4)), sb((4, 4))
        nisa.nc_matmul(acc, loaded(a), loaded(a))
        nisa.tensor_copy(dst=out, src=acc)
        return out

    with nki.use_target("trn3"):
        got = run(body, x)
    xf = x.astype(np.float32)
    np.testing.assert_allclose(got, xf.T @ xf, rtol=1e-6)
    y = (np.abs(f32(4, 8)) + 0.5).astype(np.float32)

    def rsqrt(a):
        t, p = loaded(a), ps((4, 8))
        out = nl.rsqrt(t)
        nisa.activation(dst=p, op=nl.rsqrt, data=t)  # the ScalarE activation still reads/writes PSUM
        nisa.tensor_tensor(dst=out, data1=out, data2=p, op=nl.add)
        return out

    np.testing.assert_allclose(run(rsqrt, y), 2 / np.sqrt(y), rtol=1e-6)
    assert nki.last_stats().instructions["gpsimd"] == 1


def test_gpsimd_activation_is_not_emulated():
    with pytest.raises(NotImplementedError, match="GpSimd activation"):
        nisa.activation(dst=sb((4, 4)), op=nl.exp, data=sb((4, 4)), engine=nisa.engine.gpsimd)


def test_keyword_only_kernel_signature_is_rejected():
    def kernel(x, *, flag=True):
        return None

    with pytest.raises(nki.NkiValidationError, match=r"keyword-only parameters \(flag\) after `\*`"):
        nki.jit(kernel)(f32(2, 2))


def test_view_queries_and_tensor_indirection():
    t = sb((4, 6, 8))
    assert t.is_contiguous() and not t[0:4, 0:6, 0:8:2].is_contiguous() and not t.is_indirect()
    assert t[0:4, 1:3].get_pattern() == [[48, 4], [8, 2], [1, 8]]
    placed = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf, address=(0, 0))
    assert placed.get_pattern() == [[8, 4], [1, 8]]
    h = nl.ndarray((8, 4), dtype=nl.float32, buffer=nl.shared_hbm)
    assert h.ap([[4, 2], [1, 4]], vector_offset=sb((2, 1), nl.int32)).is_indirect()
    with pytest.raises(NotImplementedError, match="Tensor Indirection"):
        t.indirect(sb((4, 1), nl.uint32))


def test_strided_views_write_through_for_every_base():
    """emulator/tensor.py _strided: an ndarray over a contiguous base's buffer, as_strided otherwise (a caller's
    transposed array, fp8 bytes): each a view of the same memory, writes reaching it."""
    from opport.backends.neuron.emulator.tensor import _strided

    flat = np.arange(32, dtype=np.float32)
    v = _strided(flat[4:], (3, 4), (32, 4))
    assert v.tolist() == [[4, 5, 6, 7], [12, 13, 14, 15], [20, 21, 22, 23]]
    v[1, 0] = -1
    assert flat[12] == -1
    caller = np.arange(12, dtype=np.float32).reshape(3, 4).T  # not contiguous: no buffer, the as_strided path
    span = _strided(caller, (12,), (4,))
    span[1] = 99
    assert np.shares_memory(span, caller) and caller[1, 0] == 99  # memory order: the untransposed [0, 1]
    e5 = np.zeros(8, ml_dtypes.float8_e5m2)
    w = _strided(e5[2:], (2, 2), (2, 1))
    w[...] = 1.5
    assert w.dtype == e5.dtype and e5.astype(np.float32).tolist() == [0, 0, 1.5, 1.5, 1.5, 1.5, 0, 0]
