"""topk_router: a mixture of experts' router, each token's k experts and their weights from its router logits."""

from __future__ import annotations

import numpy as np

from opport import casegen as cg
from opport.errors import ArgumentError, DTypeError, ShapeError
from opport.ops.silu import sigmoid64
from opport.spec import (
    FLOAT32,
    Case,
    Cost,
    ErrorCase,
    check,
    check_bool,
    check_choice,
    check_domain,
    check_float,
    check_grad,
    grad_constraints,
    op,
)

NAME = "topk_router"
BWD = f"{NAME}_backward"
SCORINGS = ("softmax", "sigmoid")


@op(
    arrays=("logits", "bias"),
    domains={"bias": FLOAT32},
    constraints={
        f"{NAME}.dtype": "logits is float32, float16, bfloat16 or float64",
        f"{NAME}.logits_rank": "logits is 2-d [T, E] with E >= 1",
        f"{NAME}.k": "k is an int, 1 <= k <= E",
        f"{NAME}.renormalize": "renormalize is True or False",
        f"{NAME}.scoring": "scoring is 'softmax' or 'sigmoid'",
        f"{NAME}.bias_dtype": "bias is float32",
        f"{NAME}.bias": "bias is None, or [E] with scoring='sigmoid'",
    },
)
def topk_router(logits, k: int, renormalize: bool = False, scoring: str = "softmax", bias=None):
    """Each token's k experts, (weights [T, k] in logits' dtype, indices [T, k] int32), best first.

    softmax scoring (Mixtral, Qwen-MoE): p = softmax(logits) per row (float32 for 16-bit inputs), the k experts
    of largest p, weights = p at them. sigmoid scoring (DeepSeek-V3): s = sigmoid(logits), the k experts of
    largest s + bias (bias [E] float32, None: zeros), weights = s at them: the bias decides the choice only,
    never the weights. renormalize=True divides each token's k weights by their sum.

    The order: descending score, ties to the lowest expert index (a stable sort), NaN above every number
    (torch.topk's rule); -0 and +0 tie. The score is the exact one: softmax's and an unbiased sigmoid's order is
    the logits' own (both are strictly increasing), so probabilities that round to the same float (or to 0)
    still rank by their logits; with a bias, s + bias is formed in float32 (float64 for float64 logits), so two
    experts whose exact scores differ by less than its rounding may be ordered either way. Weights follow the
    float64 formulas: a row with a NaN or +inf logit, or all -inf, is NaN under softmax (as torch.softmax); an
    expert of logit -inf has p = 0 and ranks below every finite logit. indices carry no gradient.
    """
    check_float(NAME, "logits", logits)
    check(logits.ndim == 2 and logits.shape[1] >= 1, ShapeError, NAME, "logits", f"{NAME}.logits_rank",
          "2-d [T, E], E >= 1", logits.shape)
    e = logits.shape[1]
    ok = isinstance(k, (int, np.integer)) and not isinstance(k, bool) and 1 <= k <= e
    check(ok, ArgumentError, NAME, "k", f"{NAME}.k", f"an int in [1, {e}] (E = {e})", repr(k))
    check_bool(NAME, "renormalize", renormalize)
    check_choice(NAME, "scoring", scoring, SCORINGS)
    if bias is not None:
        check_domain(NAME, "bias", bias, FLOAT32, f"{NAME}.bias_dtype")
        check(tuple(bias.shape) == (e,), ShapeError, NAME, "bias", f"{NAME}.bias", f"({e},) = (E,)", bias.shape)
        check(scoring == "sigmoid", ArgumentError, NAME, "bias", f"{NAME}.bias", "scoring='sigmoid' with a bias",
              f"scoring={scoring!r}")


@topk_router.outputs(("weights", "indices"), integer=("indices",))
def _outputs(logits, k, renormalize, scoring, bias):
    return [((logits.shape[0], k), logits.dtype), ((logits.shape[0], k), "int32")]


def ranking_keys(logits, scoring: str, bias) -> np.ndarray:
    """What is ranked: the logits (softmax; sigmoid without a bias), else sigmoid(logits) + bias (float64)."""
    if scoring == "sigmoid" and bias is not None:
        with np.errstate(invalid="ignore"):
            return sigmoid64(logits) + np.asarray(bias, np.float64)
    return logits


