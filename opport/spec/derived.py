"""Specs derived from a declared op: its backward, its training forward and its fused value-and-grad.

Each is an op in its own right (validation, float64 reference, cases, tolerances, kernels, dispatch), named
`<op>_backward`, `<op>_forward`, `<op>_value_and_grad`, with kernels in the same backend modules as the forward's.
What they share with the forward (dtypes, tolerances, cases, shape rule, cost, value checks) is looked up in the
forward when asked, never copied when declared.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterable

import numpy as np

from opport import casegen
from opport.dtypes import acc_dtype
from opport.spec.base import Spec
from opport.spec.records import BASE_TOLERANCE, Case, Cost, Tolerance


class DerivedSpec(Spec):
    """What every derived spec looks up in its forward."""

    public = False
    kernels_optional = True

    def __init__(self, fn: Callable, forward, arrays: tuple, constraints: dict, name: str):
        super().__init__(fn, arrays, constraints, name=name)
        self.parent = forward

    @property
    def forward(self):
        return self.parent

    @property
    def module(self) -> str:
        return self.parent.module

    @property
    def package(self) -> str:
        return self.parent.package

    @property
    def dtypes(self) -> tuple:
        return self.parent.dtypes

    @property
    def domains(self) -> dict:
        return self.parent.domains

    @property
    def tolerances(self) -> dict:
        return {**self.parent.tolerances, **self._tolerances}

    fixed_out_dtype = None


class SameArgumentsSpec(DerivedSpec):
    """A derived spec that takes the forward's arguments: its validation, dtype naming and value checks are the
    forward's."""

    @property
    def dtype_pos(self):
        return self.parent.dtype_pos

    @property
    def _value_check(self):
        return self.parent._value_check

    def out_shape(self, bound: tuple) -> tuple:
        return self.parent.out_shape(bound)

    def get_cases(self, dtype: str) -> Iterable[Case]:
        return self.parent.get_cases(dtype)

    def get_strategy(self, dtype: str):
        return self.parent.get_strategy(dtype)


