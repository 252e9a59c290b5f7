"""Inputs and the torch baseline shared by the sample and sampling_probs workloads: decode steps of Llama-3 (V =
128256) and Qwen (V = 151936) vocabularies with a serving engine's usual settings (temperature 0.8, top_k 50,
top_p 0.9, min_p 0.05), the baseline a vLLM-style sort of each row."""

from __future__ import annotations

import numpy as np

from opport.bench.workloads import Shape


def shapes(name: str) -> list:
    return [
        Shape("smoke", "B4 V1000", dict(b=4, v=1000), ("smoke",)),
        Shape("llama3-decode-b64", "B64 V128256", dict(b=64, v=128256), ("small", "llm")),
        Shape("qwen-decode-b256", "B256 V151936", dict(b=256, v=151936), ("llm",)),
    ]


def make(d, dtype, mk, uniforms: bool) -> dict:
    b = d["b"]
    rng = np.random.default_rng(b)
    settings = dict(temperature=np.full(b, 0.8, np.float32), top_k=np.full(b, 50, np.int32),
                    top_p=np.full(b, 0.9, np.float32), min_p=np.full(b, 0.05, np.float32))
    if uniforms:
        settings = dict(uniforms=rng.random(b).astype(np.float32), **settings)
    if mk.kind != "numpy":
        import torch

        settings = {k: torch.from_numpy(v).to(mk.device) for k, v in settings.items()}
    return dict(logits=mk.normal((b, d["v"]), dtype, scale=3.0), **settings)


def torch_filtered(logits, temperature, top_k, top_p, min_p):
    """(kept weights [B, V] in float32 (float64 for float64 logits), greedy rows): a stable descending sort of each
    row, top-k and top-p as prefix lengths, min-p on the weights, as vLLM's sampler does."""
    import torch

    x = logits.double() if logits.dtype == torch.float64 else logits.float()
    b, v = x.shape
    t = temperature.to(x.dtype)[:, None]
    greedy = t[:, 0] == 0
    m = x.max(dim=-1, keepdim=True).values
    w = torch.exp((x - m) / torch.where(greedy[:, None], torch.ones_like(t), t))
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices
    ws = w.gather(1, order)
    cs = ws.cumsum(-1)
    k = top_k.long()
    kk = torch.where((k > 0) & (k < v), k, torch.full_like(k, v))
    s_k = cs.gather(1, (kk - 1)[:, None])
    tp = top_p.to(x.dtype)[:, None]
    reach = cs >= tp * s_k
    n_p = torch.where(reach.any(-1), reach.int().argmax(-1) + 1, torch.full_like(kk, v))
    n_p = torch.where(tp[:, 0] < 1, n_p, torch.full_like(n_p, v))
    keep = (torch.arange(v, device=x.device)[None, :] < torch.minimum(kk, n_p)[:, None])
    keep = keep & (ws >= min_p.to(x.dtype)[:, None])
    kept = torch.zeros_like(keep).scatter(1, order, keep)
    return torch.where(kept, w, torch.zeros_like(w)), greedy, x


def torch_sample(logits, uniforms, temperature, top_k, top_p, min_p):
    import torch

    wk, greedy, x = torch_filtered(logits, temperature, top_k, top_p, min_p)
    c = wk.cumsum(-1)
    tok = (c <= uniforms.to(c.dtype)[:, None] * c[:, -1:]).sum(-1).clamp(max=x.shape[1] - 1)
    return torch.where(greedy, x.argmax(-1), tok).to(torch.int32)


def torch_probs(logits, temperature, top_k, top_p, min_p):
    import torch

    wk, greedy, x = torch_filtered(logits, temperature, top_k, top_p, min_p)
    p = wk / wk.sum(-1, keepdim=True)
    onehot = torch.nn.functional.one_hot(x.argmax(-1), x.shape[1]).to(p.dtype)
    p = torch.where(greedy[:, None], onehot, p)
    return p if logits.dtype == torch.float64 else p.to(torch.float32)  # float64: the reference the test checks
