"""linear_logprobs: per-token log p(target) and entropy of softmax((hidden @ weight.T + bias) / T), logits never whole."""

from __future__ import annotations

import math

import numpy as np

from opport import casegen as cg
from opport.dtypes import INTS
from opport.errors import ArgumentError, DTypeError, ShapeError
from opport.ops import linear_cross_entropy as lce
from opport.spec import INDEX, Case, Cost, ErrorCase, Tolerance, check, check_grad, grad_constraints, op

NAME = "linear_logprobs"
BWD = f"{NAME}_backward"


@op(
    arrays=("hidden", "weight", "target", "bias"),
    domains={"target": INDEX},
    constraints={
        f"{NAME}.dtype": "hidden is float32, float16, bfloat16 or float64",
        f"{NAME}.dtype_mismatch": "weight and bias have hidden's dtype",
        f"{NAME}.hidden_shape": "hidden is 2-d [N, H]",
        f"{NAME}.weight_shape": "weight is 2-d [V, H] with V >= 1 and hidden's H",
        f"{NAME}.bias_shape": "bias.shape == (V,)",
        f"{NAME}.target_dtype": f"target is an integer array ({', '.join(INTS)})",
        f"{NAME}.target_shape": "target.shape == (N,)",
        f"{NAME}.ignore_index": "ignore_index is an int in the int64 range (targets are int64)",
        f"{NAME}.temperature": "temperature is a finite number > 0",
        f"{NAME}.softcap": "softcap is None or a finite number > 0",
        f"{NAME}.target_range": "every target is a class in [0, V) or ignore_index (read on the host before any "
                                "kernel: NumPy and CPU arrays always, device arrays under OPPORT_CHECK_VALUES=1)",
    },
    out_dtype="float32",
)
def linear_logprobs(hidden, weight, target, bias=None, temperature: float = 1.0, softcap: float | None = None,
                    ignore_index=-100):
    """Per-token log-probability of the target and entropy under a temperature, without the N x V logits.

    The logits a = hidden @ weight.T (+ bias) ([N, V], float32 accumulation) are soft-capped first where given
    (cap · tanh(a / cap), Gemma's head), then divided by the temperature T: z = cap(a) / T, the distribution a
    sampler draws from and an RL trainer scores. Returns (logps, entropy), both float32 [N]:
    logps[i] = z[i, t_i] - logsumexp(z[i]) and entropy[i] = -sum_j p_ij log p_ij, p = softmax(z[i]); a row whose
    target is ignore_index gives 0 for both (and no gradient), as a trainer's completion mask would. The entropy
    is computed as log(s) - sum_j e_j (z_j - m) / s (m the row max, e_j = exp(z_j - m), s = sum e): terms of
    the order of log V, never lse - E[z], which cancels catastrophically for large logits.
    The backward takes an upstream gradient for each output, so per-token weights (a policy loss's advantages
    and mask) and an entropy bonus are exact: dz_j = g_logp (onehot_j - p_j) - g_entropy p_j (log p_j + H).
    Kernels walk the logits in tiles of tokens x vocabulary with an online logsumexp, as linear_cross_entropy's
    (same memory: O(tile) in the forward, one vocabulary chunk of float32 dlogits in the cuda backward).
    A target outside [0, V) that is not ignore_index is `linear_logprobs.target_range` for a host target
    (its row's logp is NaN for a device target, as linear_cross_entropy's loss).
    """
    lce.check_head(NAME, hidden, weight, target, bias, ignore_index, softcap)
    check(lce._number(temperature) and temperature > 0, ArgumentError, NAME, "temperature", f"{NAME}.temperature",
          "a finite number > 0", repr(temperature))


@linear_logprobs.outputs(("logps", "entropy"))
def _outputs(hidden, weight, target, bias, temperature, softcap, ignore_index):
    return [((hidden.shape[0],), "float32")] * 2


def _logits(hidden, weight, bias, temperature, softcap) -> tuple:
    """(z, dz/da): the float64 tempered logits and their derivative w.r.t. the raw logits a."""
    z, dcap = lce._logits(hidden, weight, bias, softcap)
    return z / temperature, (1.0 if dcap is None else dcap) / temperature


