"""Post-training losses on per-token log-probabilities: DPO, SimPO, ORPO and the policy-gradient family (GRPO,
DAPO, Dr. GRPO), for NumPy, torch and JAX arrays alike.

The log-probabilities (and entropies) come from `token_logps`, which never holds the N x V logits
(opport.linear_logprobs, chunked over the vocabulary on every backend), or for a Hugging Face causal LM from
`completion_logps`; the losses are a few elementwise operations and sums on [B] or [B, S] arrays, written once for
the three array kinds (`_xp`), so torch autograd and jax.grad differentiate them with opport's backward under the
log-probabilities. NumPy inputs give values (no gradients).

Reductions follow the papers and TRL's trainers: each loss takes `reduction` "mean" (default), "sum" or "none"
(per pair / per sequence); the policy loss's `loss_type` decides how tokens are aggregated.
"""

from __future__ import annotations

import sys

import numpy as np

from opport._ops import linear_logprobs
from opport.errors import ArgumentError

REDUCTIONS = ("mean", "sum", "none")
LOSS_TYPES = ("grpo", "dapo", "dr_grpo")


def token_logps(hidden, weight, target, bias=None, temperature: float = 1.0, ignore_index: int = -100,
                softcap: float | None = None, entropy: bool = False):
    """log p(target_i | hidden_i) per token [N] under `temperature` (and with `entropy=True` also each token's entropy
    [N], as `(logps, entropy)`): the logits z = hidden @ weight.T + bias, soft-capped first where the model's head caps
    them (Gemma: cap · tanh(z / cap)), then divided by T, as a sampler and a trainer see them. opport.linear_logprobs:
    the [N, V] logits are never held, and the gradients w.r.t. hidden and weight from any per-token upstream
    gradients of both outputs (a policy loss's weights, an entropy bonus) are its exact backward; 0 where
    target == ignore_index. float32 (float64 inputs are computed in float64 and rounded once)."""
    _check_positive("token_logps", "temperature", temperature)
    logps, ent = linear_logprobs(hidden, weight, target, bias, temperature=temperature, softcap=softcap,
                                 ignore_index=ignore_index)
    return (logps, ent) if entropy else logps


def completion_logps(model, input_ids, attention_mask=None, temperature: float = 1.0, entropy: bool = False,
                     **kwargs):
    """A Hugging Face causal LM's log p(input_ids[:, t + 1] | input_ids[:, :t + 1]) for t < S - 1: [B, S - 1],
    float32, 0 where the next token is padding (attention_mask 0), from the base model's last hidden states and the
    head's weight through `token_logps`: the same values and gradients as log_softmax(model(input_ids).logits[:, :-1]
    / temperature) at the next tokens (Gemma's final soft cap before the temperature, as its head applies it),
    without the [B, S, V] logits; with `entropy=True` also each position's entropy, as `(logps, entropy)`. Patched or
    not (a patched model runs its layers through opport too); `kwargs` go to the base model (position_ids,
    FlashAttention's cu_seq_lens, ...)."""
    from opport.integrations.transformers.families import head_softcap  # here: importing the package imports torch

    out = model.base_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    hidden = out.last_hidden_state[:, :-1]
    target = input_ids[:, 1:]
    if attention_mask is not None:
        target = target.masked_fill(attention_mask[:, 1:] == 0, -100)
    head = model.get_output_embeddings()
    b, s, h = hidden.shape
    logps, ent = token_logps(hidden.reshape(b * s, h), head.weight, target.reshape(-1).long(), head.bias,
                             temperature=temperature, softcap=head_softcap(model.config), entropy=True)
    return (logps.view(b, s), ent.view(b, s)) if entropy else logps.view(b, s)


def sequence_logps(token_logps, mask, average: bool = False):
    """Per-sequence log-probability [B] of per-token ones [B, S]: the sum over the tokens `mask` keeps (the
    completion), or its mean with `average=True` (SimPO, ORPO)."""
    kept = token_logps * mask
    total = kept.sum(-1)
    return total / mask.sum(-1) if average else total


def dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta: float = 0.1,
             label_smoothing: float = 0.0, reduction: str = "mean"):
    """DPO (sigmoid), per pair: -(1 - ε) log σ(β h) - ε log σ(-β h), h = (π_c - π_r) - (ref_c - ref_r), from
    sequence log-probabilities [B] (the reference model's given, e.g. computed once without gradients)."""
    _check_positive("dpo_loss", "beta", beta)
    _check_range("dpo_loss", "label_smoothing", label_smoothing, 0.0, 0.5)
    xp = _xp(chosen_logps)
    h = beta * ((chosen_logps - rejected_logps) - (ref_chosen_logps - ref_rejected_logps))
    loss = -(1 - label_smoothing) * _log_sigmoid(xp, h) - label_smoothing * _log_sigmoid(xp, -h)
    return _reduce("dpo_loss", loss, reduction)


