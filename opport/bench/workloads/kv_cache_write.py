"""kv_cache_write: a decode step's new tokens (64 sequences) and a prefill chunk (8K tokens) into a Llama-3 8B
paged cache (Hkv 8, D 128, block 16). The row's roofline is the rows' bytes (read and written once) over the
copy bandwidth; the baseline is vLLM's torch fallback, an index_put of the rows into the flattened cache."""

import numpy as np

from opport.bench.workloads import Shape, Workload


def _s(name, t, hkv, d, blocks, bs, tiers):
    return Shape(name, f"T{t} Hkv{hkv} D{d} cache {blocks}x{bs}", dict(t=t, hkv=hkv, d=d, blocks=blocks, bs=bs), tiers)


SHAPES = [
    _s("smoke", 16, 2, 32, 8, 16, ("smoke",)),
    _s("decode-64", 64, 8, 128, 512, 16, ("small", "llm")),
    _s("prefill-2k", 2048, 8, 128, 256, 16, ("small",)),
    _s("llama8b-prefill-8k", 8192, 8, 128, 4096, 16, ("llm",)),
]


def make(d, dtype, mk):
    t, hkv, dh, blocks, bs = d["t"], d["hkv"], d["d"], d["blocks"], d["bs"]
    slots = np.random.default_rng(t).permutation(blocks * bs)[:t].astype(np.int64)
    if mk.kind != "numpy":
        import torch

        slots = torch.from_numpy(slots).to(mk.device)
    return dict(key=mk.normal((t, hkv, dh), dtype), value=mk.normal((t, hkv, dh), dtype),
                k_cache=mk.normal((blocks, bs, hkv, dh), dtype), v_cache=mk.normal((blocks, bs, hkv, dh), dtype),
                slot_mapping=slots)


def torch_eager(key, value, k_cache, v_cache, slot_mapping):
    k_cache.view(-1, *key.shape[1:])[slot_mapping] = key
    v_cache.view(-1, *value.shape[1:])[slot_mapping] = value


def numpy_composition(key, value, k_cache, v_cache, slot_mapping):
    k_cache.reshape(-1, *key.shape[1:])[slot_mapping] = key
    v_cache.reshape(-1, *value.shape[1:])[slot_mapping] = value


WORKLOAD = Workload(
    "kv_cache_write", SHAPES, make, torch_eager=torch_eager,
    torch_call="k_cache.view(-1, Hkv, D)[slot_mapping] = key (and v), vLLM's torch path",
    numpy=numpy_composition, numpy_call="k_cache.reshape(-1, Hkv, D)[slot_mapping] = key (and v)",
)
