"""quantize_fp8: absmax-scaled, saturating, round-to-nearest-even conversion to an 8-bit float format."""

from __future__ import annotations

import numpy as np

from opport import casegen as cg
from opport.arraymath import FP8_MAX, SCALE_FLOOR, grouped, scales_shape
from opport.dtypes import FP8, np_dtype
from opport.errors import ArgumentError, DTypeError, ShapeError
from opport.spec import BASE_TOLERANCE, Case, Cost, ErrorCase, Tolerance, check, check_choice, check_float, check_ndim, op

NAME = "quantize_fp8"
GRANULARITIES = ("tensor", "token", "block")

# q is judged as the nearest fp8 value to the exact quotient x / scale (docs/numerics.md 3.7): within half an
# fp8 ulp, plus 2^-16 ulp for a kernel's float32 division (<= 2 float32 ulps: 2^-22 relative, under 2^-18 of an
# fp8 ulp); rounding toward zero or away from it is off by up to a whole ulp and fails
Q_TOLERANCE = Tolerance(0.0, 0.0, metric="ulp_or_abs", ulp=0.5 + 2.0**-16,
                        reason="q must be the fp8 value nearest to x / scale (docs/numerics.md 3.7)")
SCALE_TOLERANCE = Tolerance(BASE_TOLERANCE["float32"].rtol, 0.0,
                            reason="scales are float32 amax / fp8_max: one float32 rounding (an approximate GPU division: 2 ulp)")


@op(
    arrays=("x",),
    constraints={
        "quantize_fp8.dtype": "x is float32, float16, bfloat16 or float64",
        "quantize_fp8.x_rank": "x has at least one dimension",
        "quantize_fp8.granularity": "granularity is 'tensor', 'token' or 'block'",
        "quantize_fp8.block": "block is an int > 0",
        "quantize_fp8.block_divides": "granularity 'block': block divides x.shape[-1]",
        "quantize_fp8.fp8_dtype": "dtype is 'float8_e4m3fn' or 'float8_e5m2'",
        "quantize_fp8.scale": "scale is None or a finite number > 0",
        "quantize_fp8.scale_granularity": "a static scale is per tensor: granularity 'tensor'",
    },
)
def quantize_fp8(x, granularity="tensor", block=128, dtype="float8_e4m3fn", scale: float | None = None):
    """Scale x into an 8-bit float format: returns `(q, scales)`.

    One float32 scale per group: the whole tensor ("tensor"), each row of the last axis ("token") or each
    `block` consecutive elements of the last axis ("block", DeepSeek-V3's 1 x 128 activation tiles).
    scales has x's rank: shape (1, ..., 1), x.shape[:-1] + (1,) or x.shape[:-1] + (x.shape[-1] // block,).
    Dynamic scaling (scale=None): scale = max(amax / fp8_max, 2^-126) rounded to float32, amax the group's
    largest finite |x| (fp8_max 448 for e4m3fn, 57344 for e5m2); an all-zero group gets 2^-126 (float32's
    smallest normal), so scales are never 0, inf or NaN. Static scaling: `scale` (a positive number) for the
    whole tensor. q = round_to_nearest_even(clamp(x / scale, -fp8_max, fp8_max)) in `dtype`: finite
    values saturate, ±inf becomes ±fp8_max (PTX `cvt.rn.satfinite`, TransformerEngine's saturating cast),
    NaN stays NaN (both formats have NaN; e4m3fn has no inf). `dequantize_fp8(q, scales, ...)` inverts it.
    Not differentiable (a step function; no backward is declared).
    """
    check_float(NAME, "x", x)
    check_ndim(NAME, "x", x, 1, -1)
    check_choice(NAME, "granularity", granularity, GRANULARITIES)
    check(isinstance(block, (int, np.integer)) and not isinstance(block, bool) and block > 0, ArgumentError, NAME,
          "block", "quantize_fp8.block", "an int > 0", repr(block))
    if granularity == "block":
        check(x.shape[-1] % block == 0, ShapeError, NAME, "x", "quantize_fp8.block_divides",
              f"x.shape[-1] divisible by block {block}", x.shape)
    check(dtype in FP8, DTypeError, NAME, "dtype", "quantize_fp8.fp8_dtype", f"one of {FP8}", repr(dtype))
    if scale is not None:
        ok = isinstance(scale, (int, float, np.floating, np.integer)) and not isinstance(scale, bool)
        check(ok and np.isfinite(float(scale)) and float(scale) > 0, ArgumentError, NAME, "scale",
              "quantize_fp8.scale", "None or a finite number > 0", repr(scale))
        check(granularity == "tensor", ArgumentError, NAME, "scale", "quantize_fp8.scale_granularity",
              "granularity 'tensor' with a static scale", repr(granularity))


