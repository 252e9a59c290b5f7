"""The patched forwards: module-level functions of (module, *the forward's arguments).

`patch` binds each to its module with `Bound` (an object holding the module, not a closure over it), so
`copy.deepcopy`, pickling and `torch.save` of a patched model carry each module's own forward along and
every module computes with its own weights. Each forward counts what ran through opport (`handback.ran`)
and accounts for every call it hands back to the model's own code (`handback.hand_back`).
"""

from __future__ import annotations

import inspect
import sys
from functools import cache, partial

import torch
import torch.nn.functional as F
from transformers import configuration_utils

from opport.errors import UnsupportedError
from opport.integrations import apply
from opport.integrations.transformers import layout as layouts
from opport.integrations.transformers.families import MLP_ACTIVATIONS, head_softcap
from opport.integrations.transformers.handback import CAUSES, hand_back, ran
from opport.ops import get_op

SAVED = "_opport_saved_forward"  # on a patched module: (the forward it had in its __dict__, or None,)
FAMILY = "_opport_family"  # on a patched module: its model's families.Family
PARTS = "_opport_parts"  # on a patched module: which of its optional parts it has (Parts), read by `patch`


class Bound:
    """`fn(module, *args, **kwargs)` as the module's forward. A plain object: deepcopy and pickle copy the
    module reference with the module (a closure would keep computing with the original's weights)."""

    def __init__(self, fn, module):
        self.fn, self.module = fn, module

    def __call__(self, *args, **kwargs):
        return self.fn(self.module, *args, **kwargs)

    @property
    def __signature__(self):  # the original's (generate and Trainer read forward's parameter names)
        saved = vars(self.module)[SAVED][0]
        return inspect.signature(saved) if saved is not None else _method_signature(type(self.module).forward)


@cache
def _method_signature(fn) -> inspect.Signature:
    """The signature of `fn` bound to an instance (its first parameter dropped), worked out once per function:
    generate reads the forward's signature on every step (inspect.signature of a partial: about 35 us)."""
    sig = inspect.signature(fn)
    return sig.replace(parameters=tuple(sig.parameters.values())[1:])


def call_original(module, *args, **kwargs):
    """The forward `patch` replaced (the one the module had in its __dict__, else its class's) on these arguments.
    The class's function is called with the module, not bound: torch.compile, resuming after a graph break,
    rebuilds a bound method as `module.forward`, which is the patched forward again."""
    saved = vars(module)[SAVED][0]
    if saved is not None:
        return saved(*args, **kwargs)
    return type(module).forward(module, *args, **kwargs)


class Parts:
    """What a patched forward reads of its module's structure: the names of the projections, norms and dropouts
    it has, read once per module when `patch` patches it. A failed attribute lookup on an nn.Module raises and catches an
    AttributeError (1-5 us each); a decode step's attention made a dozen. Values (weights, the window, the soft
    cap) are still read on every call; only which attributes exist is kept."""

    def __init__(self, module):
        def has(name):
            return hasattr(module, name)

        self.head_dim = "head_dim" if has("head_dim") else "head_size"  # GPT-NeoX: head_size
        self.qkv = next((n for n in ("qkv_proj", "c_attn", "query_key_value") if has(n)), "q_proj")
        norm = getattr(module, "q_norm", None)  # Qwen3, Gemma3: over each head; OLMo2: over the whole projection
        self.q_norm = None if norm is None else "heads" if norm.weight.shape[-1] == getattr(module, self.head_dim) \
            else "whole"
        self.out = next((n for n in ("o_proj", "c_proj", "dense") if has(n)), None)
        self.softcap = has("attn_logit_softcapping")  # Gemma2
        self.window = has("sliding_window")  # Qwen2: per layer; else the config's (Mistral)
        # the config's optional settings: a config's own __getattribute__ (attribute_map, per-layer checks) makes a
        # failed lookup cost ~2 us; Llama's has neither
        config = getattr(module, "config", None)
        self.config_window = hasattr(config, "sliding_window")
        self.config_causal = hasattr(config, "is_causal")
        self.resid_dropouts = has("resid_attn_dropout")  # Phi3
        # MLPs: the activation's attribute; GPT-NeoX's / GPT-2's plain MLP (up, down) or a gated one (gate_up_proj: Phi3)
        self.act = next((a for a in ("act_fn", "activation_fn", "act") if has(a)), None)
        self.plain = ("dense_h_to_4h", "dense_4h_to_h") if has("dense_h_to_4h") else ("c_fc", "c_proj") if has("c_fc") \
            else None
        self.mlp_dropout = has("dropout")
        self.gate_up = has("gate_up_proj")


