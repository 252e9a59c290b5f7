"""Drop-in opport kernels for Hugging Face Llama-family models (Llama, Mistral, Qwen2).

    from opport.integrations.transformers import patch, unpatch
    patch(model)     # RMSNorm -> opport.rmsnorm, SwiGLU MLP -> opport.swiglu,
                     # rotary embedding -> opport.rope, attention -> opport.attention,
                     # each decoder layer's residual add + post-attention RMSNorm -> opport.add_rmsnorm,
                     # the training loss (labels given, model.train()) -> opport.linear_cross_entropy
    unpatch(model)   # the original forwards again

Patching replaces the `forward` of this model's own module instances (nothing global changes, other
models are untouched); the weights, the projections (nn.Linear) and the KV cache stay as they are.
Where a call is outside what an opport op expresses, the patched forward hands it to the model's own
code for that call:
- RMSNorm (and a decoder layer's add + norm) with activations and weight of different dtypes (opport takes
  one dtype);
- attention with a materialised mask (padding, sliding window in reach, packed sequences,
  `attn_implementation="eager"`, which always builds one), with dropout while training, or a prefill
  whose key length differs from its query length without a mask (static-cache prefill);
- rotary tables narrower than the head (partial rotary).

Written against transformers 5.x (`pip install 'opport[transformers]'`). Training works: gradients
flow through every opport op the patched forwards call (opport.integrations.torch registers their
backward), and attention with dropout while training runs the model's own code.
"""

from __future__ import annotations

import sys

import torch.nn.functional as F

from opport.errors import UnsupportedError
from opport.integrations import apply
from opport.ops import get_op

FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}  # config.model_type -> class prefix
_SAVED = "_opport_saved_forward"  # on a patched module: (forward it had in its __dict__ or None,)


def patch(model) -> dict:
    """Swap the RMSNorms, SwiGLU MLPs, rotary embedding, attention and decoder layers' residual add + norm of
    `model` for opport ops.

    Returns how many modules of each kind now run opport ({"rmsnorm": n, "swiglu": n, "attention": n,
    "add_rmsnorm": n, "linear_cross_entropy": n}: decoder layers, then the causal-LM head).
    Patching an already patched model changes nothing. Raises UnsupportedError for other model types.
    """
    prefix = _family_prefix(model)
    counts = dict.fromkeys(_FORWARDS, 0)
    for module in model.modules():
        kind = _kind(module, prefix)
        if kind is None or _SAVED in vars(module):
            continue
        make = _FORWARDS[kind]
        vars(module)[_SAVED] = (vars(module).get("forward"),)
        vars(module)["forward"] = make(module, module.forward)
        counts[kind] += 1
    return counts


def unpatch(model) -> int:
    """Give every module `patch` changed its original forward back; returns how many were restored."""
    restored = 0
    for module in model.modules():
        saved = vars(module).pop(_SAVED, None)
        if saved is None:
            continue
        if saved[0] is None:
            del vars(module)["forward"]  # the class's forward shows through again
        else:
            vars(module)["forward"] = saved[0]
        restored += 1
    return restored


def is_patched(model) -> bool:
    return any(_SAVED in vars(m) for m in model.modules())


def _op(name: str, *args, **kwargs):
    """The opport op `name` on these arguments (autograd and torch.compile included), as `opport.<name>`."""
    return apply(get_op(name), *args, **kwargs)


def _family_prefix(model) -> str:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FAMILIES:
        raise UnsupportedError(op="transformers.patch", arg="model", constraint="transformers.model_type",
                               expected=f"a model whose config.model_type is one of {tuple(FAMILIES)}",
                               got=repr(model_type))
    return FAMILIES[model_type]


def _kind(module, prefix: str) -> str | None:
    """Which opport op takes this module over, judged by its class (the family's own modeling file)."""
    cls = type(module)
    if not cls.__module__.startswith("transformers.models."):
        return None
    if cls.__name__ == f"{prefix}RMSNorm":
        return "rmsnorm"
    if cls.__name__ == f"{prefix}Attention":
        return "attention"
    if cls.__name__ == f"{prefix}DecoderLayer":
        return "add_rmsnorm"
    if cls.__name__ == f"{prefix}ForCausalLM":
        return "linear_cross_entropy"
    if cls.__name__ == f"{prefix}MLP" and getattr(module.config, "hidden_act", None) in ("silu", "swish"):
        return "swiglu"
    return None


# --------------------------------------------------------------------------- the patched forwards


def _rmsnorm_forward(module, original):
    def forward(hidden_states):
        if hidden_states.dtype != module.weight.dtype:
            return original(hidden_states)
        return _op("rmsnorm", hidden_states, module.weight, module.variance_epsilon)

    return forward


def _mlp_forward(module, original):
    def forward(x):
        return module.down_proj(_op("swiglu", module.gate_proj(x), module.up_proj(x)))

    return forward