def _stats(z, target, ignore_index) -> tuple:
    """(logps, entropy, lse) in float64 of tempered logits z [N, V]; ignored rows 0, targets outside [0, V) NaN."""
    n, v = z.shape
    t = np.asarray(target).astype(np.int64)
    ignored, valid = t == ignore_index, (t >= 0) & (t < v)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        m = z.max(axis=1, initial=-np.inf) if v else np.zeros(n)
        e = np.exp(z - m[:, None])
        s = e.sum(axis=1)
        lse = m + np.log(s)
        entropy = np.log(s) - (e * (z - m[:, None])).sum(axis=1) / s
        zt = z[np.arange(n), np.where(valid, t, 0)] if n else np.zeros(0)
        logps = np.where(valid, zt - lse, np.nan)
    return np.where(ignored, 0.0, logps), np.where(ignored, 0.0, entropy), lse


# batch invariance (docs/conformance.md): the arrays whose leading axis is the batch
linear_logprobs.batched("hidden", "target")  # tokens


@linear_logprobs.reference
def _reference(hidden, weight, target, bias, temperature, softcap, ignore_index):
    z, _ = _logits(hidden, weight, bias, temperature, softcap)
    logps, entropy, _ = _stats(z, target, ignore_index)
    return logps, entropy


# docs/numerics.md 3.3, as linear_cross_entropy's loss: judged relative to itself; atol covers the logits' H-long
# float32 accumulation (a few eps32·sqrt(H)·|hidden||weight| per logit), which a log-prob or entropy near 0 carries
_TOL = {
    "float64": Tolerance(1e-7, 1e-9, reason="docs/numerics.md 3.2 (float64 computes in float64)"),
    "float32": Tolerance(1e-5, 1e-5, reason="docs/numerics.md 3.3: relative; atol for the H-long dot per logit"),
    "float16": Tolerance(1e-4, 1e-5, reason="docs/numerics.md 3.3: fp32 from exact 16-bit products, fp32 sums"),
    "bfloat16": Tolerance(1e-4, 1e-5, reason="docs/numerics.md 3.3: fp32 from exact 16-bit products, fp32 sums"),
}
linear_logprobs.tolerance(**_TOL)
linear_logprobs.tolerance(index=1, **_TOL)


def _case(name, dtype, n, h, v, bias=False, ignore=(), ignore_index=-100, temperature=1.0, softcap=None, scale=1.0,
          targets=None, tags=()):
    """hidden ~ N(0, 1), weight ~ N(0, 1/H) · scale: raw logits ~ N(0, scale²) whatever H."""
    rng = cg.rng_for(NAME, name, dtype)
    x = cg.array((n, h), dtype, rng)
    w = cg.array((v, h), dtype, rng, scale=scale / math.sqrt(max(h, 1)))
    b = cg.array((v,), dtype, rng, scale=scale) if bias else None
    t = rng.integers(0, v, n) if targets is None else np.asarray(targets, np.int64)
    t[list(ignore)] = ignore_index
    kwargs = {"temperature": temperature, "softcap": softcap, "ignore_index": ignore_index}
    return Case(name, (x, w, t, b), kwargs, tags)


@linear_logprobs.cases
def _cases(dtype):
    yield _case("t1-ignore", dtype, 16, 32, 300, ignore=(3,), tags=("llm",))
    yield _case("t0.7-bias", dtype, 13, 40, 257, bias=True, temperature=0.7)
    yield _case("t1.3-odd-vocab", dtype, 9, 24, 1000, temperature=1.3, scale=3.0)  # V % any power-of-2 tile != 0
    yield _case("targets-0-and-last", dtype, 6, 16, 131, targets=[0, 130, 0, 130, 5, 130], temperature=0.9)
    yield _case("tile-boundaries", dtype, 33, 65, 129, bias=True, ignore=(32,), temperature=1.1)
    yield _case("v-1", dtype, 6, 8, 1, ignore=(0,))  # one class: logp 0 and entropy 0 exactly
    yield _case("h-1", dtype, 10, 1, 50, temperature=0.5)
    yield _case("ignore-positive", dtype, 8, 16, 100, ignore=(0, 5), ignore_index=7)
    yield _case("softcap-t0.6", dtype, 12, 32, 300, softcap=30.0, scale=40.0, temperature=0.6)  # tanh saturating
    yield _case("softcap-bias-t2", dtype, 10, 24, 150, bias=True, softcap=5.0, scale=4.0, temperature=2.0)
    yield _case("peaked", dtype, 6, 64, 200, scale=8.0, tags=("edge",))  # logps and entropies near 0
    yield _case("hot", dtype, 6, 32, 200, scale=2.0, temperature=50.0, tags=("edge",))  # entropy near log V
    yield _case("all-ignored", dtype, 4, 16, 50, ignore=range(4), tags=("edge",))
    yield _case("empty-batch", dtype, 0, 16, 50, tags=("edge",))
    yield _case("rl-rollout", dtype, 64, 128, 2048, temperature=0.8, tags=("llm",))


