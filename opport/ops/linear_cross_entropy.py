"""linear_cross_entropy: cross_entropy(hidden @ weight.T + bias, target), the logits [N, V] never held whole."""

from __future__ import annotations

import math

import numpy as np

from opport import casegen as cg
from opport.dtypes import INTS, finfo
from opport.errors import ArgumentError, DTypeError, ShapeError
from opport.ops import cross_entropy as ce
from opport.spec import (
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
    check_same_dtype,
    grad_constraints,
    op,
)

NAME = "linear_cross_entropy"
REDUCTIONS = ce.REDUCTIONS


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
        f"{NAME}.reduction": f"reduction is one of {REDUCTIONS}",
        f"{NAME}.label_smoothing": "label_smoothing is a number in [0, 1]",
        f"{NAME}.softcap": "softcap is None or a finite number > 0",
        f"{NAME}.target_range": "every target is a class in [0, V) or ignore_index (read on the host before any "
                                "kernel: NumPy and CPU arrays always, device arrays under OPPORT_CHECK_VALUES=1)",
    },
    out_dtype="float32",
)
def linear_cross_entropy(hidden, weight, target, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                         softcap: float | None = None):
    """Cross-entropy of the logits hidden @ weight.T (+ bias), computed without ever holding the N x V logits.

    The logits z = hidden @ weight.T + bias ([N, V], float32 accumulation) are optionally softcapped,
    z = softcap · tanh(z / softcap) (Gemma 2), then judged exactly as `cross_entropy(z, target, ignore_index,
    reduction, label_smoothing)`: ignored rows 0 and out of the mean's count, every row ignored (or N = 0)
    gives a NaN "mean"; a target outside [0, V) that is not ignore_index is `linear_cross_entropy.target_range`
    before any kernel for a host target (a NaN row for a device target, unless OPPORT_CHECK_VALUES=1: see
    cross_entropy); logits near the dtype's maximum as docs/numerics.md 3.5.1; float32 result.
    Kernels walk the logits in tiles of tokens x vocabulary with an online log-sum-exp, so the extra memory
    is O(tile), not O(N V) (at N 8192, V 128256 the logits alone would be 2 GiB in bfloat16). Forward, every
    backend: the loss and lse [N] beside tiles (cpu: ROW_BLOCK x VOCAB_CHUNK = 256 x 4096 float32, 4 MiB;
    cuda: registers; neuron: SBUF/PSUM). Backward: cpu, those tiles plus a VOCAB_CHUNK x H float32 dweight
    accumulator; cuda, a float32 dlogits buffer of one vocabulary chunk (at most 2^25 elements, 128 MiB);
    neuron, SBUF only; and for 16-bit inputs a float32 dhidden accumulator [N, H] (cpu, cuda).
    """
    check_head(NAME, hidden, weight, target, bias, ignore_index, softcap)
    check_choice(NAME, "reduction", reduction, REDUCTIONS)
    check(_number(label_smoothing) and 0 <= label_smoothing <= 1, ArgumentError, NAME, "label_smoothing",
          f"{NAME}.label_smoothing", "a number in [0, 1]", repr(label_smoothing))


def check_head(name: str, hidden, weight, target, bias, ignore_index, softcap) -> None:
    """The checks an LM head's fused op shares (linear_cross_entropy, linear_logprobs), under `name`'s constraint
    ids: dtypes, shapes [N, H] / [V, H] / [V] / [N], the ignore_index and the softcap."""
    check_float(name, "hidden", hidden)
    check_same_dtype(name, "hidden", hidden, weight=weight, bias=bias)
    check(hidden.ndim == 2, ShapeError, name, "hidden", f"{name}.hidden_shape", "2-d [N, H]", hidden.shape)
    h = hidden.shape[1]
    check(weight.ndim == 2 and weight.shape[0] >= 1 and weight.shape[1] == h, ShapeError, name, "weight",
          f"{name}.weight_shape", f"[V >= 1, {h}] = [V, H]", weight.shape)
    if bias is not None:
        check(bias.shape == weight.shape[:1], ShapeError, name, "bias", f"{name}.bias_shape",
              f"({weight.shape[0]},) = (V,)", bias.shape)
    check_domain(name, "target", target, INDEX)
    check(target.shape == hidden.shape[:1], ShapeError, name, "target", f"{name}.target_shape",
          f"({hidden.shape[0]},) = (N,)", target.shape)
    ok = isinstance(ignore_index, (int, np.integer)) and not isinstance(ignore_index, (bool, np.bool_)) \
        and -(2**63) <= ignore_index < 2**63
    check(ok, ArgumentError, name, "ignore_index", f"{name}.ignore_index", "an int in [-2^63, 2^63)", repr(ignore_index))
    check(softcap is None or (_number(softcap) and softcap > 0), ArgumentError, name, "softcap", f"{name}.softcap",
          "None or a finite number > 0", repr(softcap))


