"""nki.isa.constants: the ISA enums (AWS modules import them as `from nki.isa.constants import oob_mode`).

Since NKI 0.3 enum parameters take named members only: a raw integer such as `dge_mode=2` is a
compile error (NKI 0.3.0 update guide, "Integer enum constants no longer supported"); `enum_arg`
enforces that for every instruction.
"""

from __future__ import annotations

from enum import Enum, IntEnum

from opport.backends.neuron.emulator.errors import NkiValidationError


class engine(Enum):
    tensor = "tensor"
    vector = "vector"
    scalar = "scalar"
    gpsimd = "gpsimd"
    dma = "dma"
    sync = "sync"
    unknown = "unknown"


class reduce_cmd(Enum):
    idle = "idle"
    reset = "reset"
    reduce = "reduce"
    reset_reduce = "reset_reduce"
    load_reduce = "load_reduce"


class dge_mode(Enum):
    unknown = "unknown"
    swdge = "swdge"
    hwdge = "hwdge"
    none = "none"


class oob_mode(Enum):
    error = "error"
    skip = "skip"


class matmul_perf_mode(Enum):
    none = "none"
    double_row = "double_row"


class nc_version(IntEnum):
    gen2 = 2
    gen3 = 3
    gen4 = 4


class dma_engine(Enum):
    dma = "dma"
    gpsimd_dma = "gpsimd_dma"


def enum_arg(value, cls, op: str, param: str):
    """`value` if it is a member of `cls`; raw integers (and anything else) are rejected, as in NKI >= 0.3."""
    if isinstance(value, cls):
        return value
    hint = f"nisa.{cls.__name__}.{next(iter(cls)).name}"
    if isinstance(value, int) and not isinstance(value, bool):
        raise NkiValidationError(f"{op}: {param}={value!r} is a raw integer enum constant; NKI >= 0.3 accepts only "
                                 f"named members such as {hint}")
    raise NkiValidationError(f"{op}: {param} must be a nisa.{cls.__name__} member such as {hint}, got {value!r}")


__all__ = ["engine", "reduce_cmd", "dge_mode", "oob_mode", "matmul_perf_mode", "nc_version", "dma_engine"]
