"""scaled_matmul: fp8 a [..., M, K] @ fp8 b [K, N] with float32 scales (per tensor, per row / column, 128-blocks)."""

from __future__ import annotations

import math

import numpy as np

from opport import casegen as cg
from opport.arraymath import BLOCK, expand_a, expand_b
from opport.dtypes import FP8, np_dtype
from opport.errors import ArgumentError, DTypeError, ShapeError
from opport.ops.quantize_fp8 import FP8_MAX, SCALE_FLOOR, check_scale_values
from opport.spec import FLOAT32, FP8_CODES, Case, Cost, ErrorCase, Tolerance, check, check_domain, check_ndim, op

NAME = "scaled_matmul"
OUT_DTYPES = ("float32", "float16", "bfloat16")


@op(
    arrays=("a_q", "b_q", "scale_a", "scale_b", "bias"),
    domains={"a_q": FP8_CODES, "b_q": FP8_CODES, "scale_a": FLOAT32, "scale_b": FLOAT32},
    constraints={
        "scaled_matmul.fp8_dtype": "a_q is float8_e4m3fn or float8_e5m2",
        "scaled_matmul.dtype_mismatch": "b_q has a_q's fp8 dtype (no mixed e4m3 x e5m2)",
        "scaled_matmul.a_q_rank": "a_q is at least 2-d [..., M, K]",
        "scaled_matmul.b_q_rank": "b_q is 2-d [K, N] (shared by every batch entry of a_q)",
        "scaled_matmul.inner_dim": "b_q.shape[0] == a_q.shape[-1] (K)",
        "scaled_matmul.scale_dtype": "scale_a and scale_b are float32",
        "scaled_matmul.block_divides": "a 128-block scale (scale_a with a K axis, scale_b with K or N blocks) needs K % 128 == 0",
        "scaled_matmul.scale_a_shape": "scale_a is () or (1, ..., 1), a_q.shape[:-1] + (1,) or a_q.shape[:-1] + "
                                       "(K // 128,)",
        "scaled_matmul.scale_b_shape": "scale_b is () or (1, 1), (1, N) or (K // 128, ceil(N / 128))",
        "scaled_matmul.out_dtype": "out_dtype is float32, float16 or bfloat16",
        "scaled_matmul.bias_shape": "bias.shape == (N,)",
        "scaled_matmul.bias_dtype": "bias has dtype out_dtype",
        "scaled_matmul.scale_values": "every scale of scale_a and scale_b is finite and > 0, as quantize_fp8 makes them "
                                      "(checked on the host before any kernel runs)",
    },
    dtypes=OUT_DTYPES,
    dtype_param="out_dtype",
)
def scaled_matmul(a_q, b_q, scale_a, scale_b, bias=None, out_dtype="bfloat16"):
    """(a_q * scale_a) @ (b_q * scale_b) + bias: 8-bit float operands, float32 accumulation, one rounding to
    `out_dtype`.

    a_q [..., M, K] and b_q [K, N] share one fp8 format (float8_e4m3fn or float8_e5m2); b_q is the weight,
    shared by a_q's batch dims (matmul's [K, N] layout; any strides, e.g. an nn.Linear weight's .t()). The
    scales' shapes choose the granularity, each operand on its own (torch._scaled_mm's convention; DeepSeek-V3's
    blocks):
    scale_a is (1, ..., 1) per tensor, a_q.shape[:-1] + (1,) per row, or a_q.shape[:-1] + (K // 128,) per
    1 x 128 block along K (exactly what `quantize_fp8(a, "tensor" | "token" | "block")` returns);
    scale_b is (1, 1) per tensor, (1, N) per column, or (K // 128, ceil(N / 128)) per 128 x 128 block (the
    last column block may be partial). A per-tensor scale may also be 0-d (shape (), what `torch._scaled_mm`
    users pass): the same product; kernels receive it as (1, ..., 1). Shapes that match two granularities
    (M = 1, K = 128, N = 1) mean the same product either way. 128-block scales need K % 128 == 0. Scales
    are float32, finite and > 0 (as quantize_fp8 makes them): a zero, negative, NaN or infinite one is a
    typed error before any kernel runs (the dispatcher reads the scales on the host: on a GPU, one
    synchronisation per call). bias [N] has dtype out_dtype and is added in float32 before the rounding.
    NaN codes give NaN rows/columns. Not differentiable (fp8 training is out of scope). A call's dtype is its
    `out_dtype`.
    """
    check_domain(NAME, "a_q", a_q, FP8_CODES, "scaled_matmul.fp8_dtype")
    check(b_q.dtype == a_q.dtype, DTypeError, NAME, "b_q", "scaled_matmul.dtype_mismatch", f"{a_q.dtype} (as a_q)",
          b_q.dtype)
    check_ndim(NAME, "a_q", a_q, 2, -1)
    check_ndim(NAME, "b_q", b_q, 2)
    k, n = a_q.shape[-1], b_q.shape[-1]
    check(b_q.shape[0] == k, ShapeError, NAME, "b_q", "scaled_matmul.inner_dim", f"b_q.shape[0] == {k} (a_q's K)",
          b_q.shape)
    for arg, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        check_domain(NAME, arg, s, FLOAT32, "scaled_matmul.scale_dtype")
    _check_scale(scale_a, "scale_a", a_scale_shapes(tuple(a_q.shape)), _a_blockwise(scale_a, a_q), k)
    _check_scale(scale_b, "scale_b", b_scale_shapes(k, n), _b_blockwise(scale_b, n), k)
    check(out_dtype in OUT_DTYPES, DTypeError, NAME, "out_dtype", "scaled_matmul.out_dtype", f"one of {OUT_DTYPES}",
          repr(out_dtype))
    if bias is not None:
        check(bias.shape == (n,), ShapeError, NAME, "bias", "scaled_matmul.bias_shape", f"({n},) = (N,)", bias.shape)
        check(bias.dtype == out_dtype, DTypeError, NAME, "bias", "scaled_matmul.bias_dtype", f"{out_dtype} (out_dtype)",
              bias.dtype)