def parts(module) -> Parts:
    return vars(module)[PARTS]


def _op(name: str, module, *args, **kwargs):
    """`opport.<name>(*args, **kwargs)` (autograd and torch.compile included), counted for `module`'s model."""
    out = apply(get_op(name), *args, **kwargs)
    ran(module, name)
    return out


def rmsnorm(module, hidden_states):
    """RMSNorm as opport.rmsnorm; Gemma's x̂ · (1 + weight) through the op's offset (1 + w formed in float32 inside
    the kernel, as the model forms it, also for 16-bit weights)."""
    if hidden_states.dtype != module.weight.dtype:
        hand_back(module, "rmsnorm", "dtype_mismatch")
        return call_original(module, hidden_states)
    eps = module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps
    return _op("rmsnorm", module, hidden_states, module.weight, eps, offset=vars(module)[FAMILY].norm_offset)


def layernorm(module, hidden_states):
    """torch.nn.LayerNorm over the last dimension (GPT-NeoX's norms) as opport.layernorm."""
    weight = module.weight
    if (weight is not None and hidden_states.dtype != weight.dtype) or len(module.normalized_shape) != 1:
        hand_back(module, "layernorm", "dtype_mismatch")
        return call_original(module, hidden_states)
    return _op("layernorm", module, hidden_states, weight, module.bias, module.eps)


def mlp(module, x):
    """A gated MLP, down(act(gate(x)) · up(x)), gate and up from two projections or one fused gate_up_proj (Phi3),
    SiLU as opport.swiglu, GELU as opport.gelu on the gate; or GPT-NeoX's plain one, down(gelu(up(x))). Another
    activation is handed back."""
    p = parts(module)
    act = None if p.act is None else getattr(module, p.act)
    op, kwargs = MLP_ACTIVATIONS.get(type(act).__name__, ("swiglu", None))
    if kwargs is None or (p.plain and op != "gelu"):
        hand_back(module, op, "activation")
        return call_original(module, x)
    if p.plain:  # GPT-NeoX's dense_h_to_4h / dense_4h_to_h, GPT-2's Conv1D c_fc / c_proj and dropout
        up, down = (getattr(module, n) for n in p.plain)
        out = down(_op("gelu", module, up(x), **kwargs))
        return module.dropout(out) if p.mlp_dropout else out
    if p.gate_up:
        gate, up = module.gate_up_proj(x).chunk(2, dim=-1)
    else:
        gate, up = module.gate_proj(x), module.up_proj(x)
    h = _op("swiglu", module, gate, up) if op == "swiglu" else _op("gelu", module, gate, **kwargs) * up
    return module.down_proj(h)


def base_model(module, input_ids=None, attention_mask=None, position_ids=None, *args, **kwargs):
    """The base model (LlamaModel, ...): reads the batch's token layout once for all attention layers."""
    ref = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
    if args or ref is None:  # positional extras or an invalid call: the model's code decides
        return call_original(module, input_ids, attention_mask, position_ids, *args, **kwargs)
    if layouts.KEY not in kwargs:  # a caller that knows the layout (opport.serving's step) passes it
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        kwargs[layouts.KEY] = layouts.read(attention_mask, position_ids, cache, kwargs, ref.shape)
    return call_original(module, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         **kwargs)


