"""cross_entropy: logsumexp(row) - row[target] per row of logits [N, V], with ignore_index, smoothing, reductions."""

from __future__ import annotations

import math

import numpy as np

from opport import casegen as cg
from opport.arraymath import reduce_losses
from opport.dtypes import INTS, finfo
from opport.errors import ArgumentError, DTypeError, ShapeError
from opport.spec import (
    BASE_TOLERANCE,
    INDEX,
    Case,
    Cost,
    ErrorCase,
    Tolerance,
    check,
    check_choice,
    check_domain,
    check_float,
    check_grad,
    fail,
    grad_constraints,
    op,
)

NAME = "cross_entropy"
REDUCTIONS = ("mean", "sum", "none")


@op(
    arrays=("logits", "target"),
    domains={"target": INDEX},
    constraints={
        "cross_entropy.dtype": "logits is float32, float16, bfloat16 or float64",
        "cross_entropy.logits_shape": "logits is 2-d [N, V] with V >= 1",
        "cross_entropy.target_dtype": f"target is an integer array ({', '.join(INTS)})",
        "cross_entropy.target_shape": "target.shape == (N,)",
        "cross_entropy.ignore_index": "ignore_index is an int in the int64 range (targets are int64)",
        "cross_entropy.reduction": f"reduction is one of {REDUCTIONS}",
        "cross_entropy.label_smoothing": "label_smoothing is a number in [0, 1]",
        "cross_entropy.target_range": "every target is a class in [0, V) or ignore_index (read on the host before any "
                                      "kernel: NumPy and CPU arrays always, device arrays under OPPORT_CHECK_VALUES=1)",
    },
    out_dtype="float32",
)
def cross_entropy(logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    """Softmax cross-entropy of integer class targets, always returned in float32.

    Row loss = logsumexp(row) - row[target]; with smoothing eps: (1 - eps)·that + eps·(logsumexp - mean(row)).
    Rows whose target == ignore_index have loss 0 and are left out of the mean's count; with every
    row ignored (or N = 0), "mean" is NaN, as in torch. reduction "none" -> [N], "sum"/"mean" -> 0-d.
    A target outside [0, V) that is not ignore_index is an ArgumentError (`cross_entropy.target_range`)
    before any kernel runs when target is a host array (NumPy, a CPU tensor, a JAX array on the CPU: the
    dispatcher reads it, at no synchronisation). On a device array (a CUDA tensor, a JAX array on a GPU)
    reading it back would cost a synchronisation per call, so it is not read: that row's loss is NaN, which
    poisons "sum" and "mean" (the departure PyTorch PR #195829 documents); OPPORT_CHECK_VALUES=1 turns the
    check on for device arrays too (a debug switch). Under jax.jit the check runs when the compiled function
    calls back (host arrays), so the error arrives wrapped in JAX's runtime error.
    Logits near the dtype's maximum: docs/numerics.md 3.5.1 says which results are defined.
    """
    check_float(NAME, "logits", logits)
    check(logits.ndim == 2 and logits.shape[1] >= 1, ShapeError, NAME, "logits", "cross_entropy.logits_shape",
          "2-d [N, V] with V >= 1", logits.shape)
    check_domain(NAME, "target", target, INDEX)
    check(target.shape == logits.shape[:1], ShapeError, NAME, "target", "cross_entropy.target_shape",
          f"({logits.shape[0]},) = (N,)", target.shape)
    ok = isinstance(ignore_index, (int, np.integer)) and not isinstance(ignore_index, (bool, np.bool_)) \
        and -(2**63) <= ignore_index < 2**63
    check(ok, ArgumentError, NAME, "ignore_index", "cross_entropy.ignore_index", "an int in [-2^63, 2^63)",
          repr(ignore_index))
    check_choice(NAME, "reduction", reduction, REDUCTIONS)
    ls = label_smoothing
    ok = isinstance(ls, (int, float, np.floating)) and not isinstance(ls, bool) and math.isfinite(ls) and 0 <= ls <= 1
    check(ok, ArgumentError, NAME, "label_smoothing", "cross_entropy.label_smoothing", "a number in [0, 1]", repr(ls))


# batch invariance (docs/conformance.md): the arrays whose leading axis is the batch
cross_entropy.batched("logits", "target", when=lambda logits, t, ii, reduction, *_: logits.ndim == 2 and reduction == "none")


@cross_entropy.reference
def _reference(logits, target, ignore_index, reduction, label_smoothing):
    """(m - x_t) + log(s) and, smoothed, mean(m - x) + log(s), with m the row max and s = sum(exp(x - m)): never
    logsumexp - x_t, which loses log(V) beside |m| ~ 1e38 even in float64 (docs/numerics.md 3.5.1)."""
    n, v = logits.shape
    t = target.astype(np.int64)
    ignored = t == ignore_index
    valid = (t >= 0) & (t < v)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        m = logits.max(axis=1, initial=-np.inf)
        log_s = np.log(np.exp(logits - m[:, None]).sum(axis=1))
        nll = (m - logits[np.arange(n), np.clip(t, 0, v - 1)]) + log_s
        if label_smoothing:
            nll = (1 - label_smoothing) * nll + label_smoothing * ((m[:, None] - logits).mean(axis=1) + log_s)
    loss = np.where(ignored, 0.0, np.where(valid, nll, np.nan))
    return reduce_losses(loss, ignored, reduction)


# docs/numerics.md 3.3: the loss is judged relative to itself; atol covers losses that are ~0 (peaked rows), whose
# float32 result carries an absolute error of a few eps·log(V), not a relative one.
cross_entropy.tolerance(
    float64=Tolerance(1e-7, 1e-9, reason="docs/numerics.md 3.2 (float64 computes in float64)"),
    float32=Tolerance(1e-5, 1e-6, reason="docs/numerics.md 3.3: loss relative, fp32 inputs"),
    float16=Tolerance(1e-4, 1e-6, reason="docs/numerics.md 3.3: loss returned in fp32 with fp32 accumulation"),
    bfloat16=Tolerance(1e-4, 1e-6, reason="docs/numerics.md 3.3: loss returned in fp32 with fp32 accumulation"),
)


def _case(name, dtype, n, v, ignore=(), ignore_index=-100, reduction="mean", smoothing=0.0, dist="normal", scale=1.0,
          peaked=None, shift=0.0, tags=()):
    rng = cg.rng_for(NAME, name, dtype)
    x = rng.standard_normal((n, v)) * scale if dist == "normal" else cg.array((n, v), "float64", rng, dist, scale)
    t = rng.integers(0, v, n)
    if peaked is not None:  # the target logit stands `peaked` above the rest: loss ~ V·exp(-peaked)
        x[np.arange(n), t] = x.max(axis=1) + peaked
    x += shift  # all logits negative: a masked tail that loads 0 instead of -inf becomes the row max
    t[list(ignore)] = ignore_index
    return Case(name, (cg.cast(x, dtype), t), {"ignore_index": ignore_index, "reduction": reduction,
                                               "label_smoothing": smoothing}, tags)


@cross_entropy.cases
def _cases(dtype):
    yield _case("llama2-vocab", dtype, 4, 32000, ignore=(2,), tags=("llm",))
    yield _case("llama3-vocab", dtype, 4, 128256, reduction="sum", tags=("llm",))
    yield _case("llama3-vocab-smoothing", dtype, 2, 128256, smoothing=0.1, reduction="none", tags=("llm",))
    yield _case("gpt2-vocab-odd", dtype, 3, 50257, ignore=(1,), reduction="none")  # V % any power-of-2 block != 0
    yield _case("v-block-plus-1", dtype, 5, 4097, smoothing=0.05)
    yield _case("v-1", dtype, 6, 1, ignore=(0,))
    yield _case("v-small-many-rows", dtype, 300, 23, ignore=range(0, 300, 7))
    yield _case("ignore-positive", dtype, 8, 1000, ignore=(0, 5), ignore_index=7)
    yield _case("all-ignored-mean", dtype, 4, 100, ignore=range(4), tags=("edge",))
    yield _case("all-ignored-sum", dtype, 4, 100, ignore=range(4), reduction="sum", tags=("edge",))
    yield _case("empty-batch-mean", dtype, 0, 100, tags=("edge",))
    yield _case("empty-batch-none", dtype, 0, 100, reduction="none", tags=("edge",))
    yield _case("smoothing-1", dtype, 4, 300, smoothing=1.0, reduction="none")
    yield _case("smoothing-ignore-mean", dtype, 8, 50, ignore=(3,), smoothing=0.3)
    # peaked rows: losses ~0.05, still resolvable in float32 (log(1 + t) rounds to 0 below t ~ 1e-7, as in torch)
    yield _case("peaked", dtype, 4, 32000, peaked=10.0, reduction="none", tags=("edge",))
    yield _case("peaked-negative", dtype, 4, 50257, peaked=6.0, shift=-30.0, reduction="none", tags=("edge",))
    yield _case("peaked-smoothing", dtype, 4, 32000, peaked=30.0, smoothing=0.1, reduction="none", tags=("edge",))
    yield _case("logits-1e4", dtype, 4, 4099, scale=1e4, reduction="none", tags=("edge",))
    yield _case("logits-1e4-peaked", dtype, 4, 4099, scale=1e4, peaked=5.0, reduction="none", tags=("edge",))
    yield _case("heavy-tails", dtype, 8, 3000, dist="heavy", scale=3.0, reduction="none")
    yield _neg_inf_logits(dtype)
    yield _neg_inf_target_smoothing(dtype)
    yield from _near_max(dtype)


def _near_max(dtype: str):
    """Logits near the dtype's maximum, inside the domain docs/numerics.md 3.5.1 defines: no smoothing at up to
    0.99 of the maximum (a loss past float32's range is inf, as the exact value rounds), equal and nearly equal
    rows there (loss log(V), and ~1e36: the reference must not lose log(V) beside |m|), smoothing while
    V max|x| fits the accumulation dtype, and a "mean" whose float32 sum of losses still fits."""
    fmax = float(finfo(dtype).max)
    acc_max = float(np.finfo(np.float64 if dtype == "float64" else np.float32).max)
    rng = cg.rng_for(NAME, "near-max", dtype)
    n, v = 6, 64
    t = rng.integers(0, v, n)
    x = rng.uniform(-1, 1, (n, v)) * 0.99 * fmax
    yield Case("near-max-spread", (cg.cast(x, dtype), t), {"reduction": "none"}, ("edge",))
    x = np.empty((n, v))
    x[:3] = fmax * (1 - rng.random((3, v)) * 2.0**-6)  # 1.6% below the maximum: 7 bits, exact in every dtype
    x[3], x[4], x[5] = fmax, -fmax, rng.choice([-fmax, fmax])  # equal rows: log(V)
    yield Case("near-max-equal-rows", (cg.cast(x, dtype), t), {"reduction": "none"}, ("edge",))
    x = rng.uniform(-1, 1, (n, v)) * min(0.99 * fmax, 0.5 * acc_max / v)  # V max|x| at half the dtype's range
    yield Case("near-max-smoothing", (cg.cast(x, dtype), t), {"reduction": "none", "label_smoothing": 0.1},
               ("edge",))
    x = rng.standard_normal((4, v))
    x[np.arange(4), t[:4]] = -min(0.2 * float(np.finfo(np.float32).max), 0.99 * fmax)  # 4 losses of ~0.2 max
    yield Case("near-max-mean", (cg.cast(x, dtype), t[:4]), {"reduction": "mean"}, ("edge",))


def _neg_inf_logits(dtype: str) -> Case:
    """Masked-out vocabulary entries (-inf logits) away from the target, and a NaN in an ignored row."""
    rng = cg.rng_for(NAME, "neg-inf-logits", dtype)
    x = rng.standard_normal((4, 300))
    t = rng.integers(0, 150, 4)
    x[:, 150:] = -np.inf
    t[3] = -100
    x[3, 10] = np.nan
    return Case("neg-inf-logits", (cg.cast(x, dtype), t), {"reduction": "none"}, ("edge",))


def _neg_inf_target_smoothing(dtype: str) -> Case:
    """Label smoothing where -inf logits (a masked vocabulary) include the target's: the loss is inf.

    (1-eps) nll + eps (logsumexp - mean) is inf + inf; rewriting it as nll + eps (x_t - mean) gives
    -inf - -inf = NaN (a neuron kernel did, found by the full tier). Row 1's target is finite.
    """
    rng = cg.rng_for(NAME, "neg-inf-target-smoothing", dtype)
    x = rng.standard_normal((3, 200))
    x[:, 120:] = -np.inf
    t = np.array([130, 5, 199])
    return Case("neg-inf-target-smoothing", (cg.cast(x, dtype), t), {"reduction": "none", "label_smoothing": 0.1},
                ("edge",))


@cross_entropy.strategy
def _strategy(dtype):
    from hypothesis import strategies as st

    @st.composite
    def case(draw):
        n, v = draw(st.integers(0, 40)), draw(st.one_of(cg.dims(1, 5000), st.sampled_from([4095, 4096, 4097, 8193])))
        ignore_index = draw(st.sampled_from([-100, -1, 0, 3]))
        reduction = draw(st.sampled_from(REDUCTIONS))
        smoothing = draw(st.sampled_from([0.0, 0.0, 0.1, 0.5]))
        dist, scale, seed = draw(cg.dists(specials=False)), draw(cg.scales()), draw(cg.seeds())
        tdtype = draw(st.sampled_from(["int64", "int32"]))
        rng = np.random.default_rng(seed)
        x = cg.array((n, v), dtype, rng, dist, scale)
        t = rng.integers(0, v, n)
        t[rng.random(n) < draw(st.sampled_from([0.0, 0.2, 1.0]))] = ignore_index
        kwargs = {"ignore_index": ignore_index, "reduction": reduction, "label_smoothing": smoothing}
        return Case(f"hyp-{seed}", (x, t.astype(tdtype)), kwargs, ("hypothesis",))

    return case()


@cross_entropy.error_cases
def _error_cases():
    x, t = np.zeros((4, 10), np.float32), np.zeros(4, np.int64)
    yield ErrorCase("cross_entropy.dtype", DTypeError, (np.zeros((4, 10), np.int32), t))
    yield ErrorCase("cross_entropy.logits_shape", ShapeError, (np.zeros(10, np.float32), np.zeros((), np.int64)))
    yield ErrorCase("cross_entropy.logits_shape", ShapeError, (np.zeros((4, 0), np.float32), t))
    yield ErrorCase("cross_entropy.target_dtype", DTypeError, (x, np.zeros(4, np.float32)))
    yield ErrorCase("cross_entropy.target_dtype", DTypeError, (x, np.zeros(4, bool)))
    yield ErrorCase("cross_entropy.target_shape", ShapeError, (x, np.zeros(5, np.int64)))
    yield ErrorCase("cross_entropy.target_shape", ShapeError, (x, np.zeros((4, 1), np.int64)))
    yield ErrorCase("cross_entropy.ignore_index", ArgumentError, (x, t), {"ignore_index": 1.5})
    yield ErrorCase("cross_entropy.ignore_index", ArgumentError, (x, t), {"ignore_index": True})
    yield ErrorCase("cross_entropy.ignore_index", ArgumentError, (x, t), {"ignore_index": 2**70})  # beyond int64
    yield ErrorCase("cross_entropy.reduction", ArgumentError, (x, t), {"reduction": "avg"})
    yield ErrorCase("cross_entropy.label_smoothing", ArgumentError, (x, t), {"label_smoothing": 1.5})
    yield ErrorCase("cross_entropy.label_smoothing", ArgumentError, (x, t), {"label_smoothing": float("nan")})
    for bad in ([0, 10, 1, 2], [0, -1, 1, 2], [-100, 3, 2**40, 1]):  # V, a negative label, far past V (not ignored)
        yield ErrorCase("cross_entropy.target_range", ArgumentError, (x, np.array(bad)))
    yield ErrorCase("cross_entropy.target_range", ArgumentError, (x, np.array([0, 1, 10, 2], np.int32)),
                    {"ignore_index": 7, "reduction": "none"})  # a positive ignore_index leaves V out of range
    yield ErrorCase("cross_entropy.target_range", ArgumentError, (x, np.array([0, 1, 255, 2], np.uint8)),
                    {"ignore_index": -100, "label_smoothing": 0.1})


@cross_entropy.shape
def _shape(logits, target, ignore_index, reduction, label_smoothing):
    return (logits.shape[0],) if reduction == "none" else ()


@cross_entropy.cost
def _cost(logits, target, ignore_index, reduction, label_smoothing):
    item = np.dtype(cg.np_dtype(logits.dtype)).itemsize
    titem = np.dtype(cg.np_dtype(target.dtype)).itemsize
    n = logits.shape[0]
    out = n if reduction == "none" else 1
    return Cost(bytes=logits.size * item + n * titem + 4 * out, flops=4 * logits.size)


# --------------------------------------------------------------------------- backward

BWD = f"{NAME}_backward"


@cross_entropy.saves(("lse",), shapes=lambda logits, *_: [(logits.shape[0],)])
def _saved(logits, target, ignore_index, reduction, label_smoothing):
    """Per-row logsumexp [N] (float32): -inf for a row of -inf logits, NaN for a row holding NaN or +inf."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        m = logits.max(axis=1, initial=-np.inf)
        m_ref = np.where(m == -np.inf, 0.0, m)
        return (m + np.log(np.exp(logits - m_ref[:, None]).sum(axis=1)),)


@cross_entropy.backward(
    wrt=("logits",),
    constants={"target": "integer class indices: a discrete label, not a differentiable quantity"},
    constraints={
        **grad_constraints(NAME),
        f"{BWD}.saved": "lse is [N] in the accumulation dtype, float32 (float64 for float64 logits): the training "
                        "forward's per-row logsumexp",
        f"{BWD}.target_range": "every target is a class in [0, V) or ignore_index (as cross_entropy.target_range)",
    },
)
def cross_entropy_backward(grad, logits, target, lse, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    """The gradient of cross_entropy for logits; target is a constant.

    Saves logits, target and the per-row logsumexp lse [N] (float32; float64 for float64 logits), so the backward computes the
    softmax p = exp(logits - lse) in one pass without a second reduction over the vocabulary. With
    eps = label_smoothing and c the row's share of the upstream gradient (grad[i] for "none", grad for
    "sum", grad / (non-ignored rows) for "mean"): dlogits = c (p - eps/V - (1 - eps) onehot(target)).
    Rows whose target is ignore_index get exactly 0 (whatever their logits hold); a target outside
    [0, V) is `cross_entropy_backward.target_range` on host arrays, a NaN row on device arrays (as its loss is
    NaN; see cross_entropy). A -inf logit has p = 0, so its gradient is c (-eps/V)
    (minus (1 - eps) c if it is the target): finite, although the loss is +inf when smoothing meets a
    -inf logit (its mean term is -inf) or the target's logit is -inf; this is the formula's value and
    what torch's log_softmax backward gives.
    """
    cross_entropy.validate(logits, target, ignore_index, reduction, label_smoothing)
    check_grad(BWD, grad, (logits.shape[0],) if reduction == "none" else (), "float32")
    check(lse is not None, ArgumentError, BWD, "lse", f"{BWD}.saved", "the training forward's lse", None)
    acc = "float64" if logits.dtype == "float64" else "float32"
    check(lse.dtype == acc, DTypeError, BWD, "lse", f"{BWD}.saved", acc, lse.dtype)
    check(tuple(lse.shape) == (logits.shape[0],), ShapeError, BWD, "lse", f"{BWD}.saved", f"({logits.shape[0]},) = (N,)",
          tuple(lse.shape))


def _row_coefficients(grad: np.ndarray, ignored: np.ndarray, reduction: str) -> np.ndarray:
    """Each row's share of the upstream gradient [N] (0 for ignored rows): the derivative of the reduction."""
    n = ignored.size
    if reduction == "none":
        return np.where(ignored, 0.0, grad)
    kept = n - int(np.count_nonzero(ignored))
    share = grad if reduction == "sum" else grad / max(kept, 1)  # kept = 0: every row is ignored anyway
    return np.where(ignored, 0.0, np.full(n, share))


