"""matmul: a [..., M, K] @ b ([K, N] or [..., K, N]) + bias [N], float32 accumulation."""

from __future__ import annotations

import math

import numpy as np

from opport import casegen as cg
from opport.dtypes import finfo
from opport.errors import ShapeError
from opport.spec import (
    Case,
    Cost,
    ErrorCase,
    Tolerance,
    check,
    check_float,
    check_grad,
    check_ndim,
    check_same_dtype,
    grad_constraints,
    op,
)

NAME = "matmul"


@op(
    arrays=("a", "b", "bias"),
    constraints={
        "matmul.dtype": "a is float32, float16, bfloat16 or float64",
        "matmul.dtype_mismatch": "b and bias have a's dtype",
        "matmul.a_rank": "a is at least 2-d [..., M, K]",
        "matmul.batch_dims": "b is [K, N], or [..., K, N] with exactly a's batch dims (no broadcasting)",
        "matmul.inner_dim": "b.shape[-2] == a.shape[-1] (K)",
        "matmul.bias_shape": "bias.shape == (N,) = (b.shape[-1],)",
    },
)
def matmul(a, b, bias=None):
    """Matrix product over the last two axes plus an optional bias on the output's last axis.

    16-bit inputs are multiplied with float32 accumulation; K = 0 gives zeros (plus bias).
    A 2-d b is shared by every batch entry of a; a batched b must have a's batch dims exactly.

    Range (docs/numerics.md 3.9): an output element is defined while sum_k |a_ik| |b_kj| + |bias_j|
    (`accumulation_bound`: no partial sum in any order exceeds it) is at most the largest finite value of
    the accumulation dtype (float32 for 16- and 32-bit inputs, float64 for float64). There it is the exact
    result rounded to the output dtype: beyond the dtype's range that is ±inf, as torch's float16 matmul
    gives inf above 65504. Past the bound the accumulation may overflow: the element is ±inf where every
    term has one sign (the exact result then overflows too), otherwise unspecified (±inf or NaN, by the
    order of the sum), as in torch's float32 matmul.
    """
    check_float(NAME, "a", a)
    check_same_dtype(NAME, "a", a, b=b, bias=bias)
    check_ndim(NAME, "a", a, 2, -1)
    batch_ok = b.ndim == 2 or (b.ndim == a.ndim and b.shape[:-2] == a.shape[:-2])
    check(batch_ok, ShapeError, NAME, "b", "matmul.batch_dims", f"[K, N] or [{', '.join(map(str, a.shape[:-2]))}, K, N]",
          b.shape)
    check(b.shape[-2] == a.shape[-1], ShapeError, NAME, "b", "matmul.inner_dim", f"b.shape[-2] == {a.shape[-1]} (a's K)",
          b.shape)
    if bias is not None:
        check(bias.shape == (b.shape[-1],), ShapeError, NAME, "bias", "matmul.bias_shape", f"({b.shape[-1]},) = (N,)",
              bias.shape)


def accumulation_bound(a, b, bias=None) -> np.ndarray:
    """Per output element, sum_k |a_ik| |b_kj| + |bias_j| in float64: the largest magnitude any partial sum of
    the element can reach, in any order. The result is defined where it is at most the accumulation dtype's
    largest finite value (the op's Range)."""
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.matmul(np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(b, np.float64)))
        return out if bias is None else out + np.abs(np.asarray(bias, np.float64))


# batch invariance (docs/conformance.md): the arrays whose leading axis is the batch
matmul.batched("a", when=lambda a, b, *_: b.ndim == 2)  # rows of a (or its batch) against one b


@matmul.reference
def _reference(a, b, bias):
    with np.errstate(invalid="ignore", over="ignore"):
        out = np.matmul(a, b)
        return out if bias is None else out + bias


# docs/numerics.md section 3.3: K-accumulating ops are judged norm-wise against max|r|.
matmul.tolerance(
    float64=Tolerance(1e-7, 1e-7, "normwise", reason="docs/numerics.md 3.3: K-accumulating, norm-wise"),
    float32=Tolerance(1e-5, 1e-5, "normwise", reason="docs/numerics.md 3.3: K-accumulating, norm-wise"),
    float16=Tolerance(2e-3, 1e-5, "normwise", reason="docs/numerics.md 3.3: fp32 accumulation, norm-wise"),
    bfloat16=Tolerance(1.6e-2, 1e-5, "normwise", reason="docs/numerics.md 3.3: fp32 accumulation, norm-wise"),
)