def attention(module, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, cache=None,
              **kwargs):
    """The Llama-family attention forward (modeling_llama's layout) with rope and attention from opport."""
    layout = kwargs.pop(layouts.KEY, None)
    cache = next((c for c in (cache, past_key_values, kwargs.pop("layer_past", None)) if c is not None), None)
    input_shape = hidden_states.shape[:-1]
    p = parts(module)
    head_dim = getattr(module, p.head_dim)
    q, k, v = (x.view(*input_shape, -1, head_dim) for x in _qkv(module, p, hidden_states))
    if p.q_norm == "heads":
        q, k = module.q_norm(q), module.k_norm(k)  # Qwen3, Gemma3: RMSNorm over each head's dimension, before rope
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if position_embeddings is not None:  # GPT-2's positions are learned embeddings, added before the layers
        q, k = _rope(module, q, k, position_embeddings)
    if layout is not None and layout.kind == "paged":
        out = _paged(module, layout, q, k, v, kwargs).reshape(*input_shape, -1).contiguous()
        return _output(module, out), None
    if cache is not None:
        k, v = cache.update(k, v, module.layer_idx)
    window = _window(module)
    op, cause = _why_not(module, layout, attention_mask, q, k, v, cache, window, kwargs)
    weights = None  # the attention probabilities: only the model's own (eager) code forms them
    if cause is not None:
        hand_back(module, op, cause)
        out, weights = _fallback(module, q, k, v, attention_mask, window, kwargs)
    elif op == "varlen_attention":
        out = _varlen(module, layout, q, k, v, window)
    else:
        out = _op("attention", module, q, k, v, causal=True, scale=module.scaling, sliding_window=window,
                  softcap=_softcap(module)).transpose(1, 2)
    return _output(module, out.reshape(*input_shape, -1).contiguous()), weights


def _output(module, out):
    """The attention's output projection of out [..., Hq * Dv]."""
    name = parts(module).out
    if name == "c_proj":  # GPT-2: Conv1D output projection, then its residual dropout
        return module.resid_dropout(module.c_proj(out))
    return getattr(module, name)(out)


def _paged(module, step, q, k, v, kwargs):
    """A serving step (layout.PagedStep): this layer's new K/V into its paged cache (kv_cache_write, or
    kv_cache_write_fp8 for an fp8 cache with its scales), then paged_varlen_attention of the new tokens;
    [1, T, Hq, Dv]. Nothing can be handed back here (the model's own attention does not know the paged cache): a
    call opport cannot run raises UnsupportedError."""
    cause = _refusal(module, kwargs)
    if cause is not None:
        raise UnsupportedError(op="serving", arg=CAUSES[cause][0], constraint=f"serving.{cause}",
                               expected="a call the paged attention computes", got=CAUSES[cause][1])
    qt, kt, vt = (x[0].transpose(0, 1).contiguous() for x in (q, k, v))  # [T, H, D]: the batch is one packed row
    kc, vc, ks, vs = step.cache.layer(module.layer_idx, kt, vt)
    if ks is None:
        _op("kv_cache_write", module, kt, vt, kc, vc, step.slots)
    else:
        _op("kv_cache_write_fp8", module, kt, vt, kc, vc, step.slots, ks, vs)
    out = _op("paged_varlen_attention", module, qt, kc, vc, step.block_tables, step.cu_seqlens_q, step.context_lens,
              scale=module.scaling, softcap=_softcap(module), sliding_window=_window(module), k_scale=ks, v_scale=vs)
    return out[None]


def _refusal(module, kwargs) -> str | None:
    """What no opport attention computes, whatever the layout: dropout while training, the probabilities asked for,
    a non-causal layer (the cause, or None)."""
    if module.training and _dropout_p(module) > 0:
        return "dropout"
    if kwargs.get("output_attentions") or _output_attentions(module.config):
        return "output_attentions"
    config_causal = getattr(module.config, "is_causal", True) if parts(module).config_causal else True
    causal = (kwargs.get("is_causal"), getattr(module, "is_causal", True), config_causal)
    return "non_causal" if False in causal else None


_CONFIG = getattr(configuration_utils, "PreTrainedConfig", None) or configuration_utils.PretrainedConfig  # 5.x, 4.x
_OUTPUT_ATTENTIONS = vars(_CONFIG).get("output_attentions")  # transformers' property, which returns `_output_attentions`