@cross_entropy_backward.reference
def _backward_reference(grad, logits, target, lse, ignore_index, reduction, label_smoothing):
    with np.errstate(invalid="ignore", over="ignore"):
        return _dlogits(logits - lse[:, None], target, ignore_index, reduction, label_smoothing, grad)


def _dlogits(shifted, target, ignore_index, reduction, label_smoothing, grad) -> tuple:
    """(dlogits,) from shifted = x - logsumexp(row) [N, V] (float64): c (exp(shifted) - eps/V - (1 - eps) onehot)."""
    n, v = shifted.shape
    t = target.astype(np.int64)
    ignored, valid = t == ignore_index, (t >= 0) & (t < v)
    eps = label_smoothing
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.exp(shifted)
        d -= eps / v
        rows = np.flatnonzero(valid)
        d[rows, t[rows]] -= 1 - eps
        d *= _row_coefficients(np.asarray(grad, np.float64), ignored, reduction)[:, None]
    d[~valid] = np.nan
    d[ignored] = 0.0
    return (d,)


# docs/numerics.md 3.3: the loss is judged against its own relative tolerances, the gradient against the base table
cross_entropy_backward.tolerance(**{
    d: Tolerance(t.rtol, t.atol, reason="docs/numerics.md 3.3: cross_entropy's gradient, in logits' dtype: the base table")
    for d, t in BASE_TOLERANCE.items()})


