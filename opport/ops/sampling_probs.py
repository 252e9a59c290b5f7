"""sampling_probs: the distribution `sample` draws from, renormalised over its kept tokens (zero elsewhere)."""

from __future__ import annotations

import numpy as np

from opport import casegen as cg
from opport.ops.sample import (
    DOMAINS,
    PARAMS,
    cases_for,
    check_args,
    check_ranges,
    constraints,
    error_cases,
    filter_row,
    greedy,
    invalid_row,
)
from opport.spec import Cost, op

NAME = "sampling_probs"


@op(arrays=("logits", *PARAMS), domains={k: DOMAINS[k] for k in PARAMS}, constraints=constraints(NAME, False),
    out_dtype="float32")
def sampling_probs(logits, temperature, top_k, top_p, min_p):
    """float32 [B, V]: the probabilities `sample` draws from, after temperature, top_k, top_p and min_p (the same
    settings, the same kept tokens: see opport.sample), renormalised over the kept tokens and exactly 0 elsewhere.
    temperature == 0: one-hot at the argmax (ties to the lowest index). A row with a NaN or +inf logit, or all
    -inf, is NaN throughout.
    """
    check_args(NAME, logits, {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p})


@sampling_probs.check_values(PARAMS)
def _check_values(logits, temperature, top_k, top_p, min_p):
    check_ranges(NAME, {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p})


def probs_rows(logits, temperature, top_k, top_p, min_p, topp_first=False, highest_first=False,
               renormalise=True) -> np.ndarray:
    b, v = logits.shape
    out = np.zeros((b, v))
    for i in range(b):
        x = logits[i]
        if invalid_row(x):
            out[i] = np.nan
        elif temperature[i] == 0:
            out[i, greedy(x)] = 1.0
        else:
            kept, w = filter_row(x, float(temperature[i]), int(top_k[i]), float(top_p[i]), float(min_p[i]),
                                 topp_first, highest_first)
            kw = np.where(kept, w, 0.0)
            out[i] = kw / (np.sum(kw) if renormalise else np.sum(w))
    return out


# batch invariance (docs/conformance.md): the arrays whose leading axis is the batch
sampling_probs.batched("logits", "temperature", "top_k", "top_p", "min_p")  # rows


@sampling_probs.reference
def _reference(logits, temperature, top_k, top_p, min_p):
    return probs_rows(logits, temperature, top_k, top_p, min_p)


@sampling_probs.cases
def _cases(dtype):
    yield from cases_for(NAME, dtype, False)


@sampling_probs.error_cases
def _error_cases():
    yield from error_cases(NAME, False)


@sampling_probs.cost
def _cost(logits, temperature, top_k, top_p, min_p):
    """Logits read once, the float32 probabilities written once; ~40 FLOPs per logit over the search passes."""
    b, v = logits.shape
    item = np.dtype(cg.np_dtype(getattr(logits.dtype, "name", logits.dtype))).itemsize
    return Cost(bytes=b * v * (item + 4) + 16 * b, flops=40 * b * v)


@sampling_probs.mutant("top-p-before-top-k")
def _mutant_topp_first(logits, temperature, top_k, top_p, min_p):
    """top_p judged against the whole distribution's mass instead of what top_k left."""
    return probs_rows(logits, temperature, top_k, top_p, min_p, topp_first=True)


@sampling_probs.mutant("not-renormalised")
def _mutant_not_renormalised(logits, temperature, top_k, top_p, min_p):
    """The kept probabilities as they were, not divided by the kept mass."""
    return probs_rows(logits, temperature, top_k, top_p, min_p, renormalise=False)


@sampling_probs.mutant("ties-to-highest-index")
def _mutant_ties_highest(logits, temperature, top_k, top_p, min_p):
    """Tied logits at the top-k (or top-p) cut resolved to the highest index."""
    return probs_rows(logits, temperature, top_k, top_p, min_p, highest_first=True)
