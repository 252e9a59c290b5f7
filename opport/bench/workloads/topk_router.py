"""topk_router: the routers of Mixtral (8 experts, top 2, softmax), Qwen3-MoE (128, top 8, softmax renormalized)
and DeepSeek-V3 (256, top 8, sigmoid with a selection bias, renormalized), decode and 4K-token prefill. The baseline
is transformers' torch code: softmax (or sigmoid) in float32, torch.topk, the renormalizing division."""

import numpy as np

from opport.bench.workloads import Shape, Workload

ROUTERS = {"mixtral": (8, 2, False, "softmax"), "qwen3-moe": (128, 8, True, "softmax"),
           "deepseek-v3": (256, 8, True, "sigmoid")}


def _s(model, t, tiers):
    e, k, renorm, scoring = ROUTERS[model]
    return Shape(f"{model}-{t}", f"T{t} E{e} k{k} {scoring}", dict(t=t, e=e, k=k, renorm=renorm, scoring=scoring), tiers)


SHAPES = [
    Shape("smoke", "T64 E16 k4 sigmoid", dict(t=64, e=16, k=4, renorm=True, scoring="sigmoid"), ("smoke",)),
    _s("mixtral", 64, ("small", "llm")),
    _s("deepseek-v3", 64, ("small", "llm")),
    _s("qwen3-moe", 4096, ("small", "llm")),
    _s("mixtral", 4096, ("llm",)),
    _s("deepseek-v3", 4096, ("llm",)),
]


def make(d, dtype, mk):
    bias = None
    if d["scoring"] == "sigmoid":  # DeepSeek-V3's e_score_correction_bias: float32, small
        bias = (np.random.default_rng(d["e"]).standard_normal(d["e"]) * 0.01).astype(np.float32)
        if mk.kind != "numpy":
            import torch

            bias = torch.from_numpy(bias).to(mk.device)
    return dict(logits=mk.normal((d["t"], d["e"]), dtype), k=d["k"], renormalize=d["renorm"], scoring=d["scoring"],
                bias=bias)


def torch_eager(logits, k, renormalize, scoring, bias):
    import torch

    if scoring == "softmax":
        w, idx = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32 if logits.dtype != torch.float64
                                          else torch.float64), k, dim=-1)
    else:
        s = logits.float().sigmoid() if logits.dtype != torch.float64 else logits.sigmoid()
        idx = torch.topk(s + bias if bias is not None else s, k, dim=-1)[1]
        w = s.gather(1, idx)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype), idx.to(torch.int32)


def numpy_composition(logits, k, renormalize, scoring, bias):
    x = logits.astype(np.float32)
    if scoring == "softmax":
        z = np.exp(x - x.max(axis=-1, keepdims=True))
        score = key = z / z.sum(axis=-1, keepdims=True)
    else:
        score = 1 / (1 + np.exp(-x))
        key = score + bias if bias is not None else score
    idx = np.argsort(-key, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(score, idx, axis=-1)
    if renormalize:
        w = w / w.sum(axis=-1, keepdims=True)
    return w.astype(logits.dtype), idx.astype(np.int32)


WORKLOAD = Workload(
    "topk_router", SHAPES, make, torch_eager=torch_eager,
    torch_call="torch.topk(torch.softmax(logits, -1, dtype=float32), k) (or sigmoid + bias), renormalized: transformers'",
    numpy=numpy_composition, numpy_call="np.argsort(-softmax(x)) [:, :k], take_along_axis (float32 math)",
)
