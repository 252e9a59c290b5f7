"""Per-token log-probabilities of a causal LM's own tokens without its [B, S, V] logits, for preference and RL
losses (opport.losses): the base model's last hidden states and the LM head's weight through opport.losses.token_logps
(opport.linear_cross_entropy, chunked over the vocabulary). Works on patched and unpatched models alike; a patched
model runs its attention, norms and MLPs through opport too."""

from __future__ import annotations

import torch

from opport import losses


def completion_logps(model, input_ids, attention_mask=None, temperature: float = 1.0, **kwargs):
    """log p(input_ids[:, t + 1] | input_ids[:, :t + 1]) for t < S - 1: [B, S - 1], float32, 0 where the next token
    is padding (attention_mask 0). The same values as log_softmax(model(input_ids).logits[:, :-1] / temperature)
    at the next tokens (Gemma's final soft cap applied before the temperature, as the model's head does), and the
    same gradients, without the logits. `kwargs` go to the base model (position_ids, FlashAttention's cu_seq_lens, ...)."""
    out = model.base_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    hidden = out.last_hidden_state[:, :-1]
    target = input_ids[:, 1:]
    if attention_mask is not None:
        target = target.masked_fill(attention_mask[:, 1:] == 0, -100)
    head = model.get_output_embeddings()
    cap = getattr(model.config, "final_logit_softcapping", None) if _head_caps(model) else None
    b, s, h = hidden.shape
    logps = losses.token_logps(hidden.reshape(b * s, h), head.weight, target.reshape(-1).to(torch.long), head.bias,
                               temperature=temperature, softcap=cap)
    return logps.view(b, s)


def _head_caps(model) -> bool:
    """Whether the model's own head applies config.final_logit_softcapping (Gemma's; Llama's ignores it)."""
    from opport.integrations.transformers.families import FAMILIES

    family = FAMILIES.get(getattr(model.config, "model_type", None))
    return family is not None and family.head_softcap