def select(keys: np.ndarray, k: int) -> np.ndarray:
    """The k best columns of each row of keys: NaN first, then descending value, ties to the lowest index."""
    t, e = keys.shape
    nan = np.isnan(keys)
    with np.errstate(invalid="ignore"):
        value = np.where(nan, 0.0, -keys)  # -(-0.0) == -(0.0): the signed zeros tie
    col = np.broadcast_to(np.arange(e), keys.shape)
    order = np.lexsort((col, value, ~nan), axis=-1)  # last key primary: NaN, then -value, then the index
    return order[:, :k] if t else np.zeros((0, k), np.int64)


def weights_of(logits, idx, renormalize: bool, scoring: str) -> np.ndarray:
    """The float64 weights of the chosen experts idx [T, k]."""
    rows = np.arange(logits.shape[0])[:, None]
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        if scoring == "softmax":
            z = np.exp(logits - np.max(logits, axis=1, keepdims=True)) if logits.size else logits
            w = z[rows, idx] / (np.sum(z, axis=1, keepdims=True) if not renormalize else 1.0)
        else:
            w = sigmoid64(logits)[rows, idx]
        if renormalize:
            w = w / np.sum(w, axis=1, keepdims=True)
    return w


# batch invariance (docs/conformance.md): the arrays whose leading axis is the batch
topk_router.batched("logits")  # tokens


@topk_router.reference
def _reference(logits, k, renormalize, scoring, bias):
    idx = select(ranking_keys(logits, scoring, bias), k)
    return weights_of(logits, idx, renormalize, scoring), idx


def _separated(keys: np.ndarray, k: int, gap: float = 1e-4) -> np.ndarray:
    """Per row: whether the k + 1 best keys are exact ties or at least `gap` apart (relative to 1 + |key|), so that
    a float32 kernel forming s + bias orders them as the float64 reference does."""
    if not keys.size:
        return np.ones(keys.shape[0], bool)
    top = np.take_along_axis(keys, select(keys, min(k + 1, keys.shape[1])), axis=1)
    d = np.abs(np.diff(top, axis=1))
    with np.errstate(invalid="ignore"):
        return np.all((d == 0) | (d >= gap * (1 + np.abs(top[:, 1:]))) | np.isnan(d), axis=1)


