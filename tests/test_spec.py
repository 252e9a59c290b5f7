"""The declaration machinery (opport/spec/): derived specs look their forward up, so declaration order loses
nothing; every spec answers for itself what consumers would otherwise switch on."""

import numpy as np
import pytest

from opport.ops import all_ops, with_derived
from opport.spec import BASE_TOLERANCE, Case, Tolerance, op


def _declare():
    """A toy op with a training forward, a backward and a value-and-grad, declared before its tolerances."""

    @op(arrays=("x",))
    def toy(x, scale: float = 2.0):
        """y = scale * x."""

    @toy.reference
    def _ref(x, scale):
        return scale * x

    @toy.saves(("s",), shapes=lambda x, scale: [tuple(x.shape[:-1])])
    def _saved(x, scale):
        return (x.sum(axis=-1),)

    @toy.backward(wrt=("x",))
    def toy_backward(grad, x, s, scale: float = 2.0):
        """dx = scale * grad."""

    @toy_backward.reference
    def _bref(grad, x, s, scale):
        return (scale * grad,)

    @toy.value_and_grad()
    def toy_value_and_grad(x, scale: float = 2.0):
        """(y, dy/dx at grad 1)."""

    return toy, toy_backward


def test_declared_after_the_backward_is_seen_by_every_derived_spec():
    toy, toy_backward = _declare()
    late = Tolerance(1e-4, 1e-4, reason="declared after @toy.backward")
    toy.tolerance(float32=late)  # after @saves, @backward and @value_and_grad

    @toy.cases
    def _cases(dtype):
        yield Case("late", (np.ones((2, 3), dtype),))

    for spec in toy.family():
        assert spec.tolerance_for("float32", 0) == late, spec.name
        assert spec.tolerances["float16"] == BASE_TOLERANCE["float16"]
    assert [c.name for c in toy.train_forward.get_cases("float32")] == ["late"]
    assert [c.name for c in toy_backward.get_cases("float32")] == ["late"]
    assert [c.name for c in toy.value_and_grad_op.get_cases("float32")] == ["late"]


def test_a_derived_spec_overrides_without_touching_its_forward():
    toy, toy_backward = _declare()
    own = Tolerance(1e-3, 1e-3, reason="the backward's own")
    toy_backward.tolerance(float32=own)
    toy.tolerance(float16=Tolerance(2e-3, 1e-5, reason="later, on the forward"))
    assert toy_backward.tolerance_for("float32", 0) == own
    assert toy.tolerance_for("float32", 0) == BASE_TOLERANCE["float32"]
    assert toy_backward.tolerances["float16"].rtol == 2e-3  # the forward's later override reaches it


def test_specs_answer_for_themselves():
    toy, toy_backward = _declare()
    fwd, vag = toy.train_forward, toy.value_and_grad_op
    assert toy.family() == (toy, fwd, toy_backward, vag) and toy_backward.family() == (toy_backward,)
    assert [s.forward for s in toy.family()] == [toy] * 4
    assert (toy.output_labels, fwd.output_labels, toy_backward.output_labels, vag.output_labels) == (
        ("out",), ("out", "s"), ("dx",), ("out", "dx"))
    assert [s.public for s in toy.family()] == [True, False, False, False]
    assert [s.own_error_cases for s in toy.family()] == [True, False, True, True]
    assert [s.returns_list for s in toy.family()] == [False, False, True, False]
    assert fwd.tolerance_for("float16", 1) == BASE_TOLERANCE["float32"]  # statistics kept in float32
    assert {s.module for s in toy.family()} == {"toy"}


@pytest.mark.parametrize("spec", with_derived(all_ops().values()), ids=lambda s: s.name)
def test_every_spec_answers(spec):
    """Each registered spec gives labels for its outputs and a tolerance for each, in every dtype."""
    assert len(spec.output_labels) == spec.n_outputs
    for dtype in spec.dtypes:
        for i in range(spec.n_outputs):
            assert isinstance(spec.tolerance_for(dtype, i), Tolerance)
    assert spec in spec.forward.family()
