"""moe_experts: the routed experts of a mixture-of-experts MLP (transformers' Qwen3MoeExperts / MixtralExperts)."""

from __future__ import annotations

import math

import numpy as np

from opport import casegen as cg
from opport.errors import ArgumentError, DTypeError, ShapeError
from opport.ops.matmul import matmul
from opport.ops.silu import sigmoid64, silu_grad64
from opport.ops.swiglu import _reference as swiglu64
from opport.spec import (
    INDEX,
    Case,
    Cost,
    ErrorCase,
    check,
    check_domain,
    check_float,
    check_grad,
    check_ndim,
    check_same_dtype,
    grad_constraints,
    op,
)

NAME = "moe_experts"


@op(
    arrays=("x", "gate_up_proj", "down_proj", "top_k_index", "top_k_weights"),
    domains={"top_k_index": INDEX},
    constraints={
        f"{NAME}.dtype": "x is float32, float16, bfloat16 or float64",
        f"{NAME}.dtype_mismatch": "gate_up_proj, down_proj and top_k_weights have x's dtype",
        f"{NAME}.x_shape": "x is 2-d [T, H] with H >= 1",
        f"{NAME}.gate_up_shape": "gate_up_proj is [E, 2I, H] with E >= 1, I >= 1 and x's H",
        f"{NAME}.down_shape": "down_proj is [E, H, I] with gate_up_proj's E and I and x's H",
        f"{NAME}.index_dtype": "top_k_index is an integer array",
        f"{NAME}.index_shape": "top_k_index is 2-d [T, k] with x's T",
        f"{NAME}.top_k": "1 <= k <= E (k = top_k_index.shape[1])",
        f"{NAME}.weights_shape": "top_k_weights.shape == top_k_index.shape = (T, k)",
        f"{NAME}.index_range": "every index is an expert in [0, E) (read on the host before any kernel)",
    },
)
def moe_experts(x, gate_up_proj, down_proj, top_k_index, top_k_weights):
    """The routed experts of an MoE MLP, out [T, H] in x's dtype (transformers 5's Qwen3MoeExperts layout).

    For each token t and each of its k picks j, with e = top_k_index[t, j]: h = gate_up_proj[e] @ x[t] (2I),
    gate = h[:I], up = h[I:], a = silu(gate) * up, and out[t] += top_k_weights[t, j] * (down_proj[e] @ a): exactly
    transformers' loop over the experts hit. An index picked twice in one row counts twice (a router never does
    this; transformers' index_add_ gives the same sum). Weights are taken as given: zero, negative or unnormalised.
    Experts no token picks are never read (NaN there does not leak). silu and the product follow `swiglu`'s rules.
    16-bit inputs accumulate in float32; kernels may round the intermediate a to x's dtype before the down
    projection (as transformers does, and as tensor cores take it). Indices are checked on the host before any
    kernel (they pick which weights a kernel reads).
    """
    check_float(NAME, "x", x)
    check_same_dtype(NAME, "x", x, gate_up_proj=gate_up_proj, down_proj=down_proj, top_k_weights=top_k_weights)
    check(x.ndim == 2 and x.shape[1] >= 1, ShapeError, NAME, "x", f"{NAME}.x_shape", "2-d [T, H], H >= 1", x.shape)
    t, h = x.shape
    gu = gate_up_proj.shape
    ok = len(gu) == 3 and gu[0] >= 1 and gu[1] >= 2 and gu[1] % 2 == 0 and gu[2] == h
    check(ok, ShapeError, NAME, "gate_up_proj", f"{NAME}.gate_up_shape", f"[E >= 1, 2I >= 2, {h}] = [E, 2I, H]", gu)
    e, i = gu[0], gu[1] // 2
    check(tuple(down_proj.shape) == (e, h, i), ShapeError, NAME, "down_proj", f"{NAME}.down_shape",
          f"({e}, {h}, {i}) = [E, H, I]", down_proj.shape)
    check_domain(NAME, "top_k_index", top_k_index, INDEX, f"{NAME}.index_dtype")
    check_ndim(NAME, "top_k_index", top_k_index, 2, constraint=f"{NAME}.index_shape")
    check(top_k_index.shape[0] == t, ShapeError, NAME, "top_k_index", f"{NAME}.index_shape", f"[{t}, k] = [T, k]",
          top_k_index.shape)
    k = top_k_index.shape[1]
    check(1 <= k <= e, ShapeError, NAME, "top_k_index", f"{NAME}.top_k", f"1 <= k <= E = {e}", k)
    check(tuple(top_k_weights.shape) == tuple(top_k_index.shape), ShapeError, NAME, "top_k_weights",
          f"{NAME}.weights_shape", f"{tuple(top_k_index.shape)} (top_k_index's)", top_k_weights.shape)


