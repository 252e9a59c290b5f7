"""silu: x * sigmoid(x), elementwise; silu(-inf) = -0.0 and silu(+inf) = +inf.

Also holds the input sets shared by the elementwise activations (silu, gelu, swiglu's gate).
"""

from __future__ import annotations

import numpy as np

from opport import casegen as cg
from opport.spec import Case, Cost, ErrorCase, Tolerance, check_float, check_grad, grad_constraints, op

NAME = "silu"

# docs/numerics.md section 3.3, composite activations: pass if within `ulp` ULPs of the dtype or within atol.
ACTIVATION_TOLERANCE = {
    "float32": Tolerance(0.0, 1e-5, "ulp_or_abs", ulp=8, signed_zero=True,
                         reason="composite activation (docs/numerics.md 3.3): measured abs <= 4.9e-7 where ULPs blow up"),
    "float16": Tolerance(1e-3, 1e-5, "ulp_or_abs", ulp=2, signed_zero=True,
                         reason="composite activation (docs/numerics.md 3.3): 2 ULP or base"),
    "bfloat16": Tolerance(1.6e-2, 1e-5, "ulp_or_abs", ulp=2, signed_zero=True,
                          reason="composite activation (docs/numerics.md 3.3): 2 ULP or base"),
    "float64": Tolerance(1e-7, 1e-7, signed_zero=True, reason="base table; the reference defines signed zeros"),
}


@op(arrays=("x",), constraints={"silu.dtype": "x is float32, float16, bfloat16 or float64"})
def silu(x):
    """SiLU (swish): x * sigmoid(x), elementwise, any shape (0-d and empty included).

    The limits define the infinities: silu(-inf) = -0.0 (the naive -inf * 0 would be NaN; torch
    gives NaN) and silu(+inf) = +inf. NaN propagates.
    """
    check_float(NAME, "x", x)


def sigmoid64(x: np.ndarray) -> np.ndarray:
    """float64 sigmoid with exp only of -|x| (never overflows)."""
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0, e) / (1.0 + e)


def silu_grad64(x: np.ndarray) -> np.ndarray:
    """silu'(x) = sigmoid(x) (1 + x sigmoid(-x)) in float64, written q (num + x e q) with e = exp(-|x|),
    q = 1 / (1 + e), num = 1 for x >= 0 else e: exp never overflows and no 1 - sigmoid(x) cancels for x >> 0.
    The x e term is 0 where e is (|x| > 745, ±inf), so silu'(-inf) = 0 and silu'(+inf) = 1 (their limits,
    where the formula would give inf * 0). NaN propagates."""
    with np.errstate(invalid="ignore"):
        e = np.exp(-np.abs(x))
        q = 1.0 / (1.0 + e)
        xe = np.where(e == 0, 0.0, x * e)
        return q * (np.where(x >= 0, 1.0, e) + xe * q)


