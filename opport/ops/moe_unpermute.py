"""moe_unpermute: the experts' output rows, in expert order, combined back per token with the router weights."""

from __future__ import annotations

import numpy as np

from opport import casegen as cg
from opport.errors import ArgumentError, DTypeError, ShapeError
from opport.spec import (
    INDEX,
    Case,
    Cost,
    ErrorCase,
    Tolerance,
    check,
    check_domain,
    check_float,
    check_grad,
    check_ndim,
    check_same_dtype,
    grad_constraints,
    op,
)

NAME = "moe_unpermute"
BWD = f"{NAME}_backward"
PERMUTATION = "source is a permutation of [0, T*k): every flat slot t*k+j appears exactly once"


@op(
    arrays=("y", "source", "weights"),
    domains={"source": INDEX},
    constraints={
        f"{NAME}.dtype": "y is float32, float16, bfloat16 or float64",
        f"{NAME}.dtype_mismatch": "weights has y's dtype",
        f"{NAME}.y_rank": "y is 2-d [T*k, N]",
        f"{NAME}.weights_rank": "weights is 2-d [T, k] with k >= 1",
        f"{NAME}.rows": "y has T*k rows (weights' T times k)",
        f"{NAME}.source_dtype": "source is an integer array",
        f"{NAME}.source_shape": "source is 1-d [T*k]",
        f"{NAME}.source_values": PERMUTATION,
    },
)
def moe_unpermute(y, source, weights):
    """The weighted sum of each token's k expert rows, out [T, N] in y's dtype (the combine step of a mixture of
    experts; transformers' `routing_weights`-weighted sum).

    y holds the experts' output rows in expert order, as `moe_permute` laid the tokens out: row r is the
    output for flat slot s = source[r] = t*k + j (token t's j-th expert). Then
    out[t] = sum_j weights[t, j] * y[r with source[r] == t*k + j], summed over j = 0..k-1 in order (float32
    accumulation for 16-bit inputs, one rounding). A weight of 0 still multiplies its row: 0 * inf and
    0 * NaN are NaN, as in the dense formula. source must be a permutation of [0, T*k); its values are
    checked on every call before any kernel runs (they decide which rows a kernel reads).
    """
    check_float(NAME, "y", y)
    check_same_dtype(NAME, "y", y, weights=weights)
    check_ndim(NAME, "y", y, 2)
    check(weights.ndim == 2 and weights.shape[1] >= 1, ShapeError, NAME, "weights", f"{NAME}.weights_rank",
          "2-d [T, k], k >= 1", weights.shape)
    t, k = weights.shape
    check(y.shape[0] == t * k, ShapeError, NAME, "y", f"{NAME}.rows", f"T*k = {t * k} rows (weights is [{t}, {k}])",
          y.shape)
    check_domain(NAME, "source", source, INDEX, f"{NAME}.source_dtype")
    check(tuple(source.shape) == (t * k,), ShapeError, NAME, "source", f"{NAME}.source_shape", f"({t * k},) = (T*k,)",
          source.shape)


def check_permutation(name: str, source, n: int) -> None:
    """`<name>.source_values` (the forward's and the backward's): source is a permutation of [0, n)."""
    s = np.asarray(source).astype(np.int64)
    bad = (s < 0) | (s >= n)
    check(not bad.any(), ArgumentError, name, "source", f"{name}.source_values", f"values in [0, {n})",
          f"source[{int(np.argmax(bad))}] = {int(s[bad][0])}" if bad.any() else None)
    seen = np.zeros(n, np.int64)
    np.add.at(seen, s, 1)
    check(not (seen > 1).any(), ArgumentError, name, "source", f"{name}.source_values", PERMUTATION,
          f"slot {int(np.argmax(seen > 1))} appears {int(seen.max())} times" if n else None)


@moe_unpermute.check_values(("source",))
def _check_source(y, source, weights):
    check_permutation(NAME, source, weights.shape[0] * weights.shape[1])


