"""nki.dtype: the NKI dtype names at module level (AWS modules do `from nki.dtype import float8_e4m3fn_x4`).

The same objects as nki.language's dtypes (NumPy dtypes; the x4 packed MX types are opaque byte records
that only move, see dtypes.py).
"""

from opport.backends.neuron.emulator.dtypes import (  # noqa: F401  (re-exported NKI names)
    bfloat16,
    bool_,
    float4_e2m1fn_x4,
    float8_e4m3,
    float8_e4m3fn,
    float8_e4m3fn_x4,
    float8_e5m2,
    float8_e5m2_x4,
    float8_e8m0fnu,
    float16,
    float32,
    int8,
    int16,
    int32,
    tfloat32,
    uint8,
    uint16,
    uint32,
)