@cross_entropy_backward.error_cases
def _backward_error_cases():
    x, t, lse = np.zeros((4, 10), np.float32), np.zeros(4, np.int64), np.zeros(4, np.float32)
    g0, gn = np.ones((), np.float32), np.ones(4, np.float32)
    yield ErrorCase(f"{BWD}.grad_shape", ShapeError, (gn, x, t, lse))  # "mean" has a 0-d loss
    yield ErrorCase(f"{BWD}.grad_shape", ShapeError, (g0, x, t, lse), {"reduction": "none"})
    yield ErrorCase(f"{BWD}.grad_dtype", DTypeError, (np.ones((), np.float16), x, t, lse))
    yield ErrorCase(f"{BWD}.saved", ShapeError, (g0, x, t, np.zeros(5, np.float32)))
    yield ErrorCase(f"{BWD}.saved", DTypeError, (g0, x, t, lse.astype(np.float64)))
    yield ErrorCase(f"{BWD}.target_range", ArgumentError, (g0, x, np.array([0, 10, 1, 2]), lse))
    yield ErrorCase(f"{BWD}.target_range", ArgumentError, (gn, x, np.array([0, -5, 1, 2]), lse), {"reduction": "none"})


@cross_entropy_backward.cost
def _backward_cost(grad, logits, target, lse, ignore_index, reduction, label_smoothing):
    item = np.dtype(cg.np_dtype(logits.dtype)).itemsize
    titem = np.dtype(cg.np_dtype(target.dtype)).itemsize
    n = logits.shape[0]
    return Cost(bytes=2 * logits.size * item + n * (titem + 4) + 4 * grad.size, flops=4 * logits.size)


