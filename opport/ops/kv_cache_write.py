"""kv_cache_write: each new token's K and V rows copied into its slot of a paged KV cache, in place (vLLM's
reshape_and_cache)."""

from __future__ import annotations

import numpy as np

from opport import casegen as cg
from opport.arraymath import PAD
from opport.errors import ArgumentError, DTypeError, ShapeError
from opport.spec import (
    Case,
    Cost,
    Domain,
    ErrorCase,
    Tolerance,
    check,
    check_domain,
    check_float,
    check_ndim,
    check_same_dtype,
    op,
)

NAME = "kv_cache_write"
HOST_READ = (" (read on the host before any kernel: NumPy and CPU arrays always, device arrays under "
             "OPPORT_CHECK_VALUES=1)")
SLOTS = Domain("an int32 or int64 array", ("int32", "int64"))  # vLLM's slot_mapping is int64; 32-bit index paths


@op(
    arrays=("key", "value", "k_cache", "v_cache", "slot_mapping"),
    domains={"slot_mapping": SLOTS},
    writes=("k_cache", "v_cache"),
    constraints={
        "kv_cache_write.dtype": "key is float32, float16, bfloat16 or float64",
        "kv_cache_write.dtype_mismatch": "value, k_cache and v_cache have key's dtype",
        "kv_cache_write.rank": "key, value are 3-d [T, Hkv, D], [T, Hkv, Dv]; caches 4-d; slot_mapping 1-d [T]",
        "kv_cache_write.tokens": "value and slot_mapping have key's T",
        "kv_cache_write.heads": "k_cache is [num_blocks, block_size, Hkv, D] and v_cache [num_blocks, block_size, "
                                "Hkv, Dv], with key's Hkv, D and value's Hkv, Dv; block_size >= 1",
        "kv_cache_write.slot_dtype": "slot_mapping is int32 or int64",
        "kv_cache_write.slot_range": "each slot is -1 (skipped) or in [0, num_blocks * block_size)" + HOST_READ,
        "kv_cache_write.slot_unique": "no slot other than -1 appears twice" + HOST_READ,
    },
)
def kv_cache_write(key, value, k_cache, v_cache, slot_mapping):
    """Write each token's key and value rows into its cache slot, in place; returns None.

    key [T, Hkv, D] and value [T, Hkv, Dv] go to k_cache and v_cache [num_blocks, block_size, Hkv, D/Dv] at
    slot s = slot_mapping[t]: block s // block_size, offset s % block_size. A slot of -1 is skipped (a
    padding token). The rows are copied bit for bit; every other byte of the caches is left unchanged.
    Slots out of range or repeated raise before anything is written (the dispatcher reads slot_mapping
    back from the device to check it).
    """
    check_float(NAME, "key", key)
    check_same_dtype(NAME, "key", key, value=value, k_cache=k_cache, v_cache=v_cache)
    check_rows(NAME, key, value, k_cache, v_cache, slot_mapping)


def check_rows(name: str, key, value, k_cache, v_cache, slot_mapping) -> None:
    """`<name>.rank`, `.tokens`, `.heads` and `.slot_dtype`: the rows, caches and slots' shapes agree (kv_cache_write
    and kv_cache_write_fp8)."""
    for arg, m, nd in (("key", key, 3), ("value", value, 3), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4),
                       ("slot_mapping", slot_mapping, 1)):
        check_ndim(name, arg, m, nd, constraint=f"{name}.rank")
    t = key.shape[0]
    for arg, m in (("value", value), ("slot_mapping", slot_mapping)):
        check(m.shape[0] == t, ShapeError, name, arg, f"{name}.tokens", f"T = {t} (as key)", m.shape)
    check(k_cache.shape[1] >= 1 and k_cache.shape[2:] == key.shape[1:], ShapeError, name, "k_cache", f"{name}.heads",
          f"[num_blocks, block_size >= 1, {key.shape[1]}, {key.shape[2]}] (key's Hkv, D)", k_cache.shape)
    check(v_cache.shape[:2] == k_cache.shape[:2] and v_cache.shape[2:] == value.shape[1:], ShapeError, name, "v_cache",
          f"{name}.heads", f"[{k_cache.shape[0]}, {k_cache.shape[1]}, {value.shape[1]}, {value.shape[2]}] "
          "(k_cache's blocks, value's Hkv, Dv)", v_cache.shape)
    check(value.shape[1] == key.shape[1], ShapeError, name, "value", f"{name}.heads", f"Hkv = {key.shape[1]} (as key)",
          value.shape)
    check_domain(name, "slot_mapping", slot_mapping, SLOTS, f"{name}.slot_dtype")


