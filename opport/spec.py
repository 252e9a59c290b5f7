"""The op declaration machinery.

An op is declared once, in `opport/ops/<name>.py`, by decorating its validation function:

    @op(arrays=("x", "weight"), constraints={"rmsnorm.weight_shape": "weight.shape == (x.shape[-1],)"})
    def rmsnorm(x, weight=None, eps=1e-6):
        ...  # validation only: array arguments arrive as `Meta` (shape, dtype, device), never data

and then attaching the rest to the returned `OpSpec`:

    @rmsnorm.reference      # NumPy float64 reference, takes float64 arrays
    @rmsnorm.cases          # fixed conformance cases for one dtype
    @rmsnorm.strategy       # Hypothesis strategy of cases for one dtype
    @rmsnorm.error_cases    # one bad input per declared constraint
    @rmsnorm.cost           # bytes moved and FLOPs, from metas

This module is pure declaration: it imports neither the dispatcher nor any backend. Backends register
kernels for a declared op with `@impl(rmsnorm, "cuda", dtypes=..., supports=...)` (opport.dispatch), and
`opport.rmsnorm(x, w)` is a plain function generated from the declaration (opport/_ops.py, opport/public.py)
that hands its arguments to the dispatcher.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from opport import casegen, errors
from opport.dtypes import FLOATS, acc_dtype

# --------------------------------------------------------------------------- metadata


class Meta:
    """What validation and `supports(...)` may look at: an array's metadata, never its data."""

    __slots__ = ("kind", "dtype", "shape", "strides", "device")

    def __init__(self, kind: str, dtype: str, shape: tuple, strides: tuple | None, device: str):
        self.kind, self.dtype, self.shape = kind, dtype, tuple(shape)
        self.strides, self.device = strides, device  # strides in elements; None = contiguous

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    @property
    def contiguous(self) -> bool:
        return self.strides is None or self.strides == contiguous_strides(self.shape)

    def __repr__(self):
        return f"Meta({self.kind}, {self.dtype}, shape={self.shape}, strides={self.strides}, {self.device})"


def contiguous_strides(shape: tuple) -> tuple:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


# --------------------------------------------------------------------------- declarations


@dataclass(frozen=True)
class Tolerance:
    """How an output is compared with the float64 reference (docs/numerics.md section 3).

    metric: "elementwise" |a-r| <= atol + rtol*|r|; "normwise" |a-r| <= atol + rtol*max|r|
    (K-accumulating ops); "ulp_or_abs" passes where the error is <= `ulp` units in the last
    place of the dtype or <= atol (composite activations near cancellation).
    NaN positions and signed infinities are always exact; signed zeros too where `signed_zero`.
    """

    rtol: float
    atol: float
    metric: str = "elementwise"
    ulp: float | None = None
    reason: str = ""
    signed_zero: bool = False  # the reference defines the sign of its zeros (elementwise ops): check it exactly


# docs/numerics.md section 3.2
BASE_TOLERANCE = {
    "float64": Tolerance(1e-7, 1e-7),
    "float32": Tolerance(1.3e-6, 1e-5),
    "float16": Tolerance(1e-3, 1e-5),
    "bfloat16": Tolerance(1.6e-2, 1e-5),
}


@dataclass(frozen=True)
class Cost:
    """Minimum bytes a fused kernel must move (read + write once) and the FLOPs it performs."""

    bytes: int
    flops: int


@dataclass
class Case:
    """One conformance input: NumPy arrays already in the dtype under test, plus scalars."""

    name: str
    args: tuple
    kwargs: dict = field(default_factory=dict)
    tags: tuple = ()
    tolerance: Tolerance | None = None  # per-case override; must carry a reason


@dataclass
class ErrorCase:
    """A bad input and the typed error it must raise before any kernel runs."""

    constraint: str
    error: type
    args: tuple
    kwargs: dict = field(default_factory=dict)