def _grad_case(name: str, dtype: str, forward: Case, grad=None, tags=("edge",)) -> Case:
    case = cross_entropy_backward.from_forward(forward, dtype, grad=None if grad is None else np.asarray(grad, np.float32))
    return Case(name, case.args, case.kwargs, tags)


@cross_entropy_backward.cases
def _backward_cases(dtype):
    """Edge cases for the gradient beside those derived from the forward's (random upstream gradients)."""
    ignored = _case("ignored-rows", dtype, 6, 500, ignore=(0, 2, 5), reduction="none")
    nan = ignored.args[0].copy()
    nan[2, ::7] = cg.cast(np.nan, dtype)  # NaN in an ignored row: its gradient is still exactly 0
    nan[5, 3] = cg.cast(np.inf, dtype)
    yield _grad_case("ignored-rows-nonfinite", dtype, Case("ignored-rows", (nan, *ignored.args[1:]), ignored.kwargs))
    yield _grad_case("ignored-rows-mean", dtype, _case("ignored-mean", dtype, 6, 500, ignore=(1, 4), smoothing=0.1))
    yield _grad_case("all-ignored-mean-grad", dtype, _case("all-ignored", dtype, 3, 50, ignore=range(3)), 1.0)
    yield _grad_case("zero-grad", dtype, _case("zero-grad", dtype, 4, 300, reduction="none"), np.zeros(4))
    yield _grad_case("neg-inf-smoothing-sum", dtype, _neg_inf_smoothing_sum(dtype))
    yield _grad_case("large-logits-smoothing", dtype, _case("large-s", dtype, 4, 4099, scale=1e4, smoothing=0.1, reduction="sum"))
    yield _grad_case("large-grad", dtype, _case("large-g", dtype, 5, 1000, reduction="none"), [1e30, -3e20, 1.0, 0.0, -1e-30])


