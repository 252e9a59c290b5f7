"""grouped_matmul: one matmul per expert over its contiguous group of rows (MoE expert layers), float32 accumulation."""

from __future__ import annotations

import numpy as np

from opport import casegen as cg
from opport.arraymath import cu
from opport.errors import ArgumentError, DTypeError, ShapeError
from opport.ops.matmul import matmul as dense
from opport.spec import (
    INDEX,
    Case,
    Cost,
    ErrorCase,
    check,
    check_bool,
    check_domain,
    check_float,
    check_grad,
    check_ndim,
    check_same_dtype,
    grad_constraints,
    op,
)

NAME = "grouped_matmul"
BWD = f"{NAME}_backward"
_VALUES = "offsets[0] == 0, offsets never decrease, offsets[E] == M (x's rows)"


@op(
    arrays=("x", "w", "offsets"),
    domains={"offsets": INDEX},
    constraints={
        f"{NAME}.dtype": "x is float32, float16, bfloat16 or float64",
        f"{NAME}.dtype_mismatch": "w has x's dtype",
        f"{NAME}.x_rank": "x is 2-d [M, K]",
        f"{NAME}.w_rank": "w is 3-d: [E, K, N], or [E, N, K] with trans_w=True",
        f"{NAME}.trans_w": "trans_w is True or False",
        f"{NAME}.inner_dim": "w's K (w.shape[1], or w.shape[2] with trans_w=True) == x.shape[1]",
        f"{NAME}.offsets_dtype": "offsets is an integer array",
        f"{NAME}.offsets_shape": "offsets is 1-d [E + 1], E = w.shape[0]",
        f"{NAME}.offsets_values": _VALUES,
    },
)
def grouped_matmul(x, w, offsets, trans_w: bool = False):
    """Per-expert matmul over contiguous row groups: out [M, N], rows offsets[e]:offsets[e+1] of x times w[e].

    w is [E, K, N], or [E, N, K] with trans_w=True (nn.Linear's layout, transformers' stacked
    gate_up_proj / down_proj), whose product is x_e @ w[e]^T. offsets are the E + 1 prefix sums of the
    group sizes (what moe_permute returns): experts may be empty, and an expert's weights are read only
    where it has rows, so NaN or inf in an unused expert never reach the output. Each output element is
    one K-long dot product, with float32 accumulation for 16-bit inputs and one rounding; K = 0 gives
    zeros. The offsets values are checked on every call before any kernel runs (they decide which
    memory a kernel reads).

    Range (docs/numerics.md 3.9): matmul's, per expert: an element is defined while its
    `accumulation_bound` (sum_k |x_ik| |w[e]_kj|) is at most the accumulation dtype's largest finite value.
    """
    check_float(NAME, "x", x)
    check_same_dtype(NAME, "x", x, w=w)
    check_ndim(NAME, "x", x, 2)
    check_ndim(NAME, "w", w, 3)
    check_bool(NAME, "trans_w", trans_w)
    k_axis = 2 if trans_w else 1
    check(w.shape[k_axis] == x.shape[1], ShapeError, NAME, "w", f"{NAME}.inner_dim",
          f"w.shape[{k_axis}] == {x.shape[1]} (x's K{', trans_w=True' if trans_w else ''})", w.shape)
    check_domain(NAME, "offsets", offsets, INDEX)
    check(offsets.ndim == 1 and offsets.shape[0] == w.shape[0] + 1, ShapeError, NAME, "offsets", f"{NAME}.offsets_shape",
          f"1-d [{w.shape[0] + 1}] (E + 1, E = w.shape[0])", offsets.shape)