class OpSpec:
    """One operator: signature, validation, reference, cases, tolerances, cost (kernels live in opport.dispatch)."""

    # "forward", "forward_train" (forward that also returns saved statistics), "backward", "value_and_grad"
    direction = "forward"

    def __init__(self, fn: Callable, arrays: tuple, constraints: dict, dtypes: tuple, out_dtype: str | None,
                 name: str | None = None, writes: tuple = ()):
        self.name = name or fn.__name__
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn
        self.signature = inspect.signature(fn)
        self.params = tuple(self.signature.parameters)
        self.arrays = tuple(arrays)
        self.array_pos = tuple(self.params.index(a) for a in arrays)
        self.scalar_pos = tuple(i for i in range(len(self.params)) if i not in self.array_pos)
        defaults = [p.default for p in self.signature.parameters.values()]
        self.optional_pos = tuple(i for i in self.array_pos if defaults[i] is None)  # arrays that may be None
        self.constraints = {
            f"{self.name}.array_type": "array arguments are NumPy arrays, torch tensors or JAX arrays",
            f"{self.name}.device": "all arrays on one device the backend can use",
            f"{self.name}.backend": "the backend asked for (keyword, use_backend, OPPORT_BACKEND) exists and can run here",
            f"{self.name}.supported": "a kernel of the chosen backend takes the call (else cpu, or an error in strict mode)",
            **constraints,
        }
        self.dtypes = tuple(dtypes)
        self.fixed_out_dtype = out_dtype
        self.validate = fn
        self._bind = _make_binder(fn)
        self.module = self.name  # backends keep this op's kernels in `<backend package>.<module>`
        # the distribution that declares the op: "opport", or a plugin package (kernels in <package>.backends.<b>)
        self.package = (fn.__module__ or "opport").split(".")[0]
        self._reference = self._cases = self._strategy = self._errors = self._cost = None
        self.reference_takes_dtype = False  # set by @<op>.reference: its reference is told the dtype under test
        self.tolerances: dict[str, Tolerance] = dict(BASE_TOLERANCE)
        self.invariants: list[Callable] = []
        self._shape: Callable | None = None
        self.output_names: tuple = ("out",)  # several for an op declared with @<op>.outputs
        self._out_metas: Callable | None = None
        self.output_tolerances: dict = {}  # output index (> 0) -> {dtype or "*": Tolerance}
        self.parent: OpSpec | None = None  # the forward op of a derived (training forward or backward) spec
        self.backward_op: BackwardSpec | None = None  # set by @<op>.backward
        self.train_forward: TrainForwardSpec | None = None  # set by @<op>.saves: the forward that returns stats too
        self.value_and_grad_op: ValueAndGradSpec | None = None  # set by @<op>.value_and_grad: forward + unit gradients
        # arrays the op writes in place (it returns None); `@<op>.written` gives the region, the reference its values
        unknown = [w for w in writes if w not in self.arrays]
        if unknown:
            raise TypeError(f"{self.name}: writes {unknown} are not among its arrays {self.arrays}")
        self.writes = tuple(writes)
        self.write_pos = tuple(self.params.index(w) for w in self.writes)
        self._written: Callable | None = None
        self._value_check: tuple | None = None  # (names, fn): a check of some arrays' values before any kernel
        self._magnitude: Callable | None = None  # @<op>.magnitude: sum |terms| per output element (K-accumulating ops)
        if self.writes:
            self.output_names = ()

    # -- attaching the parts of the declaration

    def reference(self, fn):
        """The float64 reference. A reference with a keyword-only `input_dtype` parameter also gets the name of the dtype under
        test (inputs still arrive as float64 copies): for ops that define a rounding to that dtype part-way
        (add_rmsnorm's sum); it defaults to the inputs' own dtype when called directly."""
        self._reference = fn
        self.reference_takes_dtype = "input_dtype" in inspect.signature(fn).parameters
        return fn

    def magnitude(self, fn):
        """For ops whose outputs are sums (K-accumulating): `fn(*bound)` (float64 inputs) gives, per output, the sum of
        the absolute values of its terms, sum_k |a_k b_k| (None for an output that is not one). A norm-wise tolerance
        then also allows one unit roundoff of that magnitude per element: where a sum cancels (sum |terms| >> |sum|),
        every summation order carries errors at that scale, and the verdict would otherwise depend on the order
        (docs/numerics.md 3.10)."""
        self._magnitude = fn
        return fn

    def get_magnitude(self, bound: tuple) -> tuple | None:
        if self._magnitude is None:
            return None
        with np.errstate(all="ignore"):
            out = self._magnitude(*bound)
        return out if isinstance(out, tuple) else (out,)

    def cases(self, fn):
        self._cases = fn
        return fn

    def strategy(self, fn):
        self._strategy = fn
        return fn

    def error_cases(self, fn):
        self._errors = fn
        return fn

    def cost(self, fn):
        self._cost = fn
        return fn

    def shape(self, fn):
        """The output's shape rule `fn(*bound) -> tuple`, for ops whose output is not shaped like their first array."""
        self._shape = fn
        return fn

    def written(self, fn):
        """The region an op declared with `writes=` writes: `fn(*bound) -> one NumPy index per name in `writes``
        (e.g. `(blocks, offsets)` for rows picked by fancy indexing; bound integer arrays as NumPy). The
        reference returns the values written there, one float64 array per name, shaped like `arg[index]`.
        Everything outside the region must stay bitwise unchanged (the conformance suite checks it)."""
        self._written = fn
        return fn

    def written_region(self, bound: tuple) -> tuple:
        """One index per written argument (see `written`)."""
        return tuple(self._written(*bound))

    def check_values(self, names: tuple):
        """Declare a check of some arrays' values (slot indices, block tables: small integer arrays), which
        metadata validation cannot see: `fn(*bound)` gets those arrays as NumPy (the others as given) and raises
        the op's typed errors. The dispatcher runs it on every call after validation and before any kernel
        (reading those arrays back from a device costs a synchronisation)."""

        def declare(fn):
            self._value_check = (tuple(self.params.index(n) for n in names), fn)
            return fn

        return declare

    def outputs(self, names: tuple):
        """Declare an op that returns several arrays, `(names[0], names[1], ...)`, from their rule
        `fn(*bound) -> [(shape, dtype name), ...]` (bound arrays are Metas or arrays; scalars as given). Output 0
        is judged with the op's tolerances, output i > 0 with `output_tolerances[i]` (set with `tolerance(index=i,
        ...)`)."""

        def declare(fn):
            self.output_names, self._out_metas = tuple(names), fn
            return fn

        return declare

    def invariant(self, fn):
        """A property the output must have beyond closeness (e.g. softmax rows sum to 1).

        `fn(out64, *bound)` gets the kernel's output upcast to float64 and the case's arguments, and
        returns None when the property holds, else a message saying how it fails.
        """
        self.invariants.append(fn)
        return fn

    def tolerance(self, index: int = 0, **per_dtype: Tolerance):
        """Override the base tolerance for some dtypes (each override says why in `reason`); `index` > 0: of
        that output of an op declared with @<op>.outputs (the key "any" applies to every dtype)."""
        if index:
            self.output_tolerances.setdefault(index, {}).update(per_dtype)
        else:
            self.tolerances.update(per_dtype)

    def tolerance_for(self, dtype: str, index: int, case: Case | None = None) -> Tolerance:
        """Output `index`'s tolerance: its declared one (`tolerance(index=i, ...)`; "any" for every dtype), else
        the case's override or the op's."""
        per = self.output_tolerances.get(index, {})
        if dtype in per or "any" in per:
            return per.get(dtype) or per["any"]
        return case.tolerance if case is not None and case.tolerance is not None else self.tolerances[dtype]

    def backward(self, wrt: tuple, constraints: dict | None = None, constants: dict | None = None,
                 reduces: tuple = ()):
        """Declare the op's backward (vector-Jacobian product) from its validation function.

        The function's signature is the backward kernels' signature: `grad` (the cotangent of the output),
        then what the forward saves for the backward, named as in the forward (its arrays, `out`, the
        statistics named by `@<op>.saves`), then the forward's scalars. Its docstring says what is saved
        and why. The backward returns one gradient per name in `wrt`, in order (None where that optional
        input was None). `constants`: the forward's array arguments that have no gradient, each with the
        reason (a gradient request for one is refused). `reduces`: the inputs whose gradient sums over
        rows (weights, biases, shared K/V): judged norm-wise, like other K-accumulating outputs
        (docs/numerics.md 3.1 rule 5).
        """

        def declare(fn):
            spec = BackwardSpec(fn, self, tuple(wrt), constraints or {}, dict(constants or {}), tuple(reduces))
            self.backward_op = spec
            return spec

        return declare

    def saves(self, names: tuple, shapes: Callable):
        """Declare statistics the forward saves for the backward, from their float64 reference `fn(*bound)`.

        `names` name them (as the backward's parameters do); `shapes(*bound)` gives their shapes. They are
        kept in the accumulation dtype: float32 (float64 for float64 inputs). The op then has a training
        forward, `<op>_forward`, returning (out, *stats): backends register kernels for it like any op
        (`@impl(<op>.train_forward, ...)`).
        """

        def declare(fn):
            self.train_forward = TrainForwardSpec(self, tuple(names), shapes, fn)
            return fn

        return declare

    def value_and_grad(self, constraints: dict | None = None):
        """Declare a fused training forward, `<op>_value_and_grad`, from its validation function (the forward's
        signature): it returns `(out, *d<input>)`, the output and the gradients of the backward's `wrt` inputs for a
        unit upstream gradient (ones shaped like the output), in the inputs' dtypes. Its float64 reference is the
        forward's and the backward's at that gradient (nothing to derive twice); its cases and strategy are the
        forward's; validation is the forward's (its bad inputs are checked there, naming the forward). Autograd
        runs it instead of the training forward where the selected backend has a kernel for it, and scales the
        saved gradients by the upstream gradient (opport/autodiff.py): worth it where the backward would re-read
        an input as large as the gradients (cross_entropy's logits)."""

        def declare(fn):
            if self.backward_op is None:
                raise TypeError(f"{self.name}: declare @{self.name}.backward before @{self.name}.value_and_grad")
            spec = ValueAndGradSpec(fn, self, constraints or {})
            self.value_and_grad_op = spec
            return spec

        return declare

    # -- using the declaration

    def bind(self, *args, **kwargs) -> tuple:
        """All parameters in signature order, defaults filled in (TypeError on a bad call)."""
        return self._bind(*args, **kwargs)

    def run_reference(self, *args, **kwargs):
        """The float64 reference on the given (already rounded) inputs, upcast to float64."""
        bound = list(self.bind(*args, **kwargs))
        dtype = getattr(self.dtype_of(bound), "name", None) if self.array_pos else None
        for i in self.array_pos:
            a = bound[i]
            if a is not None and getattr(a, "dtype", None) is not None and a.dtype.kind in "fV":
                with np.errstate(invalid="ignore"):  # NaN payloads of 16-bit inputs
                    bound[i] = a.astype("float64")
        return self.call_reference(bound, dtype)

    def call_reference(self, bound, dtype: str | None):
        """The reference on bound arguments as they are, told the dtype under test if it asks for it."""
        if self.reference_takes_dtype and dtype is not None:
            return self._reference(*bound, input_dtype=dtype)
        return self._reference(*bound)

    def get_cases(self, dtype: str) -> Iterable[Case]:
        return self._cases(dtype) if self._cases else ()

    def get_strategy(self, dtype: str):
        return self._strategy(dtype) if self._strategy else None

    def get_error_cases(self) -> Iterable[ErrorCase]:
        return self._errors() if self._errors else ()

    def get_cost(self, *args, **kwargs) -> Cost:
        return self._cost(*self.bind(*args, **kwargs))

    dtype_pos: int | None = None  # set by op(dtype_param=...)

    def dtype_of(self, bound: tuple) -> str:
        """The dtype that names a call (first array argument's dtype, or the `dtype_param` scalar)."""
        if self.dtype_pos is not None:
            return bound[self.dtype_pos]
        return bound[self.array_pos[0]].dtype

    @property
    def n_outputs(self) -> int:
        """1 for an op returning one array; the tuple's length for derived specs and ops that return several."""
        return len(self.output_names)

    def out_metas(self, bound: tuple) -> list:
        """[(shape, dtype)] per output (None for an output that is None for these arguments)."""
        if self._out_metas is not None:
            return [(tuple(s), d) for s, d in self._out_metas(*bound)]
        if self.writes:
            return []  # writes in place, returns None
        return [(self.out_shape(bound), self.out_dtype(bound))]

    def out_shape(self, bound: tuple) -> tuple:
        """The output's shape for bound arguments (arrays or Metas)."""
        if self._out_metas is not None:
            return self.out_metas(bound)[0][0]
        if self._shape is None:
            return tuple(bound[self.array_pos[0]].shape)
        return tuple(self._shape(*bound))

    def out_dtype(self, bound: tuple) -> str:
        if self._out_metas is not None:
            return self.out_metas(bound)[0][1]
        return self.fixed_out_dtype or self.dtype_of(bound)

    def __repr__(self):
        return f"<opport op {self.name}{self.signature}>"