def inverse(source) -> np.ndarray:
    """row[s]: the row r of y with source[r] == s (the inverse permutation)."""
    s = np.asarray(source).astype(np.int64)
    row = np.empty(s.size, np.int64)
    row[s] = np.arange(s.size)
    return row


@moe_unpermute.reference
def _reference(y, source, weights):
    t, k = weights.shape
    rows = y[inverse(source)].reshape(t, k, y.shape[1])
    out = np.zeros((t, y.shape[1]))
    with np.errstate(invalid="ignore", over="ignore"):
        for j in range(k):  # in the declared order (float64: the order does not show)
            out = out + weights[:, j, None] * rows[:, j]
    return out


@moe_unpermute.magnitude
def _magnitude(y, source, weights):
    return _reference(np.abs(y), source, np.abs(weights))


_SUM = "a sum of k products per element (K-accumulating): norm-wise, docs/numerics.md 3.1 rule 5"
moe_unpermute.tolerance(**{d: Tolerance(t.rtol, t.atol, "normwise", reason=_SUM) for d, t in (
    ("float64", Tolerance(1e-7, 1e-7)), ("float32", Tolerance(1.3e-6, 1e-5)), ("float16", Tolerance(1e-3, 1e-5)),
    ("bfloat16", Tolerance(1.6e-2, 1e-5)))})


def expert_order(top_k_index: np.ndarray) -> np.ndarray:
    """moe_permute's source for top_k_index [T, k]: the flat slots sorted by expert, stable (int32)."""
    return np.argsort(np.asarray(top_k_index).reshape(-1), kind="stable").astype(np.int32)


def make_case(name: str, dtype: str, t: int, k: int, n: int, experts: int | None = None, weights: str = "softmax",
              source_dtype=np.int32, tags=()) -> Case:
    """T tokens routed to k of `experts` experts (random, distinct per token): y [T*k, N] in the expert order
    moe_permute gives (`experts` None: a random permutation instead), router weights of `weights` kind:
    "softmax" (positive, each row summing to at most 1), "normal" (any sign), "signed-zeros" (0, -0 and
    negative weights among normal ones)."""
    rng = cg.rng_for(NAME, name, dtype)
    if experts is None:
        source = rng.permutation(t * k).astype(source_dtype)
    else:
        idx = np.argsort(rng.random((t, experts)), axis=1)[:, :k]
        source = expert_order(idx).astype(source_dtype)
    y = cg.array((t * k, n), dtype, rng)
    if weights == "softmax":
        logits = rng.standard_normal((t, k + 2))
        w = (np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True))[:, :k]
    else:
        w = rng.standard_normal((t, k))
        if weights == "signed-zeros" and w.size:
            w.reshape(-1)[::3] = 0.0
            w.reshape(-1)[1::5] = -0.0
    return Case(name, (y, source, cg.cast(w, dtype)), {}, tags)


@moe_unpermute.cases
def _cases(dtype):
    # realistic shapes for `opport bench` (beyond the emulated backends' fast-tier size cap)
    yield make_case("mixtral-combine", dtype, 128, 2, 4096, experts=8, tags=("llm",))
    yield make_case("qwen3-moe-combine", dtype, 64, 8, 2048, experts=128, tags=("llm",))
    yield make_case("t1-k2", dtype, 1, 2, 64, experts=8)
    yield make_case("k1", dtype, 37, 1, 96, experts=4)
    yield make_case("k-equals-e", dtype, 9, 8, 40, experts=8)  # every token to every expert
    yield make_case("e256-k4", dtype, 12, 4, 24, experts=256, weights="normal")
    yield make_case("random-perm", dtype, 33, 3, 130, source_dtype=np.int64)  # N not a power of two; int64 source
    yield make_case("identity", dtype, 20, 1, 32, experts=1)  # all tokens to one expert: source = arange
    yield make_case("zero-negative-weights", dtype, 16, 4, 48, experts=6, weights="signed-zeros", tags=("edge",))
    yield make_case("no-tokens", dtype, 0, 2, 32, experts=4, tags=("edge",))
    yield _nonfinite(dtype)


