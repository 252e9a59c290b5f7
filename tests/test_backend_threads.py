"""Every backend that can run here gives, from 8 threads with a cold selection cache, what it gives serially
(docs/numerics.md G9). Triton's interpreter is not thread-safe on its own: the cuda backend declares itself
`serialized` in interpreter mode and the dispatcher runs its kernels under a lock."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import opport
from opport.dispatch import backends, kernels


@pytest.mark.parametrize("name", [n for n, b in backends().items() if not b.unavailable()])
def test_threads_with_cold_cache_match_serial(name):
    """On the backend's own kernels (strict: no fallback) of rmsnorm and softmax, those it has."""
    ops = [op for op in (opport.rmsnorm, opport.softmax) if kernels(op.spec, backends()[name])]
    if not ops:
        pytest.skip(f"backend {name} has no rmsnorm or softmax kernel")
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((n, 512)).astype(np.float32) for n in (1, 3, 5, 8)]
    calls = [(op, x) for op in ops for x in xs]
    with opport.strict():
        serial = [op(x, backend=name) for op, x in calls]
    opport.clear_cache()
    errors, barrier = [], threading.Barrier(8)

    def worker(t):
        try:
            barrier.wait()
            with opport.strict():
                for i in range(24):
                    j = (t + i) % len(calls)
                    op, x = calls[j]
                    np.testing.assert_array_equal(op(x, backend=name), serial[j])
        except Exception as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