def check_offsets(name: str, x, offsets) -> None:
    """`<name>.offsets_values` (the forward's and the backward's): 0 first, never decreasing, M last."""
    arg, cid = "offsets", f"{name}.offsets_values"
    check(int(offsets[0]) == 0, ArgumentError, name, arg, cid, "offsets[0] == 0", int(offsets[0]))
    steps = np.diff(offsets.astype(np.int64))
    bad = int(np.argmax(steps < 0)) if (steps < 0).any() else None
    check(bad is None, ArgumentError, name, arg, cid, "non-decreasing values",
          None if bad is None else f"offsets[{bad}] = {offsets[bad]} > offsets[{bad + 1}] = {offsets[bad + 1]}")
    check(int(offsets[-1]) == x.shape[0], ArgumentError, name, arg, cid, f"offsets[-1] == {x.shape[0]} (x's rows M)",
          int(offsets[-1]))


@grouped_matmul.check_values(("offsets",))
def _check_offsets(x, w, offsets, trans_w):
    check_offsets(NAME, x, offsets)


def groups(offsets):
    """(expert, row slice) of every expert, empty ones included."""
    o = [int(v) for v in offsets]
    return [(e, slice(o[e], o[e + 1])) for e in range(len(o) - 1)]


def accumulation_bound(x, w, offsets, trans_w=False) -> np.ndarray:
    """Per output element, sum_k |x_ik| |w[e]_kj| in float64 (matmul's bound, per expert): the largest magnitude
    any partial sum of the element can reach, in any order."""
    return _reference(np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(w, np.float64)), offsets, trans_w)


def expert_weights(w, e: int, trans_w: bool):
    """w[e] as [K, N] (a transposed view with trans_w)."""
    return w[e].T if trans_w else w[e]


@grouped_matmul.reference
def _reference(x, w, offsets, trans_w):
    n = w.shape[1] if trans_w else w.shape[2]
    out = np.zeros((x.shape[0], n))
    with np.errstate(invalid="ignore", over="ignore"):
        for e, rows in groups(offsets):
            if rows.stop > rows.start:
                out[rows] = x[rows] @ expert_weights(w, e, trans_w)
    return out


# matmul's: every output element is one K-long dot product with float32 accumulation, judged norm-wise
# (docs/numerics.md 3.3, 3.10), whatever expert it comes from
grouped_matmul.tolerance(**dense.tolerances)


@grouped_matmul.magnitude
def _magnitude(x, w, offsets, trans_w):
    return _reference(np.abs(x), np.abs(w), offsets, trans_w)


def _case(name, dtype, sizes, k, n, trans_w=False, dist="normal", scale=(1.0, 1.0), tags=()):
    """Rows grouped by `sizes` (one per expert), K = k, N = n."""
    rng = cg.rng_for(NAME, name, dtype)
    x = cg.array((int(sum(sizes)), k), dtype, rng, dist, scale[0])
    w = cg.array((len(sizes), n, k) if trans_w else (len(sizes), k, n), dtype, rng, dist, scale[1])
    return Case(name, (x, w, cu(sizes)), {"trans_w": trans_w}, tags)


def _routed_sizes(rng, rows: int, experts: int) -> list:
    """Group sizes of `rows` rows each sent to a random expert (a skewed router: some experts busy, many empty)."""
    p = rng.dirichlet(np.full(experts, 0.3))
    return np.bincount(rng.choice(experts, rows, p=p), minlength=experts).tolist()