def _attention_forward(module, original):
    """The Llama-family attention forward with rope and attention from opport (modeling_llama's layout)."""
    modeling = sys.modules[type(module).__module__]
    hf_rope, eager = modeling.apply_rotary_pos_emb, modeling.eager_attention_forward
    attention_functions = modeling.ALL_ATTENTION_FUNCTIONS

    def forward(hidden_states, position_embeddings, attention_mask=None, past_key_values=None, cache=None, **kwargs):
        cache = cache if cache is not None else past_key_values  # transformers 5.24 renamed the argument `cache`
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, module.head_dim)
        q = module.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k = module.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = module.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        q, k = _rotate(q, k, *position_embeddings, hf_rope)
        if cache is not None:
            k, v = cache.update(k, v, module.layer_idx)
        if _opport_attends(module, q, k, attention_mask):
            out = _op("attention", q, k, v, causal=q.shape[2] > 1, scale=module.scaling).transpose(1, 2)
        else:
            fallback = attention_functions.get_interface(module.config._attn_implementation, eager)
            out, _ = fallback(module, q, k, v, attention_mask, scaling=module.scaling, sliding_window=_window(module),
                              dropout=module.attention_dropout if module.training else 0.0, **kwargs)
        out = out.reshape(*input_shape, -1).contiguous()
        return module.o_proj(out), None

    return forward


def _decoder_layer_forward(module, original):
    """The decoder layer (modeling_llama's pre-norm layout) with the attention's residual add and the
    post-attention RMSNorm in one opport.add_rmsnorm: one read of each input, one write of each output."""
    norm = module.post_attention_layernorm

    def forward(hidden_states, *args, **kwargs):
        if args:  # the model passes everything after hidden_states by name; anything else: the layer's own code
            return original(hidden_states, *args, **kwargs)
        residual = hidden_states
        h, _ = module.self_attn(hidden_states=module.input_layernorm(hidden_states), **kwargs)
        if not h.dtype == residual.dtype == norm.weight.dtype:
            hidden = residual + h
            return hidden + module.mlp(norm(hidden))
        normed, hidden = _op("add_rmsnorm", h, residual, norm.weight, norm.variance_epsilon)
        return hidden + module.mlp(normed)

    return forward


def _causal_lm_forward(module, original):
    """While training with labels: the loss from opport.linear_cross_entropy on the last hidden states and the
    lm_head's weight (and bias), the logits never materialised, so the output's `logits` is None (as with
    Liger's fused loss). HF's shift (labels[..., 1:], the last position ignored), `ignore_index`,
    `shift_labels` and `num_items_in_batch` (sum over the batch's tokens divided by it) are kept; other calls,
    and a model whose head has a final-logit softcap or slices `logits_to_keep`, run the model's own code."""
    modeling = sys.modules[type(module).__module__]

    def forward(input_ids=None, *args, labels=None, logits_to_keep=0, **kwargs):
        plain = not args and isinstance(logits_to_keep, int) and logits_to_keep == 0
        if labels is None or not module.training or not plain or _final_softcap(module) is not None:
            return original(input_ids, *args, labels=labels, logits_to_keep=logits_to_keep, **kwargs)
        num_items = kwargs.pop("num_items_in_batch", None)
        ignore_index = kwargs.pop("ignore_index", -100)
        shift_labels = kwargs.pop("shift_labels", None)
        outputs = module.model(input_ids=input_ids, **kwargs)
        hidden = outputs.last_hidden_state
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        head = module.lm_head
        loss = _op("linear_cross_entropy", hidden.reshape(-1, hidden.shape[-1]), head.weight,
                   shift_labels.reshape(-1).to(hidden.device), head.bias, ignore_index=ignore_index,
                   reduction="mean" if num_items is None else "sum")
        if num_items is not None:
            loss = loss / num_items
        rest = {k: v for k, v in outputs.items() if k != "last_hidden_state"}
        return modeling.CausalLMOutputWithPast(loss=loss, logits=None, **rest)

    return forward


def _final_softcap(module):
    return getattr(module.config, "final_logit_softcapping", None)


def _rotate(q, k, cos, sin, hf_rope):
    """q and k rotated by opport.rope; HF's tables are [B or 1, S, D] with the half-angle table repeated."""
    d = q.shape[-1]
    if cos.shape[-1] != d:  # partial rotary: not an opport.rope layout
        return hf_rope(q, k, cos, sin)
    cos, sin = cos[..., : d // 2], sin[..., : d // 2]  # [1 or B, S, D/2]: opport.rope broadcasts a batch of 1
    return _op("rope", q, cos, sin), _op("rope", k, cos, sin)


def _opport_attends(module, q, k, attention_mask) -> bool:
    """True when the call is plain causal attention as SDPA would run it without a mask.

    With no mask HF means `is_causal` for Sq > 1 (top-left aligned, equal to opport's bottom-right
    only when Sq == Sk) and "every key" for Sq == 1 (a decode step, which bottom-right causal equals).
    """
    if attention_mask is not None or (module.training and module.attention_dropout > 0):
        return False
    sq, sk = q.shape[2], k.shape[2]
    return sq == 1 or sq == sk


_FORWARDS = {"rmsnorm": _rmsnorm_forward, "swiglu": _mlp_forward, "attention": _attention_forward,
             "add_rmsnorm": _decoder_layer_forward, "linear_cross_entropy": _causal_lm_forward}


def _window(module):
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    return getattr(module.config, "sliding_window", None)
