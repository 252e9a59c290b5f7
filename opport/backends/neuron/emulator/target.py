"""NeuronCore generations the emulator can model (docs/nki.md 2.2/2.3), selected per thread.

The default is trn2 (NeuronCore-v3); `NEURON_PLATFORM_TARGET_OVERRIDE` (the SDK's own variable) or
`use_target()` / `set_target()` pick another.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass

PMAX = 128
PSUM_BANKS = 8
PSUM_BANK_BYTES = 2048
PSUM_MIN_ALIGN = 4  # nl.tile_size.psum_min_align: byte alignment of a PSUM free-dim address


@dataclass(frozen=True)
class Target:
    name: str  # trn1 / trn2 / trn3
    version: int  # NeuronCore version: 2, 3, 4
    sbuf_partition_bytes: int  # usable bytes per partition (tile_size.total_available_sbuf_size)
    matmul_moving_fmax: int  # nc_matmul moving free size with a float32 destination

    @property
    def psum_partition_bytes(self) -> int:
        return PSUM_BANKS * PSUM_BANK_BYTES


TARGETS = {
    "trn1": Target("trn1", 2, 180224, 512),
    "trn2": Target("trn2", 3, 212984, 512),
    "trn3": Target("trn3", 4, 245752, 4096),
}
_ALIASES = {"inf2": "trn1", "gen2": "trn1", "gen3": "trn2", "gen4": "trn3"}
DEFAULT = "trn2"

_local = threading.local()


def resolve(name: str) -> Target:
    key = _ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in TARGETS:
        raise ValueError(f"unknown NKI target {name!r}; valid: {', '.join([*TARGETS, *_ALIASES])}")
    return TARGETS[key]


def from_env() -> Target:
    """The generation NEURON_PLATFORM_TARGET_OVERRIDE names (trn2 when unset)."""
    return resolve(os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE") or DEFAULT)


def current(env: Target | None = None) -> Target:
    """This thread's set_target/use_target choice, else `env` (from_env() read earlier), else from_env()."""
    t = getattr(_local, "target", None)
    if t is None:
        t = env or from_env()
    return t


def set_target(name: str | None):
    """Select the modelled generation for this thread (None: back to the env/default)."""
    _local.target = None if name is None else resolve(name)


@contextlib.contextmanager
def use_target(name: str):
    old = getattr(_local, "target", None)
    _local.target = resolve(name)
    try:
        yield _local.target
    finally:
        _local.target = old