def _output_attentions(config) -> bool:
    """config.output_attentions, read past the config's own __getattribute__ (attribute_map, per-layer checks: 3 us
    a read, on every attention call) where it is transformers' property, which returns `_output_attentions`; while
    torch.compile traces, as written (dynamo does not trace object.__getattribute__; the graph fixes the value anyway)."""
    if (_OUTPUT_ATTENTIONS is not None and type(config).output_attentions is _OUTPUT_ATTENTIONS
            and not torch.compiler.is_compiling()):
        try:
            return object.__getattribute__(config, "_output_attentions")
        except AttributeError:
            pass
    return getattr(config, "output_attentions", False)


def _dropout_p(module) -> float:
    """The attention-probability dropout: a float on most families, an nn.Dropout on GPT-2."""
    p = getattr(module, "attention_dropout", None)
    return module.attn_dropout.p if p is None else p


def _qkv(module, p: Parts, hidden_states) -> tuple:
    """The q, k, v projections [..., heads * head_dim]: three Linears, or one fused qkv_proj split (Phi3); OLMo2's
    q/k norms span the whole projection and come here, before the split into heads."""
    if p.qkv == "qkv_proj":
        nq, nkv = module.config.num_attention_heads * module.head_dim, module.num_key_value_heads * module.head_dim
        return module.qkv_proj(hidden_states).split((nq, nkv, nkv), dim=-1)
    if p.qkv == "c_attn":  # GPT-2: one Conv1D, [q | k | v] over the whole width
        return module.c_attn(hidden_states).split(module.split_size, dim=-1)
    if p.qkv == "query_key_value":  # GPT-NeoX: [q | k | v] within each head
        qkv = module.query_key_value(hidden_states).view(*hidden_states.shape[:-1], -1, 3 * module.head_size)
        return (x.flatten(-2) for x in qkv.chunk(3, dim=-1))
    q, k, v = module.q_proj(hidden_states), module.k_proj(hidden_states), module.v_proj(hidden_states)
    if p.q_norm == "whole":
        q, k = module.q_norm(q), module.k_norm(k)
    return q, k, v


