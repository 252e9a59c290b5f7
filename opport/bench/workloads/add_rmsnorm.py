"""add_rmsnorm: rmsnorm's Llama-3 shapes (decode and prefill), with a residual stream beside x."""

import numpy as np

from opport.bench.workloads import Workload, acc
from opport.bench.workloads.rmsnorm import SHAPES


def make(d, dtype, mk):
    return dict(x=mk.normal((d["rows"], d["n"]), dtype), residual=mk.normal((d["rows"], d["n"]), dtype),
                weight=mk.uniform((d["n"],), dtype, 0.5, 1.5), eps=1e-6)


def torch_eager(x, residual, weight, eps):
    import torch.nn.functional as F

    s = x + residual
    return F.rms_norm(s, (s.shape[-1],), weight, eps), s


def numpy_composition(x, residual, weight, eps):
    s = (acc(x) + acc(residual)).astype(x.dtype)
    sf = acc(s)
    y = sf / np.sqrt(np.mean(sf * sf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * acc(weight)
    return y.astype(x.dtype), s


WORKLOAD = Workload(
    "add_rmsnorm", SHAPES, make,
    torch_eager=torch_eager, torch_call="s = x + residual; torch.nn.functional.rms_norm(s, (N,), weight, eps), s",
    numpy=numpy_composition,
    numpy_call="s = (x + residual) rounded; s / np.sqrt(np.mean(s*s, -1, keepdims=True) + eps) * weight (float32 math)",
)
