"""Drop-in opport kernels for Hugging Face decoder models: Llama, Mistral, Qwen2, Qwen3, Phi3, OLMo2, Gemma2,
Gemma3 (text), GPT-NeoX, GPT-2 and the mixture-of-experts Mixtral and Qwen3-MoE (families.py: what runs where, as data).

    from opport.integrations.transformers import patch, stats, unpatch
    patch(model)     # RMSNorm -> opport.rmsnorm, gated MLP -> opport.swiglu (SiLU) or opport.gelu (Gemma),
                     # rotary embedding -> opport.rope, attention -> opport.attention (dense batches) or
                     # opport.varlen_attention (padded and packed batches), with the layer's sliding window,
                     # each decoder layer's residual add + post-attention RMSNorm -> opport.add_rmsnorm,
                     # MoE routers -> opport.topk_router, MoE experts -> opport.moe_experts,
                     # the training loss (labels given, model.train()) -> opport.linear_cross_entropy
    stats(model)     # calls of each op run through opport, and calls handed back with their causes
    unpatch(model)   # the original forwards again

Patching replaces the `forward` of this model's own module instances (nothing global changes, other
models are untouched); the weights, the projections (nn.Linear) and the KV cache stay as they are. The
base model reads the batch's token layout (padding, packed documents) once per forward (layout.py).
Where a call is outside what an opport op expresses, the patched forward hands it to the model's own code,
never silently: it is counted in `stats`, warns once per cause (`HandBackWarning`, an
`opport.FallbackWarning`) and raises UnsupportedError under `opport.strict()` (handback.CAUSES lists the
causes; docs/integration.md which op each applies to).

Written against transformers 5.x (`pip install 'opport[transformers]'`). Training works: gradients
flow through every opport op the patched forwards call (opport.integrations.torch registers their
backward).
"""

from __future__ import annotations

import torch

from opport.errors import UnsupportedError
from opport.integrations.transformers import trl_head
from opport.integrations.transformers.families import FAMILIES, Family
from opport.integrations.transformers.forwards import FAMILY, FORWARDS, PARTS, SAVED, Bound, Parts
from opport.integrations.transformers.handback import CAUSES, STATE, Counts, HandBackWarning, summary

__all__ = ["CAUSES", "FAMILIES", "HandBackWarning", "OPS", "family_of", "is_patched", "patch", "stats", "unpatch"]

OPS = ("rmsnorm", "layernorm", "swiglu", "gelu", "rope", "attention", "varlen_attention", "add_rmsnorm", "topk_router",
       "moe_experts", "linear_cross_entropy", "linear_logprobs", "kv_cache_write", "kv_cache_write_fp8",
       "paged_varlen_attention")


def patch(model) -> dict:
    """Swap the RMSNorms, gated MLPs, rotary embedding, attention and (pre-norm) decoder layers' residual add +
    norm of `model` for opport ops, as families.FAMILIES says for its config.model_type.

    Returns how many modules of each kind now run opport ({"rmsnorm": n, "mlp": n, "attention": n,
    "add_rmsnorm": n, "linear_cross_entropy": n, "inputs": n}: decoder layers, then the causal-LM head, and
    the base model, which reads the batch's layout). Patching an already patched model changes nothing.
    Raises UnsupportedError for other model types.
    """
    family = family_of(model)
    counts = dict.fromkeys(FORWARDS, 0)
    shared = next((vars(m)[STATE] for m in model.modules() if STATE in vars(m)), None) or Counts()
    for module in model.modules():
        kind = _kind(module, family)
        if kind is None or SAVED in vars(module):
            continue
        vars(module)[SAVED] = (vars(module).get("forward"),)
        vars(module)[STATE] = shared
        vars(module)[FAMILY] = family
        vars(module)[PARTS] = Parts(module)
        vars(module)["forward"] = Bound(FORWARDS[kind], module)
        counts[kind] += 1
    # TRL's fused LM head (log-probs without logits) through opport.linear_logprobs
    trl_head.register(model, next((m for m in model.modules() if STATE in vars(m)), None))
    return counts


def unpatch(model) -> int:
    """Give every module `patch` changed its original forward back; returns how many were restored."""
    restored = 0
    trl_head.unregister(model)
    for module in model.modules():
        saved = vars(module).pop(SAVED, None)
        if saved is None:
            continue
        vars(module).pop(STATE, None)
        vars(module).pop(FAMILY, None)
        vars(module).pop(PARTS, None)
        if saved[0] is None:
            del vars(module)["forward"]  # the class's forward shows through again
        else:
            vars(module)["forward"] = saved[0]
        restored += 1
    return restored


def is_patched(model) -> bool:
    return any(SAVED in vars(m) for m in model.modules())


def stats(model, reset: bool = False) -> dict:
    """What the patched modules of `model` ran since `patch` (or the last reset): for each op in OPS,
    {"opport": calls run through opport, "handed_back": calls handed to the model's own code,
    "reasons": {cause: calls}} (causes as in CAUSES). reset=True zeroes the counts after reading them."""
    found = {id(c): c for c in (vars(m).get(STATE) for m in model.modules()) if c is not None}
    total = Counts()
    for counts in found.values():
        total = total.merged(counts)
        if reset:
            counts.ran.clear()
            counts.handed_back.clear()
    return summary(total, OPS)


def family_of(model, op: str = "transformers.patch", constraint: str = "transformers.model_type") -> Family:
    """The model's entry in FAMILIES; UnsupportedError (`op`, `constraint`) for another model type."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FAMILIES:
        raise UnsupportedError(op=op, arg="model", constraint=constraint,
                               expected=f"a model whose config.model_type is one of {tuple(FAMILIES)}",
                               got=repr(model_type))
    return FAMILIES[model_type]


def _kind(module, family: Family) -> str | None:
    """Which patched forward takes this module over, judged by its class (the family's own modeling file)."""
    cls = type(module)
    if family.layernorm and cls is torch.nn.LayerNorm:
        return "layernorm"
    if not cls.__module__.startswith("transformers.models.") or not cls.__name__.startswith(family.prefix):
        return None
    return family.kinds().get(cls.__name__[len(family.prefix):])
