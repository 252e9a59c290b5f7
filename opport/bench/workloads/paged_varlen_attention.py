"""paged_varlen_attention: one call for a vLLM-style mixed batch, decodes and prefill chunks over one paged cache.

Llama-3 8B heads (Hq 32 / Hkv 8, D 128), block 16: many decode sequences at a long context plus a few prefill
chunks (each chunk's new tokens the last positions of its context). The torch baseline is what a framework
without a mixed-batch paged kernel runs: SDPA per sequence over its dense K/V, gathered once outside the timing,
with the bottom-right causal mask of its chunk (built once too).
"""

import math

import numpy as np

from opport.bench.workloads import Shape, Workload
from opport.bench.workloads.paged_attention import caches, dequantised


def _s(name, decodes, ctx, chunks, new, chunk_ctx, hq, hkv, d, tiers, fp8=False):
    desc = f"{decodes} decodes at ctx{ctx} + {chunks} chunks of {new} at ctx{chunk_ctx}, H{hq}/{hkv} D{d} block16"
    return Shape(name + "-fp8" * fp8, desc + " fp8-e4m3 per token" * fp8,
                 dict(ctx=[ctx] * decodes + [chunk_ctx] * chunks, new=[1] * decodes + [new] * chunks, hq=hq, hkv=hkv,
                      d=d, bs=16, fp8=fp8), tiers)


SHAPES = [
    _s("smoke", 2, 64, 1, 16, 48, 4, 2, 32, ("smoke",)),
    _s("mixed-256", 6, 256, 2, 64, 256, 8, 2, 64, ("small",)),
    _s("llama8b-mixed-4k", 60, 4096, 4, 512, 2048, 32, 8, 128, ("llm",)),
    _s("llama8b-chunks-4k", 0, 4096, 8, 1024, 4096, 32, 8, 128, ("llm",)),
    _s("llama8b-decode-4k", 64, 4096, 0, 1, 1, 32, 8, 128, ("llm",)),  # against paged_attention's row of this shape
    # an fp8 cache (e4m3fn, a scale per token and head), as Engine(kv_cache_dtype=...) keeps it
    _s("smoke", 2, 64, 1, 16, 48, 4, 2, 32, ("smoke",), fp8=True),
    _s("llama8b-mixed-4k", 60, 4096, 4, 512, 2048, 32, 8, 128, ("llm",), fp8=True),
]


def make(d, dtype, mk):
    ctx, new, bs = d["ctx"], d["new"], d["bs"]
    need = [-(-n // bs) for n in ctx]
    order = np.random.default_rng(sum(ctx)).permutation(sum(need)).astype(np.int32)
    tables = np.zeros((len(ctx), max(need)), np.int32)
    at = 0
    for b, m in enumerate(need):
        tables[b, :m] = order[at:at + m]
        at += m
    cu = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    lens = np.asarray(ctx, np.int32)
    if mk.kind != "numpy":
        import torch

        tables, cu, lens = (torch.from_numpy(a).to(mk.device) for a in (tables, cu, lens))
    return dict(q=mk.normal((int(sum(new)), d["hq"], d["d"]), dtype),
                **caches(mk, (sum(need), bs, d["hkv"], d["d"]), dtype, d["fp8"]), block_tables=tables,
                cu_seqlens_q=cu, context_lens=lens, scale=None, softcap=None, sliding_window=None)


_dense: dict = {}  # (id(k_cache), q's dtype) -> (k_cache, [(dense k, dense v, mask)] per sequence): built once


def _sequences(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, k_scale, v_scale):
    key = (id(k_cache), q.dtype)
    hit = _dense.get(key)
    if hit is None or hit[0] is not k_cache:
        import torch

        bs, seqs = k_cache.shape[1], []
        for b in range(block_tables.shape[0]):
            ctx, n = int(context_lens[b]), int(cu_seqlens_q[b + 1] - cu_seqlens_q[b])
            pos = torch.arange(ctx, device=k_cache.device)
            blk = block_tables[b].long()[pos // bs]
            k, v = (dequantised(c, s, (blk, pos % bs), q).transpose(0, 1).contiguous()  # [Hkv, ctx, D]
                    for c, s in ((k_cache, k_scale), (v_cache, v_scale)))
            mask = pos[None, :] <= (ctx - n + torch.arange(n, device=k_cache.device))[:, None]  # bottom-right causal
            seqs.append((k, v, mask))
        _dense.clear()
        hit = _dense[key] = (k_cache, seqs)
    return hit[1]


def torch_eager(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, softcap, sliding_window, k_scale,
                v_scale):
    """SDPA per sequence over its dense K/V with its chunk's causal mask (gathered and built outside the timing)."""
    import torch
    import torch.nn.functional as F

    out = []
    seqs = _sequences(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, k_scale, v_scale)
    for b, (k, v, mask) in enumerate(seqs):
        qb = q[int(cu_seqlens_q[b]):int(cu_seqlens_q[b + 1])].transpose(0, 1)  # [Hq, n, D]
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale, enable_gqa=qb.shape[0] != k.shape[0])
        out.append(o.transpose(0, 1))
    return torch.cat(out)


def torch_reference(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, softcap, sliding_window,
                    k_scale, v_scale):
    """float64 attention per sequence over its gathered K/V (math only, no SDPA backend choice)."""
    import torch

    out = []
    seqs = _sequences(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, k_scale, v_scale)
    for b, (k, v, mask) in enumerate(seqs):
        qb = q[int(cu_seqlens_q[b]):int(cu_seqlens_q[b + 1])].transpose(0, 1)
        g = qb.shape[0] // k.shape[0]
        s = qb @ k.repeat_interleave(g, 0).transpose(1, 2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
        out.append((p @ v.repeat_interleave(g, 0)).transpose(0, 1))
    return torch.cat(out)


WORKLOAD = Workload(
    "paged_varlen_attention", SHAPES, make, torch_eager=torch_eager,
    torch_call="torch.nn.functional.scaled_dot_product_attention per sequence (bottom-right causal mask) on the dense "
               "K/V gathered once outside the timing",
    torch_reference=torch_reference,
)