def _nonfinite(dtype: str) -> Case:
    """inf and NaN in y: a row of weight 0 gives NaN (0 * inf), a positive weight keeps inf's sign, and the tokens
    whose rows are finite stay finite."""
    case = make_case("nonfinite-rows", dtype, 10, 2, 32, experts=4, weights="normal", tags=("edge",))
    y, source, w = case.args
    y, w = y.copy(), w.copy()
    rows = inverse(source)
    w[1, 0], w[2, 1], w[3, 0] = 0.0, 0.5, -0.0  # token 1 slot 0: 0 * inf; token 2: 0.5 * inf; token 3: -0 * NaN
    y[rows[2], ::5] = cg.cast(np.inf, dtype)
    y[rows[5], 3] = cg.cast(-np.inf, dtype)
    y[rows[6], 7] = cg.cast(np.nan, dtype)
    return Case(case.name, (y, source, w), {}, case.tags)


@moe_unpermute.error_cases
def _error_cases():
    y, w = np.ones((8, 5), np.float32), np.ones((4, 2), np.float32)
    s = np.arange(8, dtype=np.int32)[::-1].copy()
    yield ErrorCase(f"{NAME}.dtype", DTypeError, (y.astype(np.int32), s, w.astype(np.int32)))
    yield ErrorCase(f"{NAME}.dtype_mismatch", DTypeError, (y, s, w.astype(np.float16)))
    yield ErrorCase(f"{NAME}.y_rank", ShapeError, (y.reshape(8, 5, 1), s, w))
    yield ErrorCase(f"{NAME}.weights_rank", ShapeError, (y, s, w.reshape(8)))
    yield ErrorCase(f"{NAME}.weights_rank", ShapeError, (y[:0], s[:0], w[:, :0]))  # k = 0
    yield ErrorCase(f"{NAME}.rows", ShapeError, (y[:7], s, w))
    yield ErrorCase(f"{NAME}.source_dtype", DTypeError, (y, s.astype(np.float32), w))
    yield ErrorCase(f"{NAME}.source_shape", ShapeError, (y, s.reshape(4, 2), w))
    yield ErrorCase(f"{NAME}.source_shape", ShapeError, (y, s[:7], w))
    yield ErrorCase(f"{NAME}.source_values", ArgumentError, (y, np.array([0, 1, 2, 3, 4, 5, 6, 8], np.int32), w))
    yield ErrorCase(f"{NAME}.source_values", ArgumentError, (y, np.array([0, 1, 2, 3, 4, 5, 6, -1], np.int64), w))
    yield ErrorCase(f"{NAME}.source_values", ArgumentError, (y, np.array([0, 1, 2, 3, 4, 5, 6, 6], np.int32), w))


@moe_unpermute.shape
def _shape(y, source, weights):
    return (weights.shape[0], y.shape[1])


def _item(meta) -> int:
    return np.dtype(cg.np_dtype(getattr(meta.dtype, "name", meta.dtype))).itemsize


@moe_unpermute.cost
def _cost(y, source, weights):
    """Read y, source and the weights once, write out once; k multiply-adds per output element."""
    t, k = weights.shape
    n = y.shape[1]
    return Cost(bytes=(t * k * n + t * n + t * k) * _item(y) + t * k * _item(source), flops=2 * t * k * n)


# --------------------------------------------------------------------------- backward


@moe_unpermute.backward(
    wrt=("y", "weights"),
    reduces=("weights",),
    constants={"source": "integer row order (moe_permute's): it picks rows, not a differentiable quantity"},
    constraints={**grad_constraints(NAME), f"{BWD}.source_values": PERMUTATION},
)
def moe_unpermute_backward(grad, y, source, weights):
    """Gradients of moe_unpermute for y and the router weights.

    Saves y, source and the weights. With grad [T, N], for row r of y and its slot s = source[r] = t*k + j:
    dy[r] = weights[t, j] * grad[t] (one product, in y's expert order), and dweights[t, j] = grad[t] . y[r]
    (a dot product over N: judged norm-wise). 0 * inf is NaN as in the forward. source is checked again before
    any kernel runs.
    """
    moe_unpermute.validate(y, source, weights)
    check_grad(BWD, grad, (weights.shape[0], y.shape[1]), y.dtype)