@linear_logprobs.error_cases
def _error_cases():
    x, w, t = np.zeros((4, 8), np.float32), np.zeros((10, 8), np.float32), np.zeros(4, np.int64)
    yield ErrorCase(f"{NAME}.dtype", DTypeError, (x.astype(np.int32), w.astype(np.int32), t))
    yield ErrorCase(f"{NAME}.dtype_mismatch", DTypeError, (x, w.astype(np.float16), t))
    yield ErrorCase(f"{NAME}.hidden_shape", ShapeError, (np.zeros(8, np.float32), w, np.zeros((), np.int64)))
    yield ErrorCase(f"{NAME}.weight_shape", ShapeError, (x, np.zeros((10, 7), np.float32), t))
    yield ErrorCase(f"{NAME}.bias_shape", ShapeError, (x, w, t, np.zeros(9, np.float32)))
    yield ErrorCase(f"{NAME}.target_dtype", DTypeError, (x, w, np.zeros(4, np.float32)))
    yield ErrorCase(f"{NAME}.target_shape", ShapeError, (x, w, np.zeros(5, np.int64)))
    yield ErrorCase(f"{NAME}.ignore_index", ArgumentError, (x, w, t), {"ignore_index": 1.5})
    yield ErrorCase(f"{NAME}.temperature", ArgumentError, (x, w, t), {"temperature": 0.0})
    yield ErrorCase(f"{NAME}.temperature", ArgumentError, (x, w, t), {"temperature": float("nan")})
    yield ErrorCase(f"{NAME}.temperature", ArgumentError, (x, w, t), {"temperature": True})
    yield ErrorCase(f"{NAME}.softcap", ArgumentError, (x, w, t), {"softcap": -1.0})
    for bad in ([0, 10, 1, 2], [0, -1, 1, 2]):
        yield ErrorCase(f"{NAME}.target_range", ArgumentError, (x, w, np.array(bad)))


@linear_logprobs.cost
def _cost(hidden, weight, target, bias, temperature, softcap, ignore_index):
    """Inputs read once, two floats per token written: no N x V logits move. FLOPs: the logits' GEMM."""
    return Cost(bytes=lce._bytes_in(hidden, weight, target, bias) + 8 * hidden.shape[0],
                flops=2 * hidden.shape[0] * weight.shape[0] * hidden.shape[1])


# --------------------------------------------------------------------------- backward


@linear_logprobs.saves(("lse",), shapes=lambda hidden, *_: [(hidden.shape[0],)])
def _saved(hidden, weight, target, bias, temperature, softcap, ignore_index):
    """Per-row logsumexp of the tempered logits [N], float32 (float64 for float64 inputs)."""
    z, _ = _logits(hidden, weight, bias, temperature, softcap)
    return (_stats(z, target, ignore_index)[2],)


@linear_logprobs.backward(
    wrt=("hidden", "weight", "bias"),
    reduces=("hidden", "weight", "bias"),
    constants={"target": "integer class indices: a discrete label, not a differentiable quantity"},
    constraints={
        **grad_constraints(NAME),
        f"{BWD}.saved": "lse is [N] in the accumulation dtype, float32 (float64 for float64 inputs), and entropy "
                        "[N] float32: the training forward's",
        f"{BWD}.target_range": "every target is a class in [0, V) or ignore_index (as linear_logprobs.target_range)",
    },
)
def linear_logprobs_backward(grad_logps, grad_entropy, hidden, weight, target, entropy, lse, bias=None,
                             temperature: float = 1.0, softcap: float | None = None, ignore_index=-100):
    """Gradients of linear_logprobs for hidden, weight and bias from the upstream gradients of both outputs.

    Saves hidden, weight, target, bias, the entropy output and the per-row logsumexp lse [N]; the logits are
    recomputed tile by tile. Per tile: dz = g_logp (onehot - p) - g_entropy p (z - lse + H) (each row's own
    upstream gradients: no reduction is assumed), da = dz / T · (1 - tanh²(a / cap)) with a softcap, then
    dhidden += da @ weight[tile], dweight[tile] += da^T @ hidden, dbias[tile] += column sums. Ignored rows
    contribute exactly 0. All three sum over V or over N: judged norm-wise.
    """
    linear_logprobs.validate(hidden, weight, target, bias, temperature, softcap, ignore_index)
    n = hidden.shape[0]
    check_grad(BWD, grad_logps, (n,), "float32", "grad_logps")
    check_grad(BWD, grad_entropy, (n,), "float32", "grad_entropy")
    acc = "float64" if hidden.dtype == "float64" else "float32"
    for name, a, dtype in (("lse", lse, acc), ("entropy", entropy, "float32")):
        check(a is not None, ArgumentError, BWD, name, f"{BWD}.saved", f"the training forward's {name}", None)
        check(a.dtype == dtype, DTypeError, BWD, name, f"{BWD}.saved", dtype, a.dtype)
        check(tuple(a.shape) == (n,), ShapeError, BWD, name, f"{BWD}.saved", f"({n},) = (N,)", tuple(a.shape))


