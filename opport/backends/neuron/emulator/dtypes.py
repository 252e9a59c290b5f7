"""NKI dtypes as NumPy dtypes (16/8-bit floats through ml_dtypes), and the casts hardware does.

NumPy dtypes compare equal to their names, so `t.dtype == nl.float32` and `t.dtype == "float32"` both hold.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

bool_ = np.dtype(np.bool_)
int8, int16, int32 = np.dtype(np.int8), np.dtype(np.int16), np.dtype(np.int32)
uint8, uint16, uint32 = np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32)
float16, float32 = np.dtype(np.float16), np.dtype(np.float32)
bfloat16 = np.dtype(ml_dtypes.bfloat16)
float8_e4m3 = np.dtype(ml_dtypes.float8_e4m3)  # [U] docs/nki.md 2.8: Neuron's legacy E4M3 mapped to IEEE-style e4m3
float8_e5m2 = np.dtype(ml_dtypes.float8_e5m2)
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)
float8_e8m0fnu = np.dtype(ml_dtypes.float8_e8m0fnu)  # MX scale type (NKI 0.5): power-of-two exponent, NaN = 0xFF
tfloat32 = "tfloat32"  # no NumPy storage type: rejected with a clear message where used


def _packed(name: str, nbytes: int) -> np.dtype:
    """An x4 packed MX type: opaque bytes (a one-field structured dtype, so each name is a distinct dtype)."""
    return np.dtype([(name, np.uint8, (nbytes,))])


# four fp8 values in 32 bits, four fp4 values in 16 bits (nki.language dtype docs; NKI 0.3 update guide's
# `uint16.view(nl.float4_e2m1fn_x4)`); only data movement and nc_matmul_mx / quantize_mx (trn3) use them
float8_e4m3fn_x4 = _packed("float8_e4m3fn_x4", 4)
float8_e5m2_x4 = _packed("float8_e5m2_x4", 4)
float4_e2m1fn_x4 = _packed("float4_e2m1fn_x4", 2)

FLOATS = (float32, float16, bfloat16, float8_e4m3, float8_e5m2, float8_e4m3fn, float8_e8m0fnu)
INTS = (int8, int16, int32, uint8, uint16, uint32, bool_)
PACKED = (float8_e4m3fn_x4, float8_e5m2_x4, float4_e2m1fn_x4)
ALL = FLOATS + INTS + PACKED
MATMUL_INPUTS = (float32, float16, bfloat16, float8_e4m3, float8_e5m2, float8_e4m3fn)
_NAMES = {str(d): d for d in FLOATS + INTS} | {d.names[0]: d for d in PACKED} | {"bool_": bool_, "bfloat16": bfloat16}


def as_dtype(dtype, op: str = "nl") -> np.dtype:
    """Normalise a dtype spelling (NumPy dtype, type, or NKI name) to a supported NumPy dtype."""
    from opport.backends.neuron.emulator.errors import NkiValidationError

    if isinstance(dtype, str):
        if dtype == tfloat32:
            raise NkiValidationError(f"{op}: tfloat32 tiles are not supported by the opport emulator; use float32")
        if dtype in _NAMES:
            return _NAMES[dtype]
    try:
        d = np.dtype(dtype)
    except TypeError:
        d = None
    if d is None or d not in ALL:
        raise NkiValidationError(f"{op}: unsupported dtype {dtype!r}; NKI dtypes: {', '.join(sorted(_NAMES))}")
    return d


def name(d: np.dtype) -> str:
    """The NKI name of a dtype (packed types are structured dtypes whose str() is not their name)."""
    return d.names[0] if d in PACKED else str(d)


def is_packed(d) -> bool:
    return d in PACKED


def _no_packed_math(d: np.dtype, what: str):
    if d in PACKED:
        raise NotImplementedError(f"{what} {name(d)}: arithmetic and dtype conversion of packed x4 MX types are not "
                                  "emulated (NKI uses them in nisa.quantize_mx / nc_matmul_mx on NeuronCore-v4); "
                                  "copies between equal dtypes and .view() work")


def is_float(d: np.dtype) -> bool:
    return d in FLOATS


def is_int(d: np.dtype) -> bool:
    return d in INTS


def cast(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Hardware cast of float32 math results: RNE to floats; RNE with saturation to ints (NaN -> 0)."""
    values = np.asarray(values)
    if dtype == values.dtype:
        return values
    _no_packed_math(dtype, "casting to")
    if is_int(dtype) and values.dtype.kind == "f":
        if dtype == bool_:
            return values != 0
        info = np.iinfo(dtype)
        v = np.nan_to_num(np.rint(values.astype(np.float64)), nan=0.0, posinf=info.max, neginf=info.min)
        return np.clip(v, info.min, info.max).astype(dtype)
    # floats: ml_dtypes rounding, as the real simulator does with NKI_PRECISE_FP=1
    return values.astype(dtype)


def to_f32(values: np.ndarray) -> np.ndarray:
    """What the engines compute in: float32 (integers converted by value)."""
    values = np.asarray(values)
    _no_packed_math(values.dtype, "reading")
    return values.astype(np.float32)


def sentinel(dtype: np.dtype):
    """Fill value of fresh allocations: NaN for floats (4 for integers, as the real simulator does)."""
    return np.nan if is_float(dtype) else 4
