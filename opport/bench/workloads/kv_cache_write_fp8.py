"""kv_cache_write_fp8: kv_cache_write's rows (a decode step of 64 sequences, prefill chunks) quantised to e4m3fn with a
scale per token and head, into a Llama-3 8B paged cache (Hkv 8, D 128, block 16). The baseline is the torch
composition a framework without the fused op runs: amax per row and head, the scale, the saturated quotient cast to
fp8, and two index_puts (codes, scales)."""

import numpy as np

from opport.bench.workloads import Shape, Workload
from opport.dtypes import np_dtype

FMT, FMAX = "float8_e4m3fn", 448.0


def _s(name, t, hkv, d, blocks, bs, tiers):
    return Shape(name, f"T{t} Hkv{hkv} D{d} cache {blocks}x{bs} e4m3 per token",
                 dict(t=t, hkv=hkv, d=d, blocks=blocks, bs=bs), tiers)


SHAPES = [
    _s("smoke", 16, 2, 32, 8, 16, ("smoke",)),
    _s("decode-64", 64, 8, 128, 512, 16, ("small", "llm")),
    _s("prefill-2k", 2048, 8, 128, 256, 16, ("small",)),
    _s("llama8b-prefill-8k", 8192, 8, 128, 4096, 16, ("llm",)),
]


def make(d, dtype, mk):
    t, hkv, dh, blocks, bs = d["t"], d["hkv"], d["d"], d["blocks"], d["bs"]
    slots = np.random.default_rng(t).permutation(blocks * bs)[:t].astype(np.int64)
    if mk.kind == "numpy":
        kc, vc = (np.zeros((blocks, bs, hkv, dh), np_dtype(FMT)) for _ in range(2))
    else:
        import torch

        slots = torch.from_numpy(slots).to(mk.device)
        kc, vc = (torch.zeros((blocks, bs, hkv, dh), dtype=torch.float8_e4m3fn, device=mk.device) for _ in range(2))
    return dict(key=mk.normal((t, hkv, dh), dtype), value=mk.normal((t, hkv, dh), dtype), k_cache=kc, v_cache=vc,
                slot_mapping=slots, k_scale=mk.uniform((blocks, bs, hkv), "float32", 1.0, 2.0),
                v_scale=mk.uniform((blocks, bs, hkv), "float32", 1.0, 2.0))


def torch_eager(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    import torch

    for x, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        xf = x.float()
        s = (xf.abs().amax(-1) / FMAX).clamp_min(2.0**-126)
        codes = (xf / s[..., None]).clamp(-FMAX, FMAX).to(torch.float8_e4m3fn)
        cache.view(-1, *x.shape[1:])[slot_mapping] = codes
        scale.view(-1, x.shape[1])[slot_mapping] = s


def numpy_composition(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    for x, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        xf = x.astype(np.float32)
        s = np.maximum(np.abs(xf).max(-1) / np.float32(FMAX), np.float32(2.0**-126))
        cache.reshape(-1, *x.shape[1:])[slot_mapping] = np.clip(xf / s[..., None], -FMAX, FMAX).astype(cache.dtype)
        scale.reshape(-1, x.shape[1])[slot_mapping] = s


WORKLOAD = Workload(
    "kv_cache_write_fp8", SHAPES, make, torch_eager=torch_eager,
    torch_call="s = amax(|x|) / 448 per row and head; cache.view(-1, Hkv, D)[slots] = (x / s).clamp(+-448).to(fp8); "
               "scale.view(-1, Hkv)[slots] = s (and v)",
    numpy=numpy_composition, numpy_call="the same in NumPy (ml_dtypes' cast)",
)
