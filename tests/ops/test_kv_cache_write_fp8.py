"""kv_cache_write_fp8 and the paged attention ops over an fp8 cache: codes against an independent rounding, the
accuracy policy of docs/numerics.md 3.12 (the quantisation's error against the unquantised cache), the conformance
suite catching wrong conversions, and bad scales raising before anything is written."""

import math

import ml_dtypes
import numpy as np
import pytest

import opport
from opport.conformance.cases import Item
from opport.conformance.execute import run_item
from opport.dispatch import clear_cache
from opport.dispatch.registry import get_backend, kernels
from opport.errors import ArgumentError
from opport.ops.kv_cache_write import PAD
from opport.ops.kv_cache_write_fp8 import kv_cache_write_fp8 as spec
from opport.ops.kv_cache_write_fp8 import make_case
from opport.ops.paged_varlen_attention import make_inputs

FORMATS = {"float8_e4m3fn": (ml_dtypes.float8_e4m3fn, 448.0, 2.0**-4), "float8_e5m2": (ml_dtypes.float8_e5m2, 57344.0,
                                                                                          2.0**-3)}


def _call(case, backend="cpu"):
    args = [np.array(a, copy=True) for a in case.args]
    assert opport.kv_cache_write_fp8(*args, backend=backend) is None
    return args


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("token", [True, False])
def test_codes_are_ml_dtypes_rounding_of_the_quotient(fmt, token):
    """Token by token, in float64: scale = float32(amax / fp8_max) (or the static one), code = ml_dtypes' RNE cast
    of clip(x / scale): bit for bit, every other slot untouched."""
    np_fmt, fmax, _ = FORMATS[fmt]
    case = make_case("t", "float32", fmt, token, 30, 2, 16, 4, 16, pad=4, dist="specials")
    key, value, kc, vc, slots, ks, vs = _call(case)
    for x, cache, scale, before, s_before in ((case.args[0], kc, ks, case.args[2], case.args[5]),
                                              (case.args[1], vc, vs, case.args[3], case.args[6])):
        want, want_s = np.array(before, copy=True), np.array(s_before, copy=True)
        for t, slot in enumerate(case.args[4]):
            if slot == PAD:
                continue
            b, o = divmod(int(slot), cache.shape[1])
            row = x[t].astype(np.float64)
            if token:
                amax = np.where(np.isfinite(row), np.abs(row), 0).max(axis=-1)
                s = np.maximum(np.float32(amax / fmax), np.float32(2.0**-126))
                want_s[b, o] = s
            else:
                s = np.full(row.shape[0], s_before[0], np.float32)
            with np.errstate(invalid="ignore"):
                want[b, o] = np.clip(row / s[:, None].astype(np.float64), -fmax, fmax).astype(np_fmt)
        assert cache.tobytes() == want.tobytes()
        assert scale.tobytes() == want_s.tobytes()


def _policy_error(fmt, token):
    """(norm-wise max error / max|ref|, RMS error / RMS ref) of paged_varlen_attention over the cache written by
    kv_cache_write_fp8, against the same call over the unquantised float32 cache (fmt None: a bfloat16 cache)."""
    rng = np.random.default_rng(7)
    q, kc, vc, bt, cuq, lens = make_inputs(rng, "float32", [300, 128, 57, 1000], [1, 16, 57, 1], 8, 2, 128, 16,
                                           extra_blocks=0)
    kc, vc = np.nan_to_num(kc, nan=0.0, posinf=0.0), np.nan_to_num(vc, nan=0.0, posinf=0.0)
    ref = opport.paged_varlen_attention(q.astype(np.float64), kc.astype(np.float64), vc.astype(np.float64), bt, cuq,
                                        lens)
    if fmt is None:
        bf = lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float64)  # noqa: E731
        out = opport.paged_varlen_attention(q.astype(np.float64), bf(kc), bf(vc), bt, cuq, lens)
    else:
        nb, bs, h, d = kc.shape
        shape = (nb, bs, h) if token else (1,)
        k8, v8 = np.zeros(kc.shape, FORMATS[fmt][0]), np.zeros(vc.shape, FORMATS[fmt][0])
        ks = np.full(shape, np.abs(kc).max() / FORMATS[fmt][1], np.float32)
        vs = np.full(shape, np.abs(vc).max() / FORMATS[fmt][1], np.float32)
        opport.kv_cache_write_fp8(kc.reshape(-1, h, d), vc.reshape(-1, h, d), k8, v8, np.arange(nb * bs), ks, vs)
        out = opport.paged_varlen_attention(q, k8, v8, bt, cuq, lens, k_scale=ks, v_scale=vs)
    err = out - ref
    return np.abs(err).max() / np.abs(ref).max(), math.sqrt((err**2).mean() / (ref**2).mean())


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("token", [True, False])
def test_attention_over_an_fp8_cache_is_within_the_accuracy_policy(fmt, token):
    """docs/numerics.md 3.12: each cached value is off by at most u |x| (u, the format's unit roundoff: 2^-4 for
    e4m3fn, 2^-3 for e5m2, 2^-8 for bfloat16), about 0.41 u RMS; through the scores (K) and the weighted sum (V)
    the output's RMS error is about u / sqrt(3) of its RMS: the policy is at most u RMS and 2u norm-wise."""
    u = FORMATS[fmt][2]
    normwise, rms = _policy_error(fmt, token)
    assert rms <= u and normwise <= 2 * u, (normwise, rms)
    assert rms > u / 4  # the quantisation happened (a kernel that kept the float values would not be this far)
    bf_normwise, bf_rms = _policy_error(None, token)
    assert bf_rms <= 2.0**-8 and bf_normwise <= 2.0**-7 and rms > 8 * bf_rms, (bf_normwise, bf_rms)