def _dlogits(grad_logps, grad_entropy, z, target, entropy, lse, ignore_index):
    """dL/dz [N, V] in float64 (before the temperature and softcap factors); ignored rows 0, bad targets NaN."""
    n, v = z.shape
    t = np.asarray(target).astype(np.int64)
    ignored, valid = t == ignore_index, (t >= 0) & (t < v)
    with np.errstate(invalid="ignore", over="ignore"):
        zl = z - lse[:, None]
        p = np.exp(zl)
        d = -p * (grad_logps[:, None] + grad_entropy[:, None] * (zl + entropy[:, None]))
        hit = np.flatnonzero(valid)
        d[hit, t[hit]] += grad_logps[hit]
    d[ignored] = 0
    d[~valid & ~ignored] = np.nan
    return d


def _grads(d, hidden, weight, bias, dz_da):
    with np.errstate(invalid="ignore", over="ignore"):
        da = d * dz_da
        return da @ weight, da.T @ hidden, None if bias is None else da.sum(axis=0)


@linear_logprobs_backward.reference
def _backward_reference(grad_logps, grad_entropy, hidden, weight, target, entropy, lse, bias, temperature, softcap,
                        ignore_index):
    z, dz_da = _logits(hidden, weight, bias, temperature, softcap)
    d = _dlogits(grad_logps, grad_entropy, z, target, entropy, lse, ignore_index)
    return _grads(d, hidden, weight, bias, dz_da)


# docs/numerics.md 3.3, as linear_cross_entropy's backward: every gradient sums over V (dhidden) or N (dweight,
# dbias) with float32 accumulation, judged norm-wise
linear_logprobs_backward.tolerance(
    float64=Tolerance(1e-7, 1e-7, "normwise", reason="docs/numerics.md 3.3: K-accumulating, norm-wise"),
    float32=Tolerance(1e-5, 1e-5, "normwise", reason="docs/numerics.md 3.3: K-accumulating, norm-wise"),
    float16=Tolerance(2e-3, 1e-5, "normwise", reason="docs/numerics.md 3.3: fp32 accumulation, norm-wise"),
    bfloat16=Tolerance(1.6e-2, 1e-5, "normwise", reason="docs/numerics.md 3.3: fp32 accumulation, norm-wise"),
)


_PEAKED = ("logits up to |z| ~ 36 from a 64-long float32 dot carry ~8e-6 of rounding, and the entropy's gradient "
           "p (log p + H) amplifies a logit's error by 1 + |log p + H|: the float64 reference fed the float32 GEMM's "
           "logits alone moves dweight by 8.65e-5 (|dweight| 5.6), the cpu kernel's whole error (8.62e-5)")
linear_logprobs_backward.case_tolerance(
    "peaked", float32=Tolerance(2e-5, 1e-5, "normwise", reason=_PEAKED))


@linear_logprobs_backward.error_cases
def _backward_error_cases():
    x, w, t = np.zeros((4, 8), np.float32), np.zeros((10, 8), np.float32), np.zeros(4, np.int64)
    g, s = np.ones(4, np.float32), np.zeros(4, np.float32)
    yield ErrorCase(f"{BWD}.grad_shape", ShapeError, (np.ones((), np.float32), g, x, w, t, s, s))
    yield ErrorCase(f"{BWD}.grad_shape", ShapeError, (g, np.ones(5, np.float32), x, w, t, s, s))
    yield ErrorCase(f"{BWD}.grad_dtype", DTypeError, (g.astype(np.float16), g, x, w, t, s, s))
    yield ErrorCase(f"{BWD}.saved", ShapeError, (g, g, x, w, t, s, np.zeros(5, np.float32)))
    yield ErrorCase(f"{BWD}.saved", DTypeError, (g, g, x, w, t, s, s.astype(np.float64)))
    yield ErrorCase(f"{BWD}.saved", DTypeError, (g, g, x, w, t, s.astype(np.float16), s))
    yield ErrorCase(f"{BWD}.target_range", ArgumentError, (g, g, x, w, np.array([0, 10, 1, 2]), s, s))