class BackwardSpec(OpSpec):
    """An op's backward, declared with `@<op>.backward(...)`: an op in its own right (validation, float64
    reference, cases, tolerances, kernels, dispatch), named `<op>_backward`, whose kernels live in the
    same backend modules as the forward's."""

    direction = "backward"

    def __init__(self, fn, forward: OpSpec, wrt: tuple, constraints: dict, constants: dict, reduces: tuple):
        params = tuple(inspect.signature(fn).parameters)
        stats = forward.train_forward.stats if forward.train_forward else ()
        # one upstream gradient per forward output: `grad`, or `grad_<output>` for an op with several outputs
        grads = ("grad",) if forward.n_outputs == 1 else tuple(f"grad_{o}" for o in forward.output_names)
        outs = ("out",) if forward.n_outputs == 1 else forward.output_names
        strange = [p for p in params[len(grads):] if p not in (*outs, *forward.params, *stats)]
        if params[:len(grads)] != grads or strange:
            raise TypeError(f"{fn.__name__}: a backward takes {', '.join(grads)}, then the forward's parameters, "
                            f"{', '.join(outs)} and saved statistics (declare @saves first) by name; got {params}")
        arrays = tuple(p for p in params if p in (*grads, *outs, *forward.arrays, *stats))
        super().__init__(fn, arrays, constraints, forward.dtypes, None, name=f"{forward.name}_backward")
        unknown = [n for n in (*wrt, *constants) if n not in forward.arrays]
        if unknown or set(wrt) & set(constants) or set(wrt) | set(constants) != set(forward.arrays):
            raise TypeError(f"{self.name}: wrt {wrt} and constants {tuple(constants)} must split {forward.arrays}")
        self.parent, self.module, self.package = forward, forward.module, forward.package
        self.wrt, self.constants, self.reduces = wrt, constants, reduces
        self.grads, self.saved_outputs = grads, outs  # the upstream gradients' names; the names saved outputs take
        self.tolerances = dict(forward.tolerances)
        self._extra_cases = None
        self._case_tolerances: dict = {}  # case name -> {dtype: Tolerance}
        self.mutants: dict = {}  # name -> float64 function of the backward's arguments (plausible bugs)

    @property
    def n_outputs(self) -> int:
        return len(self.wrt)

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

    def mutant(self, name: str):
        """Declare a plausible wrong backward (a dropped term, a gradient not summed over rows, a wrong scale)
        as a float64 function of the backward's arguments: the gate's self-test runs it as a kernel and the
        conformance cases must catch it (opport.conformance.mutants)."""

        def declare(fn):
            self.mutants[name] = fn
            return fn

        return declare

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
        for i, (name, g, (shape, out_dtype)) in enumerate(zip(self.grads, grads, metas)):
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
                    by_name[name] = casegen.cast(o, getattr(out_dtype, "name", out_dtype))
            if fwd.train_forward is not None:
                stats = fwd.train_forward.run_stats(*bound)
                acc = acc_dtype(dtype).name
                by_name.update({n: casegen.cast(v, acc) for n, v in zip(fwd.train_forward.stats, stats)})
        tol = self._case_tolerances.get(case.name, {}).get(dtype)
        return Case(case.name, tuple(by_name[p] for p in self.params), {}, case.tags, tol)

    def get_cost(self, *args, **kwargs) -> Cost:
        """The declared cost (`@<op>_backward.cost`), else the minimum of any backward: every array it receives
        read once, every gradient written once (FLOPs unknown: 0)."""
        if self._cost is not None:
            return super().get_cost(*args, **kwargs)
        bound = self.bind(*args, **kwargs)
        read = sum(_nbytes(bound[i]) for i in self.array_pos if bound[i] is not None)
        written = sum(math.prod(m[0]) * _itemsize(m[1]) for m in self.out_metas(bound) if m is not None)
        return Cost(bytes=read + written, flops=0)

    def tolerance_for(self, dtype: str, index: int, case: Case | None = None) -> Tolerance:
        """The tolerance of gradient `index` (of `wrt`) for `case` (its override, if any, else the op's):
        norm-wise for gradients that sum over rows."""
        t = case.tolerance if case is not None and case.tolerance is not None else self.tolerances[dtype]
        if self.wrt[index] in self.reduces and t.metric != "normwise":
            reason = "sums over rows: judged norm-wise, as K-accumulating outputs (docs/numerics.md 3.1 rule 5)"
            return Tolerance(t.rtol, t.atol, "normwise", None, t.reason or reason)
        return t


