"""paged_attention: Llama-3 8B decode (Hq 32 / Hkv 8, D 128) over paged caches of 1K-32K tokens, block 16.

Every sequence fills its table (context = max_blocks * block_size), so the cost model's visited blocks are
exact and the row's roofline is the KV bytes over the copy bandwidth measured in the same run. The torch
baseline is SDPA over the dense K/V gathered once, outside the timing (memoised per cache tensor): what a
framework without paged attention would run if the gather were free.
"""

import math

import numpy as np

from opport.bench.workloads import Shape, Workload
from opport.dtypes import np_dtype


def _s(name, b, hq, hkv, ctx, d, bs, tiers):
    return Shape(name, f"B{b} H{hq}/{hkv} ctx{ctx} D{d} block{bs}", dict(b=b, hq=hq, hkv=hkv, ctx=ctx, d=d, bs=bs), tiers)


SHAPES = [
    _s("smoke", 2, 4, 2, 64, 32, 16, ("smoke",)),
    _s("decode-256", 8, 8, 2, 256, 64, 16, ("small",)),
    _s("decode-1k-b32", 4, 8, 2, 1024, 64, 32, ("small",)),
    _s("llama8b-decode-1k", 64, 32, 8, 1024, 128, 16, ("llm",)),
    _s("llama8b-decode-4k", 64, 32, 8, 4096, 128, 16, ("llm",)),
    _s("llama8b-decode-8k", 64, 32, 8, 8192, 128, 16, ("llm",)),
    _s("llama8b-decode-16k", 64, 32, 8, 16384, 128, 16, ("llm",)),
    _s("llama8b-decode-32k", 64, 32, 8, 32768, 128, 16, ("llm",)),
    _s("llama8b-decode-8k-b32", 64, 32, 8, 8192, 128, 32, ("llm",)),
    _s("few-long-32k", 4, 32, 8, 32768, 128, 16, ("llm",)),  # 32 (b, kv head) pairs: only the split fills the GPU
    # an fp8 cache (e4m3fn, a scale per token and head): half the KV bytes of the bf16 row above it
    Shape("smoke-fp8", "B2 H4/2 ctx64 D32 block16 fp8", dict(b=2, hq=4, hkv=2, ctx=64, d=32, bs=16, fp8=True),
          ("smoke",)),
    Shape("llama8b-decode-8k-fp8", "B64 H32/8 ctx8192 D128 block16 fp8-e4m3 per token",
          dict(b=64, hq=32, hkv=8, ctx=8192, d=128, bs=16, fp8=True), ("llm",)),
]


def caches(mk, shape, dtype, fp8: bool) -> dict:
    """k_cache, v_cache (and k_scale, v_scale) of `shape`: random values in `dtype`, or e4m3fn codes with a float32
    scale per token and head (values about N(0, 0.5), as a float cache's)."""
    if not fp8:
        return dict(k_cache=mk.normal(shape, dtype), v_cache=mk.normal(shape, dtype), k_scale=None, v_scale=None)
    out = {}
    for name in ("k", "v"):
        x = mk.normal(shape, "float32", 100.0)
        if mk.kind == "numpy":
            codes = np.clip(x, -448, 448).astype(np_dtype("float8_e4m3fn"))
        else:
            import torch

            codes = x.clamp(-448, 448).to(torch.float8_e4m3fn)
        out[f"{name}_cache"], out[f"{name}_scale"] = codes, mk.uniform(shape[:3], "float32", 4e-3, 6e-3)
    return out


def dequantised(cache, scale, idx, like):
    """cache[idx] (a gather of whole blocks, or of slots) in `like`'s dtype; an fp8 cache as code x scale."""
    rows = cache[idx]
    if scale is None:
        return rows
    s = scale[idx]
    return (rows.to(like.dtype) * s.to(like.dtype)[..., None]).to(like.dtype)


def make(d, dtype, mk):
    b, ctx, bs, hkv, dh = d["b"], d["ctx"], d["bs"], d["hkv"], d["d"]
    per = ctx // bs
    tables = np.random.default_rng(ctx + b).permutation(b * per).astype(np.int32).reshape(b, per)
    lens = np.full(b, ctx, np.int32)
    if mk.kind != "numpy":
        import torch

        tables, lens = torch.from_numpy(tables).to(mk.device), torch.from_numpy(lens).to(mk.device)
    return dict(q=mk.normal((b, d["hq"], dh), dtype), **caches(mk, (b * per, bs, hkv, dh), dtype, d.get("fp8", False)),
                block_tables=tables, context_lens=lens, scale=None, softcap=None, sliding_window=None)


_dense: dict = {}  # (id(k_cache), q's dtype) -> (k_cache, dense k, dense v): the baseline's gather, once per cache


def _gathered(q, k_cache, v_cache, block_tables, k_scale, v_scale):
    """Dense K/V [B, Hkv, n, D] in q's dtype (an fp8 cache dequantised as well: outside the timing too)."""
    key = (id(k_cache), q.dtype)
    hit = _dense.get(key)
    if hit is None or hit[0] is not k_cache:
        idx = block_tables.long()
        b, per = idx.shape
        k = dequantised(k_cache, k_scale, idx, q).reshape(b, per * k_cache.shape[1], *k_cache.shape[2:]).transpose(1, 2)
        v = dequantised(v_cache, v_scale, idx, q).reshape(b, per * v_cache.shape[1], *v_cache.shape[2:]).transpose(1, 2)
        _dense.clear()
        hit = _dense[key] = (k_cache, k.contiguous(), v.contiguous())
    return hit[1], hit[2]


def torch_eager(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, sliding_window, k_scale, v_scale):
    """SDPA of each sequence's one query over its dense K/V (every table full: the bench's shapes)."""
    import torch.nn.functional as F

    k, v = _gathered(q, k_cache, v_cache, block_tables, k_scale, v_scale)
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[:, :, 0]


def torch_reference(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, sliding_window, k_scale,
                    v_scale):
    """float64 attention per sequence over its gathered K/V (math only, no SDPA backend choice)."""
    import torch

    k, v = _gathered(q, k_cache, v_cache, block_tables, k_scale, v_scale)
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("bhd,bhnd->bhn", q, k) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    return torch.einsum("bhn,bhnd->bhd", torch.softmax(s, -1), v)


WORKLOAD = Workload(
    "paged_attention", SHAPES, make, torch_eager=torch_eager,
    torch_call="torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa) on the dense K/V "
               "gathered once outside the timing (an fp8 cache dequantised there too)",
    torch_reference=torch_reference,
)