@grouped_matmul.cases
def _cases(dtype):
    yield _case("uneven", dtype, [5, 0, 37, 22], 48, 40)
    # group sizes around the tiles kernels use (16, 64, 128 rows): every boundary inside a tile
    yield _case("tile-boundaries", dtype, [15, 17, 63, 65, 1, 127, 129], 24, 20, trans_w=True)
    yield _case("empty-experts", dtype, [0, 0, 17, 0, 9, 0], 32, 24)
    yield _case("one-expert-all-rows", dtype, [0, 0, 70, 0, 0], 20, 33, trans_w=True)
    yield _case("e-1", dtype, [33], 40, 50)
    yield _case("e-128", dtype, _routed_sizes(cg.rng_for(NAME, "e-128"), 24, 128), 16, 8, trans_w=True)
    yield _case("m-1", dtype, [0, 1, 0], 64, 17)
    yield _case("m-zero", dtype, [0, 0, 0], 16, 8, tags=("edge",))
    yield _case("k-zero", dtype, [3, 0, 7], 0, 12, tags=("edge",))
    big = (501.0, 1e-2) if dtype == "float16" else (4988429.2, 1e-3)  # exact products stay representable
    yield _case("large", dtype, [9, 8], 64, 17, scale=big, tags=("edge",))
    yield _case("heavy-tails", dtype, [20, 44], 64, 32, trans_w=True, dist="heavy")
    yield _nonfinite(dtype)
    # a fine-grained MoE's expert layer (Granite-3.0-1B-A400M: hidden 1024, expert intermediate 512, 32 experts,
    # top-8; Qwen3-30B-A3B's: 2048, 768, 128, top-8): 64 routed rows through a slice of two
    # experts' down_proj [E, hidden, intermediate], as transformers stores it. The CPU tier runs it in float64 too,
    # so it stays at 1M weights; emulated backends skip it (past their element cap)
    yield _case("moe-down-proj", dtype, [40, 24], 512, 1024, trans_w=True, tags=("llm",))


def _nonfinite(dtype: str) -> Case:
    """NaN and inf in an empty expert's weights (never read), NaN in one row of x, -inf in one weight of a busy
    expert: only that row, and that expert's rows in that column, are non-finite."""
    case = _case("nonfinite", dtype, [6, 0, 9, 5], 16, 12, dist="uniform", tags=("edge",))
    x, w, offsets = case.args
    x, w = x.copy(), w.copy()
    w[1, ::2] = cg.cast(np.nan, dtype)
    w[1, 1::2] = cg.cast(np.inf, dtype)
    x[8, 3] = cg.cast(np.nan, dtype)
    w[3, 5, 7] = cg.cast(-np.inf, dtype)
    return Case(case.name, (x, w, offsets), case.kwargs, case.tags)


@grouped_matmul.strategy
def _strategy(dtype):
    from hypothesis import strategies as st

    @st.composite
    def case(draw):
        # few experts of few rows: emulated backends run 25 of these per dtype, at a fixed cost per expert
        sizes = draw(st.lists(st.sampled_from([0, 0, 1, 2, 7, 16, 17, 33, 65]), min_size=1, max_size=4))
        k, n = draw(st.integers(1, 40)), draw(st.integers(1, 40))
        trans_w, dist, scale = draw(st.booleans()), draw(cg.dists(specials=False)), draw(cg.scales())
        seed = draw(cg.seeds())
        rng = np.random.default_rng(seed)
        x = cg.array((sum(sizes), k), dtype, rng, dist, scale)
        w = cg.array((len(sizes), n, k) if trans_w else (len(sizes), k, n), dtype, rng, dist, 1.0)
        return Case(f"hyp-{seed}", (x, w, cu(sizes)), {"trans_w": trans_w}, ("hypothesis",))

    return case()


@grouped_matmul.error_cases
def _error_cases():
    x, w, o = np.ones((6, 8), np.float32), np.ones((2, 8, 5), np.float32), np.array([0, 4, 6], np.int32)
    yield ErrorCase(f"{NAME}.dtype", DTypeError, (x.astype(np.int32), w.astype(np.int32), o))
    yield ErrorCase(f"{NAME}.dtype_mismatch", DTypeError, (x, w.astype(np.float16), o))
    yield ErrorCase(f"{NAME}.x_rank", ShapeError, (x[None], w, o))
    yield ErrorCase(f"{NAME}.w_rank", ShapeError, (x, w[0], o))
    yield ErrorCase(f"{NAME}.trans_w", ArgumentError, (x, w, o), {"trans_w": 1})
    yield ErrorCase(f"{NAME}.inner_dim", ShapeError, (x, np.ones((2, 7, 5), np.float32), o))
    yield ErrorCase(f"{NAME}.inner_dim", ShapeError, (x, w, o), {"trans_w": True})  # [E, N, K] wanted: K = 5
    yield ErrorCase(f"{NAME}.offsets_dtype", DTypeError, (x, w, o.astype(np.float32)))
    yield ErrorCase(f"{NAME}.offsets_shape", ShapeError, (x, w, o[None]))
    yield ErrorCase(f"{NAME}.offsets_shape", ShapeError, (x, w, o[1:]))  # E entries, not E + 1
    yield ErrorCase(f"{NAME}.offsets_values", ArgumentError, (x, w, np.array([1, 4, 6], np.int32)))  # start
    yield ErrorCase(f"{NAME}.offsets_values", ArgumentError, (x, w, np.array([0, 7, 6], np.int32)))  # decreasing
    yield ErrorCase(f"{NAME}.offsets_values", ArgumentError, (x, w, np.array([0, 4, 5], np.int64)))  # end short of M
    yield ErrorCase(f"{NAME}.offsets_values", ArgumentError, (x, w, np.array([0, -2, 6], np.int64)))  # negative