def _number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_)) \
        and math.isfinite(x)


def _logits(hidden, weight, bias, softcap) -> tuple:
    """(z, dz/dlogits or None): the (softcapped) logits in float64 and the softcap's derivative 1 - tanh²."""
    with np.errstate(invalid="ignore", over="ignore"):
        z = hidden @ weight.T
        if bias is not None:
            z = z + bias
        if softcap is None:
            return z, None
        t = np.tanh(z / softcap)
        return softcap * t, 1 - t * t


# batch invariance (docs/conformance.md): the arrays whose leading axis is the batch
linear_cross_entropy.batched("hidden", "target", when=lambda *bound: bound[5] == "none")  # tokens (per-token losses)


@linear_cross_entropy.reference
def _reference(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap):
    z, _ = _logits(hidden, weight, bias, softcap)
    return ce._reference(z, target, ignore_index, reduction, label_smoothing)


# docs/numerics.md 3.3: the loss is judged relative to itself, as cross_entropy's; atol covers the logits' H-long
# float32 accumulation (a few eps32·sqrt(H)·|hidden||weight| per logit, ~1e-6 here), which a loss near 0 carries.
linear_cross_entropy.tolerance(
    float64=Tolerance(1e-7, 1e-9, reason="docs/numerics.md 3.2 (float64 computes in float64)"),
    float32=Tolerance(1e-5, 1e-5, reason="docs/numerics.md 3.3: loss relative; atol for the H-long dot per logit"),
    float16=Tolerance(1e-4, 1e-5, reason="docs/numerics.md 3.3: loss in fp32 from exact 16-bit products, fp32 sums"),
    bfloat16=Tolerance(1e-4, 1e-5, reason="docs/numerics.md 3.3: loss in fp32 from exact 16-bit products, fp32 sums"),
)


def _case(name, dtype, n, h, v, bias=False, ignore=(), ignore_index=-100, reduction="mean", smoothing=0.0,
          softcap=None, scale=1.0, targets=None, tags=()):
    """hidden ~ N(0, 1), weight ~ N(0, 1/H) · scale: logits ~ N(0, scale²) whatever H."""
    rng = cg.rng_for(NAME, name, dtype)
    x = cg.array((n, h), dtype, rng)
    w = cg.array((v, h), dtype, rng, scale=scale / math.sqrt(max(h, 1)))
    b = cg.array((v,), dtype, rng, scale=scale) if bias else None
    t = rng.integers(0, v, n) if targets is None else np.asarray(targets, np.int64)
    t[list(ignore)] = ignore_index
    kwargs = {"ignore_index": ignore_index, "reduction": reduction, "label_smoothing": smoothing, "softcap": softcap}
    return Case(name, (x, w, t, b), kwargs, tags)


