"""An op as declared in `opport/ops/<name>.py`: `@op(...)` and what attaches to it (see opport/spec/__init__.py)."""

from __future__ import annotations

from collections.abc import Callable

from opport.dtypes import FLOATS
from opport.spec.base import Spec
from opport.spec.derived import BackwardSpec, TrainForwardSpec, ValueAndGradSpec
from opport.spec.domains import Domain
from opport.spec.records import Case, Tolerance


class OpSpec(Spec):
    """A declared op. Its derived specs (training forward, backward, fused value-and-grad) look their shared parts
    up here when asked, so what is declared after `@<op>.backward` or `@<op>.saves` is seen by them too."""

    def __init__(self, fn: Callable, arrays: tuple, constraints: dict, dtypes: tuple, out_dtype: str | None,
                 writes: tuple = (), domains: dict | None = None):
        super().__init__(fn, arrays, constraints)
        self.dtypes = tuple(dtypes)
        unknown = [a for a in (domains or {}) if a not in self.arrays]
        if unknown:
            raise TypeError(f"{self.name}: domains {unknown} are not among its arrays {self.arrays}")
        self.domains: dict[str, Domain] = dict(domains or {})
        self.fixed_out_dtype = out_dtype
        self.module = self.name  # backends keep this op's kernels in `<backend package>.<module>`
        # the distribution that declares the op: "opport", or a plugin package (kernels in <package>.backends.<b>)
        self.package = (fn.__module__ or "opport").split(".")[0]
        self.output_names: tuple = ("out",)  # several for an op declared with @<op>.outputs
        self._out_metas: Callable | None = None
        self.output_tolerances: dict = {}  # output index (> 0) -> {dtype or "any": Tolerance}
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
        self.batch_args: tuple = ()  # set by <op>.batched(...): the arrays whose leading axis is the batch
        self.batch_when: Callable | None = None
        if self.writes:
            self.output_names = ()

    @property
    def derived(self) -> tuple:
        """The op's training forward, backward and fused value-and-grad, those it declares."""
        return tuple(d for d in (self.train_forward, self.backward_op, self.value_and_grad_op) if d is not None)

    def family(self) -> tuple:
        return (self, *self.derived)

    # -- attaching the parts only a declared op has

    def batched(self, *names: str, when: Callable | None = None):
        """Declare the op's batch: the arrays `names` share a leading axis of independent rows (tokens, sequences),
        and every output that has that axis follows it. The conformance suite then checks, on every backend, whether
        a row's output is bitwise the same computed alone, in its batch and at another position in it (batch
        invariance, docs/conformance.md); under `opport.batch_invariant()` a backend that declares the mode must
        make it so. `when(*bound)`: whether a call's leading axis is that batch (rmsnorm's 1-d x is one row)."""
        unknown = [n for n in names if n not in self.arrays]
        if unknown or not names:
            raise TypeError(f"{self.name}: batched {names}: name one or more of its arrays {self.arrays}")
        self.batch_args, self.batch_when = tuple(names), when

    def written(self, fn):
        """The region an op declared with `writes=` writes: `fn(*bound) -> one NumPy index per name in `writes``
        (e.g. `(blocks, offsets)` for rows picked by fancy indexing; bound integer arrays as NumPy). The
        reference returns the values written there, one float64 array per name, shaped like `arg[index]`. Written
        array i is judged with `tolerance(index=i, ...)` where declared (else the op's), in its own dtype.
        Everything outside the region must stay bitwise unchanged (the conformance suite checks it)."""
        self._written = fn
        return fn

    def written_region(self, bound: tuple) -> tuple:
        """One index per written argument (see `written`)."""
        return tuple(self._written(*bound))

    def outputs(self, names: tuple, integer: tuple = ()):
        """Declare an op that returns several arrays, `(names[0], names[1], ...)`, from their rule
        `fn(*bound) -> [(shape, dtype name), ...]` (bound arrays are Metas or arrays; scalars as given). Output 0
        is judged with the op's tolerances, output i > 0 with `output_tolerances[i]` (set with `tolerance(index=i,
        ...)`). `integer`: the outputs of an integer dtype (a router's expert indices, group offsets): judged
        exactly, and without a gradient (the backward takes no `grad_<name>` for them; torch and JAX see them as
        non-differentiable). Output 0 is floating."""

        def declare(fn):
            unknown = [n for n in integer if n not in names]
            if unknown or (integer and names[0] in integer):
                raise TypeError(f"{self.name}: integer outputs {tuple(integer)} must be among {tuple(names)[1:]}")
            self.output_names, self._out_metas, self.integer_outputs = tuple(names), fn, tuple(integer)
            return fn

        return declare

    def tolerance(self, index: int = 0, **per_dtype: Tolerance):
        """Override the base tolerance for some dtypes (each override says why in `reason`); `index` > 0: of
        that output of an op declared with @<op>.outputs (the key "any" applies to every dtype)."""
        if index:
            self.output_tolerances.setdefault(index, {}).update(per_dtype)
        else:
            self._tolerances.update(per_dtype)

    def tolerance_for(self, dtype: str, index: int, case: Case | None = None) -> Tolerance:
        """Output `index`'s tolerance: its declared one (`tolerance(index=i, ...)`; "any" for every dtype), else
        the case's override or the op's."""
        per = self.output_tolerances.get(index, {})
        if dtype in per or "any" in per:
            return per.get(dtype) or per["any"]
        return super().tolerance_for(dtype, index, case)

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

    # -- outputs

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


def op(arrays: tuple, constraints: dict | None = None, dtypes=FLOATS, out_dtype: str | None = None,
       dtype_param: str | None = None, writes: tuple = (), domains: dict | None = None):
    """Declare an op from its validation function (see opport/spec/__init__.py). `dtypes`: the dtypes that name
    a call (its first array's, or the `dtype_param` scalar's). `domains`: the array arguments that accept other
    dtypes (integer indices, fp8 codes, float32 scales), each with its `Domain` (opport/spec/domains.py); the
    others take the call's dtype. `dtype_param`: the scalar parameter (a dtype name) that names a call's dtype
    instead of the first array's (dequantize_fp8: its output dtype, since its input is an fp8 code). `writes`:
    the arrays the op writes in place (kv_cache_write's caches); such an op returns None, declares its region
    with `@<op>.written`, and has no backward."""

    def declare(fn):
        spec = OpSpec(fn, arrays, constraints or {}, dtypes, out_dtype, writes=tuple(writes), domains=domains)
        spec.dtype_pos = spec.params.index(dtype_param) if dtype_param else None
        return spec

    return declare
