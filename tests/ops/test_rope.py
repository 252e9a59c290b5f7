"""rope: the cpu kernel against the float64 reference on every declared case, plus exact semantics."""

from functools import partial

import numpy as np
import pytest

import opport
from opport.backends.cpu.rope import rope as kernel
from opport.casegen import cast
from opport.dispatch.adapters import NumpyAdapter
from opport.ops.rope import angle_tables
from opport.ops.rope import rope as spec
from tests.ops import _check

DTYPES = ("float32", "float16", "bfloat16", "float64")


assert_matches = partial(_check.assert_matches, spec)


def run(case):
    return kernel(*spec.bind(*case.args, **case.kwargs))


def halves_from_pairs(a):
    """Interleaved layout (x0, y0, x1, y1, ...) -> rotate-half layout (x0, x1, ..., y0, y1, ...)."""
    return np.concatenate([a[..., 0::2], a[..., 1::2]], axis=-1)


test_fixed_cases = _check.fixed_cases_test(spec, signed_zero=False)
test_hypothesis_cases = _check.hypothesis_test(spec, signed_zero=False)


def test_interleaved_is_rotate_half_on_permuted_features():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 7, 16)).astype(np.float32)
    cos, sin = angle_tables(np.arange(7), 16)
    inter = kernel(x, cos, sin, True)
    half = kernel(halves_from_pairs(x), cos, sin, False)
    assert np.array_equal(halves_from_pairs(inter), half)
    assert not np.allclose(inter, kernel(x, cos, sin, False))  # the two layouts really differ


def test_matches_hf_rotate_half_in_torch():
    import torch

    def rotate_half(t):
        h = t.shape[-1] // 2
        return torch.cat((-t[..., h:], t[..., :h]), dim=-1)

    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 4, 9, 32))
    cos, sin = angle_tables(np.arange(100, 109), 32, "float64")
    c, s = (torch.from_numpy(np.concatenate([t, t], -1)) for t in (cos, sin))  # HF stores full-width tables
    ref = (torch.from_numpy(x) * c + rotate_half(torch.from_numpy(x)) * s).numpy()
    assert np.allclose(kernel(x, cos, sin, False), ref, rtol=1e-14, atol=1e-14)


def test_position_zero_is_identity_and_pair_norms_are_kept():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 2, 5, 8))
    cos, sin = angle_tables(np.arange(5) * 977, 8, "float64")
    out = kernel(x, cos, sin, False)
    assert np.array_equal(out[:, :, 0], x[:, :, 0])
    norm = lambda a: np.hypot(a[..., :4], a[..., 4:])  # noqa: E731
    assert np.allclose(norm(out), norm(x), rtol=1e-14)


def test_per_batch_tables_equal_per_batch_calls():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 2, 6, 16)).astype(np.float32)
    pos = np.arange(6)[None] + np.array([[0], [50], [131066]])
    cos, sin = angle_tables(pos, 16)
    out = kernel(x, cos, sin, True)
    for b in range(3):
        assert np.array_equal(out[b:b + 1], kernel(x[b:b + 1], cos[b], sin[b], True))


def test_long_context_tables_need_float64_angles():
    """The case tables round fp64 angles once; angles formed in float32 are off by ~0.01 rad at 131071."""
    pos, d = np.array([131071]), 128
    cos, _ = angle_tables(pos, d)
    exact = np.cos(pos[:, None] * 10000.0 ** (-np.arange(0, d, 2) / d))
    assert np.abs(cos - exact).max() <= 2**-24
    f32 = np.cos(pos[:, None].astype(np.float32) * np.float32(10000.0) ** (-np.arange(0, d, 2, dtype=np.float32) / d))
    assert np.abs(f32 - exact).max() > 1e-3


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_strided_inputs_match_contiguous_and_are_not_mutated(dtype):
    rng = np.random.default_rng(4)
    xs = cast(rng.standard_normal((2, 9, 3, 16)), dtype).transpose(0, 2, 1, 3)  # [B, S, H, D] memory
    cos, sin = angle_tables(np.arange(18), 16)
    cos_s, sin_s = cos[::2], sin[::2]
    before = [a.copy() for a in (xs, cos, sin)]
    for inter in (False, True):
        out = kernel(xs, cos_s, sin_s, inter)
        assert np.array_equal(out, kernel(np.ascontiguousarray(xs), cos[::2].copy(), sin[::2].copy(), inter))
    assert all(np.array_equal(a, b) for a, b in zip((xs, cos, sin), before))


def test_dispatch_reaches_cpu_kernel():
    x = np.ones((1, 1, 2, 4), np.float16)
    cos, sin = angle_tables(np.arange(2), 4)  # float32 tables with float16 x: allowed
    assert opport.explain("rope", x, cos, sin, backend="cpu").kernel == "cpu.rope"
    out = opport.rope(x, cos, sin, backend="cpu")
    assert out.dtype == np.float16 and np.array_equal(out, kernel(x, cos, sin, False))




def test_cost():
    metas = [NumpyAdapter.meta(a) for a in (np.ones((1, 2, 4, 8), np.float16), *angle_tables(np.arange(4), 8))]
    c = spec.get_cost(*metas)
    assert c.bytes == 2 * 64 * 2 + 2 * 16 * 4 and c.flops == 3 * 64


def test_batch_one_tables_broadcast_over_the_batch():
    """[1, S, D/2] tables (Hugging Face's, for position ids [1, S]) are the [S, D/2] table for every batch entry."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 2, 7, 16)).astype(np.float32)
    cos, sin = angle_tables(np.arange(40, 47), 16)
    for inter in (False, True):
        assert np.array_equal(kernel(x, cos[None], sin[None], inter), kernel(x, cos, sin, inter))
        assert np.array_equal(opport.rope(x, cos[None], sin[None], interleaved=inter, backend="cpu"), kernel(x, cos, sin, inter))
