"""A few of an op's own conformance cases, to check a framework integration with (opcheck, jit tests)."""

from __future__ import annotations

import numpy as np


def small_cases(spec, dtype: str = "float32", limit: int = 2, max_elements: int = 4096) -> list:
    """A few of the op's own conformance cases, small and free of special values, to check an integration.

    Falls back to the smallest case when none is under `max_elements` elements in all.
    """

    def size(case):
        return sum(a.size for a in case.args if isinstance(a, np.ndarray))

    cases = [c for c in spec.get_cases(dtype) if "edge" not in c.tags]
    small = [c for c in cases if 0 < size(c) <= max_elements][:limit]
    return small or sorted(cases, key=size)[:1]