@kv_cache_write.check_values(("slot_mapping",))
def _check_slots(key, value, k_cache, v_cache, slot_mapping):
    check_slot_values(NAME, k_cache, slot_mapping)


def check_slot_values(name: str, k_cache, slot_mapping) -> None:
    """`<name>.slot_range` and `<name>.slot_unique` (kv_cache_write and kv_cache_write_fp8)."""
    n = k_cache.shape[0] * k_cache.shape[1]
    s = np.asarray(slot_mapping).astype(np.int64)
    bad = (s != PAD) & ((s < 0) | (s >= n))
    check(not bad.any(), ArgumentError, name, "slot_mapping", f"{name}.slot_range", f"-1 or in [0, {n})",
          f"slot {int(s[bad][0]) if bad.any() else 0} at token {int(np.flatnonzero(bad)[0]) if bad.any() else 0}")
    live = np.sort(s[s != PAD])
    dup = live[1:][live[1:] == live[:-1]]
    check(dup.size == 0, ArgumentError, name, "slot_mapping", f"{name}.slot_unique", "distinct slots (other than -1)",
          f"slot {int(dup[0]) if dup.size else 0} repeated")


# on device arrays only under OPPORT_CHECK_VALUES=1 (a host read per call would break CUDA-graph capture); the cuda
# kernels guard their memory accesses instead (docs/serving.md, "What each call checks")
_check_slots.on_device = False


def written_rows(slot_mapping, block_size: int) -> tuple:
    """(tokens, blocks, offsets) of the tokens that are written (slot != -1)."""
    s = np.asarray(slot_mapping).astype(np.int64)
    tokens = np.flatnonzero(s != PAD)
    return tokens, s[tokens] // block_size, s[tokens] % block_size


@kv_cache_write.written
def _written(key, value, k_cache, v_cache, slot_mapping):
    _, blocks, offsets = written_rows(slot_mapping, k_cache.shape[1])
    return (blocks, offsets), (blocks, offsets)


@kv_cache_write.reference
def _reference(key, value, k_cache, v_cache, slot_mapping):
    tokens, _, _ = written_rows(slot_mapping, k_cache.shape[1])
    return key[tokens], value[tokens]


kv_cache_write.tolerance(**{d: Tolerance(0.0, 0.0, signed_zero=True, reason="a copy: bit for bit (NaN stays NaN)")
                            for d in ("float64", "float32", "float16", "bfloat16")})


def make_case(name, dtype, t, hkv, d, num_blocks, block_size, dv=None, pad=0, slot_dtype="int64", dist="normal",
              tags=()):
    """T tokens (pad of them -1) to distinct random slots of a cache that already holds other values (NaN
    in a few rows, so an unchanged-bytes check sees a kernel that touches them)."""
    rng = cg.rng_for(NAME, name, dtype)
    dv = dv or d
    key = cg.array((t, hkv, d), dtype, rng, dist)
    value = cg.array((t, hkv, dv), dtype, rng, dist)
    k_cache = cg.array((num_blocks, block_size, hkv, d), dtype, rng)
    v_cache = cg.array((num_blocks, block_size, hkv, dv), dtype, rng)
    k_cache.reshape(-1, hkv, d)[::7] = cg.cast(np.nan, dtype)
    v_cache.reshape(-1, hkv, dv)[3::11] = cg.cast(-np.inf, dtype)
    slots = rng.permutation(num_blocks * block_size)[:t].astype(slot_dtype)
    slots[rng.permutation(t)[:pad]] = PAD
    return Case(name, (key, value, k_cache, v_cache, slots), {}, tags)