def check_scale_values(op: str, arg: str, scales) -> None:
    """Scales arrays are multiplied by, as quantize_fp8 makes them: finite and > 0 (a zero scale silently zeroes
    a group, a negative one flips its sign, NaN poisons it). Run by the dispatcher on the host before any
    kernel (`check_values`): on a GPU that reads the scales back, one synchronisation per call."""
    s = np.asarray(scales, np.float32)
    bad = ~(np.isfinite(s) & (s > 0))
    where = tuple(int(i) for i in np.argwhere(bad)[0]) if bad.any() else ()
    check(not bad.any(), ArgumentError, op, arg, f"{op}.scale_values", "finite scales > 0",
          f"{s[where] if bad.any() else ''} at {where}")


@quantize_fp8.outputs(("q", "scales"))
def _outputs(x, granularity, block, dtype, scale):
    return [(tuple(x.shape), dtype), (scales_shape(tuple(x.shape), granularity, block), "float32")]


def dynamic_scales(x: np.ndarray, granularity: str, block: int, dtype: str) -> np.ndarray:
    """float32 scales: max(amax / fp8_max, SCALE_FLOOR) per group, amax over finite |x| only."""
    g = grouped(x, granularity, block)
    a = np.where(np.isfinite(g), np.abs(g), 0.0)
    amax = np.max(a, axis=-1, initial=0.0)
    s = (amax / FP8_MAX[dtype]).astype(np.float32)
    return np.maximum(s, np.float32(SCALE_FLOOR))


@quantize_fp8.reference
def _reference(x, granularity, block, dtype, scale):
    """q as the exact saturated quotient in float64 (judged by nearest rounding, Q_TOLERANCE), scales in float32."""
    if scale is None:
        s = dynamic_scales(x, granularity, block, dtype)
    else:
        s = np.full(scales_shape(x.shape, granularity, block), scale, np.float32)
    fmax = FP8_MAX[dtype]
    with np.errstate(invalid="ignore", over="ignore"):
        q = grouped(x, granularity, block) / s.astype(np.float64)[..., None]
        q = np.clip(q, -fmax, fmax).reshape(x.shape)  # clip keeps NaN; ±inf saturates
    return q, s


quantize_fp8.tolerance(**{d: Q_TOLERANCE for d in ("float32", "float16", "bfloat16", "float64")})
quantize_fp8.tolerance(index=1, any=SCALE_TOLERANCE)


def _kw(granularity, dtype, block=128, scale=None):
    return {"granularity": granularity, "block": block, "dtype": dtype, "scale": scale}


