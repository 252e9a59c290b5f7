"""What a patched model ran through opport and what it handed back to the model's own code, and why.

Every patched module of one model shares one `Counts` (kept in the module's `__dict__`, so `copy.deepcopy`
and pickling give a copied model its own). A hand-back is never silent: it is counted, it warns once per
cause and model (`HandBackWarning`, a `opport.FallbackWarning`), and under `opport.strict()` it raises
UnsupportedError with the constraint id `transformers.<op>.<cause>` before anything runs.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from opport.dispatch import FallbackWarning
from opport.dispatch.context import is_strict
from opport.errors import UnsupportedError

STATE = "_opport_counts"  # on a patched module: the model's Counts

# cause -> (the argument responsible, why opport cannot run the call); docs/integration.md lists them
CAUSES = {
    "dropout": ("dropout", "attention dropout while training (opport's attention has no dropout)"),
    "output_attentions": ("output_attentions", "attention weights requested (opport never forms the probabilities)"),
    "non_causal": ("is_causal", "bidirectional attention (the patched forward runs causal attention)"),
    "custom_mask": ("attention_mask", "a 4-D or prepared attention mask, whose token layout opport cannot read"),
    "static_cache": ("cache", "a cache layer other than a DynamicCache's (its keys are not the last tokens in order)"),
    "mask_length": ("attention_mask", "a 2-D attention mask whose length is not the cached plus the new tokens"),
    "window_gaps": ("attention_mask", "a sliding window over a padding mask with a gap inside a row"),
    "no_backward": ("q", "gradients are needed and varlen_attention has no backward kernel (not differentiable)"),
    "traced_layout": ("attention_mask", "a padding mask or position_ids under torch.compile (their values decide "
                                        "the layout, which a traced graph cannot read)"),
    "dtype_mismatch": ("weight", "activations and weight of different dtypes (the op takes one dtype)"),
    "positional_args": ("args", "arguments after the first passed by position"),
    "logits_to_keep": ("logits_to_keep", "logits_to_keep slices the hidden states before the head"),
    "final_softcap": ("final_logit_softcapping", "a final-logit softcap on the head"),
    "router_aux_loss": ("output_router_logits", "the MoE load-balancing loss, which the model's own head adds"),
    "activation": ("act_fn", "an activation the op does not compute (swiglu and moe_experts: SiLU; gelu: GELU)"),
    "expert_bias": ("gate_up_proj_bias", "experts with biases (moe_experts' projections have none)"),
    "head_metrics": ("outputs", "TRL's fused head asked for fields linear_logprobs does not compute (mean_logits, "
                                "is_top1, log_sum_sq_probs: no-gradient metrics)"),
    "logit_scale": ("logit_scale", "a logit scale on the head (linear_logprobs takes a temperature and a soft cap)"),
}


class HandBackWarning(FallbackWarning):
    """A patched forward handed a call back to the model's own code (filter it as opport.FallbackWarning)."""


@dataclass
class Counts:
    ran: dict = field(default_factory=dict)  # op -> calls that ran through opport
    handed_back: dict = field(default_factory=dict)  # op -> {cause: calls handed back}
    warned: set = field(default_factory=set)  # constraint ids already warned about

    def merged(self, other: Counts) -> Counts:
        out = Counts(dict(self.ran), {op: dict(c) for op, c in self.handed_back.items()}, set(self.warned))
        for op, n in other.ran.items():
            out.ran[op] = out.ran.get(op, 0) + n
        for op, causes in other.handed_back.items():
            mine = out.handed_back.setdefault(op, {})
            for cause, n in causes.items():
                mine[cause] = mine.get(cause, 0) + n
        return out


def ran(module, op: str) -> None:
    counts = vars(module)[STATE]
    counts.ran[op] = counts.ran.get(op, 0) + 1


def hand_back(module, op: str, cause: str) -> None:
    """Account for handing `op` back to the model's code: raise under strict(), else count and warn once."""
    arg, why = CAUSES[cause]
    constraint = f"transformers.{op}.{cause}"
    where = f"{op} in {type(module).__name__}"
    _refuse(op, arg, constraint, why, where)
    counts = vars(module)[STATE]
    by_cause = counts.handed_back.setdefault(op, {})
    by_cause[cause] = by_cause.get(cause, 0) + 1
    if constraint not in counts.warned:
        counts.warned.add(constraint)
        _warn(f"opport.integrations.transformers: {where} handed back to the model's own code: {why} "
              f"[{constraint}] (counted in stats(model); raises under opport.strict())")


# torch.compile cannot trace strict mode (a ContextVar) or warnings.warn: marked as constant results, the two
# below run in Python when a graph is traced and their outcome is fixed into it (strict mode refuses at trace
# time, wrapped in torch's error, as the JAX integration fixes strict mode at trace time; the warning is given
# once, then). Eagerly the mark changes nothing. The counts are traced: dynamo replays them on every run.


@torch._dynamo.assume_constant_result
def _refuse(op: str, arg: str, constraint: str, why: str, where: str) -> bool:
    """Raise UnsupportedError under strict mode (nothing has run yet)."""
    if is_strict():
        raise UnsupportedError(op=op, arg=arg, constraint=constraint, expected="a call opport can run", got=why,
                               message=f"{where}: would be handed back to the model's own code: {why}; "
                                       f"strict mode refuses [{constraint}]")
    return False


@torch._dynamo.assume_constant_result
def _warn(message: str) -> bool:
    warnings.warn(message, HandBackWarning, stacklevel=4)
    return True


def summary(counts: Counts, ops) -> dict:
    """{op: {"opport": calls run, "handed_back": calls handed back, "reasons": {cause: calls}}} for every op."""
    out = {}
    for op in ops:
        reasons = dict(counts.handed_back.get(op, {}))
        out[op] = {"opport": counts.ran.get(op, 0), "handed_back": sum(reasons.values()), "reasons": reasons}
    return out
