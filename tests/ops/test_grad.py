"""Every op's backward: the float64 reference VJP against finite differences, the cpu backward kernel
against the reference on the backward cases of every dtype."""

from __future__ import annotations

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
