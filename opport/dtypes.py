"""Canonical dtype names and their NumPy / torch / JAX spellings.

opport names dtypes by string ("float32", "bfloat16", ...). bfloat16 crosses into NumPy
through ml_dtypes, so nothing is lost on the way between frameworks.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

FLOATS = ("float32", "float16", "bfloat16", "float64")
LOW_PRECISION = ("float16", "bfloat16")
INTS = ("int64", "int32", "int16", "int8", "uint8")
FP8 = ("float8_e4m3fn", "float8_e5m2")  # quantize_fp8 / dequantize_fp8 storage formats (OCP FP8; ml_dtypes, torch)

_NP = {name: np.dtype(name) for name in ("float32", "float16", "float64", *INTS, "bool")}
_NP["bfloat16"] = np.dtype(ml_dtypes.bfloat16)
_NP.update({name: np.dtype(getattr(ml_dtypes, name)) for name in FP8})


def np_dtype(name: str) -> np.dtype:
    """NumPy dtype object for a canonical name (bfloat16 via ml_dtypes)."""
    return _NP[name]


def acc_dtype(name: str) -> np.dtype:
    """Accumulation dtype: float64 stays float64, everything else computes in float32."""
    return _NP["float64"] if name == "float64" else _NP["float32"]


def acc_of(dt: np.dtype) -> np.dtype:
    """acc_dtype of a NumPy dtype, for kernels on their hot path: `dt.name` is Python code in NumPy (about 3 us),
    `dt.type` an attribute (either byte order of float64 has type np.float64, as both have the name "float64")."""
    return _NP["float64"] if dt.type is np.float64 else _NP["float32"]


def is_float(name: str) -> bool:
    return name in FLOATS


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def finfo(name: str):
    return ml_dtypes.finfo(np_dtype(name))