def check_index_values(name: str, top_k_index, n_experts: int) -> None:
    """`<name>.index_range` (the forward's and the backward's): every index in [0, E)."""
    idx = np.asarray(top_k_index)
    bad = (idx < 0) | (idx >= n_experts)
    check(not bad.any(), ArgumentError, name, "top_k_index", f"{name}.index_range", f"experts in [0, {n_experts})",
          int(idx[bad][0]) if bad.any() else None)


@moe_experts.check_values(("top_k_index",))
def _check_index(x, gate_up_proj, down_proj, top_k_index, top_k_weights):
    check_index_values(NAME, top_k_index, gate_up_proj.shape[0])


def _routes(top_k_index, n_experts: int):
    """Per expert hit, in expert order: (e, tokens, picks), the (t, j) with top_k_index[t, j] == e, as transformers'
    `torch.where(expert_mask[e])` lists them (by pick, then token)."""
    idx = np.asarray(top_k_index).astype(np.int64)
    for e in range(n_experts):
        picks, tokens = np.nonzero(idx.T == e)
        if tokens.size:
            yield e, tokens, picks


def _expert(xt, w1, w2):
    """One expert on its rows xt [n, H] in float64: (gate, up, a, y) with y = down(silu(gate) * up)."""
    i = w2.shape[1]
    h = xt @ w1.T
    gate, up = h[:, :i], h[:, i:]
    a = swiglu64(gate, up)
    return gate, up, a, a @ w2.T


# batch invariance (docs/conformance.md): the arrays whose leading axis is the batch
moe_experts.batched("x", "top_k_index", "top_k_weights")  # tokens


@moe_experts.reference
def _reference(x, gate_up_proj, down_proj, top_k_index, top_k_weights):
    out = np.zeros(x.shape)
    with np.errstate(invalid="ignore", over="ignore"):
        for e, tokens, picks in _routes(top_k_index, gate_up_proj.shape[0]):
            y = _expert(x[tokens], gate_up_proj[e], down_proj[e])[3]
            np.add.at(out, tokens, y * top_k_weights[tokens, picks][:, None])  # index_add_
    return out


# Two GEMMs in a chain, each K-accumulating (over H, then over I) with float32 accumulation: judged norm-wise with
# matmul's table. float32: the first GEMM's error (~sqrt(H) u relative) passes through silu and the product, the second
# adds ~sqrt(I) u: both far below 1e-5 for the H, I of the cases (the magnitude below covers cancelling sums). 16-bit:
# one more rounding than matmul, of the intermediate a to the dtype (eps/2 relative per term of the down GEMM's sum,
# as transformers rounds it), plus the output's: about eps of max|r| in all, inside matmul's 2 eps (bf16 1.6e-2,
# fp16 2e-3); the router-weighted sum over k adds float32 rounding only.
moe_experts.tolerance(**matmul.tolerances)


@moe_experts.magnitude
def _magnitude(x, gate_up_proj, down_proj, top_k_index, top_k_weights):
    """Per output element, sum |terms| of the down GEMM (|w| |down| |a|) plus, to first order, the first GEMM's
    sum |terms| per gate and up element carried through silu and the product: the scale each partial sum lives at."""
    out = np.zeros(x.shape)
    i = down_proj.shape[2]
    with np.errstate(invalid="ignore", over="ignore"):
        for e, tokens, picks in _routes(top_k_index, gate_up_proj.shape[0]):
            xt = x[tokens]
            gate, up, a, _ = _expert(xt, gate_up_proj[e], down_proj[e])
            sums = np.abs(xt) @ np.abs(gate_up_proj[e]).T  # sum_h |x_h w_ih| per gate and up element
            spread = np.abs(a) + np.abs(silu_grad64(gate) * up) * sums[:, :i] + np.abs(gate * sigmoid64(gate)) * sums[:, i:]
            np.add.at(out, tokens, (spread @ np.abs(down_proj[e]).T) * np.abs(top_k_weights[tokens, picks])[:, None])
    return out


