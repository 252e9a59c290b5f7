"""paged_attention: Llama-3 8B decode (Hq 32 / Hkv 8, D 128) over paged caches of 1K-32K tokens, block 16.

Every sequence fills its table (context = max_blocks * block_size), so the cost model's visited blocks are
exact and the row's roofline is the KV bytes over the copy bandwidth measured in the same run. The torch
baseline is SDPA over the dense K/V gathered once, outside the timing (memoised per cache tensor): what a
framework without paged attention would run if the gather were free.
"""

import math

import numpy as np

from opport.bench.workloads import Shape, Workload


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
]


def make(d, dtype, mk):
    b, ctx, bs, hkv, dh = d["b"], d["ctx"], d["bs"], d["hkv"], d["d"]
    per = ctx // bs
    tables = np.random.default_rng(ctx + b).permutation(b * per).astype(np.int32).reshape(b, per)
    lens = np.full(b, ctx, np.int32)
    if mk.kind != "numpy":
        import torch

        tables, lens = torch.from_numpy(tables).to(mk.device), torch.from_numpy(lens).to(mk.device)
    return dict(q=mk.normal((b, d["hq"], dh), dtype), k_cache=mk.normal((b * per, bs, hkv, dh), dtype),
                v_cache=mk.normal((b * per, bs, hkv, dh), dtype), block_tables=tables, context_lens=lens,
                scale=None, softcap=None, sliding_window=None)


_dense: dict = {}  # id(k_cache) -> (k_cache, dense k, dense v): the baseline's gather, done once per cache


def _gathered(k_cache, v_cache, block_tables):
    hit = _dense.get(id(k_cache))
    if hit is None or hit[0] is not k_cache:
        idx = block_tables.long()
        b, per = idx.shape
        k = k_cache[idx].reshape(b, per * k_cache.shape[1], *k_cache.shape[2:]).transpose(1, 2)
        v = v_cache[idx].reshape(b, per * v_cache.shape[1], *v_cache.shape[2:]).transpose(1, 2)
        _dense.clear()
        hit = _dense[id(k_cache)] = (k_cache, k.contiguous(), v.contiguous())
    return hit[1], hit[2]


def torch_eager(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, sliding_window):
    """SDPA of each sequence's one query over its dense K/V (every table full: the bench's shapes)."""
    import torch.nn.functional as F

    k, v = _gathered(k_cache, v_cache, block_tables)
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[:, :, 0]


def torch_reference(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, sliding_window):
    """float64 attention per sequence over its gathered K/V (math only, no SDPA backend choice)."""
    import torch

    k, v = _gathered(k_cache, v_cache, block_tables)
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("bhd,bhnd->bhn", q, k) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    return torch.einsum("bhn,bhnd->bhd", torch.softmax(s, -1), v)


WORKLOAD = Workload(
    "paged_attention", SHAPES, make, torch_eager=torch_eager,
    torch_call="torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa) on the dense K/V "
               "gathered once outside the timing",
    torch_reference=torch_reference,
)
