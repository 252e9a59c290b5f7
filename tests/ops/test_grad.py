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
        k = spec.n_outputs
        outs = train(*bound)
        out, stats = outs[:k], outs[k:]
        for o, f in zip(out, forward(*bound) if k > 1 else (forward(*bound),)):
            np.testing.assert_array_equal(o, f)
        metas = spec.train_forward.out_metas(bound)[k:]
        acc = acc_dtype(dtype).name
        for name, s, ref, (shape, _) in zip(spec.train_forward.stats, stats, spec.train_forward.run_stats(*bound), metas):
            assert s.dtype == acc and s.shape == shape, f"{spec.name}/{case.name}: {name} {s.dtype} {s.shape}"
            verdict = compare(s, np.asarray(ref), BASE_TOLERANCE[acc], acc)
            assert verdict.ok, f"{spec.name}/{dtype}/{case.name}: {name}: {verdict.message}"


FUSED = [s for s in DIFFERENTIABLE if s.value_and_grad_op is not None]


@pytest.mark.parametrize("spec", FUSED, ids=lambda s: s.name)
def test_value_and_grad_reference_is_the_forward_and_its_unit_vjp(spec):
    """The fused value-and-grad's float64 reference: output 0 is the forward's reference bit for bit, and each
    gradient agrees with central finite differences of the forward along random directions (upstream 1),
    and with the backward's reference at grad = 1 on the unrounded statistics (to float64's rounding)."""
    from tests.ops._grad import _fd_try, _steps, as64, backward_args64

    vag, bwd = spec.value_and_grad_op, spec.backward_op
    for case in fd_cases(spec):
        bound = tuple(as64(a) for a in spec.bind(*case.args, **case.kwargs))
        out, *grads = vag.run_reference(*bound)
        np.testing.assert_array_equal(out, spec.run_reference(*bound))
        ones = np.ones(np.shape(out))
        # float64 rounding apart: the fused reference may form x - lse as (x - m) - log(s) (cross_entropy's), which
        # keeps log(s) beside |m| ~ 1e38 where one float64 lse cannot (docs/numerics.md 3.5.1): no comparison there
        near_max = case.name.startswith("near-max")
        for got, want in zip(grads, () if near_max else bwd.run_reference(*backward_args64(bwd, bound, ones))):
            assert (got is None) == (want is None)  # an absent input (no bias): no gradient
            if got is not None:
                np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
        rng = np.random.default_rng(0)
        for name, dx in ((n, d) for n, d in zip(vag.wrt, grads) if d is not None):
            i = spec.params.index(name)
            u = rng.standard_normal(bound[i].shape)
            tries = [_fd_try(spec, bound, i, u, ones, dx, h) for h in _steps(bound[i])]
            assert any(ok for ok, _ in tries), f"{vag.name}/{case.name}: d{name}: " + "; ".join(m for _, m in tries)


@pytest.mark.parametrize("spec", FUSED, ids=lambda s: s.name)
def test_value_and_grad_declaration(spec):
    """Derived from the forward: its parameters, cases and tolerances (output 0 the forward's, gradients the
    backward's); its outputs are the output then one gradient per `wrt` input, shaped and typed like it."""
    vag = spec.value_and_grad_op
    assert vag.name == f"{spec.name}_value_and_grad" and vag.params == spec.params and vag.parent is spec
    assert vag.wrt == spec.backward_op.wrt and vag.n_outputs == 1 + len(vag.wrt)
    case = next(iter(vag.get_cases("bfloat16")))
    for d in FLOATS:
        assert vag.tolerance_for(d, 0, case) == spec.tolerances[d]
        assert vag.tolerance_for(d, 1, case) == spec.backward_op.tolerance_for(d, 0)
    metas = vag.out_metas(vag.bind(*case.args, **case.kwargs))
    assert metas[1] == (case.args[0].shape, case.args[0].dtype)


def test_value_and_grad_needs_a_backward_and_the_forward_signature():
    from opport.spec import op

    @op(arrays=("x",))
    def toy(x, eps=1.0):
        """A toy op."""

    with pytest.raises(TypeError, match="declare @toy.backward"):
        toy.value_and_grad()(lambda x, eps=1.0: None)

    @toy.backward(wrt=("x",))
    def toy_backward(grad, x, eps=1.0):
        """Its backward."""

    with pytest.raises(TypeError, match="takes the forward's parameters"):
        toy.value_and_grad()(lambda x: None)