@linear_cross_entropy.cases
def _cases(dtype):
    yield _case("mean-ignore", dtype, 16, 32, 300, ignore=(3,), tags=("llm",))
    yield _case("bias-sum", dtype, 13, 40, 257, bias=True, reduction="sum")
    yield _case("none-odd-vocab", dtype, 9, 24, 1000, reduction="none", scale=3.0)  # V % any power-of-2 tile != 0
    yield _case("targets-0-and-last", dtype, 6, 16, 131, targets=[0, 130, 0, 130, 5, 130], reduction="none")
    yield _case("tile-boundaries", dtype, 33, 65, 129, bias=True, ignore=(32,))  # one past 32 / 64 / 128
    yield _case("v-1", dtype, 6, 8, 1, ignore=(0,))
    yield _case("h-1", dtype, 10, 1, 50, reduction="sum")
    yield _case("ignore-positive", dtype, 8, 16, 100, ignore=(0, 5), ignore_index=7)
    yield _case("smoothing", dtype, 12, 32, 200, smoothing=0.1, ignore=(4,))
    yield _case("smoothing-1-bias", dtype, 5, 16, 77, bias=True, smoothing=1.0, reduction="none")
    yield _case("softcap", dtype, 12, 32, 300, softcap=30.0, scale=40.0, reduction="none")  # tanh saturating
    yield _case("softcap-bias-smoothing", dtype, 10, 24, 150, bias=True, softcap=5.0, scale=4.0, smoothing=0.2)
    yield _case("peaked", dtype, 6, 64, 200, scale=8.0, reduction="none", tags=("edge",))  # losses near 0
    yield _case("all-ignored-mean", dtype, 4, 16, 50, ignore=range(4), tags=("edge",))
    yield _case("all-ignored-sum", dtype, 4, 16, 50, ignore=range(4), reduction="sum", tags=("edge",))
    yield _case("empty-batch-mean", dtype, 0, 16, 50, tags=("edge",))
    yield _case("empty-batch-none", dtype, 0, 16, 50, reduction="none", tags=("edge",))
    yield from _near_max(dtype)


def _near_max(dtype: str):
    """Logits z = hidden @ weight.T near the dtype's maximum, inside docs/numerics.md 3.5.1's domain: to about half
    the maximum without smoothing, and while V max|z| fits the accumulation dtype with it. H = 1 and z = (±2^a)
    (k 2^b), |k| <= 255: every product is exact in every dtype, so the kernels' logits are the reference's (the
    H-long dot near the maximum is matmul's contract, not this op's)."""
    fmax = float(finfo(dtype).max)
    acc_max = float(np.finfo(np.float64 if dtype == "float64" else np.float32).max)
    rng = cg.rng_for(NAME, "near-max", dtype)
    n, v = 6, 40
    for name, top, smoothing in (("near-max-logits", 0.99 * fmax, 0.0),
                                 ("near-max-smoothing", min(0.99 * fmax, 0.5 * acc_max / v), 0.1)):
        e = int(np.floor(np.log2(top))) - 8  # |z| <= 255 2^e < top
        a, b = e // 2, e - e // 2
        h = np.ldexp(rng.choice([-1.0, 1.0], (n, 1)), a)
        w = np.ldexp(rng.integers(-255, 256, (v, 1)).astype(np.float64), b)
        kwargs = {"ignore_index": -100, "reduction": "none", "label_smoothing": smoothing, "softcap": None}
        yield Case(name, (cg.cast(h, dtype), cg.cast(w, dtype), rng.integers(0, v, n), None), kwargs, ("edge",))


@linear_cross_entropy.strategy
def _strategy(dtype):
    from hypothesis import strategies as st

    @st.composite
    def case(draw):
        # V >= 2 and |logits| of at most ~40: float32's error in dlogits is eps32·|z| (the logits' rounding), which
        # the norm-wise tolerance covers against gradients of ~|weight|, not where they vanish (V = 1: exactly 0)
        n, h = draw(st.integers(0, 40)), draw(st.integers(1, 70))
        v = draw(st.one_of(st.integers(2, 600), st.sampled_from([2, 17, 63, 64, 65, 127, 128, 129, 255, 256, 257])))
        ignore_index = draw(st.sampled_from([-100, -1, 0, 3]))
        kwargs = {"ignore_index": ignore_index, "reduction": draw(st.sampled_from(REDUCTIONS)),
                  "label_smoothing": draw(st.sampled_from([0.0, 0.0, 0.1, 0.5])),
                  "softcap": draw(st.sampled_from([None, None, 5.0, 30.0]))}
        scale, seed, bias = draw(st.sampled_from([0.5, 1.0, 4.0, 10.0])), draw(cg.seeds()), draw(st.booleans())
        rng = np.random.default_rng(seed)
        x = cg.array((n, h), dtype, rng)
        w = cg.array((v, h), dtype, rng, scale=scale / math.sqrt(h))
        b = cg.array((v,), dtype, rng, scale=scale) if bias else None
        t = rng.integers(0, v, n)
        t[rng.random(n) < draw(st.sampled_from([0.0, 0.2, 1.0]))] = ignore_index
        t = t.astype(draw(st.sampled_from(["int64", "int32"])))
        return Case(f"hyp-{seed}", (x, w, t, b), kwargs, ("hypothesis",))

    return case()