@grouped_matmul.shape
def _shape(x, w, offsets, trans_w):
    return (x.shape[0], w.shape[1] if trans_w else w.shape[2])


def _itemsize(dtype) -> int:
    return np.dtype(cg.np_dtype(getattr(dtype, "name", dtype))).itemsize


def _used_experts(w, offsets) -> int:
    """Experts with rows where the offsets values are at hand (arrays), else all of them (Metas): their weights are
    the only ones a kernel must read."""
    if isinstance(offsets, np.ndarray):
        return int((np.diff(offsets.astype(np.int64)) > 0).sum())
    return w.shape[0]


@grouped_matmul.cost
def _cost(x, w, offsets, trans_w):
    m, k = x.shape
    n = w.shape[1] if trans_w else w.shape[2]
    weights = _used_experts(w, offsets) * k * n
    return Cost(bytes=(m * k + weights + m * n) * _itemsize(x.dtype) + offsets.shape[0] * _itemsize(offsets.dtype),
                flops=2 * m * k * n)


# --------------------------------------------------------------------------- backward

_OFFSETS = "integer group boundaries: they pick which expert's weights each row meets, not a differentiable quantity"


@grouped_matmul.backward(
    wrt=("x", "w"),
    reduces=("w",),
    constants={"offsets": _OFFSETS},
    constraints={**grad_constraints(NAME), f"{BWD}.offsets_values": _VALUES},
)
def grouped_matmul_backward(grad, x, w, offsets, trans_w: bool = False):
    """Gradients of grouped_matmul for x and w.

    Saves x and w (each is the other's gradient's factor). With grad [M, N] and the rows of expert e:
    dx_e = grad_e w[e]^T (a grouped matmul itself, over N), and dw[e] = x_e^T grad_e [K, N]
    (grad_e^T x_e [N, K] with trans_w=True), a sum over that expert's rows only; an expert without rows
    gets dw[e] = 0. Both accumulate (over N, and over the expert's rows): judged norm-wise, like the
    forward. Kernels sum each expert's rows in a fixed order (no atomics). offsets are not
    differentiable; their values are checked again before any kernel runs.
    """
    grouped_matmul.validate(x, w, offsets, trans_w)
    check_grad(BWD, grad, (x.shape[0], w.shape[1] if trans_w else w.shape[2]), x.dtype)


@grouped_matmul_backward.check_values(("offsets",))
def _check_backward_offsets(grad, x, w, offsets, trans_w):
    check_offsets(BWD, x, offsets)


@grouped_matmul_backward.reference
def _backward_reference(grad, x, w, offsets, trans_w):
    dx, dw = np.zeros(x.shape), np.zeros(w.shape)
    with np.errstate(invalid="ignore", over="ignore"):
        for e, rows in groups(offsets):
            if rows.stop == rows.start:
                continue
            dx[rows] = grad[rows] @ expert_weights(w, e, trans_w).T
            dw[e] = grad[rows].T @ x[rows] if trans_w else x[rows].T @ grad[rows]
    return dx, dw


