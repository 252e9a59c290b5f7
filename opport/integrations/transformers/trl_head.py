"""TRL's fused LM head through opport.linear_logprobs for patched models.

TRL (>= 1.16) scores completions without logits: its trainers call `add_fused_lm_head(model, temperature, outputs)`
and then `model(..., labels=labels, fused_lm_head=True)`, which runs the backbone and hands hidden states, the head's
weight and bias, the labels, the temperature and the final soft cap to `trl.trainer.utils._ChunkedLogProbFunction`.
`install()` puts `OpportHead` in its place: for the head of a model `patch` has patched, the per-token log-probs
and entropies come from opport.linear_logprobs (forward and backward, any backend); for any other model TRL's own
function runs as before (opport was not asked). Fields linear_logprobs does not compute (TRL's no-gradient metrics
`mean_logits`, `is_top1`, `log_sum_sq_probs`) and a logit scale (Cohere, Granite) are hand-backs: counted, warned
once, refused under opport.strict(). `patch` installs it when trl is already imported; call `install()` yourself
when importing trl later.
"""

from __future__ import annotations

import sys

from torch.utils.weak import WeakIdKeyDictionary

from opport.integrations.transformers.handback import hand_back, ran

FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")  # TRL's FusedCausalLMOutput order
OURS = ("log_probs", "entropy")
_HEADS = WeakIdKeyDictionary()  # head weight (by identity) -> a patched module of its model


def register(model, patched) -> None:
    """Mark `model`'s output embedding as the head of a patched model (`patched`: one of its patched modules, whose
    counts the head's calls join), and install the hook if trl is imported."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if head is not None and getattr(head, "weight", None) is not None and patched is not None:
        _HEADS[head.weight] = patched
    if "trl" in sys.modules:
        install()


def unregister(model) -> None:
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if head is not None and getattr(head, "weight", None) is not None:
        _HEADS.pop(head.weight, None)


def install() -> bool:
    """Route TRL's fused head through opport for patched models; False when TRL has no fused head to replace."""
    try:
        from trl.trainer import utils
    except ImportError:
        return False
    current = getattr(utils, "_ChunkedLogProbFunction", None)
    if current is None:
        return False
    if current is not OpportHead:
        OpportHead.original = current
        utils._ChunkedLogProbFunction = OpportHead
    return True


def uninstall() -> None:
    from trl.trainer import utils

    if getattr(utils, "_ChunkedLogProbFunction", None) is OpportHead:
        utils._ChunkedLogProbFunction = OpportHead.original


class OpportHead:
    """Stands in for TRL's `_ChunkedLogProbFunction` (same `apply` signature and result: one tensor or None per
    field of FIELDS, [tokens] each)."""

    original = None

    @classmethod
    def apply(cls, hidden, weight, bias, labels, temperature, chunk_size, softcap, logit_scale, outputs):
        model = _HEADS.get(weight)
        if model is None:  # not a patched model's head: TRL's own function, as without opport
            return cls.original.apply(hidden, weight, bias, labels, temperature, chunk_size, softcap, logit_scale,
                                      outputs)
        cause = "head_metrics" if set(outputs) - set(OURS) else "logit_scale" if logit_scale != 1.0 else None
        if cause is not None:
            hand_back(model, "linear_logprobs", cause)
            return cls.original.apply(hidden, weight, bias, labels, temperature, chunk_size, softcap, logit_scale,
                                      outputs)
        import opport

        ran(model, "linear_logprobs")
        logps, entropy = opport.linear_logprobs(hidden, weight, labels, bias, temperature=float(temperature),
                                                softcap=None if softcap is None else float(softcap))
        return logps, entropy if "entropy" in outputs else None, None, None, None