def _itemsize(dtype) -> int:
    return np.dtype(casegen.np_dtype(getattr(dtype, "name", dtype))).itemsize


def _nbytes(a) -> int:
    """Bytes of an array or a Meta."""
    return math.prod(a.shape) * _itemsize(a.dtype)


class TrainForwardSpec(OpSpec):
    """The forward an op runs when a backward will follow: `(out, *stats)`, named `<op>_forward`. Declared by
    `@<op>.saves(...)`; validation, cases and error cases are the forward's."""

    direction = "forward_train"

    def __init__(self, forward: OpSpec, stats: tuple, shapes: Callable, reference: Callable):
        super().__init__(forward.validate, forward.arrays, {}, forward.dtypes, forward.fixed_out_dtype,
                         name=f"{forward.name}_forward")
        self.constraints = forward.constraints  # its validation is the forward's: errors name the op the user called
        self.parent, self.module, self.package, self.stats = forward, forward.module, forward.package, stats
        self._stat_shapes, self._stats_ref = shapes, reference
        self.tolerances = dict(forward.tolerances)
        self._shape = forward._shape
        self._reference = lambda *bound: (forward._reference(*bound), *reference(*bound))
        self._cases, self._strategy, self._cost = forward._cases, forward._strategy, forward._cost
        self.invariants = []  # the forward's invariants look at its single output

    @property
    def n_outputs(self) -> int:
        return 1 + len(self.stats)

    def out_metas(self, bound: tuple) -> list:
        dtype = self.dtype_of(bound)
        acc = acc_dtype(getattr(dtype, "name", dtype)).name
        return [(self.out_shape(bound), self.out_dtype(bound))] + [(tuple(s), acc) for s in self._stat_shapes(*bound)]

    def run_stats(self, *args, **kwargs) -> tuple:
        """The float64 reference of the saved statistics."""
        return tuple(self.run_reference(*args, **kwargs)[1:])