def _router(rng, t: int, e: int, k: int, p=None) -> np.ndarray:
    """k distinct experts per token, as a router picks them: the top k of random scores (skewed by p: a few
    experts take most tokens)."""
    scores = rng.random((t, e)) * (np.ones(e) if p is None else np.asarray(p, np.float64))
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def _weights(rng, t: int, k: int) -> np.ndarray:
    """Router weights: a softmax over the k picks (positive, summing to 1)."""
    z = np.exp(rng.standard_normal((t, k)))
    return z / z.sum(axis=1, keepdims=True)


def _case(name, dtype, t, h, i, e, k, index=None, weights=None, p=None, index_dtype="int64", tags=()):
    """x ~ N(0, 1); gate_up_proj ~ N(0, 1/H) and down_proj ~ N(0, 1/I): gate, up and the output stay O(1)."""
    rng = cg.rng_for(NAME, name, dtype)
    x = cg.array((t, h), dtype, rng)
    w1 = cg.array((e, 2 * i, h), dtype, rng, scale=1 / math.sqrt(h))
    w2 = cg.array((e, h, i), dtype, rng, scale=1 / math.sqrt(i))
    idx = _router(rng, t, e, k, p) if index is None else np.asarray(index).reshape(t, k)
    w = _weights(rng, t, k) if weights is None else np.asarray(weights, np.float64).reshape(t, k)
    return Case(name, (x, w1, w2, idx.astype(index_dtype), cg.cast(w, dtype)), {}, tags)


@moe_experts.cases
def _cases(dtype):
    yield _case("prefill-e16-k4", dtype, 64, 128, 64, 16, 4, tags=("llm",))
    yield _case("decode-e32-k8", dtype, 4, 128, 64, 32, 8, index_dtype="int32", tags=("llm",))
    yield _case("small", dtype, 16, 32, 24, 4, 2)
    # groups of 1 to ~30 rows (none a multiple of a tile) from a skewed router, and an expert nobody picks
    yield _case("ragged-groups", dtype, 37, 40, 20, 4, 2, p=(1, 8, 0, 3))
    yield _case("tile-edges", dtype, 33, 130, 66, 2, 2, index_dtype="int32")  # H, I, T one or two past 32 / 64 / 128
    yield _case("all-to-one-expert", dtype, 20, 24, 16, 4, 1, index=np.full(20, 2), index_dtype="int32", tags=("edge",))
    yield _case("k-equals-e", dtype, 10, 16, 12, 3, 3)
    yield _case("t-one", dtype, 1, 32, 16, 8, 2)
    yield _case("t-zero", dtype, 0, 16, 8, 4, 2, tags=("edge",))
    # E = 128 at tiny H and I: experts 0 and 127 among a few picks, most experts empty
    yield _case("e128-tiny", dtype, 3, 16, 8, 128, 2, index=[127, 0, 64, 127, 1, 126], index_dtype="int32")
    # an expert twice in one row (a router never does this: it counts twice); router weights zero, negative, > 1
    # (the smallest case, so the one most layout variants take: two experts keep it cheap on emulated backends)
    yield _case("duplicates-signed-weights", dtype, 8, 16, 8, 2, 2, index=[1, 1, 0, 1, 0, 0, 1, 0, 0, 0, 1, 1, 0, 1, 1, 1],
                weights=[0.0, 1.0, -0.5, 1.5, 0.0, 0.0, 2.0, -1.0, 0.25, 0.75, -3.0, 0.0, 1.0, 1.0, 0.5, -0.5],
                tags=("edge",))
    yield _nonfinite(dtype)


def _nonfinite(dtype: str) -> Case:
    """NaN in one token's x and inf in another's; NaN and -inf in the weights of the expert no token picks: the other
    tokens stay finite (no token reads another's row, no expert's weights are read unless picked)."""
    case = _case("nonfinite-isolated", dtype, 12, 16, 8, 4, 2, p=(1, 1, 0, 1), tags=("edge",))
    x, w1, w2, idx, w = case.args
    x, w1, w2 = x.copy(), w1.copy(), w2.copy()
    x[3, 5], x[7, 0] = cg.cast(np.nan, dtype), cg.cast(np.inf, dtype)
    w1[2, 3, 1], w2[2, 0, 2] = cg.cast(np.nan, dtype), cg.cast(-np.inf, dtype)
    return Case(case.name, (x, w1, w2, idx, w), {}, case.tags)