def _case(name, dtype, a_shape, b_shape, bias=False, dist="normal", scale=(1.0, 1.0), tags=()):
    rng = cg.rng_for(NAME, name, dtype)
    a = cg.array(a_shape, dtype, rng, dist, scale[0])
    b = cg.array(b_shape, dtype, rng, dist, scale[1])
    c = cg.array(b_shape[-1:], dtype, rng, "normal", 1.0) if bias else None
    return Case(name, (a, b, c), {}, tags)


def _with_specials(case: Case, dtype: str) -> Case:
    """One NaN and one inf in different rows of a; b keeps finite non-zero values (so each is a clean ±inf/NaN row)."""
    a = case.args[0].copy()
    a[3, 5], a[7, 0] = cg.cast(np.nan, dtype), cg.cast(-np.inf, dtype)
    return Case(case.name, (a, *case.args[1:]), case.kwargs, case.tags)


@matmul.cases
def _cases(dtype):
    yield _case("llm-proj", dtype, (64, 300), (300, 64), bias=True, tags=("llm",))
    yield _case("decode-gemv", dtype, (1, 300), (300, 300), tags=("llm",))
    yield _case("m1-k17-n64", dtype, (1, 17), (17, 64))
    yield _case("m17-k64-n17", dtype, (17, 64), (64, 17), bias=True)
    yield _case("m300-k17-n1", dtype, (300, 17), (17, 1))
    yield _case("m64-k1-n300", dtype, (64, 1), (1, 300))
    yield _case("k-zero", dtype, (17, 0), (0, 64), tags=("edge",))
    yield _case("k-zero-bias", dtype, (17, 0), (0, 64), bias=True, tags=("edge",))
    yield _case("m-zero", dtype, (0, 64), (64, 17), bias=True, tags=("edge",))
    yield _case("batched-b", dtype, (2, 3, 17, 64), (2, 3, 64, 17), bias=True)
    yield _case("batched-a-shared-b", dtype, (4, 64, 17), (17, 300))
    yield _case("heads-qk", dtype, (1, 8, 64, 64), (1, 8, 64, 64), tags=("llm",))
    # large magnitudes per docs/numerics.md 4, chosen so the exact product stays representable in the dtype
    big = (501.0, 1e-2) if dtype == "float16" else (4988429.2, 1e-3)
    yield _case("large", dtype, (17, 64), (64, 17), scale=big, tags=("edge",))
    yield _case("tiny", dtype, (17, 64), (64, 17), scale=(1e-2, 1e-1), tags=("edge",))
    yield _case("heavy-tails", dtype, (64, 64), (64, 64), dist="heavy")
    yield _with_specials(_case("nan-inf-rows", dtype, (17, 64), (64, 17), dist="uniform", scale=(1.0, 1.0), tags=("edge",)),
                         dtype)
    yield from _range_cases(dtype)


def _range_cases(dtype):
    """The edge of the op's Range (docs/numerics.md 3.9). "near-max": just inside, finite and accurate on every
    backend (accumulation_bound up to 0.9 of the accumulation dtype's maximum; float16: results of exactly
    ±65504 in exact arithmetic). "past-max": every product of a sum one sign and the exact result twice the
    output dtype's maximum (float16: ±65536): ±inf, as the rounded reference."""
    rng = cg.rng_for(NAME, "range", dtype)
    if dtype == "float16":
        # rows of ±32 against columns of 2047/64 give ±65504 exactly (every partial sum exact in float32), and
        # columns of 32 give ±65536 -> ±inf; the other columns are random (|result| ~ 5e3)
        a = np.where(np.arange(8)[:, None] % 2, -32.0, 32.0) * np.ones((8, 64))
        rand = rng.uniform(-32, 32, (64, 12))
        for name, edge in (("near-max", 2047 / 64), ("past-max", 32.0)):
            b = np.concatenate([np.full((64, 4), edge), rand], axis=1)
            yield Case(name, (cg.cast(a, dtype), cg.cast(b, dtype), None), {}, ("edge",))
        return
    big = float(finfo(dtype).max)  # bfloat16's is float32's, to 0.4%
    ua, ub = rng.uniform(0.5, 1, (17, 64)) * rng.choice([-1, 1], (17, 64)), rng.uniform(0.5, 1, (64, 17))
    ub = ub * rng.choice([-1, 1], (64, 17))
    c = np.sqrt(0.85 * big / accumulation_bound(ua, ub).max())
    bias = rng.uniform(-0.05, 0.05, 17) * big
    yield Case("near-max", (cg.cast(ua * c, dtype), cg.cast(ub * c, dtype), cg.cast(bias, dtype)), {}, ("edge",))
    c = np.sqrt(2 * big / 64)  # every sum: 64 products of one sign, twice the maximum in all
    signs = np.where(np.arange(17) % 2, -1.0, 1.0)
    yield Case("past-max", (cg.cast(np.full((17, 64), c), dtype), cg.cast(np.full((64, 17), c) * signs, dtype), None), {},
               ("edge",))


