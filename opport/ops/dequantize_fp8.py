"""dequantize_fp8: fp8 codes times their float32 group scales, rounded once to the output dtype."""

from __future__ import annotations

import numpy as np

from opport import casegen as cg
from opport.dtypes import FLOATS, FP8, np_dtype
from opport.errors import ArgumentError, DTypeError, ShapeError
from opport.ops.quantize_fp8 import GRANULARITIES, check_scale_values, dynamic_scales, grouped, scales_shape
from opport.spec import (
    BASE_TOLERANCE,
    FLOAT32,
    FP8_CODES,
    Case,
    Cost,
    ErrorCase,
    Tolerance,
    check,
    check_choice,
    check_domain,
    check_ndim,
    op,
)

NAME = "dequantize_fp8"


@op(
    arrays=("q", "scales"),
    domains={"q": FP8_CODES, "scales": FLOAT32},
    constraints={
        "dequantize_fp8.q_dtype": "q is float8_e4m3fn or float8_e5m2",
        "dequantize_fp8.q_rank": "q has at least one dimension",
        "dequantize_fp8.scales_dtype": "scales is float32",
        "dequantize_fp8.granularity": "granularity is 'tensor', 'token' or 'block'",
        "dequantize_fp8.block": "block is an int > 0",
        "dequantize_fp8.block_divides": "granularity 'block': block divides q.shape[-1]",
        "dequantize_fp8.scales_shape": "scales has quantize_fp8's scales shape for q, granularity and block (or, "
                                       "per tensor, is 0-d)",
        "dequantize_fp8.out_dtype": "out_dtype is float32, float16, bfloat16 or float64",
        "dequantize_fp8.scale_values": "every scale is finite and > 0, as quantize_fp8 makes them (checked on the host "
                                       "before any kernel runs)",
    },
    dtype_param="out_dtype",
)
def dequantize_fp8(q, scales, granularity="tensor", block=128, out_dtype="float32"):
    """q * scales (broadcast over each scaling group), computed in float32 and rounded once to `out_dtype`.

    q and scales are what `quantize_fp8(x, granularity, block, ...)` returned; a per-tensor scale may also be 0-d
    (shape (), as torch._scaled_mm users keep it), which kernels receive as (1, ..., 1). NaN codes give NaN (and e5m2's
    ±inf gives ±inf). Every scale must be finite and > 0, as quantize_fp8 makes them: a zero, negative,
    NaN or infinite one is a typed error before any kernel runs (the dispatcher reads the scales on the
    host: on a GPU, one synchronisation per call). A call's dtype is its `out_dtype`.
    """
    check_domain(NAME, "q", q, FP8_CODES)
    check_ndim(NAME, "q", q, 1, -1)
    check_domain(NAME, "scales", scales, FLOAT32)
    check_choice(NAME, "granularity", granularity, GRANULARITIES)
    check(isinstance(block, (int, np.integer)) and not isinstance(block, bool) and block > 0, ArgumentError, NAME,
          "block", "dequantize_fp8.block", "an int > 0", repr(block))
    if granularity == "block":
        check(q.shape[-1] % block == 0, ShapeError, NAME, "q", "dequantize_fp8.block_divides",
              f"q.shape[-1] divisible by block {block}", q.shape)
    want = scales_shape(tuple(q.shape), granularity, block)
    ok = tuple(scales.shape) == want or (granularity == "tensor" and scales.ndim == 0)
    check(ok, ShapeError, NAME, "scales", "dequantize_fp8.scales_shape", f"{want}" + " or ()" * (granularity == "tensor"),
          scales.shape)
    check(out_dtype in FLOATS, DTypeError, NAME, "out_dtype", "dequantize_fp8.out_dtype", f"one of {FLOATS}",
          repr(out_dtype))


def _per_tensor_view(q, scales, granularity, block, out_dtype) -> dict:
    """A 0-d per-tensor scale as the (1, ..., 1) array every kernel takes (a free reshape, by the dispatcher)."""
    return {"scales": (1,) * q.ndim} if scales.ndim == 0 else {}


dequantize_fp8.kernel_shapes = _per_tensor_view  # read by the dispatcher (opport/dispatch/core.py `kernel_views`)


@dequantize_fp8.check_values(("scales",))
def _check_scales(q, scales, granularity, block, out_dtype):
    check_scale_values(NAME, "scales", scales)


@dequantize_fp8.shape
def _shape(q, scales, granularity, block, out_dtype):
    return tuple(q.shape)


@dequantize_fp8.reference
def _reference(q, scales, granularity, block, out_dtype):
    with np.errstate(invalid="ignore", over="ignore"):
        return (grouped(q, granularity, block) * scales[..., None]).reshape(q.shape)