def simpo_loss(chosen_avg_logps, rejected_avg_logps, beta: float = 2.0, gamma: float = 0.5, reduction: str = "mean"):
    """SimPO, per pair: -log σ(β (π̄_c - π̄_r) - γ), from length-averaged log-probabilities (no reference model)."""
    _check_positive("simpo_loss", "beta", beta)
    xp = _xp(chosen_avg_logps)
    return _reduce("simpo_loss", -_log_sigmoid(xp, beta * (chosen_avg_logps - rejected_avg_logps) - gamma), reduction)


def orpo_loss(chosen_avg_logps, rejected_avg_logps, chosen_nll, beta: float = 0.1, reduction: str = "mean"):
    """ORPO, per pair: NLL of the chosen completion - β log σ(log odds_c - log odds_r), odds = p / (1 - p) of the
    length-averaged log-probabilities (log(1 - p) as log1p(-exp(logp)), exact for p near 0)."""
    _check_positive("orpo_loss", "beta", beta)
    xp = _xp(chosen_avg_logps)
    log_odds = (chosen_avg_logps - rejected_avg_logps) - (
        xp.log1p(-xp.exp(chosen_avg_logps)) - xp.log1p(-xp.exp(rejected_avg_logps)))
    return _reduce("orpo_loss", chosen_nll - beta * _log_sigmoid(xp, log_odds), reduction)


def policy_loss(logps, old_logps, advantages, mask, ref_logps=None, beta: float = 0.0, epsilon: float = 0.2,
                epsilon_high: float | None = None, loss_type: str = "grpo", max_completion_length: int | None = None):
    """Clipped policy-gradient loss over completions [B, S] (token log-probabilities under the current and the
    sampling policy, per-sequence advantages [B], the completion mask [B, S]):

        per token: -min(r A, clip(r, 1 - ε, 1 + ε_high) A) + β KL,  r = exp(logp - old_logp),
        KL = exp(ref - logp) - (ref - logp) - 1 (the k3 estimator; with ref_logps and β > 0)

    aggregated as `loss_type` says: "grpo" the mean over each sequence's tokens, then over sequences; "dapo" the
    sum over every token of the batch over their count (token level); "dr_grpo" the sum over B x
    max_completion_length (S when not given): no length normalisation."""
    if loss_type not in LOSS_TYPES:
        raise ArgumentError(op="policy_loss", arg="loss_type", constraint="policy_loss.loss_type",
                            expected=f"one of {LOSS_TYPES}", got=repr(loss_type))
    _check_range("policy_loss", "epsilon", epsilon, 0.0, 1.0)
    xp = _xp(logps)
    high = epsilon if epsilon_high is None else epsilon_high
    ratio = xp.exp(logps - old_logps)
    adv = advantages[:, None]
    per_token = -xp.minimum(ratio * adv, xp.clip(ratio, 1 - epsilon, 1 + high) * adv)
    if beta:
        if ref_logps is None:
            raise ArgumentError(op="policy_loss", arg="ref_logps", constraint="policy_loss.ref_logps",
                                expected="the reference policy's token log-probabilities when beta > 0", got="None")
        delta = ref_logps - logps
        per_token = per_token + beta * (xp.exp(delta) - delta - 1)
    kept = per_token * mask
    if loss_type == "grpo":
        return (kept.sum(-1) / mask.sum(-1)).mean()
    if loss_type == "dapo":
        return kept.sum() / mask.sum()
    return kept.sum() / (mask.shape[0] * (max_completion_length or mask.shape[1]))


def _xp(x):
    """The array namespace of x: torch, jax.numpy or numpy (each has exp, log1p, logaddexp, minimum, clip)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return torch
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(x, jax.Array):
        return jax.numpy
    return np


def _log_sigmoid(xp, x):
    return -xp.logaddexp(xp.zeros_like(x), -x)  # log σ(x) = -softplus(-x), finite for any finite x


def _reduce(op: str, loss, reduction: str):
    if reduction not in REDUCTIONS:
        raise ArgumentError(op=op, arg="reduction", constraint=f"{op}.reduction", expected=f"one of {REDUCTIONS}",
                            got=repr(reduction))
    return loss if reduction == "none" else loss.mean() if reduction == "mean" else loss.sum()


def _check_positive(op: str, arg: str, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value <= 0:
        raise ArgumentError(op=op, arg=arg, constraint=f"{op}.{arg}", expected="a finite number > 0", got=repr(value))


def _check_range(op: str, arg: str, value, lo: float, hi: float):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise ArgumentError(op=op, arg=arg, constraint=f"{op}.{arg}", expected=f"a number in [{lo}, {hi}]",
                            got=repr(value))