@kv_cache_write.cases
def _cases(dtype):
    yield make_case("prefill-b16", dtype, 40, 2, 64, 8, 16, tags=("llm",))
    yield make_case("decode-b32-int32", dtype, 7, 4, 32, 6, 32, slot_dtype="int32")
    yield make_case("padded", dtype, 33, 2, 16, 5, 16, pad=9)
    yield make_case("dv-ne-d", dtype, 12, 2, 64, 4, 16, dv=32)
    yield make_case("block-size-1", dtype, 10, 1, 8, 12, 1)
    yield make_case("full-cache", dtype, 48, 1, 16, 3, 16)  # every slot written
    yield make_case("all-padding", dtype, 6, 2, 16, 2, 16, pad=6, tags=("edge",))
    yield make_case("no-tokens", dtype, 0, 2, 16, 2, 16, tags=("edge",))
    yield make_case("specials", dtype, 20, 2, 16, 4, 16, dist="specials", tags=("edge",))  # NaN, inf, -0.0 copied as is
    yield make_case("decode-llm", dtype, 64, 8, 128, 80, 16, tags=("llm",))


@kv_cache_write.strategy
def _strategy(dtype):
    from hypothesis import strategies as st

    @st.composite
    def case(draw):
        bs = draw(st.sampled_from([1, 8, 16, 32]))
        num_blocks = draw(st.integers(1, 6))
        t = draw(st.integers(0, num_blocks * bs))
        hkv, d = draw(st.integers(1, 3)), draw(st.sampled_from([1, 8, 16, 24, 64]))
        dv = draw(st.sampled_from([d, 8]))
        pad, seed = draw(st.integers(0, t)), draw(cg.seeds())
        c = make_case(f"hyp-{seed}", dtype, t, hkv, d, num_blocks, bs, dv, pad, draw(st.sampled_from(SLOTS.dtypes)),
                      draw(cg.dists()), ("hypothesis",))
        return c

    return case()


@kv_cache_write.error_cases
def _error_cases():
    def t(*shape, dt=np.float32):
        return np.zeros(shape, dt)

    k, v, kc, vc, s = t(4, 2, 8), t(4, 2, 8), t(3, 16, 2, 8), t(3, 16, 2, 8), np.arange(4, dtype=np.int64)
    yield ErrorCase(f"{NAME}.dtype", DTypeError, (t(4, 2, 8, dt=np.int32), v, kc, vc, s))
    yield ErrorCase(f"{NAME}.dtype_mismatch", DTypeError, (k, v, t(3, 16, 2, 8, dt=np.float16), vc, s))
    yield ErrorCase(f"{NAME}.dtype_mismatch", DTypeError, (k, t(4, 2, 8, dt=np.float64), kc, vc, s))
    yield ErrorCase(f"{NAME}.rank", ShapeError, (t(4, 16), v, kc, vc, s))
    yield ErrorCase(f"{NAME}.rank", ShapeError, (k, v, t(48, 2, 8), vc, s))
    yield ErrorCase(f"{NAME}.rank", ShapeError, (k, v, kc, vc, s.reshape(4, 1)))
    yield ErrorCase(f"{NAME}.tokens", ShapeError, (k, t(5, 2, 8), kc, vc, s))
    yield ErrorCase(f"{NAME}.tokens", ShapeError, (k, v, kc, vc, np.arange(3)))
    yield ErrorCase(f"{NAME}.heads", ShapeError, (k, v, t(3, 16, 1, 8), vc, s))
    yield ErrorCase(f"{NAME}.heads", ShapeError, (k, v, kc, t(3, 8, 2, 8), s))
    yield ErrorCase(f"{NAME}.heads", ShapeError, (k, t(4, 1, 8), kc, t(3, 16, 1, 8), s))
    yield ErrorCase(f"{NAME}.heads", ShapeError, (k, v, t(3, 0, 2, 8), t(3, 0, 2, 8), s))
    yield ErrorCase(f"{NAME}.slot_dtype", DTypeError, (k, v, kc, vc, s.astype(np.float32)))
    yield ErrorCase(f"{NAME}.slot_range", ArgumentError, (k, v, kc, vc, np.array([0, 1, 48, 2])))
    yield ErrorCase(f"{NAME}.slot_range", ArgumentError, (k, v, kc, vc, np.array([0, -2, 3, 2], np.int32)))
    yield ErrorCase(f"{NAME}.slot_unique", ArgumentError, (k, v, kc, vc, np.array([5, -1, 5, 2])))


@kv_cache_write.cost
def _cost(key, value, k_cache, v_cache, slot_mapping):
    item = np.dtype(cg.np_dtype(key.dtype)).itemsize
    slot_item = 8 if slot_mapping.dtype == "int64" else 4
    # every token's rows read once and written once (padding tokens counted: an upper bound), slots read once
    return Cost(bytes=2 * (key.size + value.size) * item + slot_mapping.size * slot_item, flops=0)