@moe_experts.error_cases
def _error_cases():
    f = np.float32
    x, w1, w2 = np.ones((4, 8), f), np.ones((3, 10, 8), f), np.ones((3, 8, 5), f)
    idx, w = np.zeros((4, 2), np.int64), np.ones((4, 2), f)
    yield ErrorCase(f"{NAME}.dtype", DTypeError, (x.astype(np.int32), w1, w2, idx, w))
    yield ErrorCase(f"{NAME}.dtype_mismatch", DTypeError, (x, w1.astype(np.float16), w2, idx, w))
    yield ErrorCase(f"{NAME}.dtype_mismatch", DTypeError, (x, w1, w2.astype(np.float64), idx, w))
    yield ErrorCase(f"{NAME}.dtype_mismatch", DTypeError, (x, w1, w2, idx, w.astype(np.float16)))
    yield ErrorCase(f"{NAME}.x_shape", ShapeError, (np.ones(8, f), w1, w2, idx, w))
    yield ErrorCase(f"{NAME}.x_shape", ShapeError, (np.ones((4, 0), f), np.ones((3, 10, 0), f), np.ones((3, 0, 5), f),
                                                    idx, w))
    yield ErrorCase(f"{NAME}.gate_up_shape", ShapeError, (x, np.ones((3, 10, 7), f), w2, idx, w))  # H
    yield ErrorCase(f"{NAME}.gate_up_shape", ShapeError, (x, np.ones((3, 9, 8), f), w2, idx, w))  # odd 2I
    yield ErrorCase(f"{NAME}.gate_up_shape", ShapeError, (x, np.ones((0, 10, 8), f), np.ones((0, 8, 5), f), idx, w))
    yield ErrorCase(f"{NAME}.gate_up_shape", ShapeError, (x, np.ones((10, 8), f), w2, idx, w))
    yield ErrorCase(f"{NAME}.down_shape", ShapeError, (x, w1, np.ones((3, 5, 8), f), idx, w))  # [E, I, H]: transposed
    yield ErrorCase(f"{NAME}.down_shape", ShapeError, (x, w1, np.ones((2, 8, 5), f), idx, w))
    yield ErrorCase(f"{NAME}.index_dtype", DTypeError, (x, w1, w2, idx.astype(f), w))
    yield ErrorCase(f"{NAME}.index_dtype", DTypeError, (x, w1, w2, idx.astype(bool), w))
    yield ErrorCase(f"{NAME}.index_shape", ShapeError, (x, w1, w2, np.zeros(4, np.int64), np.ones(4, f)))
    yield ErrorCase(f"{NAME}.index_shape", ShapeError, (x, w1, w2, np.zeros((5, 2), np.int64), np.ones((5, 2), f)))
    yield ErrorCase(f"{NAME}.top_k", ShapeError, (x, w1, w2, np.zeros((4, 4), np.int64), np.ones((4, 4), f)))  # k > E
    yield ErrorCase(f"{NAME}.top_k", ShapeError, (x, w1, w2, np.zeros((4, 0), np.int64), np.ones((4, 0), f)))
    yield ErrorCase(f"{NAME}.weights_shape", ShapeError, (x, w1, w2, idx, np.ones((4, 1), f)))
    yield ErrorCase(f"{NAME}.weights_shape", ShapeError, (x, w1, w2, idx, np.ones(8, f)))
    for bad in ([[0, 1], [2, 3], [0, 0], [1, 1]], [[0, 1], [-1, 2], [0, 0], [1, 1]]):  # E itself, a negative expert
        yield ErrorCase(f"{NAME}.index_range", ArgumentError, (x, w1, w2, np.array(bad), w))
    yield ErrorCase(f"{NAME}.index_range", ArgumentError, (x, w1, w2, np.array([[0, 1], [2, 200], [0, 0], [1, 1]],
                                                                                  np.uint8), w))


def _item(dtype) -> int:
    return np.dtype(cg.np_dtype(getattr(dtype, "name", dtype))).itemsize