@linear_cross_entropy.error_cases
def _error_cases():
    x, w, t = np.zeros((4, 8), np.float32), np.zeros((10, 8), np.float32), np.zeros(4, np.int64)
    yield ErrorCase(f"{NAME}.dtype", DTypeError, (x.astype(np.int32), w.astype(np.int32), t))
    yield ErrorCase(f"{NAME}.dtype_mismatch", DTypeError, (x, w.astype(np.float16), t))
    yield ErrorCase(f"{NAME}.dtype_mismatch", DTypeError, (x, w, t, np.zeros(10, np.float64)))
    yield ErrorCase(f"{NAME}.hidden_shape", ShapeError, (np.zeros(8, np.float32), w, np.zeros((), np.int64)))
    yield ErrorCase(f"{NAME}.weight_shape", ShapeError, (x, np.zeros((10, 7), np.float32), t))
    yield ErrorCase(f"{NAME}.weight_shape", ShapeError, (x, np.zeros((0, 8), np.float32), t))
    yield ErrorCase(f"{NAME}.weight_shape", ShapeError, (x, np.zeros(8, np.float32), t))
    yield ErrorCase(f"{NAME}.bias_shape", ShapeError, (x, w, t, np.zeros(9, np.float32)))
    yield ErrorCase(f"{NAME}.target_dtype", DTypeError, (x, w, np.zeros(4, np.float32)))
    yield ErrorCase(f"{NAME}.target_dtype", DTypeError, (x, w, np.zeros(4, bool)))
    yield ErrorCase(f"{NAME}.target_shape", ShapeError, (x, w, np.zeros(5, np.int64)))
    yield ErrorCase(f"{NAME}.ignore_index", ArgumentError, (x, w, t), {"ignore_index": 1.5})
    yield ErrorCase(f"{NAME}.ignore_index", ArgumentError, (x, w, t), {"ignore_index": 2**70})
    yield ErrorCase(f"{NAME}.reduction", ArgumentError, (x, w, t), {"reduction": "avg"})
    yield ErrorCase(f"{NAME}.label_smoothing", ArgumentError, (x, w, t), {"label_smoothing": -0.1})
    yield ErrorCase(f"{NAME}.softcap", ArgumentError, (x, w, t), {"softcap": 0.0})
    yield ErrorCase(f"{NAME}.softcap", ArgumentError, (x, w, t), {"softcap": float("inf")})
    yield ErrorCase(f"{NAME}.softcap", ArgumentError, (x, w, t), {"softcap": True})
    for bad in ([0, 10, 1, 2], [0, -1, 1, 2], [-100, 3, 2**40, 1]):  # V, a negative label, far past V (not ignored)
        yield ErrorCase(f"{NAME}.target_range", ArgumentError, (x, w, np.array(bad)))
    yield ErrorCase(f"{NAME}.target_range", ArgumentError, (x, w, np.array([0, 1, 10, 2], np.int32)),
                    {"ignore_index": 7, "reduction": "none"})


@linear_cross_entropy.shape
def _shape(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap):
    return (hidden.shape[0],) if reduction == "none" else ()


def _item(dtype) -> int:
    """Bytes per element of a Meta's dtype name (or an array's dtype)."""
    return np.dtype(cg.np_dtype(getattr(dtype, "name", dtype))).itemsize