class BackwardSpec(DerivedSpec):
    """An op's backward, declared with `@<op>.backward(...)`: it returns one gradient per input in `wrt`."""

    direction = "backward"
    returns_list = True

    def __init__(self, fn, forward, wrt: tuple, constraints: dict, constants: dict, reduces: tuple):
        params = tuple(inspect.signature(fn).parameters)
        stats = forward.train_forward.stats if forward.train_forward else ()
        # one upstream gradient per floating forward output: `grad`, or `grad_<output>` for an op with several
        grads = ("grad",) if forward.n_outputs == 1 else tuple(f"grad_{o}" for o in forward.grad_outputs)
        outs = ("out",) if forward.n_outputs == 1 else forward.output_names
        strange = [p for p in params[len(grads):] if p not in (*outs, *forward.params, *stats)]
        if params[:len(grads)] != grads or strange:
            raise TypeError(f"{fn.__name__}: a backward takes {', '.join(grads)}, then the forward's parameters, "
                            f"{', '.join(outs)} and saved statistics (declare @saves first) by name; got {params}")
        arrays = tuple(p for p in params if p in (*grads, *outs, *forward.arrays, *stats))
        super().__init__(fn, forward, arrays, constraints, name=f"{forward.name}_backward")
        unknown = [n for n in (*wrt, *constants) if n not in forward.arrays]
        if unknown or set(wrt) & set(constants) or set(wrt) | set(constants) != set(forward.arrays):
            raise TypeError(f"{self.name}: wrt {wrt} and constants {tuple(constants)} must split {forward.arrays}")
        self.wrt, self.constants, self.reduces = wrt, constants, reduces
        self.grads, self.saved_outputs = grads, outs  # the upstream gradients' names; the names saved outputs take
        self._extra_cases = None
        self._case_tolerances: dict = {}  # case name -> {dtype: Tolerance}

    @property
    def output_labels(self) -> tuple:
        return tuple(f"d{n}" for n in self.wrt)

    def dtype_of(self, bound: tuple) -> str:
        """The dtype of the first differentiable input the backward receives, else of `grad`."""
        for name in self.wrt:
            if name in self.params and bound[self.params.index(name)] is not None:
                return bound[self.params.index(name)].dtype
        return bound[0].dtype

    def out_metas(self, bound: tuple) -> list:
        """Per input in `wrt`: its shape and dtype where the backward receives it, else grad's (an input the
        forward does not save is shaped like the output, e.g. softmax's x, rope's x); None if it was None."""
        metas = []
        for name in self.wrt:
            a = bound[self.params.index(name)] if name in self.params else bound[0]
            metas.append(None if a is None else (tuple(a.shape), a.dtype if name in self.params else self.dtype_of(bound)))
        return metas

    def out_shape(self, bound: tuple) -> tuple:
        return self.out_metas(bound)[0][0]

    def out_dtype(self, bound: tuple) -> str:
        return self.dtype_of(bound)

    def cases(self, fn):
        """Backward-only cases (edge upstream gradients) beside those derived from the forward's cases."""
        self._extra_cases = fn
        return fn

    def case_tolerance(self, case: str, **per_dtype: Tolerance):
        """A reasoned tolerance for one derived case (by the forward case's name), per dtype."""
        if not all(t.reason for t in per_dtype.values()):
            raise ValueError(f"{self.name}: a case tolerance override needs a reason")
        self._case_tolerances.setdefault(case, {}).update(per_dtype)

    def get_cases(self, dtype: str) -> Iterable[Case]:
        for case in self.parent.get_cases(dtype):
            yield self.from_forward(case, dtype)
        if self._extra_cases:
            yield from self._extra_cases(dtype)

    def get_strategy(self, dtype: str):
        fwd = self.parent.get_strategy(dtype)
        return None if fwd is None else fwd.map(lambda case: self.from_forward(case, dtype))

    def from_forward(self, case: Case, dtype: str, grad=None) -> Case:
        """The backward case of a forward case: a seeded random `grad` of the output's shape and dtype (or the
        one given; a tuple, one per output, for an op with several), and what the forward saves (its outputs and
        statistics from the float64 reference, rounded to the output dtype and float32 as kernels would save
        them)."""
        fwd = self.parent
        bound = fwd.bind(*case.args, **case.kwargs)
        by_name = dict(zip(fwd.params, bound))
        metas = fwd.out_metas(bound)
        grads = (grad,) if len(self.grads) == 1 else (grad if grad is not None else (None,) * len(self.grads))
        floating = [m for o, m in zip(fwd.output_labels, metas) if o not in fwd.integer_outputs]
        for i, (name, g, (shape, out_dtype)) in enumerate(zip(self.grads, grads, floating)):
            out_dtype = getattr(out_dtype, "name", out_dtype)  # np.dtype of an array, or a Meta's name
            if g is None:
                seed = case.name if i == 0 else f"{case.name}/{name}"
                g = casegen.array(shape, out_dtype, casegen.rng_for(self.name, seed, dtype))
            by_name[name] = g
        with warnings.catch_warnings():  # an empty case's statistics: NumPy warns of the empty mean it returns
            warnings.filterwarnings("ignore", "Mean of empty slice", RuntimeWarning)
            if any(o in self.params for o in self.saved_outputs):
                outs = fwd.run_reference(*bound)
                outs = (outs,) if len(self.saved_outputs) == 1 else outs
                for name, o, (_, out_dtype) in zip(self.saved_outputs, outs, metas):
                    by_name[name] = casegen.cast(o, getattr(out_dtype, "name", out_dtype))  # exact for integers
            if fwd.train_forward is not None:
                stats = fwd.train_forward.run_stats(*bound)
                acc = acc_dtype(dtype).name
                by_name.update({n: casegen.cast(v, acc) for n, v in zip(fwd.train_forward.stats, stats)})
        tol = self._case_tolerances.get(case.name, {}).get(dtype)
        return Case(case.name, tuple(by_name[p] for p in self.params), {}, case.tags, tol)

    def tolerance_for(self, dtype: str, index: int, case: Case | None = None) -> Tolerance:
        """The tolerance of gradient `index` (of `wrt`) for `case` (its override, if any, else the op's):
        norm-wise for gradients that sum over rows."""
        t = super().tolerance_for(dtype, index, case)
        if self.wrt[index] in self.reduces and t.metric != "normwise":
            reason = "sums over rows: judged norm-wise, as K-accumulating outputs (docs/numerics.md 3.1 rule 5)"
            return Tolerance(t.rtol, t.atol, "normwise", None, t.reason or reason)
        return t