def _neg_inf_smoothing_sum(dtype: str) -> Case:
    """-inf logits (a masked vocabulary), the target's own among them in row 0, with smoothing and "sum":
    the loss is +inf, the gradient the formula's finite value (see cross_entropy_backward)."""
    c = _neg_inf_target_smoothing(dtype)
    return Case(c.name, c.args, {**c.kwargs, "reduction": "sum"}, c.tags)


@cross_entropy_backward.mutant("mean-not-divided")
def _mutant_mean_not_divided(grad, logits, target, lse, ignore_index, reduction, label_smoothing):
    """"mean" treated as "sum": the gradient not divided by the count of kept rows."""
    return _backward_reference(grad, logits, target, lse, ignore_index, "sum" if reduction == "mean" else reduction,
                               label_smoothing if reduction == "mean" else label_smoothing * 0.5)


@cross_entropy_backward.mutant("smoothing-dropped")
def _mutant_smoothing_dropped(grad, logits, target, lse, ignore_index, reduction, label_smoothing):
    """Label smoothing left out of the gradient (softmax minus one-hot only)."""
    return _backward_reference(grad, logits, target, lse, ignore_index, reduction, 0.0 if label_smoothing else 0.1)


# --------------------------------------------------------------------------- forward fused with the backward

VAG = f"{NAME}_value_and_grad"