def _experts_read(top_k_index, n_experts: int) -> int:
    """Experts whose weights must be read: those picked, when the index values are at hand (an array), else as many
    as T * k picks can reach."""
    if isinstance(top_k_index, np.ndarray):
        return int(np.unique(top_k_index).size)
    return min(n_experts, math.prod(top_k_index.shape))


@moe_experts.cost
def _cost(x, gate_up_proj, down_proj, top_k_index, top_k_weights):
    """Bytes: x, the picked experts' weights, the index and router weights read once, out written once (no
    intermediate is counted: a fused kernel need not store it). FLOPs: both GEMMs per pick, 2 T k (2I H + H I);
    SwiGLU (silu's 5 and the product) per intermediate element; the weighted sum over k (2 per output element)."""
    t, h = x.shape
    e, i, k = gate_up_proj.shape[0], down_proj.shape[2], top_k_index.shape[1]
    item = _item(x.dtype)
    weights = _experts_read(top_k_index, e) * 3 * i * h
    rows = t * k
    return Cost(bytes=(2 * t * h + weights + rows) * item + rows * _item(top_k_index.dtype),
                flops=2 * rows * (2 * i * h + i * h) + 6 * rows * i + 2 * rows * h)


# --------------------------------------------------------------------------- backward

BWD = f"{NAME}_backward"


@moe_experts.backward(
    wrt=("x", "gate_up_proj", "down_proj", "top_k_weights"),
    reduces=("gate_up_proj", "down_proj"),
    constants={"top_k_index": "integer expert picks: a discrete routing decision, not a differentiable quantity"},
    constraints={**grad_constraints(NAME),
                 f"{BWD}.index_range": "every index is an expert in [0, E) (as moe_experts.index_range)"},
)
def moe_experts_backward(grad, x, gate_up_proj, down_proj, top_k_index, top_k_weights):
    """Gradients of moe_experts for x, gate_up_proj, down_proj and top_k_weights; top_k_index is a constant.

    Saves only the inputs (x, both weight tensors, the index and the router weights): the gate, up and a of every
    pick (3 T k I values) are recomputed, never stored between the passes. Per pick (t, j), e = top_k_index[t, j],
    g = grad[t]: y = down_proj[e] @ a, dtop_k_weights[t, j] = g . y = (down_proj[e]^T g) . a; dy = w g,
    ddown_proj[e] += dy a^T, da = down_proj[e]^T dy, dgate = da up silu'(gate), dup = da silu(gate),
    dgate_up_proj[e] += [dgate; dup] x[t]^T, dx[t] += gate_up_proj[e]^T [dgate; dup]. An expert no token picks
    gets zero gradients (its weights are never read); a pick counted twice contributes twice. The weight
    gradients sum over the expert's rows, dx over k picks and 2I, dtop_k_weights over H: all judged norm-wise.
    """
    moe_experts.validate(x, gate_up_proj, down_proj, top_k_index, top_k_weights)
    check_grad(BWD, grad, x.shape, x.dtype)


@moe_experts_backward.check_values(("top_k_index",))
def _check_backward_index(grad, x, gate_up_proj, down_proj, top_k_index, top_k_weights):
    check_index_values(BWD, top_k_index, gate_up_proj.shape[0])


@moe_experts_backward.reference
def _backward_reference(grad, x, gate_up_proj, down_proj, top_k_index, top_k_weights):
    return _vjp(grad, x, gate_up_proj, down_proj, top_k_index, top_k_weights)


def _vjp(grad, x, gate_up_proj, down_proj, top_k_index, top_k_weights, weighted=True, expert_shift=0):
    """The float64 gradients, expert by expert. Mutants: weighted=False drops the router weight from dy (the weight
    gradients and dx); expert_shift adds expert e's weight gradients to expert (e + shift) % E."""
    n_experts = gate_up_proj.shape[0]
    dx, dw1, dw2 = np.zeros(x.shape), np.zeros(gate_up_proj.shape), np.zeros(down_proj.shape)
    dw = np.zeros(top_k_weights.shape)
    with np.errstate(invalid="ignore", over="ignore"):
        for e, tokens, picks in _routes(top_k_index, n_experts):
            xt, g, w = x[tokens], grad[tokens], top_k_weights[tokens, picks][:, None]
            gate, up, a, y = _expert(xt, gate_up_proj[e], down_proj[e])
            dw[tokens, picks] = np.sum(g * y, axis=1)
            dy = g * w if weighted else g
            da = dy @ down_proj[e]
            dh = np.concatenate([(da * up) * silu_grad64(gate), swiglu64(gate, da)], axis=1)  # silu(gate) * da
            to = (e + expert_shift) % n_experts
            dw2[to] += dy.T @ a
            dw1[to] += dh.T @ xt
            np.add.at(dx, tokens, dh @ gate_up_proj[e])
    return dx, dw1, dw2, dw


