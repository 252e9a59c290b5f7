"""What every spec answers for itself, whether an op declared by hand or one derived from it (a training
forward, a backward, a fused value-and-grad): its parameters, outputs, reference, cases, tolerances, cost.

Consumers ask the spec, never which kind of spec it is: `output_labels`, `tolerance_for`, `family()`,
`public`, `kernels_optional`, `own_error_cases`, `returns_list` say what differs.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable

import numpy as np

from opport import casegen
from opport.spec.domains import Domain
from opport.spec.records import BASE_TOLERANCE, Case, Cost, ErrorCase, Tolerance


class Spec:
    """One callable op: signature, validation, reference, cases, tolerances, cost (kernels live in opport.dispatch)."""

    # data for reports: "forward", "forward_train" (also returns saved statistics), "backward", "value_and_grad"
    direction = "forward"
    public = True  # has a public function, `opport.<name>` (derived specs are called through the dispatcher)
    kernels_optional = False  # a backend may lack kernels for it (derived: calls then run on cpu)
    own_error_cases = True  # validates with its own bad inputs (a training forward validates as its forward)
    returns_list = False  # returns a list whose entries may be None (a backward's gradients), not fixed outputs
    parent = None  # the forward a derived spec is derived from
    output_names: tuple = ("out",)
    integer_outputs: tuple = ()  # outputs of an integer dtype (indices, offsets): compared exactly, no gradient
    writes = write_pos = ()  # arrays written in place (kv_cache_write's caches), by name and position
    _value_check: tuple | None = None
    _written: Callable | None = None

    def __init__(self, fn: Callable, arrays: tuple, constraints: dict, name: str | None = None):
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
        self.validate = fn
        self._bind = _make_binder(fn)
        self._reference = self._cases = self._strategy = self._errors = self._cost = None
        self.reference_takes_dtype = False  # set by @<op>.reference: its reference is told the dtype under test
        self.reference_takes_dtypes = False  # ... or its arrays' dtypes
        self._tolerances: dict[str, Tolerance] = {}  # this spec's own overrides (see `tolerances`)
        self.invariants: list[Callable] = []
        self._shape: Callable | None = None
        self._magnitude: Callable | None = None  # @<op>.magnitude: sum |terms| per output element (K-accumulating ops)
        self.mutants: dict = {}  # name -> float64 function of the spec's arguments (plausible bugs)

    # -- what derived specs look up in their forward (never copied: declaration order cannot lose anything)

    @property
    def forward(self) -> Spec:
        """The op as declared: itself, or the forward a derived spec comes from."""
        return self

    @property
    def tolerances(self) -> dict:
        """Per dtype: the base tolerance (a derived spec: its forward's), overridden by `tolerance(...)`."""
        return {**BASE_TOLERANCE, **self._tolerances}

    def family(self) -> tuple:
        """The specs a run of this one covers: an op and what is derived from it; a derived spec alone."""
        return (self,)

    domains: dict = {}  # argument -> Domain where it differs from the op's dtypes (see opport/spec/domains.py)

    def domain(self, arg: str) -> Domain:
        """The dtypes array argument `arg` accepts."""
        return self.domains.get(arg) or Domain("an array of the op's dtype", self.dtypes)

    # -- attaching the parts of the declaration

    def reference(self, fn):
        """The float64 reference. A reference with a keyword-only `input_dtype` parameter also gets the name of the dtype under
        test (inputs still arrive as float64 copies): for ops that define a rounding to that dtype part-way
        (add_rmsnorm's sum); it defaults to the inputs' own dtype when called directly. One with a keyword-only
        `dtypes` gets the array arguments' dtypes before the upcast, by name (kv_cache_write_fp8: its caches' fp8
        format)."""
        self._reference = fn
        self.reference_takes_dtype = "input_dtype" in inspect.signature(fn).parameters
        self.reference_takes_dtypes = "dtypes" in inspect.signature(fn).parameters
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

    def invariant(self, fn):
        """A property the output must have beyond closeness (e.g. softmax rows sum to 1).

        `fn(out64, *bound)` gets the kernel's output upcast to float64 and the case's arguments, and
        returns None when the property holds, else a message saying how it fails.
        """
        self.invariants.append(fn)
        return fn

    def tolerance(self, index: int = 0, **per_dtype: Tolerance):
        """Override the base tolerance for some dtypes (each override says why in `reason`)."""
        if index:
            raise TypeError(f"{self.name}: per-output tolerances (index={index}) are declared on an op with @outputs")
        self._tolerances.update(per_dtype)

    def check_values(self, names: tuple):
        """Declare a check of some arrays' values (slot indices, block tables: small integer arrays), which
        metadata validation cannot see: `fn(*bound)` gets those arrays as NumPy (the others as given) and raises
        the op's typed errors. The dispatcher runs it on every call after validation and before any kernel
        (reading those arrays back from a device costs a synchronisation); the training forward and the fused
        value-and-grad, which take the op's arguments, run it too."""

        def declare(fn):
            self._value_check = (tuple(self.params.index(n) for n in names), fn)
            return fn

        return declare

    def mutant(self, name: str):
        """Declare a plausible wrong kernel (a dropped term, a gradient not summed over rows, a wrong scale) as a
        float64 function of the spec's arguments: the gate's self-test runs it as a kernel and the conformance
        cases must catch it (opport.conformance.mutants)."""

        def declare(fn):
            self.mutants[name] = fn
            return fn

        return declare

    # -- using the declaration

    def bind(self, *args, **kwargs) -> tuple:
        """All parameters in signature order, defaults filled in (TypeError on a bad call)."""
        return self._bind(*args, **kwargs)

    def run_reference(self, *args, **kwargs):
        """The float64 reference on the given (already rounded) inputs, upcast to float64."""
        bound = list(self.bind(*args, **kwargs))
        dtype = getattr(self.dtype_of(bound), "name", None) if self.array_pos else None
        dtypes = self._dtypes(bound) if self.reference_takes_dtypes else None
        for i in self.array_pos:
            a = bound[i]
            if a is not None and getattr(a, "dtype", None) is not None and a.dtype.kind in "fV":
                with np.errstate(invalid="ignore"):  # NaN payloads of 16-bit inputs
                    bound[i] = a.astype("float64")
        return self.call_reference(bound, dtype, dtypes)

    def call_reference(self, bound, dtype: str | None, dtypes: dict | None = None):
        """The reference on bound arguments as they are, told the dtype under test (and the arrays' dtypes before
        any upcast: `dtypes`, else as they are) if it asks for them."""
        kw = {"input_dtype": dtype} if self.reference_takes_dtype and dtype is not None else {}
        if self.reference_takes_dtypes:
            kw["dtypes"] = self._dtypes(bound) if dtypes is None else dtypes
        return self._reference(*bound, **kw)

    def _dtypes(self, bound) -> dict:
        return {self.params[i]: str(bound[i].dtype).removeprefix("torch.") for i in self.array_pos
                if getattr(bound[i], "dtype", None) is not None}

    def get_cases(self, dtype: str) -> Iterable[Case]:
        return self._cases(dtype) if self._cases else ()

    def get_strategy(self, dtype: str):
        return self._strategy(dtype) if self._strategy else None

    def get_error_cases(self) -> Iterable[ErrorCase]:
        return self._errors() if self._errors else ()

    def get_cost(self, *args, **kwargs) -> Cost:
        """The declared cost, else every array read once and every output written once (FLOPs unknown: 0)."""
        bound = self.bind(*args, **kwargs)
        if self._cost is not None:
            return self._cost(*bound)
        read = sum(_nbytes(bound[i]) for i in self.array_pos if bound[i] is not None)
        written = sum(math.prod(m[0]) * _itemsize(m[1]) for m in self.out_metas(bound) if m is not None)
        return Cost(bytes=read + written, flops=0)

    dtype_pos: int | None = None  # set by op(dtype_param=...)

    def dtype_of(self, bound: tuple) -> str:
        """The dtype that names a call (first array argument's dtype, or the `dtype_param` scalar)."""
        if self.dtype_pos is not None:
            return bound[self.dtype_pos]
        return bound[self.array_pos[0]].dtype

    @property
    def output_labels(self) -> tuple:
        """A name per output, for reports and messages."""
        return self.output_names

    @property
    def grad_outputs(self) -> tuple:
        """The outputs a backward takes an upstream gradient for: the floating ones (an integer output has none)."""
        return tuple(o for o in self.output_labels if o not in self.integer_outputs)

    @property
    def n_outputs(self) -> int:
        """1 for an op returning one array; the tuple's length for derived specs and ops that return several."""
        return len(self.output_labels)

    def tolerance_for(self, dtype: str, index: int, case: Case | None = None) -> Tolerance:
        """Output `index`'s tolerance for `case`: the case's override, else the spec's."""
        return case.tolerance if case is not None and case.tolerance is not None else self.tolerances[dtype]

    def __repr__(self):
        return f"<opport op {self.name}{self.signature}>"


def _itemsize(dtype) -> int:
    return np.dtype(casegen.np_dtype(getattr(dtype, "name", dtype))).itemsize


def _nbytes(a) -> int:
    """Bytes of an array or a Meta."""
    return math.prod(a.shape) * _itemsize(a.dtype)


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