def _bytes_in(hidden, weight, target, bias) -> int:
    item, titem = _item(hidden.dtype), _item(target.dtype)
    return (hidden.size + weight.size + (bias.size if bias is not None else 0)) * item + hidden.shape[0] * titem


@linear_cross_entropy.cost
def _cost(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap):
    """Inputs read once, the loss written: no N x V logits move through memory. FLOPs: the logits' GEMM."""
    out = hidden.shape[0] if reduction == "none" else 1
    return Cost(bytes=_bytes_in(hidden, weight, target, bias) + 4 * out,
                flops=2 * hidden.shape[0] * weight.shape[0] * hidden.shape[1])


# --------------------------------------------------------------------------- backward

BWD = f"{NAME}_backward"


@linear_cross_entropy.saves(("lse",), shapes=lambda hidden, *_: [(hidden.shape[0],)])
def _saved(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap):
    """Per-row logsumexp of the (softcapped) logits [N], float32 (float64 for float64 inputs)."""
    z, _ = _logits(hidden, weight, bias, softcap)
    return ce._saved(z, target, ignore_index, reduction, label_smoothing)


@linear_cross_entropy.backward(
    wrt=("hidden", "weight", "bias"),
    reduces=("hidden", "weight", "bias"),
    constants={"target": "integer class indices: a discrete label, not a differentiable quantity"},
    constraints={
        **grad_constraints(NAME),
        f"{BWD}.saved": "lse is [N] in the accumulation dtype, float32 (float64 for float64 inputs): the training "
                        "forward's per-row logsumexp",
        f"{BWD}.target_range": "every target is a class in [0, V) or ignore_index (as linear_cross_entropy.target_range)",
    },
)
def linear_cross_entropy_backward(grad, hidden, weight, target, lse, bias=None, ignore_index=-100, reduction="mean",
                                  label_smoothing=0.0, softcap: float | None = None):
    """Gradients of linear_cross_entropy for hidden, weight and bias; target is a constant.

    Saves hidden, weight, target, bias and the per-row logsumexp lse [N]; the logits are recomputed tile by
    tile, never stored. Per tile: dz = c (exp(z - lse) - eps/V - (1 - eps) onehot(target)) (cross_entropy's
    gradient, c the row's share of grad), dlogits = dz · (1 - tanh²(logits / softcap)) with a softcap, then
    dhidden += dlogits @ weight[tile], dweight[tile] += dlogits^T @ hidden, dbias[tile] += column sums.
    Ignored rows contribute exactly 0; a target outside [0, V) is `linear_cross_entropy_backward.target_range`
    for a host target; on a device target (not read back) it makes its row NaN, and so every dweight and dbias
    entry (as torch's matmul backward would). All three sum over V or over N: judged norm-wise.
    """
    linear_cross_entropy.validate(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap)
    check_grad(BWD, grad, (hidden.shape[0],) if reduction == "none" else (), "float32")
    check(lse is not None, ArgumentError, BWD, "lse", f"{BWD}.saved", "the training forward's lse", None)
    acc = "float64" if hidden.dtype == "float64" else "float32"
    check(lse.dtype == acc, DTypeError, BWD, "lse", f"{BWD}.saved", acc, lse.dtype)
    check(tuple(lse.shape) == (hidden.shape[0],), ShapeError, BWD, "lse", f"{BWD}.saved",
          f"({hidden.shape[0]},) = (N,)", tuple(lse.shape))


@linear_cross_entropy_backward.reference
def _backward_reference(grad, hidden, weight, target, lse, bias, ignore_index, reduction, label_smoothing, softcap):
    z, dcap = _logits(hidden, weight, bias, softcap)
    (dz,) = ce._backward_reference(grad, z, target, lse, ignore_index, reduction, label_smoothing)
    with np.errstate(invalid="ignore", over="ignore"):
        d = dz if dcap is None else dz * dcap
        return d @ weight, d.T @ hidden, None if bias is None else d.sum(axis=0)


