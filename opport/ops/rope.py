"""rope: rotary position embedding of x [B, H, S, D] by cos/sin tables [S, D/2], [1, S, D/2] or [B, S, D/2]."""

from __future__ import annotations

import numpy as np

from opport import casegen as cg
from opport.arraymath import pair_views
from opport.dtypes import FLOATS
from opport.errors import ArgumentError, DTypeError, ShapeError
from opport.spec import FLOATING, Case, Cost, ErrorCase, check, check_bool, check_domain, check_float, check_ndim, op

NAME = "rope"


@op(
    arrays=("x", "cos", "sin"),
    domains={"cos": FLOATING, "sin": FLOATING},
    constraints={
        "rope.dtype": "x is float32, float16, bfloat16 or float64",
        "rope.x_rank": "x is 4-d [B, H, S, D]",
        "rope.head_dim_even": "D = x.shape[-1] is even",
        "rope.table_dtype": "cos and sin are float arrays of one dtype (any float dtype; may differ from x's)",
        "rope.table_shape": "cos.shape is (S, D/2), (1, S, D/2) or (B, S, D/2)",
        "rope.table_shapes_match": "sin.shape == cos.shape",
        "rope.interleaved": "interleaved is True or False",
    },
)
def rope(x, cos, sin, interleaved=False):
    """Rotate pairs of x's features by per-position angles given as cos/sin tables.

    interleaved=False (rotate-half, GPT-NeoX/Llama): pairs are (i, i + D/2);
    interleaved=True (GPT-J): pairs are (2i, 2i + 1). For a pair (x1, x2) and angle t:
    (x1·cos t − x2·sin t, x2·cos t + x1·sin t). The tables are [S, D/2] (shared by the batch),
    [1, S, D/2] (the same, as Hugging Face models produce them for position ids [1, S]) or [B, S, D/2]
    (per batch entry); cos and sin have one shape. Computed in float32 for 16-bit x; keep the tables in
    float32 or better at long contexts (their angles should be computed in float64 before rounding).
    """
    check_float(NAME, "x", x)
    check_ndim(NAME, "x", x, 4)
    d = x.shape[-1]
    check(d % 2 == 0, ShapeError, NAME, "x", "rope.head_dim_even", "an even head dim D", d)
    for arg, t in (("cos", cos), ("sin", sin)):
        check_domain(NAME, arg, t, FLOATING, "rope.table_dtype")
    check(sin.dtype == cos.dtype, DTypeError, NAME, "sin", "rope.table_dtype", f"{cos.dtype} (as cos)", sin.dtype)
    b, _, s, _ = x.shape
    shapes = ((s, d // 2), (1, s, d // 2)) + (((b, s, d // 2),) if b != 1 else ())  # (1, ...) is (B, ...) when B = 1
    # (a list, not a set or dict: under torch.compile the sizes may be symbolic, which cannot be hashed)
    check(cos.shape in shapes, ShapeError, NAME, "cos", "rope.table_shape", " or ".join(map(str, shapes)), cos.shape)
    check(sin.shape == cos.shape, ShapeError, NAME, "sin", "rope.table_shapes_match", f"{cos.shape} (as cos)", sin.shape)
    check_bool(NAME, "interleaved", interleaved)


def _tables(t: np.ndarray) -> np.ndarray:
    """[S, D/2] -> [1, 1, S, D/2]; [1 or B, S, D/2] -> [1 or B, 1, S, D/2]: broadcast over heads (and batch)."""
    return t[None, None] if t.ndim == 2 else t[:, None]


# batch invariance (docs/conformance.md): the arrays whose leading axis is the batch
rope.batched("x", when=lambda x, cos, *_: x.ndim >= 3 and cos.ndim == 2)  # [B, ...] with shared tables


@rope.reference
def _reference(x, cos, sin, interleaved):
    c, s = _tables(cos), _tables(sin)
    x1, x2 = pair_views(x, interleaved)
    out = np.empty_like(x)
    o1, o2 = pair_views(out, interleaved)
    with np.errstate(invalid="ignore", over="ignore"):
        o1[...] = x1 * c - x2 * s
        o2[...] = x2 * c + x1 * s
    return out


def angle_tables(positions, d: int, dtype: str = "float32", base: float = 10000.0):
    """cos/sin tables for integer positions (any shape) and head dim d: angles in float64, then rounded.

    transformers PR #29285: low-precision angles lose the position at long contexts.
    """
    inv_freq = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.asarray(positions, np.float64)[..., None] * inv_freq
    return cg.cast(np.cos(ang), dtype), cg.cast(np.sin(ang), dtype)


def _case(name, dtype, shape, positions, interleaved=False, table_dtype="float32", dist="normal", scale=1.0,
          base=10000.0, tags=()):
    rng = cg.rng_for(NAME, name, dtype)
    x = cg.array(shape, dtype, rng, dist, scale)
    cos, sin = angle_tables(positions, shape[-1], table_dtype, base)
    return Case(name, (x, cos, sin), {"interleaved": interleaved}, tags)


def _one_sided(name: str, dtype: str, values: np.ndarray, interleaved: bool, tags=("edge",)) -> Case:
    """`values` [B, H, S, D/2] in the first member of every pair, zeros in the second.

    The outputs are then the plain products x1·cos, x1·sin: huge values never overflow (|cos|, |sin| <= 1) and
    never cancel, and NaN/inf land where the reference puts them (inf·sin 0 at position 0 is NaN in both). With
    both members non-zero, x1·cos − x2·sin in float32 errs by up to ~eps·|x|, which the elementwise metric
    (atol 1e-5) only absorbs while |x| stays below ~50; two-sided cases therefore keep O(1) magnitudes."""
    b, h, s, half = values.shape
    x = np.zeros((b, h, s, 2 * half), np.float64)
    pair_views(x, interleaved)[0][...] = values
    cos, sin = angle_tables(np.arange(s), 2 * half)
    return Case(name, (cg.cast(x, dtype), cos, sin), {"interleaved": interleaved}, tags)


@rope.cases
def _cases(dtype):
    long = 131072
    yield _case("llama-prefill", dtype, (1, 8, 128, 128), np.arange(128), base=500000.0, tags=("llm",))
    yield _case("llama-prefill-interleaved", dtype, (1, 8, 128, 128), np.arange(128), interleaved=True, tags=("llm",))
    yield _case("head-dim-64", dtype, (2, 4, 64, 64), np.arange(64))
    yield _case("long-context-tail", dtype, (1, 4, 64, 128), np.arange(long - 64, long), base=500000.0, tags=("llm",))
    yield _case("long-context-interleaved", dtype, (1, 4, 64, 64), np.arange(long - 64, long), interleaved=True)
    yield _case("positions-spread", dtype, (1, 2, 33, 128), np.linspace(0, long, 33).round())
    yield _case("decode-per-batch", dtype, (4, 8, 1, 128), np.array([[5], [1000], [65537], [long]]), tags=("llm",))
    yield _case("per-batch-tables", dtype, (3, 2, 17, 64), np.arange(17)[None] + np.array([[0], [4096], [100000]]))
    yield _case("per-batch-interleaved", dtype, (2, 2, 17, 32), np.arange(17)[None] + np.array([[0], [77]]), interleaved=True)
    # [1, S, D/2] tables (Hugging Face's, from position ids [1, S]) broadcast over a batch
    yield _case("hf-tables-batch-3", dtype, (3, 4, 33, 64), np.arange(33)[None], tags=("llm",))
    yield _case("hf-tables-interleaved", dtype, (2, 2, 17, 32), np.arange(1000, 1017)[None], interleaved=True)
    yield _case("tables-in-x-dtype", dtype, (1, 4, 64, 64), np.arange(64), table_dtype=dtype)
    yield _case("tables-float64", dtype, (1, 2, 64, 64), np.arange(long - 64, long), table_dtype="float64")
    yield _case("head-dim-2", dtype, (2, 3, 5, 2), np.arange(5))
    yield _case("empty-seq", dtype, (2, 4, 0, 64), np.arange(0))
    yield _case("empty-head-dim", dtype, (1, 2, 3, 0), np.arange(3))
    rng = cg.rng_for(NAME, "edge", dtype)
    yield _one_sided("heavy-tails", dtype, rng.standard_t(2, (1, 2, 32, 32)), True, tags=())
    big = 13437.7 if dtype == "float16" else 4988429.2
    yield _one_sided("large", dtype, rng.standard_normal((1, 2, 16, 32)) * big, False)
    yield _one_sided("specials", dtype, rng.choice(cg.edge_values(dtype).astype(np.float64), (1, 2, 16, 16)), False)
    yield _one_sided("specials-interleaved", dtype, rng.choice(cg.edge_values(dtype).astype(np.float64), (1, 2, 16, 16)),
                     True)


@rope.strategy
def _strategy(dtype):
    from hypothesis import strategies as st

    @st.composite
    def case(draw):
        b, h, s = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(cg.dims(0, 70))
        d = 2 * draw(st.sampled_from([1, 4, 8, 16, 32, 64, 5, 17]))
        interleaved, tables = draw(st.booleans()), draw(st.sampled_from(["shared", "batch-1", "per-batch"]))
        table_dtype = draw(st.sampled_from(["float32", "float32", "float64", dtype]))
        dist, scale, seed = draw(cg.dists(specials=False)), draw(cg.scales()), draw(cg.seeds())
        rng = np.random.default_rng(seed)
        x = cg.array((b, h, s, d), dtype, rng, dist, scale)
        if dist in ("loguniform", "heavy") or scale > 4:  # large magnitudes: one-sided pairs (see _one_sided)
            pair_views(x, interleaved)[1][...] = 0
        start = rng.integers(0, 131072 - s + 1, size={"shared": (1,), "batch-1": (1, 1), "per-batch": (b, 1)}[tables])
        pos = start + np.arange(s)
        cos, sin = angle_tables(pos, d, table_dtype)
        return Case(f"hyp-{seed}", (x, cos, sin), {"interleaved": interleaved}, ("hypothesis",))

    return case()


@rope.error_cases
def _error_cases():
    x = np.ones((2, 2, 4, 8), np.float32)  # B = 2, S = 4, D/2 = 4
    cos, sin = np.ones((4, 4), np.float32), np.zeros((4, 4), np.float32)

    def t(*shape):
        return np.ones(shape, np.float32)

    yield ErrorCase("rope.dtype", DTypeError, (np.ones((1, 2, 4, 8), np.int32), cos, sin))
    yield ErrorCase("rope.x_rank", ShapeError, (np.ones((2, 4, 8), np.float32), cos, sin))
    yield ErrorCase("rope.head_dim_even", ShapeError, (np.ones((1, 2, 4, 7), np.float32), cos, sin))
    yield ErrorCase("rope.table_dtype", DTypeError, (x, np.ones((4, 4), np.int64), sin))
    yield ErrorCase("rope.table_dtype", DTypeError, (x, cos, sin.astype(np.float16)))
    yield ErrorCase("rope.table_shape", ShapeError, (x, t(4, 8), t(4, 8)))  # full-width (HF's) tables
    yield ErrorCase("rope.table_shape", ShapeError, (x, t(5, 4), t(5, 4)))
    yield ErrorCase("rope.table_shape", ShapeError, (x, t(3, 4, 4), t(3, 4, 4)))  # batch 3 for B = 2
    yield ErrorCase("rope.table_shape", ShapeError, (x, t(1, 1, 4, 4), t(1, 1, 4, 4)))
    yield ErrorCase("rope.table_shapes_match", ShapeError, (x, cos, t(5, 4)))
    yield ErrorCase("rope.table_shapes_match", ShapeError, (x, cos, t(2, 4, 4)))  # ranks differ (issue 15 item 2)
    yield ErrorCase("rope.table_shapes_match", ShapeError, (x, t(1, 4, 4), t(2, 4, 4)))
    yield ErrorCase("rope.interleaved", ArgumentError, (x, cos, sin), {"interleaved": "yes"})


@rope.cost
def _cost(x, cos, sin, interleaved):
    item = np.dtype(cg.np_dtype(x.dtype)).itemsize
    titem = np.dtype(cg.np_dtype(cos.dtype)).itemsize
    return Cost(bytes=2 * x.size * item + 2 * cos.size * titem, flops=3 * x.size)


# --------------------------------------------------------------------------- backward

_TABLES = "rotation tables of the positions (functions of position ids, not parameters): no gradient"
BWD = f"{NAME}_backward"


@rope.backward(
    wrt=("x",),
    constants={"cos": _TABLES, "sin": _TABLES},
    constraints={
        f"{BWD}.grad_dtype": "grad is float32, float16, bfloat16 or float64 (x's dtype)",
        f"{BWD}.grad_shape": "grad is 4-d [B, H, S, D] with D even (x's shape)",
    },
)
def rope_backward(grad, cos, sin, interleaved=False):
    """The gradient of rope for x; cos and sin are constants.

    Saves only the tables (x is not needed: the rotation is linear in x). dx is grad rotated back by
    the same angles: per pair (g1, g2), dx = (g1·cos + g2·sin, g2·cos − g1·sin).
    """
    check(grad is not None, ArgumentError, BWD, "grad", f"{BWD}.grad_shape", "an array", None)
    check(grad.dtype in FLOATS, DTypeError, BWD, "grad", f"{BWD}.grad_dtype", f"one of {', '.join(FLOATS)}", grad.dtype)
    check_ndim(BWD, "grad", grad, 4, constraint=f"{BWD}.grad_shape")
    check(grad.shape[-1] % 2 == 0, ShapeError, BWD, "grad", f"{BWD}.grad_shape", "an even head dim D", grad.shape)
    rope.validate(grad, cos, sin, interleaved)  # the tables' rules, against grad's (= x's) shape


@rope_backward.reference
def _backward_reference(grad, cos, sin, interleaved):
    c, s = _tables(cos), _tables(sin)
    g1, g2 = pair_views(grad, interleaved)
    dx = np.empty_like(grad)
    d1, d2 = pair_views(dx, interleaved)
    with np.errstate(invalid="ignore", over="ignore"):
        d1[...] = g1 * c + g2 * s
        d2[...] = g2 * c - g1 * s
    return (dx,)


@rope_backward.error_cases
def _backward_error_cases():
    cos = np.ones((4, 4), np.float32)  # (the tables' own rules are the forward's, tested there)
    yield ErrorCase(f"{BWD}.grad_dtype", DTypeError, (np.ones((2, 2, 4, 8), np.int32), cos, cos))
    yield ErrorCase(f"{BWD}.grad_shape", ShapeError, (np.ones((2, 4, 8), np.float32), cos, cos))
    yield ErrorCase(f"{BWD}.grad_shape", ShapeError, (np.ones((2, 2, 4, 7), np.float32), cos, cos))


@rope_backward.cost
def _backward_cost(grad, cos, sin, interleaved):
    return _cost(grad, cos, sin, interleaved)  # the same rotation, by the opposite angles


def _grad_case(name: str, dtype: str, forward: Case, grad: np.ndarray, tags=("edge",)) -> Case:
    case = rope_backward.from_forward(forward, dtype, grad=cg.cast(grad, dtype))
    return Case(name, case.args, case.kwargs, tags)


@rope_backward.cases
def _backward_cases(dtype):
    """Upstream gradients the derived cases (random normal grads) do not cover; x plays no part in dx."""
    rng = cg.rng_for(BWD, "edge", dtype)
    fwd = _case("grad-edge", dtype, (2, 2, 16, 32), np.arange(16)[None] + np.array([[0], [131000]]))
    yield _grad_case("zero-grad", dtype, fwd, np.zeros((2, 2, 16, 32)))
    big = 13437.7 if dtype == "float16" else 4988429.2
    for name, inter, values in (("large-grad", False, rng.standard_normal((1, 2, 16, 32)) * big),
                                ("specials-grad", True, rng.choice(cg.edge_values(dtype).astype(np.float64), (1, 2, 16, 16)))):
        one = _one_sided(name, dtype, values, inter)  # one-sided pairs: see _one_sided
        yield _grad_case(name, dtype, one, one.args[0].astype(np.float64))
    hf = _case("grad-hf-tables", dtype, (3, 2, 9, 16), np.arange(9)[None], interleaved=True)
    g = rng.standard_normal((3, 9, 2, 16))  # [B, S, H, D] memory: a non-contiguous upstream gradient
    yield Case("strided-grad-hf-tables", (cg.cast(g, dtype).transpose(0, 2, 1, 3), *hf.args[1:]), hf.kwargs, ())


@rope_backward.mutant("forward-rotation")
def _mutant_forward_rotation(grad, cos, sin, interleaved):
    """dx = grad rotated by +angle (the forward again) instead of rotated back."""
    return (_reference(grad, cos, sin, interleaved),)