class ValueAndGradSpec(OpSpec):
    """The forward fused with its backward at a unit upstream gradient, declared by `@<op>.value_and_grad`:
    `(out, *gradients)`, named `<op>_value_and_grad`. Output 0 is judged as the forward's output, the gradients
    as the backward's (its per-gradient and per-case tolerances)."""

    direction = "value_and_grad"

    def __init__(self, fn, forward: OpSpec, constraints: dict):
        if tuple(inspect.signature(fn).parameters) != forward.params:
            raise TypeError(f"{fn.__name__}: a value_and_grad takes the forward's parameters {forward.params}")
        super().__init__(fn, forward.arrays, constraints, forward.dtypes, None, name=f"{forward.name}_value_and_grad")
        self.parent, self.module, self.package = forward, forward.module, forward.package
        self.wrt = forward.backward_op.wrt
        self.tolerances = dict(forward.tolerances)
        self._shape = forward._shape
        self._cases, self._strategy = forward._cases, forward._strategy  # bad inputs: the forward's own cases
        self._reference = self._fused_reference
        self.mutants: dict = {}  # name -> float64 function of the forward's arguments (plausible bugs)

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

    @property
    def n_outputs(self) -> int:
        return 1 + len(self.wrt)

    def out_metas(self, bound: tuple) -> list:
        """The forward's output, then per input in `wrt` its shape and dtype (None where it was None)."""
        metas = [(self.out_shape(bound), self.parent.out_dtype(bound))]
        for name in self.wrt:
            a = bound[self.params.index(name)]
            metas.append(None if a is None else (tuple(a.shape), a.dtype))
        return metas

    def out_dtype(self, bound: tuple) -> str:
        return self.parent.out_dtype(bound)

    def mutant(self, name: str):
        """A plausible wrong fused kernel as a float64 function of the forward's arguments (see BackwardSpec.mutant)."""

        def declare(fn):
            self.mutants[name] = fn
            return fn

        return declare

    def tolerance_for(self, dtype: str, index: int, case: Case | None = None) -> Tolerance:
        """Output 0: the case's override or the forward's tolerance; gradient i: the backward's for that case."""
        if index == 0:
            return case.tolerance if case is not None and case.tolerance is not None else self.tolerances[dtype]
        bwd = self.parent.backward_op
        tol = bwd._case_tolerances.get(case.name, {}).get(dtype) if case is not None else None
        return bwd.tolerance_for(dtype, index - 1, Case("", (), tolerance=tol) if tol is not None else None)

    def get_cost(self, *args, **kwargs) -> Cost:
        """The declared cost, else every array read once and every output written once (FLOPs unknown: 0)."""
        if self._cost is not None:
            return super().get_cost(*args, **kwargs)
        bound = self.bind(*args, **kwargs)
        read = sum(_nbytes(bound[i]) for i in self.array_pos if bound[i] is not None)
        written = sum(math.prod(m[0]) * _itemsize(m[1]) for m in self.out_metas(bound) if m is not None)
        return Cost(bytes=read + written, flops=0)


