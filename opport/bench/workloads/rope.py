"""rope on x [B, H, S, D] with float32 cos/sin tables: Llama-3 query heads, prefill and decode."""

import numpy as np

from opport.bench.workloads import Shape, Workload, acc

SHAPES = [
    Shape("smoke", "1x2x16x64", dict(b=1, h=2, s=16, d=64, per_batch=False), ("smoke",)),
    Shape("llama8b-q-prefill-256", "1x32x256x128", dict(b=1, h=32, s=256, d=128, per_batch=False), ("small",)),
    Shape("llama8b-q-decode", "32x32x1x128 (B,S,D/2) tables", dict(b=32, h=32, s=1, d=128, per_batch=True), ("small",)),
    Shape("llama70b-q-decode", "64x64x1x128 (B,S,D/2) tables", dict(b=64, h=64, s=1, d=128, per_batch=True), ("llm",)),
    Shape("llama8b-q-prefill", "1x32x4096x128", dict(b=1, h=32, s=4096, d=128, per_batch=False), ("llm",)),
    Shape("llama70b-q-prefill", "1x64x8192x128", dict(b=1, h=64, s=8192, d=128, per_batch=False), ("llm",)),
    Shape("anchor-32k", "1x32x32768x128", dict(b=1, h=32, s=32768, d=128, per_batch=False), ("llm",)),  # 2e row
]


def make(d, dtype, mk):
    table = (d["b"], d["s"], d["d"] // 2) if d["per_batch"] else (d["s"], d["d"] // 2)
    theta = mk.uniform(table, "float32", 0.0, 2 * np.pi)
    cos, sin = (np.cos(theta), np.sin(theta)) if mk.kind == "numpy" else (theta.cos(), theta.sin())
    return dict(x=mk.normal((d["b"], d["h"], d["s"], d["d"]), dtype), cos=cos, sin=sin, interleaved=False)


def _tables(t):
    return t if t.ndim == 2 else t[:, None]  # [B, S, D/2] -> [B, 1, S, D/2]: broadcast over heads


def torch_eager(x, cos, sin, interleaved):
    import torch

    c, s = _tables(cos), _tables(sin)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def numpy_composition(x, cos, sin, interleaved):
    xf, c, s = acc(x), acc(_tables(cos)), acc(_tables(sin))
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        return np.stack((x1 * c - x2 * s, x2 * c + x1 * s), axis=-1).reshape(x.shape).astype(x.dtype)
    h = x.shape[-1] // 2
    x1, x2 = xf[..., :h], xf[..., h:]
    return np.concatenate((x1 * c - x2 * s, x2 * c + x1 * s), axis=-1).astype(x.dtype)


WORKLOAD = Workload(
    "rope", SHAPES, make,
    torch_eager=torch_eager,
    torch_call="x1, x2 = x.chunk(2, -1); torch.cat((x1*cos - x2*sin, x2*cos + x1*sin), -1).to(x.dtype) (float32 tables)",
    numpy=numpy_composition, numpy_call="np.concatenate((x1*cos - x2*sin, x2*cos + x1*sin), -1) (float32 math)",
)