def _rope(module, q, k, position_embeddings) -> tuple:
    """opport.rope on q and k [B, H, S, D]. Without gradients they go as one call on their heads side by side (rope
    acts on each head alone: the same bits as two calls), since a decode step's rope is mostly a call's fixed cost;
    with gradients, two calls (the joined copy and its backward would cost more than the call they save)."""
    rotary = position_embeddings[0].shape[-1]
    cos, sin = (t[..., : rotary // 2] for t in position_embeddings)
    if (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)) or q.dtype != k.dtype:
        return _rope_heads(module, q, cos, sin), _rope_heads(module, k, cos, sin)
    qk = _rope_heads(module, torch.cat((q, k), dim=1), cos, sin)
    return qk[:, : q.shape[1]], qk[:, q.shape[1]:]


def _rope_heads(module, x, cos, sin):
    """opport.rope on the rotary part of each head: HF's tables repeat the half-angle table and may cover only the
    first 2 * cos.shape[-1] dimensions (partial rotary: the rest pass through unchanged)."""
    rotary = 2 * cos.shape[-1]
    if rotary == x.shape[-1]:
        return _op("rope", module, x, cos, sin)
    return torch.cat([_op("rope", module, x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)


def _softcap(module):
    return module.attn_logit_softcapping if parts(module).softcap else None  # Gemma2: cap · tanh(scores / cap)


def _why_not(module, layout, attention_mask, q, k, v, cache, window, kwargs) -> tuple:
    """(the op this call runs on, None) or (that op, the cause of handing it back)."""
    varlen = layout is not None and layout.varlen
    op = "varlen_attention" if varlen else "attention"
    cause = _refusal(module, kwargs)
    if cause is not None:
        return op, cause
    if (layout is None and attention_mask is not None) or (layout is not None and layout.kind == "custom"):
        return op, "custom_mask"
    if cache is not None and not layouts.in_token_order(cache, module.layer_idx):
        return op, "static_cache"
    if layout is not None and layout.kind in ("misfit", "traced"):
        return op, "mask_length" if layout.kind == "misfit" else "traced_layout"
    if window is not None and varlen and layout.kind == "padded" and not layout.rows(k.shape[2], k.device)[2]:
        return op, "window_gaps"
    if varlen and get_op(op).backward_op is None and torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad):
        return op, "no_backward"
    return op, None


def _varlen(module, layout, q, k, v, window):
    """Attention as opport.varlen_attention over the batch's sequences; [B, Sq, Hq, Dv] as the dense path."""
    b, hq, sq, d = q.shape
    sk = k.shape[2]
    qt = q.transpose(1, 2).reshape(b * sq, hq, d)
    kt, vt = (x.transpose(1, 2).reshape(b * sk, x.shape[1], x.shape[3]) for x in (k, v))
    kw = dict(causal=True, scale=module.scaling, sliding_window=window, softcap=_softcap(module))
    if layout.kind == "packed":
        cu_q, cu_k = layout.cu_q.to(q.device), layout.cu_k.to(q.device)
        return _op("varlen_attention", module, qt, kt, vt, cu_q, cu_k, **kw).view(b, sq, hq, -1)
    qi, cu_q, _ = layout.rows(sq, q.device)
    ki, cu_k, _ = layout.rows(sk, q.device)
    out = _op("varlen_attention", module, qt.index_select(0, qi), kt.index_select(0, ki), vt.index_select(0, ki),
              cu_q, cu_k, **kw)
    return out.new_zeros(b * sq, hq, out.shape[-1]).index_copy(0, qi, out).view(b, sq, hq, -1)


def _fallback(module, q, k, v, attention_mask, window, kwargs):
    modeling = sys.modules[type(module).__module__]
    fn = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation,
                                                        modeling.eager_attention_forward)
    if _softcap(module) is not None:
        kwargs["softcap"] = _softcap(module)
    return fn(module, q, k, v, attention_mask, scaling=module.scaling, sliding_window=window,
              dropout=_dropout_p(module) if module.training else 0.0, **kwargs)


def _window(module):
    if parts(module).window:  # Qwen2: per layer (None on full-attention layers)
        return module.sliding_window
    return module.config.sliding_window if parts(module).config_window else None  # Mistral: every layer


def decoder_layer(module, hidden_states, *args, **kwargs):
    """The decoder layer (modeling_llama's pre-norm layout) with the attention's residual add and the
    post-attention RMSNorm in one opport.add_rmsnorm: one read of each input, one write of each output.
    Gradient checkpointing is kept as the layer's own forward applies it."""
    if args:  # the model passes everything after hidden_states by name
        hand_back(module, "add_rmsnorm", "positional_args")
        return call_original(module, hidden_states, *args, **kwargs)
    if module.gradient_checkpointing and module.training and torch.is_grad_enabled():
        if kwargs.get("use_cache"):  # as GradientCheckpointingLayer: the replay must not write the cache again
            kwargs["use_cache"] = False
        if not getattr(module, "_can_checkpoint_with_cache", False) and kwargs.get("cache") is not None:
            kwargs["cache"] = None
        return module._gradient_checkpointing_func(partial(_decoder_body, module, **kwargs), hidden_states)
    return _decoder_body(module, hidden_states, **kwargs)


def _decoder_body(module, hidden_states, **kwargs):
    norm = module.post_attention_layernorm
    residual = hidden_states
    h, _ = module.self_attn(hidden_states=module.input_layernorm(hidden_states), **kwargs)
    drops = parts(module).resid_dropouts  # Phi3's residual dropouts (identity unless training with p > 0)
    if drops:
        h = module.resid_attn_dropout(h)
    if not h.dtype == residual.dtype == norm.weight.dtype:
        hand_back(module, "add_rmsnorm", "dtype_mismatch")
        hidden = residual + h
        out = module.mlp(norm(hidden))
        return hidden + (module.resid_mlp_dropout(out) if drops else out)
    normed, hidden = _op("add_rmsnorm", module, h, residual, norm.weight, norm.variance_epsilon)
    out = module.mlp(normed)
    return hidden + (module.resid_mlp_dropout(out) if drops else out)


def router(module, hidden_states):
    """The MoE router (Qwen3MoeTopKRouter, MixtralTopKRouter): its linear layer, then softmax and top-k as
    opport.topk_router. Returns what the model's router returns: (logits, weights in the logits' dtype, expert
    indices as int64, as torch.topk gives them to code that one-hot encodes them)."""
    hidden_states = hidden_states.reshape(-1, module.hidden_dim)
    logits = F.linear(hidden_states, module.weight)
    renormalize = getattr(module, "norm_topk_prob", True)  # Mixtral's router always renormalises its top k
    weights, indices = _op("topk_router", module, logits, module.top_k, renormalize=bool(renormalize))
    return logits, weights, indices.long()


def experts(module, hidden_states, top_k_index, top_k_weights):
    """The MoE experts (Qwen3MoeExperts, MixtralExperts: gate_up_proj [E, 2I, H], down_proj [E, H, I]) as one
    opport.moe_experts: gather, gate_up GEMM, SwiGLU, down GEMM and the weighted sum over each token's experts."""
    cause = ("activation" if type(module.act_fn).__name__ not in ("SiLU", "SiLUActivation") else
             "expert_bias" if getattr(module, "gate_up_proj_bias", None) is not None else
             "dtype_mismatch" if not hidden_states.dtype == top_k_weights.dtype == module.gate_up_proj.dtype ==
             module.down_proj.dtype else None)
    if cause is not None:
        hand_back(module, "moe_experts", cause)
        return call_original(module, hidden_states, top_k_index, top_k_weights)
    return _op("moe_experts", module, hidden_states, module.gate_up_proj, module.down_proj, top_k_index,
               top_k_weights)


def causal_lm(module, input_ids=None, *args, labels=None, logits_to_keep=0, **kwargs):
    """While training with labels: the loss from opport.linear_cross_entropy on the last hidden states and the
    lm_head's weight (and bias), the logits never materialised, so the output's `logits` is None (as with
    Liger's fused loss). HF's shift (labels[..., 1:], the last position ignored), `ignore_index`,
    `shift_labels` and `num_items_in_batch` (sum over the batch's tokens divided by it) are kept. Without
    labels, or in evaluation, the model's own head runs (its logits are the output)."""
    if labels is None or not module.training:
        return call_original(module, input_ids, *args, labels=labels, logits_to_keep=logits_to_keep, **kwargs)
    router_loss = kwargs.get("output_router_logits")
    router_loss = getattr(module.config, "output_router_logits", False) if router_loss is None else router_loss
    softcap = head_softcap(module.config)  # Gemma's heads cap the logits; Llama's ignore the setting
    cause = ("positional_args" if args else
             "logits_to_keep" if not (isinstance(logits_to_keep, int) and logits_to_keep == 0) else
             "final_softcap" if softcap is None and getattr(module.config, "final_logit_softcapping", None) else
             "router_aux_loss" if router_loss else None)
    if cause is not None:
        hand_back(module, "linear_cross_entropy", cause)
        return call_original(module, input_ids, *args, labels=labels, logits_to_keep=logits_to_keep, **kwargs)
    num_items = kwargs.pop("num_items_in_batch", None)
    ignore_index = kwargs.pop("ignore_index", -100)
    shift_labels = kwargs.pop("shift_labels", None)
    outputs = module.base_model(input_ids=input_ids, **kwargs)
    hidden = outputs.last_hidden_state
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    head = module.lm_head
    loss = _op("linear_cross_entropy", module, hidden.reshape(-1, hidden.shape[-1]), head.weight,
               shift_labels.reshape(-1).to(hidden.device), head.bias, ignore_index=ignore_index,
               reduction="mean" if num_items is None else "sum", softcap=softcap)
    if num_items is not None:
        loss = loss / num_items
    rest = {k: v for k, v in outputs.items() if k != "last_hidden_state"}
    modeling = sys.modules[type(module).__module__]
    output = next(getattr(modeling, name) for name in  # the family's own output class (MoE's, GPT-2's)
                  ("MoeCausalLMOutputWithPast", "CausalLMOutputWithPast", "CausalLMOutputWithCrossAttentions")
                  if hasattr(modeling, name))
    return output(loss=loss, logits=None, **rest)


# kind -> its forward; the kinds `patch` counts, by the op each one runs
FORWARDS = {"rmsnorm": rmsnorm, "layernorm": layernorm, "mlp": mlp, "attention": attention, "add_rmsnorm": decoder_layer,
            "topk_router": router, "moe_experts": experts, "linear_cross_entropy": causal_lm, "inputs": base_model}
