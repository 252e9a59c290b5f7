"""matmul: the cpu kernel against the float64 reference on every declared case, plus exact semantics."""

from functools import partial

import numpy as np
import pytest

import opport
from opport.backends.cpu.matmul import matmul as kernel
from opport.casegen import cast
from opport.dispatch.adapters import NumpyAdapter
from opport.ops.matmul import matmul as spec
from tests.ops import _check

DTYPES = ("float32", "float16", "bfloat16", "float64")


assert_matches = partial(_check.assert_matches, spec)


def run(case):
    return kernel(*spec.bind(*case.args, **case.kwargs))


test_fixed_cases = _check.fixed_cases_test(spec, signed_zero=False)
test_hypothesis_cases = _check.hypothesis_test(spec, signed_zero=False)


def test_k_zero_is_bias_exactly():
    a, b, bias = np.ones((3, 0), np.float32), np.ones((0, 5), np.float32), np.arange(5, dtype=np.float32)
    assert np.array_equal(kernel(a, b, None), np.zeros((3, 5), np.float32))
    assert np.array_equal(kernel(a, b, bias), np.broadcast_to(bias, (3, 5)))


def test_shared_and_batched_b_agree():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((3, 4, 17, 64)).astype(np.float32), rng.standard_normal((64, 9)).astype(np.float32)
    bb = np.ascontiguousarray(np.broadcast_to(b, (3, 4, 64, 9)))
    assert np.array_equal(kernel(a, b, None), kernel(a, bb, None))


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_strided_inputs_match_contiguous_and_are_not_mutated(dtype):
    rng = np.random.default_rng(1)
    big_a = cast(rng.standard_normal((40, 2 * 33)), dtype)
    bt = cast(rng.standard_normal((17, 33)), dtype)
    a, b = big_a[::2, ::2], bt.T  # strided rows/columns, transposed
    bias = cast(rng.standard_normal(34), dtype)[::2]
    before = [x.copy() for x in (big_a, bt, bias)]
    out = kernel(a, b, bias)
    assert np.array_equal(out, kernel(np.ascontiguousarray(a), np.ascontiguousarray(b), np.ascontiguousarray(bias)))
    assert all(np.array_equal(x, y) for x, y in zip((big_a, bt, bias), before))


def test_16bit_accumulates_in_float32():
    # 4096 ones plus 1/256 each: a float16 accumulator stalls at 2048, float32 gets 4112 exactly
    a = np.full((1, 4096), 1.0, np.float16)
    b = np.full((4096, 1), 1.00390625, np.float16)
    assert float(kernel(a, b, None)[0, 0]) == 4112.0


def test_dispatch_reaches_cpu_kernel():
    a, b = np.ones((2, 3), np.float32), np.ones((3, 4), np.float32)
    assert opport.explain("matmul", a, b, backend="cpu").kernel == "cpu.matmul"
    assert np.array_equal(opport.matmul(a, b, backend="cpu"), np.full((2, 4), 3.0, np.float32))




def test_cost():
    metas = [NumpyAdapter.meta(np.ones(s, np.float16)) for s in ((2, 3, 5), (5, 7), (7,))]
    c = spec.get_cost(*metas)
    assert c.flops == 2 * 2 * 3 * 7 * 5 + 2 * 3 * 7
    assert c.bytes == 2 * (30 + 35 + 7 + 42)
