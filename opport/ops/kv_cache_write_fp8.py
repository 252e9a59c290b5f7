"""kv_cache_write_fp8: each new token's K and V rows quantised to fp8 into its slot of a paged KV cache, in place, with
per-tensor or per-(token, head) scales (vLLM's reshape_and_cache with an fp8 kv_cache_dtype)."""

from __future__ import annotations

import numpy as np

from opport import casegen as cg
from opport.arraymath import FP8_MAX, per_token_scales
from opport.dtypes import FP8
from opport.errors import ArgumentError, DTypeError, ShapeError
from opport.ops.kv_cache_write import HOST_READ, SLOTS, check_rows, check_slot_values, written_rows
from opport.ops.kv_cache_write import make_case as float_case
from opport.ops.paged_attention import check_tensor_scales, fp8_codes, fp8_quotients, fp8_scales
from opport.ops.quantize_fp8 import Q_TOLERANCE, SCALE_TOLERANCE
from opport.spec import (
    FLOAT32,
    FP8_CODES,
    Case,
    Cost,
    ErrorCase,
    check,
    check_domain,
    check_float,
    op,
)

NAME = "kv_cache_write_fp8"


@op(
    arrays=("key", "value", "k_cache", "v_cache", "slot_mapping", "k_scale", "v_scale"),
    domains={"slot_mapping": SLOTS, "k_cache": FP8_CODES, "v_cache": FP8_CODES, "k_scale": FLOAT32,
             "v_scale": FLOAT32},
    writes=("k_cache", "v_cache", "k_scale", "v_scale"),
    constraints={
        f"{NAME}.dtype": "key is float32, float16, bfloat16 or float64, value has key's dtype",
        f"{NAME}.cache_dtype": "k_cache and v_cache are both float8_e4m3fn or both float8_e5m2",
        f"{NAME}.rank": "key, value are 3-d [T, Hkv, D], [T, Hkv, Dv]; caches 4-d; slot_mapping 1-d [T]",
        f"{NAME}.tokens": "value and slot_mapping have key's T",
        f"{NAME}.heads": "k_cache is [num_blocks, block_size, Hkv, D] and v_cache [num_blocks, block_size, Hkv, Dv], "
                         "with key's Hkv, D and value's Hkv, Dv; block_size >= 1",
        f"{NAME}.slot_dtype": "slot_mapping is int32 or int64",
        f"{NAME}.kv_scale": "k_scale and v_scale are float32, both [1] (per tensor, read) or both [num_blocks, "
                            "block_size, Hkv] (per token and head, written)",
        f"{NAME}.scale_values": "per-tensor k_scale and v_scale are finite and > 0",
        f"{NAME}.slot_range": "each slot is -1 (skipped) or in [0, num_blocks * block_size)" + HOST_READ,
        f"{NAME}.slot_unique": "no slot other than -1 appears twice" + HOST_READ,
    },
)
def kv_cache_write_fp8(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    """Quantise each token's key and value rows to the caches' fp8 format at their slots, in place; returns None.

    Slots as `kv_cache_write` (slot s: block s // block_size, offset s % block_size; -1 skipped). The scales
    decide the granularity: [1] is one static scale per tensor (vLLM's k_scale / v_scale from calibration),
    read: code = saturate(x / scale); [num_blocks, block_size, Hkv] is one scale per token and head, computed
    and written next to its row: scale = max(amax / fp8_max, 2^-126) in float32, amax over the row's finite
    |x| (fp8_max 448 for e4m3fn, 57344 for e5m2), code = saturate(x / scale). Codes round to nearest even;
    finite values saturate at ±fp8_max, ±inf becomes ±fp8_max, NaN stays NaN (quantize_fp8's rules).
    `paged_attention` and `paged_varlen_attention` read the cache back as code x scale. Every other byte of the
    caches and scales is left unchanged; slots out of range or repeated raise before anything is written.
    """
    check_float(NAME, "key", key)
    check(value.dtype == key.dtype, DTypeError, NAME, "value", f"{NAME}.dtype", f"{key.dtype} (as key)", value.dtype)
    check_domain(NAME, "k_cache", k_cache, FP8_CODES, f"{NAME}.cache_dtype")
    check(v_cache.dtype == k_cache.dtype, DTypeError, NAME, "v_cache", f"{NAME}.cache_dtype",
          f"{k_cache.dtype} (as k_cache)", v_cache.dtype)
    check_rows(NAME, key, value, k_cache, v_cache, slot_mapping)
    per_token = tuple(k_cache.shape[:3])
    for arg, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        check_domain(NAME, arg, s, FLOAT32, f"{NAME}.kv_scale")
        check(tuple(s.shape) in ((1,), per_token), ShapeError, NAME, arg, f"{NAME}.kv_scale",
              f"[1] or {list(per_token)} (k_cache's [num_blocks, block_size, Hkv])", s.shape)
    check(tuple(v_scale.shape) == tuple(k_scale.shape), ShapeError, NAME, "v_scale", f"{NAME}.kv_scale",
          f"{tuple(k_scale.shape)} (as k_scale: one granularity)", v_scale.shape)


@kv_cache_write_fp8.check_values(("slot_mapping", "k_scale", "v_scale"))
def _check_values(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    check_slot_values(NAME, k_cache, slot_mapping)
    check_tensor_scales(NAME, k_scale, v_scale)


# on device arrays only under OPPORT_CHECK_VALUES=1, as kv_cache_write's (the cuda kernel skips bad slots)
_check_values.on_device = False


@kv_cache_write_fp8.written
def _written(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    _, blocks, offsets = written_rows(slot_mapping, k_cache.shape[1])
    at = (blocks, offsets)
    none = (np.zeros(0, np.int64),)  # a per-tensor scale is read, not written
    return at, at, *((at, at) if per_token_scales(k_scale) else (none, none))


@kv_cache_write_fp8.reference
def _reference(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, *, dtypes):
    """Codes as the exact saturated quotients x / scale in float64 (judged by nearest rounding, quantize_fp8's
    Q_TOLERANCE), per-token scales in float32."""
    tokens, _, _ = written_rows(slot_mapping, k_cache.shape[1])
    fmt, token = dtypes["k_cache"], per_token_scales(k_scale)
    codes, scales = [], []
    for x, s in ((key[tokens], k_scale), (value[tokens], v_scale)):
        s = fp8_scales(x, fmt, True) if token else np.asarray(s, np.float32)
        codes.append(fp8_quotients(x, s, fmt))
        scales.append(s.astype(np.float64) if token else np.zeros(0))
    return (*codes, *scales)


# codes: the fp8 value nearest the exact quotient; scales: one float32 rounding of amax / fp8_max (quantize_fp8's)
kv_cache_write_fp8.tolerance(**{d: Q_TOLERANCE for d in ("float64", "float32", "float16", "bfloat16")})
kv_cache_write_fp8.tolerance(index=1, any=Q_TOLERANCE)
kv_cache_write_fp8.tolerance(index=2, any=SCALE_TOLERANCE)
kv_cache_write_fp8.tolerance(index=3, any=SCALE_TOLERANCE)


def make_case(name, dtype, fmt, token, t, hkv, d, num_blocks, block_size, dv=None, pad=0, slot_dtype="int64",
              dist="normal", tags=(), static=None):
    """kv_cache_write's case (other rows already in the cache, NaN in a few, distinct random slots, `pad` of them
    -1) with fp8 caches and scales: per token (the scales array holds other slots' scales, NaN in a few) or one
    static scale per tensor (`static`, default one that makes the rows span the format: amax / fp8_max)."""
    c = float_case(name, dtype, t, hkv, d, num_blocks, block_size, dv, pad, slot_dtype, dist, tags)
    key, value, kc, vc, slots = c.args
    caches, scales = [], []
    for x, cache in ((key, kc), (value, vc)):
        old = np.where(np.isfinite(np.asarray(cache, np.float64)), cache, 0.0)
        s_old = fp8_scales(old, fmt, True)
        codes = fp8_codes(cache, s_old, fmt)  # NaN rows stay NaN codes
        if token:
            s_old.reshape(-1)[::5] = np.nan
            scales.append(s_old)
        else:
            fin = np.asarray(x, np.float64)[np.isfinite(np.asarray(x, np.float64))]
            amax = np.abs(fin).max(initial=0.0)
            scales.append(np.array([static or min(max(amax / FP8_MAX[fmt], 1e-3), 1e30)], np.float32))  # float32
        caches.append(codes)
    return Case(f"{name}-{fmt[7:11]}-{'token' if token else 'tensor'}", (key, value, *caches, slots, *scales), {},
                tags)


@kv_cache_write_fp8.cases
def _cases(dtype):
    e4, e5 = FP8
    yield make_case("prefill", dtype, e4, True, 40, 2, 64, 8, 16, tags=("llm",))
    yield make_case("prefill", dtype, e5, False, 40, 2, 64, 8, 16)
    yield make_case("decode-int32", dtype, e4, False, 7, 4, 32, 6, 32, slot_dtype="int32")
    yield make_case("padded", dtype, e5, True, 33, 2, 16, 5, 16, pad=9)
    yield make_case("dv-ne-d", dtype, e4, True, 12, 2, 64, 4, 16, dv=32)
    yield make_case("all-padding", dtype, e4, True, 6, 2, 16, 2, 16, pad=6, tags=("edge",))
    yield make_case("no-tokens", dtype, e5, False, 0, 2, 16, 2, 16, tags=("edge",))
    # NaN, ±inf, -0.0, subnormals and the dtype's max: NaN codes, saturation, signed zeros, the 2^-126 scale floor
    yield make_case("specials", dtype, e4, True, 20, 2, 16, 4, 16, dist="specials", tags=("edge",))
    yield make_case("specials", dtype, e5, True, 20, 2, 16, 4, 16, dist="specials", tags=("edge",))
    yield make_case("saturating", dtype, e4, False, 20, 2, 16, 4, 16, static=1e-3, tags=("edge",))  # |x| / s > 448
    yield make_case("decode-llm", dtype, e4, True, 64, 8, 128, 80, 16, tags=("llm",))


@kv_cache_write_fp8.strategy
def _strategy(dtype):
    from hypothesis import strategies as st

    @st.composite
    def case(draw):
        bs = draw(st.sampled_from([1, 8, 16]))
        num_blocks = draw(st.integers(1, 5))
        t = draw(st.integers(0, num_blocks * bs))
        hkv, d = draw(st.integers(1, 3)), draw(st.sampled_from([1, 8, 16, 24]))
        dv = draw(st.sampled_from([d, 8]))
        pad, seed = draw(st.integers(0, t)), draw(cg.seeds())
        fmt, token = draw(st.sampled_from(FP8)), draw(st.booleans())
        return make_case(f"hyp-{seed}", dtype, fmt, token, t, hkv, d, num_blocks, bs, dv, pad,
                         draw(st.sampled_from(SLOTS.dtypes)), draw(cg.dists()), ("hypothesis",))

    return case()


@kv_cache_write_fp8.error_cases
def _error_cases():
    def t(*shape, dt=np.float32):
        return np.zeros(shape, dt)

    e4, e5 = cg.np_dtype("float8_e4m3fn"), cg.np_dtype("float8_e5m2")
    k, v, kc, vc = t(4, 2, 8), t(4, 2, 8), t(3, 16, 2, 8, dt=e4), t(3, 16, 2, 8, dt=e4)
    s, one, tok = np.arange(4, dtype=np.int64), np.ones(1, np.float32), np.ones((3, 16, 2), np.float32)
    ok = (k, v, kc, vc, s, one, one)

    def with_(**kw):
        names = ("key", "value", "k_cache", "v_cache", "slot_mapping", "k_scale", "v_scale")
        return tuple(kw.get(n, a) for n, a in zip(names, ok))

    yield ErrorCase(f"{NAME}.dtype", DTypeError, with_(key=t(4, 2, 8, dt=np.int32)))
    yield ErrorCase(f"{NAME}.dtype", DTypeError, with_(value=t(4, 2, 8, dt=np.float16)))
    yield ErrorCase(f"{NAME}.cache_dtype", DTypeError, with_(k_cache=t(3, 16, 2, 8), v_cache=t(3, 16, 2, 8)))
    yield ErrorCase(f"{NAME}.cache_dtype", DTypeError, with_(v_cache=t(3, 16, 2, 8, dt=e5)))
    yield ErrorCase(f"{NAME}.rank", ShapeError, with_(key=t(4, 16)))
    yield ErrorCase(f"{NAME}.rank", ShapeError, with_(k_cache=t(48, 2, 8, dt=e4)))
    yield ErrorCase(f"{NAME}.rank", ShapeError, with_(slot_mapping=s.reshape(4, 1)))
    yield ErrorCase(f"{NAME}.tokens", ShapeError, with_(value=t(5, 2, 8)))
    yield ErrorCase(f"{NAME}.tokens", ShapeError, with_(slot_mapping=np.arange(3)))
    yield ErrorCase(f"{NAME}.heads", ShapeError, with_(k_cache=t(3, 16, 1, 8, dt=e4)))
    yield ErrorCase(f"{NAME}.heads", ShapeError, with_(v_cache=t(3, 8, 2, 8, dt=e4)))
    yield ErrorCase(f"{NAME}.heads", ShapeError, with_(value=t(4, 1, 8), v_cache=t(3, 16, 1, 8, dt=e4)))
    yield ErrorCase(f"{NAME}.slot_dtype", DTypeError, with_(slot_mapping=s.astype(np.float32)))
    yield ErrorCase(f"{NAME}.kv_scale", DTypeError, with_(k_scale=one.astype(np.float64)))
    yield ErrorCase(f"{NAME}.kv_scale", ShapeError, with_(k_scale=tok[:, :, :1], v_scale=tok[:, :, :1]))
    yield ErrorCase(f"{NAME}.kv_scale", ShapeError, with_(k_scale=one.reshape(())))
    yield ErrorCase(f"{NAME}.kv_scale", ShapeError, with_(k_scale=tok))  # mixed granularity
    for bad in (0.0, -2.0, np.nan, np.inf):
        yield ErrorCase(f"{NAME}.scale_values", ArgumentError, with_(v_scale=np.array([bad], np.float32)))
    yield ErrorCase(f"{NAME}.slot_range", ArgumentError, with_(slot_mapping=np.array([0, 1, 48, 2])))
    yield ErrorCase(f"{NAME}.slot_unique", ArgumentError, with_(slot_mapping=np.array([5, -1, 5, 2])))


@kv_cache_write_fp8.cost
def _cost(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    item = np.dtype(cg.np_dtype(key.dtype)).itemsize
    slot_item = 8 if slot_mapping.dtype == "int64" else 4
    rows = key.size + value.size
    scales = 2 * 4 * key.shape[0] * key.shape[1] if per_token_scales(k_scale) else 8
    # rows read once in key's dtype and written once as 1-byte codes, their scales written (or read), slots read
    return Cost(bytes=rows * (item + 1) + scales + slot_mapping.size * slot_item, flops=3 * rows)