@quantize_fp8.cases
def _cases(dtype):
    rng = cg.rng_for(NAME, dtype)
    for fp8 in FP8:
        short = "e4m3" if fp8 == "float8_e4m3fn" else "e5m2"
        for g in GRANULARITIES:
            yield Case(f"{short}-{g}-4x256", (cg.array((4, 256), dtype, rng),), _kw(g, fp8))
            yield Case(f"{short}-{g}-specials", (cg.array((3, 128), dtype, rng, "specials"),), _kw(g, fp8), ("edge",))
        yield Case(f"{short}-token-loguniform", (cg.array((5, 96), dtype, rng, "loguniform"),), _kw("token", fp8))
        yield Case(f"{short}-block32-3d", (cg.array((2, 3, 64), dtype, rng, "heavy"),), _kw("block", fp8, 32))
        yield Case(f"{short}-token-1d", (cg.array((23,), dtype, rng),), _kw("token", fp8))
        yield Case(f"{short}-static-saturating", (cg.array((4, 64), dtype, rng, "normal", 4.0),),
                   _kw("tensor", fp8, scale=2.0**-8 if fp8 == "float8_e4m3fn" else 2.0**-13), ("edge",))
        yield Case(f"{short}-static-unit-ties", (_ties(fp8, dtype),), _kw("tensor", fp8, scale=1.0), ("edge",))
        zeros = cg.array((4, 256), dtype, rng)
        zeros[1] = 0
        zeros[2, 128:] = 0
        yield Case(f"{short}-block-zero-groups", (zeros,), _kw("block", fp8), ("edge",))
        yield Case(f"{short}-token-zero-rows", (zeros,), _kw("token", fp8), ("edge",))
        yield Case(f"{short}-tensor-all-zero", (np.zeros((3, 40), np_dtype(dtype)),), _kw("tensor", fp8), ("edge",))
        inf_rows = cg.array((3, 128), dtype, rng)
        inf_rows[0, 5], inf_rows[1, 7], inf_rows[2, 9] = np.inf, -np.inf, np.nan
        yield Case(f"{short}-token-inf-nan", (inf_rows,), _kw("token", fp8), ("edge",))
    # what `opport bench` times: a Llama-8B prefill chunk of activations per token, DeepSeek-V3's (hidden 7168)
    # in 1 x 128 blocks
    yield Case("llama8b-token-e4m3", (cg.array((256, 4096), dtype, rng),), _kw("token", "float8_e4m3fn"), ("llm",))
    yield Case("dsv3-block-e4m3", (cg.array((128, 7168), dtype, rng),), _kw("block", "float8_e4m3fn"), ("llm",))


def _ties(fp8: str, dtype: str) -> np.ndarray:
    """Values halfway between neighbouring fp8 values (and their neighbours) where `dtype` holds them exactly:
    round-half-to-even is visible only there."""
    codes = np.arange(256, dtype=np.uint8).view(np_dtype(fp8)).astype(np.float64)
    codes = np.unique(codes[np.isfinite(codes) & (codes >= 0)])
    mids = (codes[:-1] + codes[1:]) / 2
    vals = np.concatenate([mids, -mids, codes, [0.0, -0.0]])
    exact = cg.cast(vals, dtype).astype(np.float64) == vals
    vals = vals[exact]
    return cg.cast(vals[: (vals.size // 8) * 8].reshape(8, -1), dtype)


@quantize_fp8.error_cases
def _error_cases():
    x = np.ones((2, 256), np.float32)
    yield ErrorCase("quantize_fp8.dtype", DTypeError, (np.ones((2, 4), np.int32),))
    yield ErrorCase("quantize_fp8.x_rank", ShapeError, (np.ones((), np.float32),))
    yield ErrorCase("quantize_fp8.granularity", ArgumentError, (x,), {"granularity": "channel"})
    yield ErrorCase("quantize_fp8.block", ArgumentError, (x,), {"granularity": "block", "block": 0})
    yield ErrorCase("quantize_fp8.block_divides", ShapeError, (np.ones((2, 100), np.float32),), {"granularity": "block"})
    yield ErrorCase("quantize_fp8.fp8_dtype", DTypeError, (x,), {"dtype": "float8_e4m3"})
    yield ErrorCase("quantize_fp8.scale", ArgumentError, (x,), {"scale": 0.0})
    yield ErrorCase("quantize_fp8.scale", ArgumentError, (x,), {"scale": -1.0})
    yield ErrorCase("quantize_fp8.scale", ArgumentError, (x,), {"scale": float("nan")})
    yield ErrorCase("quantize_fp8.scale_granularity", ArgumentError, (x,), {"granularity": "token", "scale": 1.0})


@quantize_fp8.cost
def _cost(x, granularity, block, dtype, scale):
    """Memory-bound: x read once, q (1 byte) and the float32 scales written once; ~4 FLOPs per element."""
    n = int(np.prod(x.shape))
    groups = int(np.prod(scales_shape(tuple(x.shape), granularity, block)))
    return Cost(bytes=n * np_dtype(x.dtype).itemsize + n + 4 * groups, flops=4 * n)