@linear_logprobs_backward.cost
def _backward_cost(grad_logps, grad_entropy, hidden, weight, target, entropy, lse, bias, temperature, softcap,
                   ignore_index):
    """Inputs and the saved rows read, the three gradients written: no logits move. FLOPs: the two GEMMs."""
    item = lce._item(hidden.dtype)
    written = (hidden.size + weight.size + (bias.size if bias is not None else 0)) * item
    n = hidden.shape[0]
    return Cost(bytes=lce._bytes_in(hidden, weight, target, bias) + written + 16 * n,
                flops=4 * n * weight.shape[0] * hidden.shape[1])


@linear_logprobs_backward.cases
def _backward_cases(dtype):
    """Upstream gradients the derived cases (random normal ones for both outputs) do not cover."""
    fwd = _case("grad-edge", dtype, 7, 16, 90, bias=True, ignore=(2,), softcap=10.0, scale=5.0, temperature=0.7)
    n = 7
    rng = cg.rng_for(BWD, "grad-edge", dtype)
    g = rng.standard_normal(n).astype(np.float32)
    for name, grads in (("logps-only", (g, np.zeros(n, np.float32))), ("entropy-only", (np.zeros(n, np.float32), g)),
                        ("zero-grads", (np.zeros(n, np.float32),) * 2)):
        case = linear_logprobs_backward.from_forward(fwd, dtype, grad=grads)
        yield Case(name, case.args, case.kwargs, ("edge",))


# The three gradient bugs users of fused log-prob / policy losses have reported: each is a mutant the gate catches.


@linear_logprobs_backward.mutant("per-token-grads-as-ones")
def _mutant_grads_as_ones(grad_logps, grad_entropy, hidden, weight, target, entropy, lse, bias, temperature, softcap,
                          ignore_index):
    """The gradient precomputed in the forward as for a summed loss, scaled by the mean upstream gradient: per-token
    weights (advantages, masks) lost, as a fused kernel that assumes a reduced loss does under reduction='none'."""
    n = grad_logps.shape[0]
    ones = np.full(n, grad_logps.mean() if n else 0.0)
    return _backward_reference(ones, grad_entropy, hidden, weight, target, entropy, lse, bias, temperature, softcap,
                               ignore_index)


@linear_logprobs_backward.mutant("entropy-grad-dropped")
def _mutant_entropy_dropped(grad_logps, grad_entropy, hidden, weight, target, entropy, lse, bias, temperature,
                            softcap, ignore_index):
    """The entropy output's upstream gradient ignored (an entropy bonus that changes the loss but not the step)."""
    return _backward_reference(grad_logps, np.zeros_like(grad_entropy), hidden, weight, target, entropy, lse, bias,
                               temperature, softcap, ignore_index)


@linear_logprobs_backward.mutant("first-grad-broadcast")
def _mutant_broadcast(grad_logps, grad_entropy, hidden, weight, target, entropy, lse, bias, temperature, softcap,
                      ignore_index):
    """The upstream gradient read as a scalar: the first token's broadcast to every token (both outputs)."""
    first = (lambda g: np.full_like(g, g[0]) if g.size else g)
    return _backward_reference(first(grad_logps), first(grad_entropy), hidden, weight, target, entropy, lse, bias,
                               temperature, softcap, ignore_index)


@linear_logprobs_backward.mutant("temperature-left-out-of-grad")
def _mutant_temperature(grad_logps, grad_entropy, hidden, weight, target, entropy, lse, bias, temperature, softcap,
                        ignore_index):
    """The chain rule's 1/T dropped (with T = 1: the entropy term's sign flipped)."""
    z, dz_da = _logits(hidden, weight, bias, temperature, softcap)
    if temperature == 1.0:
        return _backward_reference(grad_logps, -grad_entropy, hidden, weight, target, entropy, lse, bias, temperature,
                                   softcap, ignore_index)
    d = _dlogits(grad_logps, grad_entropy, z, target, entropy, lse, ignore_index)
    return _grads(d, hidden, weight, bias, dz_da * temperature)


def _check_target(hidden, weight, target, bias, temperature, softcap, ignore_index):
    lce.ce.check_targets(NAME, target, weight.shape[0], ignore_index)


def _check_backward_target(grad_logps, grad_entropy, hidden, weight, target, entropy, lse, bias, temperature, softcap,
                           ignore_index):
    lce.ce.check_targets(BWD, target, weight.shape[0], ignore_index)


linear_logprobs.check_values(("target",))(_check_target)
linear_logprobs_backward.check_values(("target",))(_check_backward_target)
_check_target.on_device = _check_backward_target.on_device = False  # opport/dispatch/core.py `value_check`