@cross_entropy.value_and_grad()
def cross_entropy_value_and_grad(logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    """The loss and dlogits = d loss / d logits for a unit upstream gradient, from one pass over each row.

    What training runs when the logits need a gradient and the backend has a kernel for it (as Liger-Kernel's
    cross-entropy): each row's logsumexp is reduced over vocabulary chunks, then the same row is walked again
    (from cache) writing dlogits = c (softmax - eps/V - (1 - eps) onehot(target)), c = 1 ("none", "sum") or
    1 / (non-ignored rows) ("mean"), 0 for ignored rows (targets outside [0, V): as cross_entropy). The backward is then
    only `upstream * dlogits` (per row for "none"), skipped where the upstream is exactly 1, in place on this
    op's own buffer: forward + backward read the logits once and write dlogits once, instead of reading them
    twice (`cross_entropy_forward` + `cross_entropy_backward`). dlogits has the logits' dtype; validation,
    cases and error cases are the forward's (errors name `cross_entropy`).
    """
    cross_entropy.validate(logits, target, ignore_index, reduction, label_smoothing)


@cross_entropy_value_and_grad.reference
def _value_and_grad_reference(logits, target, ignore_index, reduction, label_smoothing):
    """The forward's reference and dlogits at a unit upstream gradient, with x - logsumexp formed as (x - m) - log(s)
    from the row max m: a logsumexp held as one float64 number loses log(s) beside |m| ~ 1e38 (its ulp is ~1e22),
    which the fused kernels, forming p from m and log(s) as well, do not (docs/numerics.md 3.5.1)."""
    loss = _reference(logits, target, ignore_index, reduction, label_smoothing)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        m = logits.max(axis=1, initial=-np.inf)
        x = logits - np.where(m == -np.inf, 0.0, m)[:, None]  # an all -inf row: NaN below, as its logsumexp -inf
        shifted = x - np.log(np.exp(x).sum(axis=1))[:, None]
    return (loss, *_dlogits(shifted, target, ignore_index, reduction, label_smoothing, np.ones(np.shape(loss))))


@cross_entropy_value_and_grad.cost
def _value_and_grad_cost(logits, target, ignore_index, reduction, label_smoothing):
    item = np.dtype(cg.np_dtype(logits.dtype)).itemsize
    titem = np.dtype(cg.np_dtype(target.dtype)).itemsize
    n = logits.shape[0]
    out = n if reduction == "none" else 1
    return Cost(bytes=2 * logits.size * item + n * titem + 4 * out, flops=8 * logits.size)


@cross_entropy_value_and_grad.mutant("mean-not-divided")
def _vag_mutant_mean_not_divided(logits, target, ignore_index, reduction, label_smoothing):
    """dlogits of "mean" not divided by the count of kept rows."""
    loss, d = cross_entropy_value_and_grad._reference(logits, target, ignore_index, reduction, label_smoothing)
    if reduction == "mean":
        d = d * max(int(np.count_nonzero(target != ignore_index)), 1)
    else:
        d = d * 1.5
    return loss, d


@cross_entropy_value_and_grad.mutant("smoothing-dropped")
def _vag_mutant_smoothing_dropped(logits, target, ignore_index, reduction, label_smoothing):
    """The loss right, dlogits without label smoothing (softmax minus one-hot only)."""
    loss, _ = cross_entropy_value_and_grad._reference(logits, target, ignore_index, reduction, label_smoothing)
    other = 0.0 if label_smoothing else 0.1
    return loss, cross_entropy_value_and_grad._reference(logits, target, ignore_index, reduction, other)[1]


# --------------------------------------------------------------------------- class labels, checked on their values


_UNSIGNED = {np.dtype(f"i{n}"): np.dtype(f"u{n}") for n in (1, 2, 4, 8)}  # the same bits, read without sign


def check_targets(op: str, target, v: int, ignore_index) -> None:
    """Every target is a class in [0, V) or ignore_index: the one property of the inputs validation (metadata only)
    cannot see. Run by the dispatcher before any kernel (`check_values`) on host arrays; on device arrays only under
    OPPORT_CHECK_VALUES=1 (`on_device = False`: reading them back would synchronise on every call)."""
    t = target if target.__class__ is np.ndarray else np.asarray(target)
    u = t.view(_UNSIGNED[t.dtype]) if t.dtype in _UNSIGNED else t  # negatives wrap past any V
    outside = np.count_nonzero(u >= v)  # one pass on the common path: ~1 us per call on small batches
    if outside and not 0 <= ignore_index < v:
        outside -= np.count_nonzero(t == ignore_index)
    if outside:
        t = t.astype(np.int64)
        i = int(np.flatnonzero((t != ignore_index) & ((t < 0) | (t >= v)))[0])
        fail(ArgumentError, op, "target", f"{op}.target_range", f"class labels in [0, {v}) or ignore_index "
             f"({ignore_index})", f"{int(t[i])} at row {i} ({outside} row(s) out of range)")


def _check_target(logits, target, ignore_index, reduction, label_smoothing):
    check_targets(NAME, target, logits.shape[1], ignore_index)


def _check_backward_target(grad, logits, target, lse, ignore_index, reduction, label_smoothing):
    check_targets(BWD, target, logits.shape[1], ignore_index)


# the training forward and the fused value-and-grad take the forward's check (errors name cross_entropy)
cross_entropy.check_values(("target",))(_check_target)
cross_entropy_backward.check_values(("target",))(_check_backward_target)
_check_target.on_device = _check_backward_target.on_device = False  # opport/dispatch/core.py `value_check`