def make_case(name: str, dtype: str, t: int, e: int, k: int, renormalize=False, scoring="softmax", bias=False,
              scale=1.0, levels=None, tags=()) -> Case:
    """T tokens of E router logits (normal; `levels`: drawn from that many values, so rows hold exact ties), and for
    sigmoid scoring an optional float32 bias (drawn like the logits). Biased rows are redrawn until their k + 1
    best scores are tied exactly or well apart (see `_separated`)."""
    rng = cg.rng_for(NAME, name, dtype)

    def draw(shape, dt):
        if levels is None:
            return cg.array(shape, dt, rng, "normal", scale)
        return cg.cast(rng.integers(-levels // 2, levels - levels // 2, shape) * (scale / 4), dt)

    logits = draw((t, e), dtype)
    b = draw((e,), "float32") * np.float32(0.25) if bias else None
    if b is not None:
        for _ in range(100):
            bad = ~_separated(ranking_keys(logits.astype(np.float64), scoring, b), k)
            if not bad.any():
                break
            logits[bad] = draw((int(bad.sum()), e), dtype)
        assert not bad.any(), name
    return Case(name, (logits, k), {"renormalize": renormalize, "scoring": scoring, "bias": b}, tags)


@topk_router.cases
def _cases(dtype):
    # bench shapes (beyond the emulated backends' fast-tier size cap)
    yield make_case("qwen3-moe-prefill", dtype, 2048, 128, 8, renormalize=True, tags=("llm",))
    yield make_case("deepseek-v3-prefill", dtype, 1024, 256, 8, True, "sigmoid", bias=True, tags=("llm",))
    yield make_case("mixtral-e8-k2", dtype, 40, 8, 2)
    yield make_case("qwen-e128-k8-renorm", dtype, 6, 128, 8, renormalize=True)
    yield make_case("dsv3-e256-k8", dtype, 5, 256, 8, True, "sigmoid", bias=True)
    yield make_case("sigmoid-no-bias", dtype, 12, 16, 4, scoring="sigmoid", scale=4.0)
    yield make_case("k1", dtype, 17, 16, 1)
    yield make_case("k-equals-e", dtype, 9, 4, 4, renormalize=True)
    # one token (decode) of large logits: p underflows to 0 for most experts, which still rank by their logits
    yield make_case("t1-large-logits", dtype, 1, 64, 2, scale=300.0 if dtype == "float16" else 1e4)
    yield make_case("no-tokens", dtype, 0, 8, 2, tags=("edge",))
    yield _masked(dtype)
    yield _tied(dtype, "ties-softmax", "softmax", False)
    yield _tied(dtype, "ties-sigmoid-bias", "sigmoid", True)  # (not renormalized: sigmoid weights as they are)
    yield _nonfinite(dtype)


def _masked(dtype: str) -> Case:
    """-inf logits (masked experts, as a capacity or group limit leaves them): rows with fewer finite logits than k
    take the lowest-index -inf experts, of weight 0; renormalized over the finite ones."""
    case = make_case("masked-minus-inf", dtype, 10, 12, 4, renormalize=True, tags=("edge",))
    logits = case.args[0].copy()
    logits[:, 1::2] = cg.cast(-np.inf, dtype)
    logits[3, :10] = cg.cast(-np.inf, dtype)  # two finite experts left for k = 4
    logits[5, 4:] = cg.cast(-np.inf, dtype)
    return Case(case.name, (logits, case.args[1]), case.kwargs, case.tags)


def _tied(dtype: str, name: str, scoring: str, bias: bool) -> Case:
    """Logits of a few levels (exact ties inside the top k and across its boundary), -0.0 against 0.0, and a
    -inf expert per row (its ties too): the stable order decides every index."""
    case = make_case(name, dtype, 24, 16, 4, not bias, scoring, bias=bias, levels=5, tags=("edge",))
    logits = case.args[0].copy()
    logits[:, 3] = cg.cast(-np.inf, dtype)
    logits[::3, 7] = cg.cast(-0.0, dtype)
    logits[::3, 2] = cg.cast(0.0, dtype)
    logits[4] = cg.cast(1.0, dtype)  # one row all tied but its -inf expert
    logits[4, 3] = cg.cast(-np.inf, dtype)
    kw = dict(case.kwargs)
    if bias:
        kw["bias"] = np.where(np.arange(16) % 2, 0.25, 0.0).astype(np.float32)  # ties survive pairs of equal bias
    assert _separated(ranking_keys(logits.astype(np.float64), scoring, kw["bias"]), case.args[1]).all(), name
    return Case(case.name, (logits, case.args[1]), kw, case.tags)


def _nonfinite(dtype: str) -> Case:
    """NaN (ranked first), +inf and an all -inf row: those rows' weights are NaN under softmax; the others finite."""
    case = make_case("nonfinite-rows", dtype, 8, 10, 3, tags=("edge",))
    logits = case.args[0].copy()
    logits[1, 6] = cg.cast(np.nan, dtype)
    logits[2, [2, 8]] = cg.cast(np.nan, dtype)
    logits[3, 4] = cg.cast(np.inf, dtype)
    logits[5] = cg.cast(-np.inf, dtype)
    return Case(case.name, (logits, case.args[1]), case.kwargs, case.tags)


@topk_router.error_cases
def _error_cases():
    x = np.ones((4, 8), np.float32)
    b = np.zeros(8, np.float32)
    yield ErrorCase(f"{NAME}.dtype", DTypeError, (x.astype(np.int32), 2))
    yield ErrorCase(f"{NAME}.logits_rank", ShapeError, (x.reshape(4, 8, 1), 2))
    yield ErrorCase(f"{NAME}.logits_rank", ShapeError, (x[:, :0], 1))
    yield ErrorCase(f"{NAME}.k", ArgumentError, (x, 9))  # k > E
    yield ErrorCase(f"{NAME}.k", ArgumentError, (x, 0))
    yield ErrorCase(f"{NAME}.k", ArgumentError, (x, 2.0))
    yield ErrorCase(f"{NAME}.k", ArgumentError, (x, True))
    yield ErrorCase(f"{NAME}.renormalize", ArgumentError, (x, 2), {"renormalize": 1})
    yield ErrorCase(f"{NAME}.scoring", ArgumentError, (x, 2), {"scoring": "softplus"})
    yield ErrorCase(f"{NAME}.bias_dtype", DTypeError, (x, 2), {"scoring": "sigmoid", "bias": b.astype(np.float16)})
    yield ErrorCase(f"{NAME}.bias", ShapeError, (x, 2), {"scoring": "sigmoid", "bias": b[:7]})
    yield ErrorCase(f"{NAME}.bias", ArgumentError, (x, 2), {"bias": b})  # softmax scoring takes no bias


@topk_router.cost
def _cost(logits, k, renormalize, scoring, bias):
    """Read the logits (and bias) once, write weights and indices once; per logit a score (~5 FLOPs) and one
    compare per selection pass."""
    t, e = logits.shape
    item = np.dtype(cg.np_dtype(getattr(logits.dtype, "name", logits.dtype))).itemsize
    return Cost(bytes=t * e * item + (4 * e if bias is not None else 0) + t * k * (item + 4), flops=t * e * (5 + k))


# --------------------------------------------------------------------------- backward


@topk_router.backward(
    wrt=("logits",),
    constants={"bias": "enters only the choice of experts (piecewise constant): no gradient"},
    constraints={**grad_constraints(NAME), f"{BWD}.indices": "indices is the forward's: int32 [T, k], each row k "
                 "distinct experts in [0, E)"},
)
def topk_router_backward(grad_weights, logits, indices, k: int, renormalize: bool = False, scoring: str = "softmax"):
    """Gradient of topk_router's weights for the logits (indices are integer: no gradient).

    Saves the logits and the chosen indices (the choice is kept, never redone: ties cannot flip). With
    g = grad_weights and G its scatter onto the chosen experts ([T, E], zero elsewhere):
    softmax: dlogits = p (G - c), c = sum_j g_j w_j; renormalized (a softmax over the chosen logits):
    dlogits = w (G - c) on the chosen experts, 0 elsewhere; sigmoid: dlogits = s (1 - s) G; renormalized
    (w = s / S): dlogits = s (1 - s) (G - c) / S on the chosen experts. p, s and w are recomputed from the logits.
    """
    topk_router.validate(logits, k, renormalize, scoring, None)
    check_grad(BWD, grad_weights, (logits.shape[0], k), logits.dtype, arg="grad_weights")
    check(indices.dtype == "int32", DTypeError, BWD, "indices", f"{BWD}.indices", "int32 (the forward's)", indices.dtype)
    check(tuple(indices.shape) == (logits.shape[0], k), ShapeError, BWD, "indices", f"{BWD}.indices",
          f"[{logits.shape[0]}, {k}] = [T, k]", tuple(indices.shape))


@topk_router_backward.check_values(("indices",))
def _check_indices(grad_weights, logits, indices, k, renormalize=False, scoring="softmax"):
    e = logits.shape[1]
    idx = np.asarray(indices).astype(np.int64)
    bad = (idx < 0) | (idx >= e)
    check(not bad.any(), ArgumentError, BWD, "indices", f"{BWD}.indices", f"experts in [0, {e})",
          int(idx[bad][0]) if bad.any() else None)
    srt = np.sort(idx, axis=1)
    dup = (srt[:, 1:] == srt[:, :-1]).any(axis=1) if idx.size else np.zeros(0, bool)
    check(not dup.any(), ArgumentError, BWD, "indices", f"{BWD}.indices", "k distinct experts per row",
          f"row {int(np.argmax(dup))}" if dup.any() else None)


@topk_router_backward.reference
def _backward_reference(grad_weights, logits, indices, k, renormalize=False, scoring="softmax"):
    return (_vjp(grad_weights, logits, indices, renormalize, scoring, True),)


def _vjp(g, logits, indices, renormalize, scoring, centred: bool):
    """dlogits in float64; centred=False drops the - c term (a mutant)."""
    t, e = logits.shape
    idx = np.asarray(indices).astype(np.int64)
    rows = np.arange(t)[:, None]
    chosen = np.zeros((t, e), bool)
    chosen[rows, idx] = True
    big_g = np.zeros((t, e))
    big_g[rows, idx] = g
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        w = weights_of(logits, idx, renormalize, scoring)
        c = np.sum(g * w, axis=1, keepdims=True) if centred else 0.0
        if scoring == "softmax":
            if not renormalize:
                p = weights_of(logits, np.broadcast_to(np.arange(e), (t, e)), False, scoring)
                return p * (big_g - c)
            wide = np.zeros((t, e))
            wide[rows, idx] = w
            return np.where(chosen, wide * (big_g - c), 0.0)
        slope = sigmoid64(logits) * sigmoid64(-logits)
        if not renormalize:
            return np.where(chosen, slope * big_g, 0.0)
        total = np.sum(sigmoid64(logits)[rows, idx], axis=1, keepdims=True)
        return np.where(chosen, slope * (big_g - c) / total, 0.0)


@topk_router_backward.magnitude
def _backward_magnitude(grad_weights, logits, indices, k, renormalize=False, scoring="softmax"):
    """c sums k products: where G - c cancels, each term's rounding counts (docs/numerics.md 3.10)."""
    plain = _vjp(np.abs(grad_weights), logits, indices, renormalize, scoring, False)  # slope |G|
    return (2 * plain - _vjp(np.abs(grad_weights), logits, indices, renormalize, scoring, True),)  # + slope sum|g| w


@topk_router_backward.error_cases
def _backward_error_cases():
    x = np.ones((4, 8), np.float32)
    idx = np.tile(np.arange(2, dtype=np.int32), (4, 1))
    g = np.ones((4, 2), np.float32)
    yield ErrorCase(f"{BWD}.grad_shape", ShapeError, (np.ones((4, 3), np.float32), x, idx, 2))
    yield ErrorCase(f"{BWD}.grad_dtype", DTypeError, (g.astype(np.float16), x, idx, 2))
    yield ErrorCase(f"{BWD}.indices", DTypeError, (g, x, idx.astype(np.int64), 2))
    yield ErrorCase(f"{BWD}.indices", ShapeError, (g, x, idx[:3], 2))
    yield ErrorCase(f"{BWD}.indices", ArgumentError, (g, x, idx + 7, 2))  # expert 8 of 8
    yield ErrorCase(f"{BWD}.indices", ArgumentError, (g, x, np.zeros((4, 2), np.int32), 2))  # repeated


@topk_router_backward.cost
def _backward_cost(grad_weights, logits, indices, k, renormalize=False, scoring="softmax"):
    t, e = logits.shape
    item = np.dtype(cg.np_dtype(getattr(logits.dtype, "name", logits.dtype))).itemsize
    return Cost(bytes=2 * t * e * item + t * k * (item + 4), flops=t * e * 8 + 4 * t * k)


@topk_router_backward.cases
def _backward_cases(dtype):
    """Upstream gradients the derived (random) ones do not cover: zero, and large (the weights are at most 1)."""
    fwd = make_case("grad-edge", dtype, 6, 16, 4)
    yield topk_router_backward.from_forward(Case("zero-grad", fwd.args, fwd.kwargs, ("edge",)), dtype,
                                            grad=cg.cast(np.zeros((6, 4)), dtype))
    big = 501.0 if dtype == "float16" else 4988429.2
    g = cg.rng_for(BWD, "large-grad", dtype).standard_normal((6, 4)) * big
    yield topk_router_backward.from_forward(Case("large-grad", fwd.args, {**fwd.kwargs, "renormalize": True}, ("edge",)),
                                            dtype, grad=cg.cast(g, dtype))


@topk_router_backward.mutant("dropped-normalizer-term")
def _mutant_uncentred(grad_weights, logits, indices, k, renormalize=False, scoring="softmax"):
    """The softmax (or renormalization) Jacobian without its - w c term: dlogits = p G."""
    return (_vjp(grad_weights, logits, indices, renormalize, scoring, False),)


@topk_router_backward.mutant("gradient-by-slot")
def _mutant_by_slot(grad_weights, logits, indices, k, renormalize=False, scoring="softmax"):
    """Each slot's gradient sent to expert j (its position among the k) instead of the expert it chose."""
    slots = np.broadcast_to(np.arange(k), np.shape(indices))
    return (_vjp(grad_weights, logits, slots, renormalize, scoring, True),)
