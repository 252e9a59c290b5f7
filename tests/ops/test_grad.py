"""Every op's backward: the float64 reference VJP against finite differences, the cpu backward kernel
against the reference on the backward cases of every dtype."""

from __future__ import annotations

import numpy as np
import pytest

from opport.dtypes import FLOATS
from opport.ops import all_ops
from tests.ops._grad import check_backward_kernel, check_vjp_against_fd, fd_cases

DIFFERENTIABLE = [s for s in all_ops().values() if s.backward_op is not None]


@pytest.mark.parametrize("spec", DIFFERENTIABLE, ids=lambda s: s.name)
def test_reference_vjp_matches_finite_differences(spec):
    cases = fd_cases(spec)
    assert len(cases) >= 5, f"{spec.name}: only {len(cases)} finite float64 cases to check the VJP on"
    for case in cases:
        check_vjp_against_fd(spec, case)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("spec", DIFFERENTIABLE, ids=lambda s: s.name)
def test_cpu_backward_kernel_matches_reference(spec, dtype):
    for case in spec.backward_op.get_cases(dtype):
        if "large" in case.tags or "slow" in case.tags:
            continue
        check_backward_kernel(spec, case, dtype)


TRAINED = [s for s in DIFFERENTIABLE if s.train_forward is not None]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("spec", TRAINED, ids=lambda s: s.name)
def test_cpu_training_forward_is_the_forward_plus_its_statistics(spec, dtype):
    """The training forward returns the forward kernel's output bit for bit, and each statistic in the
    accumulation dtype with its declared shape, within that dtype's base tolerance of the reference."""
    from opport.accuracy import compare
    from opport.dispatch import get_backend, kernels
    from opport.dtypes import acc_dtype
    from opport.spec import BASE_TOLERANCE

    train = kernels(spec.train_forward, get_backend("cpu"))[0].fn
    forward = kernels(spec, get_backend("cpu"))[0].fn
    for case in spec.get_cases(dtype):
        bound = spec.bind(*case.args, **case.kwargs)
        out, *stats = train(*bound)
        np.testing.assert_array_equal(out, forward(*bound))
        metas = spec.train_forward.out_metas(bound)[1:]
        acc = acc_dtype(dtype).name
        for name, s, ref, (shape, _) in zip(spec.train_forward.stats, stats, spec.train_forward.run_stats(*bound), metas):
            assert s.dtype == acc and s.shape == shape, f"{spec.name}/{case.name}: {name} {s.dtype} {s.shape}"
            verdict = compare(s, np.asarray(ref), BASE_TOLERANCE[acc], acc)
            assert verdict.ok, f"{spec.name}/{dtype}/{case.name}: {name}: {verdict.message}"