def op(arrays: tuple, constraints: dict | None = None, dtypes=FLOATS, out_dtype: str | None = None,
       dtype_param: str | None = None, writes: tuple = ()):
    """Declare an op from its validation function (see the module docstring). `dtype_param`: the scalar
    parameter (a dtype name) that names a call's dtype instead of the first array's (dequantize_fp8: its
    output dtype, since its input is an fp8 code). `writes`: the arrays the op writes in place (kv_cache_write's
    caches); such an op returns None, declares its region with `@<op>.written`, and has no backward."""

    def declare(fn):
        spec = OpSpec(fn, arrays, constraints or {}, dtypes, out_dtype, writes=tuple(writes))
        spec.dtype_pos = spec.params.index(dtype_param) if dtype_param else None
        return spec

    return declare


def _make_binder(fn: Callable) -> Callable:
    """A real Python function with `fn`'s signature that returns its arguments as a tuple.

    Argument binding is then done by the interpreter itself, which is much cheaper on the
    dispatch hot path than `inspect.Signature.bind`.
    """
    params, names, env = [], [], {}
    for i, p in enumerate(inspect.signature(fn).parameters.values()):
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            raise TypeError(f"{fn.__name__}: op parameters must be named, got {p}")
        if p.kind is p.KEYWORD_ONLY and "*" not in params:
            params.append("*")
        if p.default is p.empty:
            params.append(p.name)
        else:
            env[f"_d{i}"] = p.default
            params.append(f"{p.name}=_d{i}")
        names.append(p.name)
    src = f"def {fn.__name__}({', '.join(params)}):\n    return ({', '.join(names)},)\n"
    exec(compile(src, f"<opport binder {fn.__name__}>", "exec"), env)
    return env[fn.__name__]