@moe_unpermute_backward.check_values(("source",))
def _check_backward_source(grad, y, source, weights):
    check_permutation(BWD, source, weights.shape[0] * weights.shape[1])


@moe_unpermute_backward.reference
def _backward_reference(grad, y, source, weights):
    return _vjp(grad, y, source, weights, True)


def _vjp(grad, y, source, weights, weighted: bool):
    """dy and dweights; weighted=False leaves the router weight out of dy (a mutant)."""
    k = weights.shape[1]
    s = np.asarray(source).astype(np.int64)
    g = grad[s // k]  # [T*k, N]: each row's token's upstream gradient
    with np.errstate(invalid="ignore", over="ignore"):
        dy = weights.reshape(-1)[s][:, None] * g if weighted else g.copy()
        dw = np.empty(s.size)
        dw[s] = np.sum(g * y, axis=1)
    return dy, dw.reshape(weights.shape)


@moe_unpermute_backward.magnitude
def _backward_magnitude(grad, y, source, weights):
    return None, _vjp(np.abs(grad), np.abs(y), source, weights, True)[1]


@moe_unpermute_backward.error_cases
def _backward_error_cases():
    y, w, g = np.ones((8, 5), np.float32), np.ones((4, 2), np.float32), np.ones((4, 5), np.float32)
    s = np.arange(8, dtype=np.int32)
    yield ErrorCase(f"{BWD}.grad_shape", ShapeError, (np.ones((8, 5), np.float32), y, s, w))
    yield ErrorCase(f"{BWD}.grad_dtype", DTypeError, (g.astype(np.float16), y, s, w))
    yield ErrorCase(f"{BWD}.source_values", ArgumentError, (g, y, np.array([0, 1, 2, 3, 4, 5, 7, 7], np.int32), w))


@moe_unpermute_backward.cost
def _backward_cost(grad, y, source, weights):
    """Read grad (per row of y: its token's), y, source and the weights; write dy and dweights. One product per
    element of dy, a multiply-add per element for the dot products."""
    t, k = weights.shape
    n = y.shape[1]
    return Cost(bytes=(t * n + 2 * t * k * n + 2 * t * k) * _item(y) + t * k * _item(source), flops=3 * t * k * n)


@moe_unpermute_backward.cases
def _backward_cases(dtype):
    """Upstream gradients the derived (random) ones do not cover."""
    fwd = make_case("grad-edge", dtype, 6, 3, 40, experts=5, weights="normal")
    yield moe_unpermute_backward.from_forward(Case("zero-grad", fwd.args, {}, ("edge",)), dtype, grad=cg.cast(
        np.zeros((6, 40)), dtype))
    big = 501.0 if dtype == "float16" else 4988429.2  # dy and dweights stay representable
    g = cg.rng_for(BWD, "large-grad", dtype).standard_normal((6, 40)) * big
    small = Case("large-grad", (cg.cast(fwd.args[0].astype(np.float64) * 1e-3, dtype), *fwd.args[1:]), {}, ("edge",))
    yield moe_unpermute_backward.from_forward(small, dtype, grad=cg.cast(g, dtype))


@moe_unpermute_backward.mutant("dropped-router-weight")
def _mutant_dropped_weight(grad, y, source, weights):
    """dy = grad[t] without the router weight (as if every weight were 1)."""
    return _vjp(grad, y, source, weights, False)


@moe_unpermute_backward.mutant("dy-in-slot-order")
def _mutant_slot_order(grad, y, source, weights):
    """dy laid out by flat slot t*k+j instead of y's expert order (the permutation forgotten on the way back)."""
    dy, dw = _backward_reference(grad, y, source, weights)
    out = np.empty_like(dy)
    out[np.asarray(source).astype(np.int64)] = dy
    return out, dw