@matmul.strategy
def _strategy(dtype):
    from hypothesis import strategies as st

    @st.composite
    def case(draw):
        m, k, n = draw(cg.dims(0, 130)), draw(cg.dims(0, 130)), draw(cg.dims(1, 130))
        batch = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
        batched_b = bool(batch) and draw(st.booleans())
        dist, scale, bias = draw(cg.dists(specials=False)), draw(cg.scales()), draw(st.booleans())
        seed = draw(cg.seeds())
        rng = np.random.default_rng(seed)
        a = cg.array(batch + (m, k), dtype, rng, dist, scale)
        b = cg.array((batch if batched_b else ()) + (k, n), dtype, rng, dist, 1.0)
        c = cg.array((n,), dtype, rng, "normal", scale) if bias else None
        return Case(f"hyp-{seed}", (a, b, c), {}, ("hypothesis",))

    return case()


@matmul.error_cases
def _error_cases():
    from opport.errors import DTypeError

    a, b = np.ones((4, 8), np.float32), np.ones((8, 5), np.float32)
    yield ErrorCase("matmul.dtype", DTypeError, (np.ones((4, 8), np.int32), np.ones((8, 5), np.int32)))
    yield ErrorCase("matmul.dtype_mismatch", DTypeError, (a, np.ones((8, 5), np.float16)))
    yield ErrorCase("matmul.dtype_mismatch", DTypeError, (a, b, np.ones(5, np.float64)))
    yield ErrorCase("matmul.a_rank", ShapeError, (np.ones(8, np.float32), b))
    yield ErrorCase("matmul.batch_dims", ShapeError, (np.ones((2, 4, 8), np.float32), np.ones((3, 8, 5), np.float32)))
    yield ErrorCase("matmul.batch_dims", ShapeError, (a, np.ones((2, 8, 5), np.float32)))  # b batched, a not
    yield ErrorCase("matmul.batch_dims", ShapeError, (a, np.ones(8, np.float32)))
    yield ErrorCase("matmul.inner_dim", ShapeError, (a, np.ones((7, 5), np.float32)))
    yield ErrorCase("matmul.bias_shape", ShapeError, (a, b, np.ones(4, np.float32)))
    yield ErrorCase("matmul.bias_shape", ShapeError, (a, b, np.ones((1, 5), np.float32)))


@matmul.shape
def _shape(a, b, bias):
    return (*a.shape[:-1], b.shape[-1])


@matmul.cost
def _cost(a, b, bias):
    item = np.dtype(cg.np_dtype(a.dtype)).itemsize
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    out = math.prod(a.shape[:-2]) * m * n
    extra = bias.size if bias is not None else 0
    return Cost(bytes=(a.size + b.size + extra + out) * item, flops=2 * out * k + (out if bias is not None else 0))


# --------------------------------------------------------------------------- backward


@matmul.backward(wrt=("a", "b", "bias"), reduces=("b", "bias"), constraints=grad_constraints(NAME))
def matmul_backward(grad, a, b, bias=None):
    """Gradients of matmul for a, b and bias.

    Saves a and b (each is the other's gradient's factor); bias only for its presence (its values play no
    part). With grad [..., M, N]: da = grad b^T [..., M, K]; db = a^T grad, summed over the batch when b
    is a shared [K, N]; dbias = grad summed over every row. All three accumulate (over N, or over the
    batch and M): judged norm-wise, like the forward.
    """
    matmul.validate(a, b, bias)
    check_grad(f"{NAME}_backward", grad, (*a.shape[:-1], b.shape[-1]), a.dtype)


@matmul_backward.reference
def _backward_reference(grad, a, b, bias):
    k, n = b.shape[-2:]
    rows = math.prod(a.shape[:-1])  # (-1 cannot be inferred when K or N is 0)
    with np.errstate(invalid="ignore", over="ignore"):
        da = np.matmul(grad, b.swapaxes(-1, -2))
        if b.ndim == 2:  # shared by the batch: one product over all rows of all batch entries
            db = np.matmul(a.reshape(rows, k).T, grad.reshape(rows, n))
        else:
            db = np.matmul(a.swapaxes(-1, -2), grad)
        dbias = None if bias is None else grad.reshape(rows, n).sum(axis=0)
    return da, db, dbias


