"""moe_permute: each token's row copied once per chosen expert, grouped by expert (a mixture of experts' dispatch)."""

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
    grad_constraints,
    op,
)

NAME = "moe_permute"
BWD = f"{NAME}_backward"


@op(
    arrays=("x", "top_k_index"),
    domains={"top_k_index": INDEX},
    constraints={
        f"{NAME}.dtype": "x is float32, float16, bfloat16 or float64",
        f"{NAME}.x_rank": "x is 2-d [T, H]",
        f"{NAME}.index_dtype": "top_k_index is an integer array",
        f"{NAME}.index_shape": "top_k_index is 2-d [T, k] with x's T and k >= 1",
        f"{NAME}.num_experts": "num_experts is an int E >= k",
        f"{NAME}.index_range": "every expert index is in [0, num_experts)",
    },
)
def moe_permute(x, top_k_index, num_experts: int):
    """Rows grouped by expert: (permuted [T*k, H] in x's dtype, source [T*k] int32, offsets [E + 1] int32).

    Flat slot s = t*k + j is token t's j-th expert e = top_k_index[t, j]. The slots are sorted by expert, stably
    (by s within an expert): permuted row r is a bit-for-bit copy of x[source[r] // k], where source[r] is the
    slot it came from, and expert e's rows are offsets[e]:offsets[e + 1] (offsets[0] = 0, offsets[E] = T*k; an
    expert no token chose has an empty range). `moe_unpermute` takes source back to token order. The expert
    indices are checked on every call before any kernel runs (they decide where rows are written).
    """
    check_float(NAME, "x", x)
    check_ndim(NAME, "x", x, 2)
    check_domain(NAME, "top_k_index", top_k_index, INDEX, f"{NAME}.index_dtype")
    check(top_k_index.ndim == 2 and top_k_index.shape[0] == x.shape[0] and top_k_index.shape[1] >= 1, ShapeError,
          NAME, "top_k_index", f"{NAME}.index_shape", f"[{x.shape[0]}, k >= 1] (x's T)", top_k_index.shape)
    k = top_k_index.shape[1]
    ok = isinstance(num_experts, (int, np.integer)) and not isinstance(num_experts, bool) and num_experts >= k
    check(ok, ArgumentError, NAME, "num_experts", f"{NAME}.num_experts", f"an int >= k = {k}", repr(num_experts))


@moe_permute.check_values(("top_k_index",))
def _check_index(x, top_k_index, num_experts):
    idx = np.asarray(top_k_index).astype(np.int64)
    bad = (idx < 0) | (idx >= num_experts)
    check(not bad.any(), ArgumentError, NAME, "top_k_index", f"{NAME}.index_range", f"experts in [0, {num_experts})",
          f"{int(idx[bad][0])} at {tuple(int(i) for i in np.argwhere(bad)[0])}" if bad.any() else None)


@moe_permute.outputs(("permuted", "source", "offsets"), integer=("source", "offsets"))
def _outputs(x, top_k_index, num_experts):
    n = top_k_index.shape[0] * top_k_index.shape[1]
    return [((n, x.shape[1]), x.dtype), ((n,), "int32"), ((num_experts + 1,), "int32")]


def expert_order(top_k_index: np.ndarray, num_experts: int) -> tuple:
    """(source, offsets): the flat slots sorted by expert, stable, and each expert's first row."""
    flat = np.asarray(top_k_index).astype(np.int64).reshape(-1)
    source = np.argsort(flat, kind="stable")
    offsets = np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=num_experts))])
    return source, offsets