# docs/numerics.md 3.3: every gradient sums over V (dhidden) or N (dweight, dbias) with float32 accumulation:
# matmul's norm-wise table, the 16-bit rows one rounding of the result (plus the 16-bit dlogits a GPU's dot takes)
linear_cross_entropy_backward.tolerance(
    float64=Tolerance(1e-7, 1e-7, "normwise", reason="docs/numerics.md 3.3: K-accumulating, norm-wise"),
    float32=Tolerance(1e-5, 1e-5, "normwise", reason="docs/numerics.md 3.3: K-accumulating, norm-wise"),
    float16=Tolerance(2e-3, 1e-5, "normwise", reason="docs/numerics.md 3.3: fp32 accumulation, norm-wise"),
    bfloat16=Tolerance(1.6e-2, 1e-5, "normwise", reason="docs/numerics.md 3.3: fp32 accumulation, norm-wise"),
)


@linear_cross_entropy_backward.error_cases
def _backward_error_cases():
    x, w, t, lse = np.zeros((4, 8), np.float32), np.zeros((10, 8), np.float32), np.zeros(4, np.int64), np.zeros(4, np.float32)
    g0 = np.ones((), np.float32)
    yield ErrorCase(f"{BWD}.grad_shape", ShapeError, (np.ones(4, np.float32), x, w, t, lse))
    yield ErrorCase(f"{BWD}.grad_shape", ShapeError, (g0, x, w, t, lse), {"reduction": "none"})
    yield ErrorCase(f"{BWD}.grad_dtype", DTypeError, (np.ones((), np.float16), x, w, t, lse))
    yield ErrorCase(f"{BWD}.saved", ShapeError, (g0, x, w, t, np.zeros(5, np.float32)))
    yield ErrorCase(f"{BWD}.saved", DTypeError, (g0, x, w, t, lse.astype(np.float64)))
    yield ErrorCase(f"{BWD}.target_range", ArgumentError, (g0, x, w, np.array([0, 10, 1, 2]), lse))


@linear_cross_entropy_backward.cost
def _backward_cost(grad, hidden, weight, target, lse, bias, ignore_index, reduction, label_smoothing, softcap):
    """Inputs and lse read, the three gradients written: no logits move. FLOPs: dhidden's and dweight's GEMMs."""
    item = _item(hidden.dtype)
    written = (hidden.size + weight.size + (bias.size if bias is not None else 0)) * item
    n = hidden.shape[0]
    return Cost(bytes=_bytes_in(hidden, weight, target, bias) + written + 4 * (n + grad.size),
                flops=4 * n * weight.shape[0] * hidden.shape[1])


@linear_cross_entropy_backward.cases
def _backward_cases(dtype):
    """Upstream gradients the derived cases (random normal grads) do not cover."""
    fwd = _case("grad-edge", dtype, 7, 16, 90, bias=True, ignore=(2,), reduction="none", softcap=10.0, scale=5.0)
    case = linear_cross_entropy_backward.from_forward(fwd, dtype, grad=np.zeros(7, np.float32))
    yield Case("zero-grad", case.args, case.kwargs, ("edge",))
    mean = _case("grad-mean", dtype, 7, 16, 90, ignore=(0, 6), smoothing=0.1)
    case = linear_cross_entropy_backward.from_forward(mean, dtype, grad=np.ones((), np.float32))
    yield Case("unit-grad-mean", case.args, case.kwargs, ("edge",))


@linear_cross_entropy_backward.mutant("softcap-derivative-dropped")
def _mutant_softcap(grad, hidden, weight, target, lse, bias, ignore_index, reduction, label_smoothing, softcap):
    """The softcap's 1 - tanh² left out of the chain rule (without a softcap: dweight halved)."""
    if softcap is None:
        dh, dw, db = _backward_reference(grad, hidden, weight, target, lse, bias, ignore_index, reduction,
                                         label_smoothing, softcap)
        return dh, dw * 0.5, db
    z, _ = _logits(hidden, weight, bias, softcap)
    (d,) = ce._backward_reference(grad, z, target, lse, ignore_index, reduction, label_smoothing)
    with np.errstate(invalid="ignore", over="ignore"):
        return d @ weight, d.T @ hidden, None if bias is None else d.sum(axis=0)