# docs/numerics.md 3.10: each output is a sum; its sum |terms| is the same product of absolute values
@matmul.magnitude
def _magnitude(a, b, bias):
    return _reference(np.abs(a), np.abs(b), None if bias is None else np.abs(bias))


@matmul_backward.magnitude
def _backward_magnitude(grad, a, b, bias):
    return _backward_reference(np.abs(grad), np.abs(a), np.abs(b), bias)


@matmul_backward.error_cases
def _backward_error_cases():
    from opport.errors import DTypeError

    a, b = np.ones((4, 8), np.float32), np.ones((8, 5), np.float32)
    yield ErrorCase("matmul_backward.grad_shape", ShapeError, (np.ones((4, 8), np.float32), a, b))
    yield ErrorCase("matmul_backward.grad_shape", ShapeError, (np.ones((2, 4, 5), np.float32), a, b))
    yield ErrorCase("matmul_backward.grad_dtype", DTypeError, (np.ones((4, 5), np.float16), a, b))


@matmul_backward.cost
def _backward_cost(grad, a, b, bias):
    item = np.dtype(cg.np_dtype(a.dtype)).itemsize
    k = a.shape[-1]
    extra = bias.size if bias is not None else 0  # dbias written; bias itself is not read
    flops = 4 * grad.size * k + (grad.size if bias is not None else 0)  # two GEMMs, one sum over rows
    return Cost(bytes=(grad.size + 2 * a.size + 2 * b.size + extra) * item, flops=flops)


def _grad_case(name: str, dtype: str, forward: Case, grad: np.ndarray, tags=("edge",)) -> Case:
    case = matmul_backward.from_forward(forward, dtype, grad=cg.cast(grad, dtype))
    return Case(name, case.args, case.kwargs, tags)


@matmul_backward.cases
def _backward_cases(dtype):
    """Upstream gradients the derived cases (random normal grads) do not cover."""
    rng = cg.rng_for(f"{NAME}_backward", "edge", dtype)
    fwd = _case("grad-edge", dtype, (3, 17, 64), (64, 33), bias=True)
    yield _grad_case("zero-grad", dtype, fwd, np.zeros((3, 17, 33)))
    big = 501.0 if dtype == "float16" else 4988429.2  # da's and db's exact values stay representable
    yield _grad_case("large-grad", dtype, _case("grad-large", dtype, (17, 64), (64, 17), bias=True, scale=(1e-3, 1e-3)),
                     rng.standard_normal((17, 17)) * big)
    g = rng.standard_normal((3, 33, 17))  # [..., N, M] memory: a transposed (non-contiguous) upstream gradient
    yield Case("strided-grad", (cg.cast(g, dtype).swapaxes(-1, -2), *fwd.args), {}, ())
    yield _near_max_grad(dtype, rng)


def _near_max_grad(dtype: str, rng) -> Case:
    """da = grad b^T and db = a^T grad are matmuls with the forward's Range: a, b and grad of random signs with each
    gradient's accumulation_bound (and the forward's) up to 0.85 of the dtype's maximum (which for float16 is
    far inside float32's: its gradients then stay finite too)."""
    a, b, g = (rng.uniform(0.5, 1, s) * rng.choice([-1, 1], s) for s in ((17, 16), (16, 17), (17, 17)))
    worst = max(accumulation_bound(a, b).max(), accumulation_bound(g, b.T).max(), accumulation_bound(a.T, g).max())
    c = np.sqrt(0.85 * float(finfo(dtype).max) / worst)
    fwd = Case("near-max-grad", (cg.cast(a * c, dtype), cg.cast(b * c, dtype), cg.cast(rng.standard_normal(17), dtype)), {})
    return _grad_case("near-max-grad", dtype, fwd, g * c)


@matmul_backward.mutant("db-of-last-batch")
def _mutant_db_not_summed(grad, a, b, bias):
    """A shared b's gradient from the last batch entry only, not summed over the batch."""
    da, db, dbias = _backward_reference(grad, a, b, bias)
    if b.ndim == 2 and a.ndim > 2 and a.shape[0] > 1:
        last = _backward_reference(grad[-1], a[-1], b, bias)[1]
        return da, last, dbias
    return da, db * 0.5, dbias  # no batch to forget: half the sum instead


@matmul_backward.mutant("dbias-of-last-row")
def _mutant_dbias_not_summed(grad, a, b, bias):
    """dbias from the last output row only, not summed over rows."""
    da, db, dbias = _backward_reference(grad, a, b, bias)
    if dbias is None or grad.size == 0:
        return da, db, dbias
    return da, db, grad.reshape(-1, grad.shape[-1])[-1].copy()