# the exact product of a <= 4-bit fp8 significand and a float32 scale has <= 28 bits: float32 rounds it
# once (float32 output: the base table); a 16-bit output is that float32 rounded again, which can land
# one step past a 16-bit tie: the 16-bit dtype's base tolerance (2 ulp and more)
dequantize_fp8.tolerance(float16=Tolerance(BASE_TOLERANCE["float16"].rtol, BASE_TOLERANCE["float16"].atol,
                                           reason="float32 product rounded again to float16"),
                         bfloat16=Tolerance(BASE_TOLERANCE["bfloat16"].rtol, BASE_TOLERANCE["bfloat16"].atol,
                                            reason="float32 product rounded again to bfloat16"))


def quantized(x: np.ndarray, granularity: str, block: int, fp8: str) -> tuple:
    """(q, scales) as quantize_fp8 defines them, from float64 values: inputs for dequantize cases."""
    s = dynamic_scales(x, granularity, block, fp8)
    from opport.ops.quantize_fp8 import FP8_MAX

    with np.errstate(invalid="ignore"):
        v = np.clip(grouped(x, granularity, block) / s.astype(np.float64)[..., None], -FP8_MAX[fp8], FP8_MAX[fp8])
    return v.reshape(x.shape).astype(np.float32).astype(np_dtype(fp8)), s


@dequantize_fp8.cases
def _cases(dtype):
    rng = cg.rng_for(NAME, dtype)
    for fp8 in FP8:
        short = "e4m3" if fp8 == "float8_e4m3fn" else "e5m2"
        for g in GRANULARITIES:
            x = cg.array((4, 256), "float64", rng, "loguniform" if g == "token" else "normal")
            yield Case(f"{short}-{g}-4x256", quantized(x, g, 128, fp8), {"granularity": g, "out_dtype": dtype})
        x = cg.array((2, 3, 64), "float64", rng, "heavy")
        yield Case(f"{short}-block32-3d", quantized(x, "block", 32, fp8),
                   {"granularity": "block", "block": 32, "out_dtype": dtype})
        codes = np.arange(256, dtype=np.uint8).view(np_dtype(fp8)).reshape(2, 128)  # every code, NaN (and inf)
        s = np.array([[2.0**-9], [3.0]], np.float32)
        yield Case(f"{short}-every-code", (codes.copy(), s), {"granularity": "token", "out_dtype": dtype}, ("edge",))
        q, s = quantized(np.zeros((2, 256)), "block", 128, fp8)
        yield Case(f"{short}-zero-blocks", (q, s), {"granularity": "block", "out_dtype": dtype}, ("edge",))
        q, s = quantized(cg.array((3, 5, 40), "float64", cg.rng_for(NAME, f"{short}-tensor-0d", dtype)), "tensor", 128, fp8)
        yield Case(f"{short}-tensor-0d-scale", (q, s.reshape(())), {"granularity": "tensor", "out_dtype": dtype})
    x = cg.array((256, 4096), "float64", rng)
    yield Case("llama8b-block-e4m3", quantized(x, "block", 128, "float8_e4m3fn"),
               {"granularity": "block", "out_dtype": dtype}, ("llm",))


@dequantize_fp8.error_cases
def _error_cases():
    q = np.zeros((2, 256), np_dtype("float8_e4m3fn"))
    s = np.ones((1, 1), np.float32)
    yield ErrorCase("dequantize_fp8.q_dtype", DTypeError, (np.zeros((2, 256), np.float32), s))
    yield ErrorCase("dequantize_fp8.q_rank", ShapeError, (np.zeros((), np_dtype("float8_e5m2")), np.ones((), np.float32)))
    yield ErrorCase("dequantize_fp8.scales_dtype", DTypeError, (q, np.ones((1, 1), np.float16)))
    yield ErrorCase("dequantize_fp8.granularity", ArgumentError, (q, s), {"granularity": "row"})
    yield ErrorCase("dequantize_fp8.block", ArgumentError, (q, s), {"granularity": "block", "block": -128})
    yield ErrorCase("dequantize_fp8.block_divides", ShapeError, (q, np.ones((2, 3), np.float32)),
                    {"granularity": "block", "block": 100})
    yield ErrorCase("dequantize_fp8.scales_shape", ShapeError, (q, np.ones((2, 1), np.float32)), {"granularity": "block"})
    yield ErrorCase("dequantize_fp8.scales_shape", ShapeError, (q, np.ones((), np.float32)), {"granularity": "token"})
    yield ErrorCase("dequantize_fp8.out_dtype", DTypeError, (q, s), {"out_dtype": "float8_e4m3fn"})
    tok = np.ones((2, 1), np.float32)
    for v in (0.0, -1.0, np.nan, np.inf):
        bad = tok.copy()
        bad[1, 0] = v
        yield ErrorCase("dequantize_fp8.scale_values", ArgumentError, (q.astype(np_dtype("float8_e5m2")), bad),
                        {"granularity": "token"})


@dequantize_fp8.cost
def _cost(q, scales, granularity, block, out_dtype):
    """Memory-bound: q (1 byte) and the scales read once, the output written once; one multiply per element."""
    n = int(np.prod(q.shape))
    return Cost(bytes=n + 4 * int(np.prod(scales.shape)) + n * np_dtype(out_dtype).itemsize, flops=n)
