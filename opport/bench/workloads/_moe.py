"""Inputs shared by the MoE workloads: a random router's picks (k distinct experts per token) and its weights."""

from __future__ import annotations

import numpy as np

from opport.dtypes import np_dtype, torch_dtype

# (tokens, hidden, expert intermediate, experts, experts per token) of the models the MoE rows follow
QWEN3_30B_A3B = dict(tokens=4096, hidden=2048, inter=768, experts=128, k=8)
MIXTRAL_8X7B = dict(tokens=4096, hidden=4096, inter=14336, experts=8, k=2)


def picks(mk, tokens: int, experts: int, k: int):
    """top_k_index [T, k] int64: k distinct experts per token, drawn uniformly (a balanced random router)."""
    scores = mk.uniform((tokens, experts), "float32", 0.0, 1.0)
    if mk.kind == "numpy":
        return np.argsort(scores, axis=1, kind="stable")[:, :k]
    return scores.argsort(dim=1, stable=True)[:, :k]


def weights(mk, tokens: int, k: int, dtype: str):
    """top_k_weights [T, k] in `dtype`: positive, each token's summing to 1 (a renormalised router's)."""
    w = mk.uniform((tokens, k), "float32", 0.1, 1.0)
    if mk.kind == "numpy":
        return (w / w.sum(axis=1, keepdims=True)).astype(np_dtype(dtype))
    return (w / w.sum(dim=1, keepdim=True)).to(torch_dtype(dtype))