# --------------------------------------------------------------------------- validation helpers
# Each raises the typed error of docs/design.md section 2 with the op, argument and constraint id.


def fail(error: type, op: str, arg: str | None, constraint: str, expected, got):
    raise error(op=op, arg=arg, constraint=constraint, expected=expected, got=got)


def check(cond: bool, error: type, op: str, arg: str | None, constraint: str, expected, got):
    if not cond:
        fail(error, op, arg, constraint, expected, got)


def check_float(op: str, arg: str, m: Meta, dtypes=FLOATS):
    check(m.dtype in dtypes, errors.DTypeError, op, arg, f"{op}.dtype", f"one of {', '.join(dtypes)}", m.dtype)


def check_same_dtype(op: str, first: str, m0: Meta, **others: Meta | None):
    for arg, m in others.items():
        if m is not None:
            check(m.dtype == m0.dtype, errors.DTypeError, op, arg, f"{op}.dtype_mismatch", f"{m0.dtype} (as {first})", m.dtype)


def check_ndim(op: str, arg: str, m: Meta, lo: int, hi: int | None = None, constraint: str | None = None):
    hi = lo if hi is None else hi
    ok = lo <= m.ndim and (hi < 0 or m.ndim <= hi)
    want = f"{lo}-d" if lo == hi else (f">= {lo}-d" if hi < 0 else f"{lo}-d to {hi}-d")
    check(ok, errors.ShapeError, op, arg, constraint or f"{op}.{arg}_rank", want, f"{m.ndim}-d {m.shape}")