def _conformance(case, dtype, fn):
    """One conformance item with the cpu kernel replaced by `fn`."""
    k = kernels(spec, get_backend("cpu"))[0]
    saved, k.fn = k.fn, fn
    clear_cache()
    try:
        return run_item(Item(spec.name, "cpu", dtype, case.name, case, None, "fixed"))
    finally:
        k.fn = saved
        clear_cache()


def _real(*args):
    from opport.backends.cpu.kv_cache_write_fp8 import kv_cache_write_fp8

    return kv_cache_write_fp8(*args)


def _truncates(key, value, kc, vc, slots, ks, vs):
    """Rounds toward zero (a plain float -> fp8 cast some hardware does): off by up to a whole ulp."""
    _real(key, value, kc, vc, slots, ks, vs)
    live = slots[slots != PAD]
    for x, cache, s in ((key, kc, ks), (value, vc, vs)):
        rows = x[slots != PAD].astype(np.float64)
        sc = s.reshape(-1, s.shape[-1])[live][..., None] if s.size > 1 else s[0]
        with np.errstate(invalid="ignore"):
            exact = np.clip(rows / sc, -FORMATS[str(cache.dtype)][1], FORMATS[str(cache.dtype)][1])
        code = exact.astype(cache.dtype)
        over = np.abs(code.astype(np.float64)) > np.abs(exact)  # rounded away from zero: one code back (the magnitude
        code = np.where(over, code.view(np.uint8) - np.uint8(1), code.view(np.uint8)).view(cache.dtype)  # bits)
        cache.reshape(-1, *cache.shape[2:])[live] = code


def _no_floor(key, value, kc, vc, slots, ks, vs):
    """Leaves a zero row's scale at 0 instead of 2^-126 (a later dequantisation then divides 0 by 0)."""
    _real(key, value, kc, vc, slots, ks, vs)
    if ks.size > 1:
        ks[ks == np.float32(2.0**-126)] = 0


@pytest.mark.parametrize("bad,name", [(_truncates, "prefill-e4m3-token"), (_no_floor, "specials-e4m3-token")])
def test_conformance_catches_wrong_conversions(bad, name):
    case = next(c for c in spec.get_cases("float32") if c.name == name)
    assert _conformance(case, "float32", _real)["status"] == "pass"
    res = _conformance(case, "float32", bad)
    assert res["status"] == "fail" and "written region" in res["message"], res["message"]


@pytest.mark.parametrize("backend", ["cpu", "cuda", "neuron"])
def test_bad_scales_raise_before_anything_is_written(backend):
    if get_backend(backend).unavailable():
        pytest.skip(get_backend(backend).unavailable())
    case = make_case("t", "float32", "float8_e4m3fn", False, 8, 2, 16, 2, 16)
    args = [np.array(a, copy=True) for a in case.args]
    args[6] = np.array([0.0], np.float32)
    before = args[2].tobytes() + args[3].tobytes()
    with pytest.raises(ArgumentError) as e:
        opport.kv_cache_write_fp8(*args, backend=backend)
    assert e.value.constraint == "kv_cache_write_fp8.scale_values" and e.value.arg == "v_scale"
    assert args[2].tobytes() + args[3].tobytes() == before