class TrainForwardSpec(SameArgumentsSpec):
    """The forward an op runs when a backward will follow: `(out, *stats)` (`(*outputs, *stats)` for an op with
    several outputs), named `<op>_forward`. Declared by `@<op>.saves(...)`; validation, cases and error cases are
    the forward's."""

    direction = "forward_train"
    own_error_cases = False  # its validation is the forward's: errors name the op the user called

    def __init__(self, forward, stats: tuple, shapes: Callable, reference: Callable):
        super().__init__(forward.validate, forward, forward.arrays, {}, name=f"{forward.name}_forward")
        self.constraints = forward.constraints
        self.stats, self._stat_shapes, self._stats_ref = stats, shapes, reference
        self._reference = lambda *bound: (*self._outputs_of(forward._reference(*bound)), *reference(*bound))

    def _outputs_of(self, out) -> tuple:
        return (out,) if self.parent.n_outputs == 1 else tuple(out)

    @property
    def fixed_out_dtype(self):
        return self.parent.fixed_out_dtype

    @property
    def output_labels(self) -> tuple:
        return (*(("out",) if self.parent.n_outputs == 1 else self.parent.output_labels), *self.stats)

    def out_dtype(self, bound: tuple) -> str:
        return self.parent.out_dtype(bound)

    def out_metas(self, bound: tuple) -> list:
        dtype = self.dtype_of(bound)
        acc = acc_dtype(getattr(dtype, "name", dtype)).name
        outs = [(self.out_shape(bound), self.out_dtype(bound))] if self.parent.n_outputs == 1 \
            else self.parent.out_metas(bound)
        return list(outs) + [(tuple(s), acc) for s in self._stat_shapes(*bound)]

    def get_cost(self, *args, **kwargs) -> Cost:
        return self.parent.get_cost(*args, **kwargs)

    def run_stats(self, *args, **kwargs) -> tuple:
        """The float64 reference of the saved statistics."""
        return tuple(self.run_reference(*args, **kwargs)[self.parent.n_outputs:])

    def tolerance_for(self, dtype: str, index: int, case: Case | None = None) -> Tolerance:
        """The outputs as the forward's; the statistics at the accumulation dtype's base tolerance."""
        if index >= self.parent.n_outputs:
            return BASE_TOLERANCE[acc_dtype(dtype).name]
        return self.parent.tolerance_for(dtype, index, case) if self.parent.n_outputs > 1 \
            else super().tolerance_for(dtype, index, case)


class ValueAndGradSpec(SameArgumentsSpec):
    """The forward fused with its backward at a unit upstream gradient, declared by `@<op>.value_and_grad`:
    `(out, *gradients)`, named `<op>_value_and_grad`. Output 0 is judged as the forward's output, the gradients
    as the backward's (its per-gradient and per-case tolerances)."""

    direction = "value_and_grad"

    def __init__(self, fn, forward, constraints: dict):
        if tuple(inspect.signature(fn).parameters) != forward.params:
            raise TypeError(f"{fn.__name__}: a value_and_grad takes the forward's parameters {forward.params}")
        super().__init__(fn, forward, forward.arrays, constraints, name=f"{forward.name}_value_and_grad")
        self._reference = self._fused_reference

    @property
    def wrt(self) -> tuple:
        return self.parent.backward_op.wrt

    @property
    def output_labels(self) -> tuple:
        return ("out", *(f"d{n}" for n in self.wrt))

    def _fused_reference(self, *bound):
        """The forward's reference and the backward's at grad = 1, on float64 inputs, with the float64 saved
        statistics (not rounded: the fused kernel never stores them)."""
        fwd, bwd = self.parent, self.parent.backward_op
        out = fwd._reference(*bound)
        by_name = dict(zip(fwd.params, bound))
        by_name["out"] = out
        if fwd.train_forward is not None:
            by_name.update(zip(fwd.train_forward.stats, fwd.train_forward._stats_ref(*bound)))
        by_name["grad"] = np.ones(np.shape(out), np.asarray(out).dtype)
        return (out, *bwd._reference(*(by_name[p] for p in bwd.params)))

    def out_metas(self, bound: tuple) -> list:
        """The forward's output, then per input in `wrt` its shape and dtype (None where it was None)."""
        metas = [(self.out_shape(bound), self.parent.out_dtype(bound))]
        for name in self.wrt:
            a = bound[self.params.index(name)]
            metas.append(None if a is None else (tuple(a.shape), a.dtype))
        return metas

    def out_dtype(self, bound: tuple) -> str:
        return self.parent.out_dtype(bound)

    def tolerance_for(self, dtype: str, index: int, case: Case | None = None) -> Tolerance:
        """Output 0: the case's override or the forward's tolerance; gradient i: the backward's for that case."""
        if index == 0:
            return super().tolerance_for(dtype, index, case)
        bwd = self.parent.backward_op
        tol = bwd._case_tolerances.get(case.name, {}).get(dtype) if case is not None else None
        return bwd.tolerance_for(dtype, index - 1, Case("", (), tolerance=tol) if tol is not None else None)