def check_eps(op: str, eps):
    ok = isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isfinite(eps) and eps > 0
    check(ok, errors.ArgumentError, op, "eps", f"{op}.eps", "a finite number > 0", repr(eps))


def check_choice(op: str, arg: str, value, choices: tuple):
    check(value in choices, errors.ArgumentError, op, arg, f"{op}.{arg}", f"one of {choices}", repr(value))


def check_bool(op: str, arg: str, value):
    check(isinstance(value, bool), errors.ArgumentError, op, arg, f"{op}.{arg}", "True or False", repr(value))


def check_axis(op: str, arg: str, axis, ndim: int) -> int:
    ok = isinstance(axis, int) and not isinstance(axis, bool) and -max(ndim, 1) <= axis < max(ndim, 1)
    check(ok, errors.ArgumentError, op, arg, f"{op}.{arg}", f"an int in [-{max(ndim, 1)}, {max(ndim, 1)})", repr(axis))
    return axis % max(ndim, 1)



def check_grad(op: str, grad: Meta, shape: tuple, dtype: str, arg: str = "grad"):
    """A backward's upstream gradient (`arg`: `grad`, or `grad_<output>` of an op with several) has the forward
    output's shape and dtype."""
    check(grad is not None, errors.ArgumentError, op, arg, f"{op}.grad_shape", "an array", None)
    check(grad.dtype == dtype, errors.DTypeError, op, arg, f"{op}.grad_dtype", f"{dtype} (the output's dtype)",
          grad.dtype)
    check(tuple(grad.shape) == tuple(shape), errors.ShapeError, op, arg, f"{op}.grad_shape",
          f"{tuple(shape)} (the output's shape)", tuple(grad.shape))


GRAD_CONSTRAINTS = {"grad_dtype": "grad has the forward output's dtype", "grad_shape": "grad has the forward output's shape"}


def grad_constraints(op: str) -> dict:
    """The constraint ids `check_grad` raises, for a backward's declaration."""
    return {f"{op}_backward.{k}": v for k, v in GRAD_CONSTRAINTS.items()}