# Every gradient is a sum: dx over the k picks and 2I, the weight gradients over an expert's rows, dtop_k_weights over
# H (or I): K-accumulating with float32 accumulation, judged norm-wise with matmul's backward table. 16-bit kernels
# round a, dh = [dgate, dup] and w grad to the dtype before their GEMMs (tensor-core operands, as torch's autograd of
# transformers' loop does): eps/2 relative per term, inside the table's 2 eps of max|r|.
moe_experts_backward.tolerance(**matmul.backward_op.tolerances)


@moe_experts_backward.error_cases
def _backward_error_cases():
    f = np.float32
    x, w1, w2 = np.ones((4, 8), f), np.ones((3, 10, 8), f), np.ones((3, 8, 5), f)
    idx, w = np.zeros((4, 2), np.int64), np.ones((4, 2), f)
    yield ErrorCase(f"{BWD}.grad_shape", ShapeError, (np.ones((4, 5), f), x, w1, w2, idx, w))
    yield ErrorCase(f"{BWD}.grad_dtype", DTypeError, (np.ones((4, 8), np.float16), x, w1, w2, idx, w))
    yield ErrorCase(f"{BWD}.index_range", ArgumentError, (x, x, w1, w2, np.array([[0, 1], [2, 3], [0, 0], [1, 1]]), w))


@moe_experts_backward.cost
def _backward_cost(grad, x, gate_up_proj, down_proj, top_k_index, top_k_weights):
    """Bytes: grad, x, the picked experts' weights, index and router weights read; dx, both weight gradients (all E
    experts: zeros where none picked) and dtop_k_weights written. FLOPs: the gate_up GEMM recomputed (4 T k I H),
    da (2 T k H I), ddown_proj (2 T k H I), dgate_up_proj and dx (4 T k I H each): 16 T k I H, 8/3 of the
    forward's GEMMs; dtop_k_weights as a dot over I (2 T k I), SwiGLU and its derivative (about 20 per element)."""
    t, h = x.shape
    e, i, k = gate_up_proj.shape[0], down_proj.shape[2], top_k_index.shape[1]
    item = _item(x.dtype)
    rows = t * k
    read = (3 * t * h + _experts_read(top_k_index, e) * 3 * i * h + rows) * item + rows * _item(top_k_index.dtype)
    written = (t * h + e * 3 * i * h + rows) * item
    return Cost(bytes=read + written, flops=16 * rows * i * h + 2 * rows * i + 20 * rows * i)


@moe_experts_backward.cases
def _backward_cases(dtype):
    """Upstream gradients the derived cases (random normal grads) do not cover."""
    fwd = _case("zero-grad", dtype, 9, 16, 8, 3, 2)
    case = moe_experts_backward.from_forward(fwd, dtype, grad=np.zeros((9, 16), cg.np_dtype(dtype)))
    yield Case("zero-grad", case.args, case.kwargs, ("edge",))


@moe_experts_backward.mutant("router-weight-dropped")
def _mutant_unweighted(grad, x, gate_up_proj, down_proj, top_k_index, top_k_weights):
    """dy = grad instead of top_k_weights * grad: every gradient but dtop_k_weights misses its router weight."""
    return _vjp(grad, x, gate_up_proj, down_proj, top_k_index, top_k_weights, weighted=False)


@moe_experts_backward.mutant("weight-grads-to-next-expert")
def _mutant_wrong_expert(grad, x, gate_up_proj, down_proj, top_k_index, top_k_weights):
    """Each expert's gradients scattered to the next expert's slot (a group offset off by one expert)."""
    return _vjp(grad, x, gate_up_proj, down_proj, top_k_index, top_k_weights, expert_shift=1)