@linear_cross_entropy_backward.mutant("dweight-of-last-token")
def _mutant_dweight_last(grad, hidden, weight, target, lse, bias, ignore_index, reduction, label_smoothing, softcap):
    """dweight from the last token tile only (an accumulator reset per tile), not summed over N."""
    n = hidden.shape[0]
    if n < 2:
        dh, dw, db = _backward_reference(grad, hidden, weight, target, lse, bias, ignore_index, reduction,
                                         label_smoothing, softcap)
        return dh, dw * 0.5, db
    keep = np.zeros(n, bool)
    keep[n // 2:] = True
    t = np.where(keep, target, ignore_index)
    g = grad if np.ndim(grad) == 0 else np.where(keep, grad, 0)
    dh, _, _ = _backward_reference(grad, hidden, weight, target, lse, bias, ignore_index, reduction, label_smoothing,
                                   softcap)
    _, dw, db = _backward_reference(g, hidden, weight, t, lse, bias, ignore_index, reduction if reduction != "mean"
                                    else "sum", label_smoothing, softcap)
    return dh, dw, db


# --------------------------------------------------------------------------- forward fused with the backward


@linear_cross_entropy.value_and_grad()
def linear_cross_entropy_value_and_grad(hidden, weight, target, bias=None, ignore_index=-100, reduction="mean",
                                        label_smoothing=0.0, softcap: float | None = None):
    """The loss and dhidden, dweight, dbias for a unit upstream gradient, from logits computed once.

    What training runs where the backend has a kernel that takes the call (as Liger-Kernel's fused linear
    cross-entropy): each block of rows forms its logits against the whole vocabulary, reduces them to the rows'
    losses, turns the same logits (still in memory) into dlogits and runs the two gradient GEMMs, so the logits'
    GEMM runs once instead of twice (`linear_cross_entropy_forward` + the backward, which recomputes them). The
    backward is then only `upstream * gradients`, skipped where the upstream is exactly 1. A scalar upstream only:
    a per-row one ("none") would have to enter dweight's sum over rows, so kernels decline reduction "none" (the
    training forward and backward run). Validation, cases and error cases are the forward's.
    """
    linear_cross_entropy.validate(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap)


@linear_cross_entropy_value_and_grad.cost
def _value_and_grad_cost(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap):
    """Inputs read once, the loss and the three gradients written; FLOPs: the logits' GEMM and the two gradients'."""
    item = _item(hidden.dtype)
    written = (hidden.size + weight.size + (bias.size if bias is not None else 0)) * item
    return Cost(bytes=_bytes_in(hidden, weight, target, bias) + written + 4,
                flops=6 * hidden.shape[0] * weight.shape[0] * hidden.shape[1])


@linear_cross_entropy_value_and_grad.mutant("mean-not-divided")
def _vag_mutant_mean_not_divided(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap):
    """The loss right, the gradients of "mean" not divided by the count of kept rows (of "sum": scaled by 1.5)."""
    loss, dh, dw, db = linear_cross_entropy_value_and_grad._reference(hidden, weight, target, bias, ignore_index,
                                                                      reduction, label_smoothing, softcap)
    k = max(int(np.count_nonzero(target != ignore_index)), 2) if reduction == "mean" else 1.5
    return loss, dh * k, dw * k, None if db is None else db * k


# --------------------------------------------------------------------------- class labels, checked on their values


def _check_target(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap):
    ce.check_targets(NAME, target, weight.shape[0], ignore_index)


def _check_backward_target(grad, hidden, weight, target, lse, bias, ignore_index, reduction, label_smoothing, softcap):
    ce.check_targets(BWD, target, weight.shape[0], ignore_index)


# host targets always, device targets under OPPORT_CHECK_VALUES=1 (see cross_entropy.check_targets); the training
# forward takes the forward's check
linear_cross_entropy.check_values(("target",))(_check_target)
linear_cross_entropy_backward.check_values(("target",))(_check_backward_target)
_check_target.on_device = _check_backward_target.on_device = False  # opport/dispatch/core.py `value_check`
