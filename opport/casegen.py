"""Building blocks for op conformance cases: seeded arrays, edge values, Hypothesis strategies.

Arrays are made by NumPy from a seed (cheap at LLM sizes); Hypothesis draws shapes, seeds and
value distributions, so it explores and shrinks over those instead of over millions of floats.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import zlib

import numpy as np

from opport.dtypes import finfo, np_dtype

DISTRIBUTIONS = ("normal", "uniform", "loguniform", "heavy", "specials")


# the elements a draw may still make (conformance/cases.py sets it per draw): a Hypothesis draw bigger than its
# tier's cap is dropped anyway, so it stops at its first array past the cap instead of making it (and the reference
# of it) first. None: no cap.
_BUDGET: contextvars.ContextVar = contextvars.ContextVar("opport_casegen_budget", default=None)


class OverBudget(Exception):
    """The arrays a draw asked for exceed the element budget set by `element_budget`; `name` is the draw's."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


class _Budget:
    def __init__(self, n: int):
        self.left, self.name = n, None


@contextlib.contextmanager
def element_budget(n: int | None):
    """Within it, `array` raises OverBudget once the arrays made (with the one asked for) exceed n elements, if the
    draw's name is known by then: `hyp-<seed>`, noted when `seeds()` draws the seed (opport's strategies name their
    cases so; a draw named otherwise is made in full and judged by its size after)."""
    token = _BUDGET.set(None if n is None else _Budget(n))
    try:
        yield
    finally:
        _BUDGET.reset(token)


def _spend(shape) -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.left -= math.prod(shape)
        if budget.left < 0 and budget.name is not None:
            raise OverBudget(budget.name)


def _note_seed(seed: int) -> int:
    budget = _BUDGET.get()
    if budget is not None and budget.name is None:
        budget.name = f"hyp-{seed}"
    return seed


def rng_for(*parts) -> np.random.Generator:
    """A generator seeded from the case's name, so a case is the same in every run."""
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


def array(shape, dtype: str, rng: np.random.Generator, dist: str = "normal", scale: float = 1.0) -> np.ndarray:
    """Random values of `dist`, rounded to `dtype` (bfloat16 via ml_dtypes)."""
    shape = tuple(shape)
    _spend(shape)
    if dist == "normal":
        a = rng.standard_normal(shape) * scale
    elif dist == "uniform":
        a = rng.uniform(-scale, scale, shape)
    elif dist == "loguniform":  # magnitudes spread over many binades
        a = np.exp(rng.uniform(np.log(1e-4), np.log(1e4), shape)) * rng.choice([-1.0, 1.0], shape) * scale
    elif dist == "heavy":
        a = rng.standard_t(2, shape) * scale
    elif dist == "specials":  # normal values with a sprinkle of the dtype's edge values
        a = rng.standard_normal(shape) * scale
        if a.size:
            e = edge_values(dtype)
            idx = rng.choice(a.size, size=max(1, a.size // 8), replace=a.size < 8)
            a.reshape(-1)[idx] = rng.choice(e, size=idx.size)
    else:
        raise ValueError(f"unknown distribution {dist!r}")
    return cast(a, dtype)


def cast(a, dtype: str) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(a, dtype=np.float64).astype(np_dtype(dtype))


def edge_values(dtype: str, finite: bool = False) -> np.ndarray:
    """docs/numerics.md section 4: zeros, ones, subnormals, the FTZ boundary, max finite, inf, NaN."""
    fi = finfo(dtype)
    tiny = float(fi.tiny)
    vals = [0.0, -0.0, 1.0, -1.0, 0.5, -2.0, 1e-3, -1e-3, tiny, -tiny, float(fi.smallest_subnormal),
            -float(fi.smallest_subnormal), tiny * (1 + float(fi.eps)), tiny * (1 - float(fi.eps)),
            float(fi.max), -float(fi.max), 10.0, -10.0, 20.0, -20.0, 90.0, -90.0]
    big = 13437.7 if dtype == "float16" else 4988429.2
    vals += [big, -big]
    if not finite:
        vals += [np.inf, -np.inf, np.nan]
    return cast(vals, dtype)


def interesting_lengths(block: int = 128) -> tuple:
    """Row lengths that catch tail bugs: 1, primes, block +- 1."""
    return (1, 23, block - 1, block, block + 1, 2 * block + 17)


# --------------------------------------------------------------------------- Hypothesis


def dims(min_value=1, max_value=300):
    from hypothesis import strategies as st

    return st.one_of(st.integers(min_value, max_value), st.sampled_from([1, 2, 17, 23, 63, 64, 65, 127, 128, 129, 255, 256]))


def seeds():
    from hypothesis import strategies as st

    return st.integers(0, 2**32 - 1).map(_note_seed)  # a strategy's first seed names its draw: hyp-<seed>


def dists(specials: bool = True):
    from hypothesis import strategies as st

    return st.sampled_from(DISTRIBUTIONS if specials else DISTRIBUTIONS[:-1])


def scales():
    from hypothesis import strategies as st

    return st.sampled_from([1e-3, 0.1, 1.0, 4.0, 30.0])