def silu64(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return np.where(np.isneginf(x), -0.0, x * sigmoid64(x))


# batch invariance (docs/conformance.md): the arrays whose leading axis is the batch
silu.batched("x")  # elementwise


@silu.reference
def _reference(x):
    return silu64(x)


silu.tolerance(**ACTIVATION_TOLERANCE)


# --------------------------------------------------------------------------- inputs shared by activations


def _bits(dtype: str, rng: np.random.Generator) -> np.ndarray:
    """Every bit pattern of a 16-bit dtype (docs/numerics.md 3.1 rule 4); 65,536 random patterns for wider ones."""
    np_dt = cg.np_dtype(dtype)
    if np_dt.itemsize == 2:
        return np.arange(1 << 16, dtype=np.uint16).view(np_dt)
    ints = np.uint32 if np_dt.itemsize == 4 else np.uint64
    return rng.integers(0, np.iinfo(ints).max, 1 << 16, dtype=ints, endpoint=True).view(np_dt)


def _thresholds(dtype: str) -> np.ndarray:
    """fp32 exp overflow (88.72) and underflow (-103.97) thresholds with their neighbours, both signs."""
    t = np.array([88.0, 88.72, 89.0, 103.97, 104.0, 87.33, 15.0, 16.0, 17.0, 5.5, 5.56], np.float32)
    t = np.concatenate([t, np.nextafter(t, np.float32(np.inf)), np.nextafter(t, np.float32(0))])
    return cg.cast(np.concatenate([t, -t]).astype(np.float64), dtype)


def _saturation(dtype: str, rng: np.random.Generator) -> np.ndarray:
    centres = np.repeat([10.0, 20.0, 90.0, -10.0, -20.0, -90.0], 64)
    return cg.cast(centres + rng.uniform(-0.5, 0.5, centres.size), dtype)


def _subnormals(dtype: str, rng: np.random.Generator) -> np.ndarray:
    fi = cg.finfo(dtype)
    lo, hi = np.log(float(fi.smallest_subnormal)), np.log(4 * float(fi.tiny))
    return cg.cast(np.exp(rng.uniform(lo, hi, 512)) * rng.choice([-1.0, 1.0], 512), dtype)


def activation_inputs(op_name: str, dtype: str):
    """(name, x, tags) for the fixed cases of an elementwise activation in `dtype` (docs/numerics.md section 4)."""

    def rand(name, shape, dist="normal", scale=1.0):
        return cg.array(shape, dtype, cg.rng_for(op_name, name, dtype), dist, scale)

    yield "llama-mlp", rand("llama-mlp", (4, 11008), scale=3.0), ("llm",)
    yield "llama8b-hidden", rand("llama8b-hidden", (16, 4096)), ("llm",)
    yield "scalar", rand("scalar", ()), ()
    yield "row-1", rand("row-1", (7, 1)), ()
    for n in (23, 127, 128, 129, 273):
        yield f"len-{n}", rand(f"len-{n}", (3, n), scale=4.0), ()
    yield "odd-3d", rand("odd-3d", (2, 3, 23), scale=4.0), ()
    yield "empty", rand("empty", (0,)), ()
    yield "empty-rows", rand("empty-rows", (0, 64)), ()
    yield "empty-cols", rand("empty-cols", (3, 0)), ()
    yield "edge-values", cg.edge_values(dtype), ("edge",)
    yield "exp-thresholds", _thresholds(dtype), ("edge",)
    yield "saturation", _saturation(dtype, cg.rng_for(op_name, "saturation", dtype)), ("edge",)
    yield "sweep", cg.cast(np.linspace(-20.0, 20.0, 16385), dtype), ("edge",)
    yield "subnormals", _subnormals(dtype, cg.rng_for(op_name, "subnormals", dtype)), ("edge",)
    yield "specials", rand("specials", (6, 37), "specials"), ("edge",)
    nan3 = rand("nan-every-3rd", (5, 33), scale=4.0)
    nan3.reshape(-1)[::3] = np.nan
    yield "nan-every-3rd", nan3, ("edge",)
    yield "large", rand("large", (4, 256), scale=13437.7 if dtype == "float16" else 4988429.2), ("edge",)
    yield "tiny", rand("tiny", (4, 256), scale=1e-4), ("edge",)
    yield "heavy-tails", rand("heavy-tails", (8, 300), "heavy", 3.0), ()
    yield "loguniform", rand("loguniform", (8, 300), "loguniform"), ()
    yield "all-bits", _bits(dtype, cg.rng_for(op_name, "all-bits", dtype)), ("edge", "exhaustive")


def activation_strategy(dtype: str, n_arrays: int = 1):
    """Hypothesis: (tag, shape, [arrays]) with shapes of 0-3 dims (empty included) and mixed value distributions."""
    from hypothesis import strategies as st

    @st.composite
    def draw_arrays(draw):
        kind = draw(st.integers(0, 19))  # 0: a 0-d array, 1: an empty one, else 1-3 dims
        lead = tuple(draw(st.lists(st.integers(1, 8), max_size=2))) if kind else ()
        shape = lead + ((0,) if kind == 1 else (draw(cg.dims(1, 600)),)) if kind else ()
        seed = draw(cg.seeds())
        rng = np.random.default_rng(seed)
        arrays = []
        for _ in range(n_arrays):
            dist, scale = draw(cg.dists()), draw(st.one_of(cg.scales(), st.sampled_from([10.0, 100.0])))
            arrays.append(cg.array(shape, dtype, rng, dist, scale))
        return f"hyp-{seed}", arrays

    return draw_arrays()


def elementwise_cost(n_in: int, flops_per_element: int):
    """Cost of an elementwise op with `n_in` same-shape inputs and one output of that size."""

    def cost(x, *_):
        item = np.dtype(cg.np_dtype(x.dtype)).itemsize
        return Cost(bytes=(n_in + 1) * x.size * item, flops=flops_per_element * x.size)

    return cost


# --------------------------------------------------------------------------- silu's declaration


@silu.cases
def _cases(dtype):
    for name, x, tags in activation_inputs(NAME, dtype):
        yield Case(name, (x,), {}, tags)


@silu.strategy
def _strategy(dtype):
    return activation_strategy(dtype).map(lambda na: Case(na[0], (na[1][0],), {}, ("hypothesis",)))


@silu.error_cases
def _error_cases():
    from opport.errors import DTypeError

    yield ErrorCase("silu.dtype", DTypeError, (np.ones((2, 8), np.int32),))
    yield ErrorCase("silu.dtype", DTypeError, (np.ones((2, 8), bool),))


# exp, add, divide, multiply (+ abs and the select): about 5 FLOPs per element
silu.cost(elementwise_cost(1, 5))


# --------------------------------------------------------------------------- backward, shared by the activations

# dx = grad * f'(x): one rounding more than the forward's f(x), and the same cancellation where f' crosses 0
# (silu' at x = -1.2785, gelu' at -0.7518): the composite-activation rule, without the signed-zero check: the
# sign of a zero gradient is that of grad times a derivative whose sign near its root is rounding noise.
ACTIVATION_GRAD_TOLERANCE = {
    d: Tolerance(t.rtol, t.atol, t.metric, t.ulp, "dx = grad * f'(x): the composite-activation rule of the forward "
                 "(docs/numerics.md 3.3), signs of zero gradients not compared") for d, t in ACTIVATION_TOLERANCE.items()}
LOSS_SCALE = 2.0**10  # as fp16 training scales its loss: every gradient exactly this times a unit-scale one
LOSS_SCALED = ("grad is 2^10 x a unit-scale gradient and dx = grad * f'(x) is exactly 2^10 x the unit-scale result "
               "(power-of-two scaling is exact): the absolute part of the tolerance, set for unit-scale outputs, "
               "scales with it; float32 f' near its root cancels to about 1e-8 absolute")


def grad_cases(bwd, dtype: str, sweep: Case, edges: Case, prefix: str = ""):
    """Backward-only cases of an elementwise activation: edge upstream gradients (signed zeros, specials,
    loss-scaled) on the forward's sweep case, and every edge value of x against every edge value of grad
    (from the forward's edge-values case; its other arrays repeated along)."""
    rng = cg.rng_for(bwd.name, prefix, "grad-edges", dtype)
    shape = sweep.args[0].shape
    grads = {
        "grad-zeros": cg.cast(np.where(rng.random(shape) < 0.5, 0.0, -0.0), dtype),
        "grad-specials": _sprinkled(cg.array(shape, dtype, rng), dtype, rng),
        "grad-loss-scaled": cg.cast(cg.array(shape, dtype, rng).astype(np.float64) * LOSS_SCALE, dtype),
    }
    for name, g in grads.items():
        yield bwd.from_forward(Case(prefix + name, sweep.args, sweep.kwargs, ("edge",)), dtype, g)
    e = cg.edge_values(dtype)
    args = tuple(np.repeat(a, e.size) if isinstance(a, np.ndarray) else a for a in edges.args)
    args = (np.repeat(e, e.size),) + args[1:]
    yield bwd.from_forward(Case(prefix + "grad-edge-grid", args, edges.kwargs, ("edge",)), dtype, np.tile(e, e.size))


def _sprinkled(g: np.ndarray, dtype: str, rng) -> np.ndarray:
    """Unit-scale `g` with an eighth of its elements replaced by ±0, ±inf, NaN, tiny and subnormal values.
    Large finite grads meet the edge values of x in "edge-grid" instead: f' near its root errs by up to 2.4e-7
    absolute in float32 (cancellation), which the composite rule's atol bounds for unit-scale grads only."""
    fi = cg.finfo(dtype)
    specials = cg.cast([0.0, -0.0, np.inf, -np.inf, np.nan, float(fi.tiny), -float(fi.smallest_subnormal)], dtype)
    idx = rng.choice(g.size, size=max(1, g.size // 8), replace=g.size < 8)
    g = g.copy()
    g.reshape(-1)[idx] = rng.choice(specials, size=idx.size)
    return g


def loss_scaled_tolerance(bwd, case: str) -> None:
    """The reasoned tolerance of a "grad-loss-scaled" case: the activation-gradient rule with atol x LOSS_SCALE."""
    bwd.case_tolerance(case, **{d: Tolerance(t.rtol, t.atol * LOSS_SCALE, t.metric, t.ulp, LOSS_SCALED)
                                for d, t in ACTIVATION_GRAD_TOLERANCE.items()})


@silu.backward(wrt=("x",), constraints=grad_constraints(NAME))
def silu_backward(grad, x):
    """Gradient of silu for x.

    Saves x (the input). dx = grad * silu'(x), silu'(x) = sigmoid(x) (1 + x sigmoid(-x)), with its limits at
    the infinities: silu'(-inf) = 0, silu'(+inf) = 1. NaN in x or grad gives NaN; an infinite grad gives
    inf * silu'(x), NaN where that is 0 (x = -inf, or x < -745 where silu' underflows float64).
    """
    silu.validate(x)
    check_grad(f"{NAME}_backward", grad, x.shape, x.dtype)


@silu_backward.reference
def _backward_reference(grad, x):
    with np.errstate(invalid="ignore", over="ignore"):
        return (grad * silu_grad64(x),)


silu_backward.tolerance(**ACTIVATION_GRAD_TOLERANCE)
loss_scaled_tolerance(silu_backward, "grad-loss-scaled")


@silu_backward.cases
def _backward_cases(dtype):
    by_name = {c.name: c for c in _cases(dtype)}
    yield from grad_cases(silu_backward, dtype, by_name["sweep"], by_name["edge-values"])


@silu_backward.error_cases
def _backward_error_cases():
    from opport.errors import DTypeError, ShapeError

    x = np.ones((2, 8), np.float32)
    yield ErrorCase("silu_backward.grad_shape", ShapeError, (np.ones((2, 7), np.float32), x))
    yield ErrorCase("silu_backward.grad_shape", ShapeError, (np.ones((1, 8), np.float32), x))  # no broadcasting
    yield ErrorCase("silu_backward.grad_dtype", DTypeError, (np.ones((2, 8), np.float64), x))


def elementwise_grad_cost(n_saved: int, n_grads: int, flops_per_element: int):
    """Cost of an elementwise backward: grad and `n_saved` same-shape inputs read, `n_grads` gradients written."""

    def cost(grad, *_):
        item = np.dtype(cg.np_dtype(grad.dtype)).itemsize
        return Cost(bytes=(1 + n_saved + n_grads) * grad.size * item, flops=flops_per_element * grad.size)

    return cost


# exp, add, divide, the select, x e q, + num, times q, times grad: about 9 FLOPs per element
silu_backward.cost(elementwise_grad_cost(1, 1, 9))


@silu_backward.mutant("dropped-x-term")
def _mutant_dropped_x_term(grad, x):
    """dx = grad * sigmoid(x): the x sigmoid'(x) term of the product rule dropped."""
    with np.errstate(invalid="ignore", over="ignore"):
        return (grad * sigmoid64(x),)