def _check_scale(s, arg: str, allowed: tuple, blockwise: bool, k: int):
    if blockwise:
        check(k % BLOCK == 0, ShapeError, NAME, arg, "scaled_matmul.block_divides",
              f"K divisible by {BLOCK} for a block scale", f"K = {k}")
    check(tuple(s.shape) in allowed, ShapeError, NAME, arg, f"scaled_matmul.{arg}_shape",
          " or ".join(map(str, allowed)), tuple(s.shape))


def _a_blockwise(s, a) -> bool:
    """scale_a shaped like a's rows with more than one K group: meant as 1 x 128 blocks."""
    return s.ndim == a.ndim and tuple(s.shape[:-1]) == tuple(a.shape[:-1]) and s.shape[-1] > 1


def _b_blockwise(s, n: int) -> bool:
    """scale_b with K groups or column groups that are not single columns: meant as 128 x 128 blocks."""
    return s.ndim == 2 and (s.shape[0] > 1 or s.shape[1] not in (1, n))


def a_scale_shapes(shape: tuple) -> tuple:
    """scale_a's allowed shapes for a_q.shape: per tensor (0-d too), per row, per 1 x 128 block (when K % 128 == 0)."""
    rows, k = tuple(shape[:-1]), shape[-1]
    out = ((), (1,) * len(shape), rows + (1,))
    return out + ((rows + (k // BLOCK,),) if k % BLOCK == 0 else ())


def b_scale_shapes(k: int, n: int) -> tuple:
    """scale_b's allowed shapes for b_q [K, N]: per tensor (0-d too), per column, per 128 x 128 block (when
    K % 128 == 0)."""
    out = ((), (1, 1), (1, n))
    return out + (((k // BLOCK, -(-n // BLOCK)),) if k % BLOCK == 0 else ())


def dequantized(a_q, b_q, scale_a, scale_b, dtype=np.float64) -> tuple:
    """a_q * scale_a and b_q * scale_b in `dtype`, scales expanded over their groups."""
    k, n = b_q.shape
    with np.errstate(invalid="ignore", over="ignore"):
        a = a_q.astype(dtype) * expand_a(scale_a.astype(dtype), k)
        b = b_q.astype(dtype) * expand_b(scale_b.astype(dtype), k, n)
    return a, b


@scaled_matmul.reference
def _reference(a_q, b_q, scale_a, scale_b, bias, out_dtype):
    # in the inputs' dtype: float64 copies for the reference, float32 for the gate's plain-NumPy noise floor
    a, b = dequantized(a_q, b_q, scale_a, scale_b, np.promote_types(scale_a.dtype, np.float32))
    with np.errstate(invalid="ignore", over="ignore"):
        out = np.matmul(a, b)
        return out if bias is None else out + bias


@scaled_matmul.shape
def _shape(a_q, b_q, scale_a, scale_b, bias, out_dtype):
    return (*a_q.shape[:-1], b_q.shape[-1])


# The fp8 products are exact in float32 (two <= 4-bit significands times float32 scales: at most two float32
# roundings per K group, <= 2^-23 relative each), so what remains is matmul's: float32 accumulation over K,
# judged norm-wise (docs/numerics.md 3.3), then one rounding to out_dtype. The reference is the product of the
# dequantised operands, not of the values before quantisation: fp8's own error (3.2's fp8 row) is not in it.
_WHY = "docs/numerics.md 3.7: exact fp8 products, float32 accumulation (norm-wise, as matmul), one rounding to "
scaled_matmul.tolerance(
    float32=Tolerance(1e-5, 1e-5, "normwise", reason=_WHY + "float32"),
    float16=Tolerance(2e-3, 1e-5, "normwise", reason=_WHY + "float16 (2^-11 relative)"),
    bfloat16=Tolerance(1.6e-2, 1e-5, "normwise", reason=_WHY + "bfloat16 (2^-8 relative)"),
)


# --------------------------------------------------------------------------- quantised inputs for the cases


def quantize(x: np.ndarray, scale: np.ndarray, fp8: str) -> np.ndarray:
    """x / scale (scale broadcast) saturated and rounded to fp8, as quantize_fp8 does."""
    with np.errstate(invalid="ignore", divide="ignore"):
        v = np.clip(x / scale.astype(np.float64), -FP8_MAX[fp8], FP8_MAX[fp8])
    return v.astype(np.float32).astype(np_dtype(fp8))


def _amax_scale(amax: np.ndarray, fp8: str) -> np.ndarray:
    return np.maximum((amax / FP8_MAX[fp8]).astype(np.float32), np.float32(SCALE_FLOOR))


def quantize_a(x: np.ndarray, granularity: str, fp8: str) -> tuple:
    """(a_q, scale_a) of x [..., M, K] per "tensor", "row" or "block" (1 x 128 along K)."""
    ax = np.abs(x)
    if granularity == "tensor":
        s = _amax_scale(np.full((1,) * x.ndim, ax.max(initial=0.0)), fp8)
    elif granularity == "row":
        s = _amax_scale(ax.max(axis=-1, keepdims=True, initial=0.0), fp8)
    else:
        k = x.shape[-1]
        s = _amax_scale(ax.reshape(x.shape[:-1] + (k // BLOCK, BLOCK)).max(axis=-1, initial=0.0), fp8)
    return quantize(x, expand_a(s, x.shape[-1]), fp8), s


def quantize_b(x: np.ndarray, granularity: str, fp8: str) -> tuple:
    """(b_q, scale_b) of x [K, N] per "tensor", "col" or "block" (128 x 128, the last column block partial)."""
    k, n = x.shape
    ax = np.abs(x)
    if granularity == "tensor":
        s = _amax_scale(np.full((1, 1), ax.max(initial=0.0)), fp8)
    elif granularity == "col":
        s = _amax_scale(ax.max(axis=0, keepdims=True, initial=0.0), fp8)
    else:
        nb = -(-n // BLOCK)
        padded = np.zeros((k, nb * BLOCK))
        padded[:, :n] = ax
        s = _amax_scale(padded.reshape(k // BLOCK, BLOCK, nb, BLOCK).max(axis=(1, 3), initial=0.0), fp8)
    return quantize(x, expand_b(s, k, n), fp8), s


def _short(fp8: str) -> str:
    return "e4m3" if fp8 == "float8_e4m3fn" else "e5m2"


def _case(name, dtype, fp8, a_shape, n, ga, gb, bias=False, dist="normal", tags=(), edit=None) -> Case:
    rng = cg.rng_for(NAME, name, dtype)
    x = cg.array(a_shape, "float64", rng, dist)
    w = cg.array((a_shape[-1], n), "float64", rng, dist, a_shape[-1] ** -0.5 if a_shape[-1] else 1.0)
    if edit is not None:
        edit(x, w)
    a_q, sa = quantize_a(x, ga, fp8)
    b_q, sb = quantize_b(w, gb, fp8)
    c = cg.array((n,), dtype, rng) if bias else None
    return Case(f"{_short(fp8)}-{name}", (a_q, b_q, sa, sb, c), {"out_dtype": dtype}, tags)


def _zero_blocks(x, w):
    """An all-zero row, an all-zero 1 x 128 block of a and an all-zero 128 x 128 block of b."""
    x[..., 1, :] = 0
    x[..., 2, :BLOCK] = 0
    w[:BLOCK, :BLOCK] = 0


def _saturated(case: Case, fp8: str, dtype: str) -> Case:
    """Every code of a and b at ±fp8_max (saturation values) with scales that keep the exact result finite in
    out_dtype: |out| <= K * fp8_max^2 * s_a * s_b."""
    a_q, b_q, sa, sb, c = case.args
    rng = cg.rng_for(NAME, case.name, dtype)
    fmax = FP8_MAX[fp8]
    a = (rng.choice([-fmax, fmax], a_q.shape)).astype(np_dtype(fp8))
    b = (rng.choice([-fmax, fmax], b_q.shape)).astype(np_dtype(fp8))
    s = np.float32(2.0**-8 if fp8 == "float8_e4m3fn" else 2.0**-14)
    return Case(case.name, (a, b, np.full(sa.shape, s, np.float32), np.full(sb.shape, s, np.float32), c),
                case.kwargs, case.tags)


def _nan_row(case: Case, fp8: str) -> Case:
    """One NaN code in a (row 3): that output row is NaN, the others finite."""
    a_q = case.args[0].copy()
    a_q[3, 5] = np.array(np.nan, np.float32).astype(np_dtype(fp8))
    return Case(case.name, (a_q, *case.args[1:]), case.kwargs, case.tags)


def _scalar_scales(case: Case) -> Case:
    """The case's per-tensor scales in their 0-d form (torch._scaled_mm's): the same product."""
    a_q, b_q, sa, sb, c = case.args
    sa, sb = (s.reshape(()) if s.size == 1 else s for s in (sa, sb))
    return Case(case.name, (a_q, b_q, sa, sb, c), case.kwargs, case.tags)


GRANULARITY_PAIRS = (("tensor", "tensor"), ("row", "col"), ("block", "block"))


@scaled_matmul.cases
def _cases(dtype):
    for fp8 in FP8:
        for ga, gb in GRANULARITY_PAIRS:
            yield _case(f"{ga}-{gb}-64x256x192", dtype, fp8, (64, 256), 192, ga, gb, bias=ga == "row")
        yield _case("block-block-ragged-17x384x33", dtype, fp8, (17, 384), 33, "block", "block", bias=True)
        yield _saturated(_case("saturated-block", dtype, fp8, (16, 256), 144, "block", "block", tags=("edge",)),
                         fp8, dtype)
        yield _saturated(_case("saturated-tensor", dtype, fp8, (16, 256), 16, "tensor", "tensor", tags=("edge",)),
                         fp8, dtype)
        yield _case("zero-blocks", dtype, fp8, (4, 256), 160, "block", "block", tags=("edge",), edit=_zero_blocks)
        yield _nan_row(_case("nan-row", dtype, fp8, (8, 64), 24, "tensor", "tensor", tags=("edge",)), fp8)
        # 0-d per-tensor scales (torch._scaled_mm's form), e5m2 too: the form neuron's trn2 kernel takes
        yield _scalar_scales(_case("tensor-0d-33x256x40", dtype, fp8, (33, 256), 40, "tensor", "tensor", bias=True))
        yield _scalar_scales(_case("tensor-0d-batched", dtype, fp8, (2, 9, 64), 17, "tensor", "col"))
    fp8 = "float8_e4m3fn"
    yield _case("row-tensor-130x17x130", dtype, fp8, (130, 17), 130, "row", "tensor")
    yield _case("tensor-col-1x1x1", dtype, fp8, (1, 1), 1, "tensor", "col", bias=True)
    yield _case("block-col-3x128x1", dtype, fp8, (3, 128), 1, "block", "col")
    yield _case("row-block-33x128x300", dtype, fp8, (33, 128), 300, "row", "block", bias=True)
    yield _case("batched-block", dtype, fp8, (2, 3, 17, 256), 40, "block", "block", bias=True)
    yield _case("batched-row", dtype, fp8, (2, 9, 64), 17, "row", "col")
    yield _case("heavy-tails-row", dtype, fp8, (64, 128), 64, "row", "col", dist="heavy")
    yield _case("k-zero", dtype, fp8, (17, 0), 64, "tensor", "tensor", tags=("edge",))
    yield _case("k-zero-bias", dtype, fp8, (17, 0), 64, "row", "col", bias=True, tags=("edge",))
    yield _case("m-zero", dtype, fp8, (0, 128), 17, "block", "block", bias=True, tags=("edge",))
    # what `opport bench` times when no workload module applies: a DeepSeek-V3-style block-scaled projection
    yield _case("llm-block-proj", dtype, fp8, (64, 512), 256, "block", "block", tags=("llm",))


@scaled_matmul.strategy
def _strategy(dtype):
    from hypothesis import strategies as st

    @st.composite
    def case(draw):
        fp8 = draw(st.sampled_from(FP8))
        ga, gb = draw(st.sampled_from(("tensor", "row", "block"))), draw(st.sampled_from(("tensor", "col", "block")))
        blockwise = "block" in (ga, gb)
        k = BLOCK * draw(st.integers(1, 3)) if blockwise else draw(cg.dims(0, 300))
        m, n = draw(cg.dims(0, 130)), draw(cg.dims(1, 200))
        batch = tuple(draw(st.lists(st.integers(1, 3), max_size=1)))
        dist, bias, seed = draw(cg.dists(specials=False)), draw(st.booleans()), draw(cg.seeds())
        zero = draw(st.booleans())
        rng = np.random.default_rng(seed)
        x = cg.array(batch + (m, k), "float64", rng, dist)
        w = cg.array((k, n), "float64", rng, dist, k ** -0.5 if k else 1.0)
        if zero and m and k:  # an all-zero scaling group: the scale floor
            x[..., 0, : min(k, BLOCK)] = 0
            w[: min(k, BLOCK), : min(n, BLOCK)] = 0
        a_q, sa = quantize_a(x, ga, fp8)
        b_q, sb = quantize_b(w, gb, fp8)
        c = cg.array((n,), dtype, rng) if bias else None
        return Case(f"hyp-{seed}", (a_q, b_q, sa, sb, c), {"out_dtype": dtype}, ("hypothesis",))

    return case()


@scaled_matmul.error_cases
def _error_cases():
    e4, e5 = np_dtype("float8_e4m3fn"), np_dtype("float8_e5m2")
    a, b = np.zeros((4, 256), e4), np.zeros((256, 8), e4)
    s11 = np.ones((1, 1), np.float32)
    yield ErrorCase("scaled_matmul.fp8_dtype", DTypeError, (np.zeros((4, 256), np.float32), b, s11, s11))
    yield ErrorCase("scaled_matmul.fp8_dtype", DTypeError, (np.zeros((4, 256), np.int8), np.zeros((256, 8), np.int8),
                                                            s11, s11))
    yield ErrorCase("scaled_matmul.dtype_mismatch", DTypeError, (a, np.zeros((256, 8), e5), s11, s11))
    yield ErrorCase("scaled_matmul.a_q_rank", ShapeError, (np.zeros(256, e4), b, np.ones(1, np.float32), s11))
    yield ErrorCase("scaled_matmul.b_q_rank", ShapeError, (a, np.zeros((2, 256, 8), e4), s11, s11))
    yield ErrorCase("scaled_matmul.inner_dim", ShapeError, (a, np.zeros((128, 8), e4), s11, s11))
    yield ErrorCase("scaled_matmul.scale_dtype", DTypeError, (a, b, np.ones((1, 1), np.float16), s11))
    yield ErrorCase("scaled_matmul.scale_dtype", DTypeError, (a, b, s11, np.ones((1, 1), np.float64)))
    a100, b100 = np.zeros((4, 100), e4), np.zeros((100, 8), e4)
    yield ErrorCase("scaled_matmul.block_divides", ShapeError, (a100, b100, np.ones((4, 2), np.float32), s11))
    yield ErrorCase("scaled_matmul.block_divides", ShapeError, (a100, b100, s11, np.ones((2, 1), np.float32)))
    yield ErrorCase("scaled_matmul.scale_a_shape", ShapeError, (a, b, np.ones((4, 3), np.float32), s11))
    yield ErrorCase("scaled_matmul.scale_a_shape", ShapeError, (a, b, np.ones((1, 4), np.float32), s11))
    yield ErrorCase("scaled_matmul.scale_a_shape", ShapeError, (a, b, np.ones(1, np.float32), s11))
    yield ErrorCase("scaled_matmul.scale_b_shape", ShapeError, (a, b, s11, np.ones((8, 1), np.float32)))
    yield ErrorCase("scaled_matmul.scale_b_shape", ShapeError, (a, b, s11, np.ones((2, 8), np.float32)))
    yield ErrorCase("scaled_matmul.out_dtype", DTypeError, (a, b, s11, s11), {"out_dtype": "float64"})
    yield ErrorCase("scaled_matmul.out_dtype", DTypeError, (a, b, s11, s11), {"out_dtype": "float8_e4m3fn"})
    yield ErrorCase("scaled_matmul.bias_shape", ShapeError, (a, b, s11, s11, np.ones(4, np_dtype("bfloat16"))))
    yield ErrorCase("scaled_matmul.bias_dtype", DTypeError, (a, b, s11, s11, np.ones(8, np.float32)))
    rows, blocks = np.ones((4, 1), np.float32), np.ones((2, 1), np.float32)
    a5, b5 = a.astype(e5), b.astype(e5)  # a value error is raised where a kernel takes the call (trn2: not e4m3fn)
    for v in (0.0, -1.0, np.nan, np.inf):
        sa, sb = rows.copy(), blocks.copy()
        sa[2, 0] = sb[1, 0] = v
        yield ErrorCase("scaled_matmul.scale_values", ArgumentError, (a5, b5, sa, s11))
        yield ErrorCase("scaled_matmul.scale_values", ArgumentError, (a5, b5, s11, sb))


def _per_tensor_views(a_q, b_q, scale_a, scale_b, bias, out_dtype) -> dict:
    """0-d per-tensor scales as the (1, ..., 1) arrays every kernel takes (a free reshape, by the dispatcher)."""
    shapes = {"scale_a": (1,) * a_q.ndim, "scale_b": (1, 1)}
    return {name: shapes[name] for name, s in (("scale_a", scale_a), ("scale_b", scale_b)) if s.ndim == 0}


# read by the dispatcher (opport/dispatch/core.py `kernel_views`): arrays a kernel receives reshaped
scaled_matmul.kernel_shapes = _per_tensor_views


@scaled_matmul.check_values(("scale_a", "scale_b"))
def _check_scales(a_q, b_q, scale_a, scale_b, bias, out_dtype):
    check_scale_values(NAME, "scale_a", scale_a)
    check_scale_values(NAME, "scale_b", scale_b)


@scaled_matmul.cost
def _cost(a_q, b_q, scale_a, scale_b, bias, out_dtype):
    """The 8-bit operands and the float32 scales read once, the output written once; 2 M N K FLOPs (+ bias)."""
    item = np_dtype(out_dtype).itemsize
    k, n = b_q.shape
    out = math.prod(a_q.shape[:-1]) * n
    extra = bias.size * item if bias is not None else 0
    return Cost(bytes=a_q.size + b_q.size + 4 * (scale_a.size + scale_b.size) + extra + out * item,
                flops=2 * out * k + (out if bias is not None else 0))