@moe_permute.reference
def _reference(x, top_k_index, num_experts):
    source, offsets = expert_order(top_k_index, num_experts)
    return x[source // top_k_index.shape[1]], source, offsets


moe_permute.tolerance(**{d: Tolerance(0.0, 0.0, signed_zero=True, reason="a copy: bit for bit (NaN stays NaN)")
                         for d in ("float64", "float32", "float16", "bfloat16")})


def make_case(name: str, dtype: str, t: int, h: int, e: int, k: int, experts=None, index_dtype=np.int32,
              tags=()) -> Case:
    """T tokens of H features, each routed to k distinct experts of E drawn at random (`experts`: from that list
    only, which leaves the other experts empty), as topk_router would route them."""
    rng = cg.rng_for(NAME, name, dtype)
    x = cg.array((t, h), dtype, rng)
    pool = np.arange(e) if experts is None else np.asarray(experts)
    idx = np.stack([rng.permutation(pool)[:k] for _ in range(t)]) if t else np.zeros((0, k), np.int64)
    return Case(name, (x, idx.astype(index_dtype), e), {}, tags)


@moe_permute.cases
def _cases(dtype):
    # bench shapes (beyond the emulated backends' fast-tier size cap)
    yield make_case("mixtral-dispatch", dtype, 128, 4096, 8, 2, tags=("llm",))
    yield make_case("qwen3-moe-dispatch", dtype, 64, 2048, 128, 8, tags=("llm",))
    yield make_case("t1-k2", dtype, 1, 64, 8, 2)
    yield make_case("k1", dtype, 37, 96, 4, 1)
    yield make_case("k-equals-e", dtype, 9, 40, 8, 8)
    yield make_case("e256-k8", dtype, 20, 24, 256, 8, index_dtype=np.int64)
    yield make_case("empty-experts", dtype, 45, 33, 16, 2, experts=(3, 9, 10))  # 13 of 16 experts get no row
    yield make_case("one-expert", dtype, 30, 32, 6, 1, experts=(4,))  # every token to expert 4
    yield make_case("no-tokens", dtype, 0, 32, 4, 2, tags=("edge",))
    case = make_case("nonfinite-rows", dtype, 12, 16, 5, 2, tags=("edge",))
    x = case.args[0].copy()
    x[2, ::3], x[5, 1], x[7, 4] = cg.cast(np.nan, dtype), cg.cast(-np.inf, dtype), cg.cast(-0.0, dtype)
    yield Case(case.name, (x, *case.args[1:]), {}, case.tags)


@moe_permute.error_cases
def _error_cases():
    x, idx = np.ones((4, 8), np.float32), np.array([[0, 1], [2, 3], [1, 0], [3, 3]], np.int32)
    yield ErrorCase(f"{NAME}.dtype", DTypeError, (x.astype(np.int32), idx, 4))
    yield ErrorCase(f"{NAME}.x_rank", ShapeError, (x.reshape(4, 8, 1), idx, 4))
    yield ErrorCase(f"{NAME}.index_dtype", DTypeError, (x, idx.astype(np.float32), 4))
    yield ErrorCase(f"{NAME}.index_shape", ShapeError, (x, idx[:3], 4))
    yield ErrorCase(f"{NAME}.index_shape", ShapeError, (x, idx.reshape(-1), 4))
    yield ErrorCase(f"{NAME}.index_shape", ShapeError, (x, idx[:, :0], 4))
    yield ErrorCase(f"{NAME}.num_experts", ArgumentError, (x, idx, 1))  # k > E
    yield ErrorCase(f"{NAME}.num_experts", ArgumentError, (x, idx, 4.0))
    yield ErrorCase(f"{NAME}.index_range", ArgumentError, (x, idx, 3))
    yield ErrorCase(f"{NAME}.index_range", ArgumentError, (x, idx - 1, 4))


@moe_permute.cost
def _cost(x, top_k_index, num_experts):
    """Read x's rows (each once per chosen expert: k times) and the indices, write permuted, source and offsets."""
    t, k = top_k_index.shape
    item = np.dtype(cg.np_dtype(getattr(x.dtype, "name", x.dtype))).itemsize
    idx_item = np.dtype(cg.np_dtype(getattr(top_k_index.dtype, "name", top_k_index.dtype))).itemsize
    return Cost(bytes=2 * t * k * x.shape[1] * item + t * k * (idx_item + 4) + 4 * (num_experts + 1), flops=0)


# --------------------------------------------------------------------------- backward


@moe_permute.backward(
    wrt=("x",),
    constants={"top_k_index": "integer expert choices: they pick rows, not a differentiable quantity"},
    constraints={**grad_constraints(NAME), f"{BWD}.source": "source is the forward's: int32 [T*k], a permutation "
                 "of [0, T*k)"},
)
def moe_permute_backward(grad_permuted, x, top_k_index, source, num_experts: int):
    """Gradient of moe_permute for x: dx[t] = sum_j grad_permuted[row of slot t*k + j], j = 0..k-1 in order.

    Saves the forward's source (which row each slot went to; x only for its shape and dtype). The rows of a
    token are gathered back through the inverse of source and summed (float32 accumulation for 16-bit): the
    unweighted `moe_unpermute`.
    """
    moe_permute.validate(x, top_k_index, num_experts)
    n = top_k_index.shape[0] * top_k_index.shape[1]
    check_grad(BWD, grad_permuted, (n, x.shape[1]), x.dtype, arg="grad_permuted")
    check(source.dtype == "int32", DTypeError, BWD, "source", f"{BWD}.source", "int32 (the forward's)", source.dtype)
    check(tuple(source.shape) == (n,), ShapeError, BWD, "source", f"{BWD}.source", f"({n},) = (T*k,)", source.shape)


@moe_permute_backward.check_values(("source",))
def _check_source(grad_permuted, x, top_k_index, source, num_experts):
    n = source.shape[0]
    s = np.asarray(source).astype(np.int64)
    ok = bool(((s >= 0) & (s < n)).all()) and np.unique(s).size == n
    check(ok, ArgumentError, BWD, "source", f"{BWD}.source", f"a permutation of [0, {n})", "other values")


def _gather_sum(grad, source, t: int, k: int, slots=None):
    """dx [T, H] in float64: token t's k rows summed in order j (`slots`: only those j, a mutant)."""
    s = np.asarray(source).astype(np.int64)
    row = np.empty(s.size, np.int64)
    row[s] = np.arange(s.size)
    rows = grad[row].reshape(t, k, grad.shape[1])
    dx = np.zeros((t, grad.shape[1]))
    with np.errstate(invalid="ignore", over="ignore"):
        for j in range(k) if slots is None else slots:
            dx = dx + rows[:, j]
    return dx


@moe_permute_backward.reference
def _backward_reference(grad_permuted, x, top_k_index, source, num_experts):
    return (_gather_sum(grad_permuted, source, *top_k_index.shape),)


@moe_permute_backward.magnitude
def _backward_magnitude(grad_permuted, x, top_k_index, source, num_experts):
    return (_gather_sum(np.abs(grad_permuted), source, *top_k_index.shape),)


_SUM = "a sum of k rows per element (K-accumulating): norm-wise, docs/numerics.md 3.1 rule 5"
moe_permute_backward.tolerance(**{d: Tolerance(r, 1e-5 if d != "float64" else 1e-7, "normwise", reason=_SUM) for d, r in (
    ("float64", 1e-7), ("float32", 1.3e-6), ("float16", 1e-3), ("bfloat16", 1.6e-2))})


@moe_permute_backward.error_cases
def _backward_error_cases():
    x, idx = np.ones((4, 8), np.float32), np.array([[0, 1], [2, 3], [1, 0], [3, 3]], np.int32)
    g, src = np.ones((8, 8), np.float32), np.arange(8, dtype=np.int32)
    yield ErrorCase(f"{BWD}.grad_shape", ShapeError, (np.ones((4, 8), np.float32), x, idx, src, 4))
    yield ErrorCase(f"{BWD}.grad_dtype", DTypeError, (g.astype(np.float16), x, idx, src, 4))
    yield ErrorCase(f"{BWD}.source", DTypeError, (g, x, idx, src.astype(np.int64), 4))
    yield ErrorCase(f"{BWD}.source", ShapeError, (g, x, idx, src[:7], 4))
    yield ErrorCase(f"{BWD}.source", ArgumentError, (g, x, idx, np.array([0, 1, 2, 3, 4, 5, 6, 6], np.int32), 4))


@moe_permute_backward.cost
def _backward_cost(grad_permuted, x, top_k_index, source, num_experts):
    """Read grad_permuted and source, write dx; k - 1 additions per element of dx."""
    t, k = top_k_index.shape
    item = np.dtype(cg.np_dtype(getattr(x.dtype, "name", x.dtype))).itemsize
    return Cost(bytes=(t * k + t) * x.shape[1] * item + 4 * t * k, flops=(k - 1) * t * x.shape[1])


@moe_permute_backward.mutant("first-slot-only")
def _mutant_first_slot(grad_permuted, x, top_k_index, source, num_experts):
    """dx from each token's first expert's row only, not summed over its k rows."""
    t, k = top_k_index.shape
    return (_gather_sum(grad_permuted, source, t, k, slots=(0,)),)


@moe_permute_backward.mutant("unsorted-permutation")
def _mutant_unsorted(grad_permuted, x, top_k_index, source, num_experts):
    """The rows read back in slot order, as if the forward had not sorted them by expert (source taken as 0..T*k-1)."""
    return (_gather_sum(grad_permuted, np.arange(np.shape(source)[0]), *top_k_index.shape),)