@grouped_matmul_backward.magnitude
def _backward_magnitude(grad, x, w, offsets, trans_w):
    return _backward_reference(np.abs(grad), np.abs(x), np.abs(w), offsets, trans_w)


@grouped_matmul_backward.error_cases
def _backward_error_cases():
    x, w, o = np.ones((6, 8), np.float32), np.ones((2, 8, 5), np.float32), np.array([0, 4, 6], np.int32)
    g = np.ones((6, 5), np.float32)
    yield ErrorCase(f"{BWD}.grad_shape", ShapeError, (np.ones((6, 8), np.float32), x, w, o))
    yield ErrorCase(f"{BWD}.grad_shape", ShapeError, (np.ones((5, 5), np.float32), x, w, o))
    yield ErrorCase(f"{BWD}.grad_dtype", DTypeError, (g.astype(np.float16), x, w, o))
    yield ErrorCase(f"{BWD}.offsets_values", ArgumentError, (g, x, w, np.array([0, 7, 6], np.int32)))
    yield ErrorCase(f"{BWD}.offsets_values", ArgumentError, (g, x, w, np.array([0, 4, 7], np.int32)))


@grouped_matmul_backward.cost
def _backward_cost(grad, x, w, offsets, trans_w):
    m, k = x.shape
    n = grad.shape[1]
    weights = _used_experts(w, offsets) * k * n
    # read grad, x, w (the used experts') and offsets; write dx and every expert's dw (zeros for empty ones)
    item = _itemsize(x.dtype)
    return Cost(bytes=(m * n + 2 * m * k + weights + w.shape[0] * k * n) * item
                + offsets.shape[0] * _itemsize(offsets.dtype), flops=4 * m * k * n)


def _grad_case(name: str, dtype: str, forward: Case, grad, tags=("edge",)) -> Case:
    case = grouped_matmul_backward.from_forward(forward, dtype, grad=cg.cast(grad, dtype))
    return Case(name, case.args, case.kwargs, tags)


@grouped_matmul_backward.cases
def _backward_cases(dtype):
    """Upstream gradients the derived cases (random normal grads) do not cover."""
    rng = cg.rng_for(BWD, "edge", dtype)
    fwd = _case("grad-edge", dtype, [7, 0, 12, 3], 24, 20)
    yield _grad_case("zero-grad", dtype, fwd, np.zeros((22, 20)))
    big = 501.0 if dtype == "float16" else 4988429.2  # dx's and dw's exact values stay representable
    yield _grad_case("large-grad", dtype, _case("grad-large", dtype, [9, 8], 32, 17, trans_w=True, scale=(1e-3, 1e-3)),
                     rng.standard_normal((17, 17)) * big)
    g = cg.cast(rng.standard_normal((20, 22)), dtype).T  # [N, M] memory: a transposed (non-contiguous) gradient
    case = grouped_matmul_backward.from_forward(fwd, dtype, grad=g)
    yield Case("strided-grad", case.args, case.kwargs, ())


def _shifted(offsets):
    """Every boundary between two experts one row later (clipped to M): a group's first row read as the previous
    expert's."""
    o = offsets.astype(np.int64).copy()
    o[1:-1] = np.minimum(o[1:-1] + 1, o[-1])
    return o


@grouped_matmul_backward.mutant("offset-off-by-one")
def _mutant_off_by_one(grad, x, w, offsets, trans_w):
    """The backward with every group boundary one row late: dx's and dw's boundary rows meet the wrong expert."""
    return _backward_reference(grad, x, w, _shifted(offsets), trans_w)


@grouped_matmul_backward.mutant("dw-wrong-expert")
def _mutant_dw_wrong_expert(grad, x, w, offsets, trans_w):
    """dw of expert e stored as expert e + 1's (mod E): the per-expert reduction indexed by the wrong expert."""
    dx, dw = _backward_reference(grad, x, w, offsets, trans_w)
    return dx, np.roll(dw, 1, axis=0)
