"""Which cases a run checks: the op's fixed cases, layout variants of them, Hypothesis examples, bad inputs.

Everything here is deterministic from (op, backend, dtype, Selection): a worker process rebuilds
the same list the parent asked for, and a repro command rebuilds the single case it names.

Case names: fixed cases keep their declared name; a layout variant is `<name>@<layout>`; Hypothesis
examples keep the strategy's name (`hyp-<seed>`, de-duplicated with `~2`, `~3`); bad inputs are
`bad-<constraint id>`. A case id is `<op>/<backend>/<dtype>/<name>` (`n/a` as dtype for bad inputs).
"""

from __future__ import annotations

import contextlib
import fnmatch
from dataclasses import dataclass, field

import numpy as np

from opport import casegen
from opport.spec import Case, ErrorCase, OpSpec

LAYOUTS = ("transposed", "sliced", "expanded", "offset")
OFFSET = 3  # elements before an offset view: odd, so the start is also misaligned
# Per tier: Hypothesis examples per op x dtype, element caps (all array arguments together), and whether fixed
# cases beyond the layout coverage (every tier's) get a rotating layout (`rotate`, at most `rotate_max` per op x
# dtype). A `<knob>_emulated` value replaces `<knob>` on a backend that emulates a device on this CPU (its
# Capabilities.emulated()); an `examples_compiled` value, on a backend that compiles per shape (XLA:
# Capabilities.compiles_per_shape). smoke: every op, backend and dtype in a few minutes (make run), a subset of fast;
# fast: the CI gate; full: thousands of examples, every layout. `batch`: how many cases per op x dtype are also run
# as batch-invariance items (smoke: none).
TIERS = {
    "smoke": {"examples": 10, "examples_emulated": 3, "examples_compiled": 3, "hyp_max": 1 << 16, "hyp_max_emulated": 1 << 12,
              "case_max": 1 << 16, "case_max_emulated": 1 << 14, "layout_max": 1 << 14, "rotate": False,
              "skip_tags": ("large", "slow")},
    "fast": {"examples": 100, "examples_emulated": 4, "examples_compiled": 6, "hyp_max": 1 << 20, "hyp_max_emulated": 1 << 13,
             "case_max_emulated": 1 << 16, "layout_max": 1 << 16, "layout_max_emulated": 1 << 14, "rotate": True,
             "rotate_max_emulated": 4, "batch": 2, "batch_emulated": 1, "batch_max": 1 << 18,
             "batch_max_emulated": 1 << 15,
             "skip_tags": ("large", "slow")},
    "full": {"examples": 1000, "examples_emulated": 1000, "hyp_max": None, "hyp_max_emulated": 1 << 20,
             "case_max_emulated": None, "layout_max": 1 << 20, "rotate": True, "batch": 4, "skip_tags": ()},
}


@dataclass(frozen=True)
class Selection:
    """What to run for one (op, backend, dtype): the tier knobs plus the user's filters."""

    tier: str = "fast"
    examples: int | None = None  # Hypothesis examples per op x dtype; None = the tier's default
    seed: int = 0
    cases: tuple = ()  # fnmatch patterns on case names; an explicit choice bypasses tier filters
    emulated: bool = False  # the backend emulates a device on this CPU (Capabilities.emulated())
    layouts: bool = True
    compiled: bool = False  # each new shape compiles first (Capabilities.compiles_per_shape)

    def n_examples(self) -> int:
        return self.examples if self.examples is not None else self.knob("examples")

    def knob(self, key: str):
        t = TIERS[self.tier]
        if self.emulated:
            return t.get(f"{key}_emulated", t.get(key))
        return t.get(f"{key}_compiled", t.get(key)) if self.compiled else t.get(key)

    def wants(self, name: str) -> bool:
        return not self.cases or any(fnmatch.fnmatchcase(name, p) for p in self.cases)


@dataclass
class Item:
    """One case to run: a fixed, layout or Hypothesis case, or a bad input."""

    op: str
    backend: str
    dtype: str
    name: str
    case: Case | None = None
    layout: str | None = None
    source: str = "fixed"  # fixed | layout | hypothesis | error | batch
    error: ErrorCase | None = None
    tags: tuple = field(default_factory=tuple)
    missing: tuple = ()  # source "coverage": declared constraint ids without a bad input

    @property
    def id(self) -> str:
        return f"{self.op}/{self.backend}/{self.dtype}/{self.name}"


def elements(case: Case) -> int:
    return sum(a.size for a in case.args if isinstance(a, np.ndarray)) + sum(
        a.size for a in case.kwargs.values() if isinstance(a, np.ndarray))


def items_for(spec: OpSpec, backend: str, dtype: str, sel: Selection) -> list[Item]:
    """Fixed cases, then their layout variants, then Hypothesis examples, filtered by `sel`."""
    explicit = bool(sel.cases)
    skip_tags, case_max = sel.knob("skip_tags"), sel.knob("case_max")
    declared = [c for c in declared_cases(spec, dtype) if explicit or not set(c.tags) & set(skip_tags)]
    fixed = [c for c in declared if explicit or case_max is None or elements(c) <= case_max]
    out = [Item(spec.name, backend, dtype, c.name, c, tags=tuple(c.tags)) for c in fixed if sel.wants(c.name)]
    if sel.layouts:
        out += [it for it in _layout_items(spec, backend, dtype, declared, fixed, sel) if sel.wants(it.name)]
    out += [it for it in _batch_items(spec, backend, dtype, fixed, sel) if sel.wants(it.name)]
    if sel.cases and not any(fnmatch.fnmatchcase("hyp-0", p) or "hyp" in p for p in sel.cases):
        return out  # a named fixed case: no need to draw examples
    out += [Item(spec.name, backend, dtype, c.name, c, source="hypothesis", tags=tuple(c.tags))
            for c in hypothesis_cases(spec, dtype, sel) if sel.wants(c.name)]
    return out


_SHARED: dict | None = None  # (spec id, dtype) -> (spec, its declared cases), the latest few, inside shared_cases()
_SHARED_KEEP = 2


@contextlib.contextmanager
def shared_cases():
    """Within: the declared cases of the latest (op, dtype)s are kept and shared by every backend's items (their
    arrays never reach a kernel: `lay_out` copies them). For runs that build one op's batches in a row."""
    global _SHARED
    outer, _SHARED = _SHARED, {}
    try:
        yield
    finally:
        _SHARED = outer


def declared_cases(spec: OpSpec, dtype: str) -> list[Case]:
    if _SHARED is None:
        return list(spec.get_cases(dtype))
    key = (id(spec), dtype)
    if key not in _SHARED:
        while len(_SHARED) >= _SHARED_KEEP:
            del _SHARED[next(iter(_SHARED))]
        _SHARED[key] = (spec, list(spec.get_cases(dtype)))  # the spec kept alive: its id is not reused meanwhile
    return _SHARED[key][1]


def _layout_items(spec, backend, dtype, declared, fixed, sel) -> list[Item]:
    """Coverage first: for every layout and every array argument it applies to, the smallest declared case
    giving that argument that layout (every tier, whatever its size caps: so each strided read of each input
    is checked on every backend, forward and backward). Then the full tier gives every case all four
    layouts; fast rotates one layout per case under its size cap; smoke runs the coverage alone, so
    whatever smoke runs, fast runs too (tests/test_conformance_tiers.py)."""
    usable = lambda c: [lay for lay in LAYOUTS if applies(lay, c) and not (spec.writes and lay == "expanded")]
    pairs = [] if sel.cases else coverage_pairs([c for c in declared if _taken(spec, c, backend)], usable)
    limit = sel.knob("layout_max")
    if sel.cases or sel.tier == "full":
        pairs += [(c, lay) for c in fixed if elements(c) and (sel.cases or elements(c) <= limit) for lay in usable(c)]
    elif sel.knob("rotate"):
        eligible = [c for c in fixed if 0 < elements(c) <= limit and usable(c)]
        pairs += [(c, usable(c)[k % len(usable(c))]) for k, c in enumerate(eligible)][:sel.knob("rotate_max")]
    items, seen = [], set()
    for c, lay in pairs:
        if (c.name, lay) not in seen:
            seen.add((c.name, lay))
            items.append(Item(spec.name, backend, dtype, f"{c.name}@{lay}", c, lay, "layout", tuple(c.tags)))
    return items


def _batch_items(spec: OpSpec, backend: str, dtype: str, fixed: list, sel: Selection) -> list[Item]:
    """Batch invariance: cases whose batch has at least 2 rows, each run whole, row by row alone and in reverse order
    (opport/conformance/execute.py `_batch_case`); ops that declare a batch (`<op>.batched`) only. The largest case
    under the tier's caps first (small products are often invariant where large ones are not: BLAS changes kernels
    with the shape), then the smallest, then the rest from large to small, `batch` of them."""
    if not getattr(spec, "batch_args", ()) or not sel.knob("batch"):
        return []
    cap = sel.knob("batch_max")
    eligible = sorted((c for c in fixed if batch_rows(spec, c) >= 2 and (cap is None or elements(c) <= cap)),
                      key=elements, reverse=True)
    order = [*eligible[:1], *eligible[-1:], *eligible[1:-1]] if len(eligible) > 1 else eligible
    picked = order[:sel.knob("batch")]
    return [Item(spec.name, backend, dtype, f"{c.name}@batch", c, source="batch", tags=tuple(c.tags)) for c in picked]


def batch_rows(spec: OpSpec, case: Case) -> int:
    """The size of a case's batch (the leading axis of the op's first batched array), 0 when it has none."""
    bound = spec.bind(*case.args, **case.kwargs)
    a = bound[spec.params.index(spec.batch_args[0])]
    if spec.batch_when is not None and not spec.batch_when(*bound):
        return 0
    return a.shape[0] if isinstance(a, np.ndarray) and a.ndim else 0


def _taken(spec: OpSpec, case: Case, backend: str) -> bool:
    """Whether `backend` has a kernel for the case (coverage counts only cases a kernel runs, not ones it declines:
    neuron declines e4m3 scaled_matmul, so its strided scales are covered by e5m2 cases)."""
    from opport.dispatch.core import takes
    from opport.errors import OpError

    try:
        return takes(spec, spec.bind(*case.args, **case.kwargs), backend)
    except (OpError, ValueError, TypeError):  # not a backend here (mutants, tests), or the case is the kernel's to judge
        return True


def coverage_pairs(cases: list, usable) -> list:
    """[(case, layout)]: for each layout and each argument position it can apply to in some case, the
    smallest such case (`size`; declared order breaks ties)."""
    best: dict = {}
    for order, c in enumerate(cases):
        if not elements(c):
            continue
        for lay in usable(c):
            for pos in _positions(c):
                a = _arg_at(c, pos)
                key = (lay, pos)
                if isinstance(a, np.ndarray) and _arg_applies(lay, a) and (key not in best or size(c) < best[key][0]):
                    best[key] = (size(c), order, c)
    picked = sorted({(order, lay): c for (lay, _), (_, order, c) in best.items()}.items(),
                    key=lambda kv: (LAYOUTS.index(kv[0][1]), kv[0][0]))
    return [(c, lay) for (_, lay), c in picked]


def size(case: Case) -> tuple:
    """Smallest first, but a case with an empty array last: its outputs may not depend on the others at all."""
    return (any(a.size == 0 for a in _arrays(case)), elements(case))


def _positions(case: Case) -> list:
    return list(range(len(case.args))) + list(case.kwargs)


def _arg_at(case: Case, pos):
    return case.args[pos] if isinstance(pos, int) else case.kwargs[pos]


def hypothesis_cases(spec: OpSpec, dtype: str, sel: Selection) -> list[Case]:
    """`n` examples of the op's strategy, reproducible from `sel.seed`.

    Draw i depends only on (seed, i) (`draw_examples`), so a tier with fewer examples or a tighter element
    cap runs a subset of a larger tier's examples, under the same names. Draws above the tier's cap are
    dropped, drawing up to twice as many to make up the count.
    """
    n = sel.n_examples()
    strategy = spec.get_strategy(dtype)
    if strategy is None or n <= 0:
        return []
    cap = sel.knob("hyp_max")
    return draw_examples(strategy, 2 * n if cap else n, sel.seed, keep=lambda c: cap is None or elements(c) <= cap,
                         stop=n, budget=cap)


def draw_examples(strategy, n: int, seed: int, keep=lambda case: True, stop: int | None = None,
                  budget: int | None = None) -> list:
    """Examples 0..n-1 of `strategy`: 0 is its simplest example, i > 0 a random draw from Random(f"{seed}:{i}").

    Each draw is independent of n and of the others (Hypothesis's engine, by contrast, adapts what it
    generates to max_examples, so 6 examples are not the first 6 of 200), and of which modules are imported:
    Hypothesis mixes constants found in the importing code's modules into its draws (`_get_local_constants`),
    which made the gate draw different examples on different machines; here that pool is empty. A draw
    the strategy rejects (filter, assume) or `keep` refuses is left out; drawing ends once `stop` are kept.
    Names repeated by earlier draws get `~<i>`. A draw whose `casegen.array` calls ask for more than `budget`
    elements in all is left out at the first array past it, before that array (or the reference of the draw) is
    made: the tier's cap applied during the draw, not after it (a draw's arrays can outnumber its case's: a
    backward case keeps the forward's sum, not its two inputs); monotone in the cap, so tiers still nest.
    """
    from random import Random

    from hypothesis.control import BuildContext
    from hypothesis.errors import StopTest, UnsatisfiedAssumption
    from hypothesis.internal.conjecture import providers
    from hypothesis.internal.conjecture.choice import ChoiceTemplate
    from hypothesis.internal.conjecture.data import ConjectureData

    out, seen = [], set()
    saved = providers._get_local_constants
    providers._get_local_constants = lambda: providers.Constants()
    providers.CONSTANTS_CACHE.cache.clear()
    try:
        for i in range(n):
            prefix = [ChoiceTemplate("simplest", count=None)] if i == 0 else None
            data = ConjectureData(random=Random(f"{seed}:{i}"), prefix=prefix)
            try:
                with BuildContext(data, wrapped_test=None), casegen.element_budget(budget):
                    case = data.draw(strategy)
            except (StopTest, UnsatisfiedAssumption):  # rejected by a filter or assume()
                continue
            except casegen.OverBudget as over:  # over the cap: its name still counts for the names after it
                seen.add(over.name)
                continue
            if case.name in seen:  # named before `keep`: a draw's name is the same in every tier
                case.name = f"{case.name}~{i}"
            seen.add(case.name)
            if keep(case):
                out.append(case)
            if stop is not None and len(out) >= stop:
                break
    finally:
        providers._get_local_constants = saved
        providers.CONSTANTS_CACHE.cache.clear()
    return out


def error_items(spec: OpSpec, backend: str, sel: Selection) -> list[Item]:
    """The op's declared bad inputs plus the generic ones every op shares (array_type, device)."""
    found = list(spec.get_error_cases()) + generic_error_cases(spec)
    items, seen = [], {}
    for ec in found:
        base = f"bad-{ec.constraint}"
        seen[base] = seen.get(base, 0) + 1
        name = base if seen[base] == 1 else f"{base}~{seen[base]}"
        if sel.wants(name):
            items.append(Item(spec.name, backend, "n/a", name, source="error", error=ec))
    missing = uncovered_constraints(spec, found)
    if missing and sel.wants("bad-coverage"):
        items.append(Item(spec.name, backend, "n/a", "bad-coverage", source="coverage", missing=tuple(missing)))
    return items


# Declared by every op about the call rather than its arguments (a backend name, strict mode's kernel
# choice): tested once for all ops (tests/test_dispatch.py, tests/test_hardening.py), not per op here.
CALL_CONSTRAINTS = ("backend", "supported")


def uncovered_constraints(spec: OpSpec, found: list) -> list:
    """Declared constraint ids without a bad-input case."""
    have = {ec.constraint for ec in found}
    return [c for c in spec.constraints if c not in have and c.rsplit(".", 1)[1] not in CALL_CONSTRAINTS]


def generic_error_cases(spec: OpSpec) -> list:
    """A list where an array belongs (array_type); arrays on different devices, or on a device no backend can
    use (device: torch's `meta` device stands in for a foreign one)."""
    from opport.errors import DeviceError, DTypeError

    valid = next(iter(spec.get_cases("float32")), None)
    if valid is None:
        return []
    bound = list(spec.bind(*valid.args, **valid.kwargs))
    present = [i for i in spec.array_pos if bound[i] is not None]
    bad = list(bound)
    bad[present[0]] = bound[present[0]].tolist()
    out = [ErrorCase(f"{spec.name}.array_type", DTypeError, tuple(bad))]
    if _torch():
        import torch

        dev = list(bound)
        for k, i in enumerate(present[:2]):
            a = np.ascontiguousarray(bound[i]).astype(np.float32 if bound[i].dtype.kind in "fV" else bound[i].dtype)
            dev[i] = torch.empty(a.shape, device="meta") if k == len(present[:2]) - 1 else torch.from_numpy(a)
        out.append(ErrorCase(f"{spec.name}.device", DeviceError, tuple(dev)))
    return out


def _torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------------- layouts


def applies(layout: str, case: Case) -> bool:
    return any(_arg_applies(layout, a) for a in _arrays(case))


def _arrays(case: Case):
    return [a for a in (*case.args, *case.kwargs.values()) if isinstance(a, np.ndarray)]


def _arg_applies(layout: str, a: np.ndarray) -> bool:
    if a.size == 0:
        return False
    if layout == "transposed":
        return a.ndim >= 2 and a.shape[-1] > 1 and a.shape[-2] > 1
    if layout == "expanded":
        return a.ndim >= 2 and a.shape[0] > 1 and a.dtype.kind in "fV"
    if layout == "sliced":
        return a.ndim >= 1 and a.size > 1
    return a.ndim >= 1


@dataclass
class Laid:
    """A case's arguments under one layout: what the kernel gets, what the reference gets, what to checksum."""

    args: tuple
    kwargs: dict
    ref_args: tuple
    ref_kwargs: dict
    buffers: list  # the memory behind the kernel's inputs, gaps included (checked for writes)
    views: list = field(default_factory=list)  # the strided views made (layout cases)
    moved: list = field(default_factory=list)  # arrays the layout leaves alone, as tensors on the views' device


def lay_out(case: Case, layout: str | None, torch_device: str | None) -> Laid:
    """Build the kernel's inputs: NumPy arrays as given (layout None), or views of padded buffers.

    With `torch_device`, views are torch tensors on that device (the buffer is moved first, then
    viewed there, so strides survive), and so is every array the layout does not apply to (a 1-D weight
    beside a transposed x): a NumPy array beside a CUDA tensor is a device mismatch the dispatcher rejects;
    otherwise NumPy views. `expanded` replaces an array by its first entry broadcast along axis 0
    (stride 0), so the reference sees those values.
    """
    if layout is None:  # copies: a kernel that writes into its input changes neither the case nor the reference's
        args = tuple(a.copy(order="K") if isinstance(a, np.ndarray) else a for a in case.args)
        kwargs = {k: v.copy(order="K") if isinstance(v, np.ndarray) else v for k, v in case.kwargs.items()}
        return Laid(args, kwargs, case.args, case.kwargs, [a for a in (*args, *kwargs.values()) if isinstance(a, np.ndarray)])
    buffers, views, moved = [], [], []

    def one(a):
        if not isinstance(a, np.ndarray):
            return a, a
        if not _arg_applies(layout, a):
            if not torch_device:
                return a, a
            from opport.dispatch.adapters import NumpyAdapter

            t = NumpyAdapter.to_torch(a.copy(order="C"), torch_device)
            buffers.append(t)
            moved.append(t)
            return t, a
        view, values, buf = _view(a, layout, torch_device)
        buffers.append(buf)
        views.append(view)
        return view, values

    pairs = [one(a) for a in case.args]
    kw = {k: one(v) for k, v in case.kwargs.items()}
    return Laid(tuple(p[0] for p in pairs), {k: p[0] for k, p in kw.items()},
                tuple(p[1] for p in pairs), {k: p[1] for k, p in kw.items()}, buffers, views, moved)


def _gap_value(dtype: np.dtype):
    return np.iinfo(dtype).min if dtype.kind in "iu" else np.nan


def _view(a: np.ndarray, layout: str, torch_device: str | None):
    """(kernel view, values the reference sees, buffer behind the view)."""
    values = a
    if layout == "transposed":
        buf = np.ascontiguousarray(np.swapaxes(a, -1, -2))
        make = lambda t: t.transpose(-1, -2) if torch_device else np.swapaxes(t, -1, -2)
    elif layout == "sliced":  # every other element of the last axis; the gaps hold NaN
        buf = np.full(a.shape[:-1] + (2 * a.shape[-1],), _gap_value(a.dtype), a.dtype)
        buf[..., ::2] = a
        make = lambda t: t[..., ::2]
    elif layout == "expanded":
        buf = np.ascontiguousarray(a[:1])
        values = np.broadcast_to(buf, a.shape).copy()
        make = lambda t: t.expand(*a.shape) if torch_device else np.broadcast_to(t, a.shape)
    elif layout == "offset":
        buf = np.full(OFFSET + a.size, _gap_value(a.dtype), a.dtype)
        buf[OFFSET:] = a.reshape(-1)
        make = lambda t: t[OFFSET:].reshape(a.shape)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    if torch_device:
        from opport.dispatch.adapters import NumpyAdapter

        buf = NumpyAdapter.to_torch(buf, torch_device)
    return make(buf), values, buf


def layout_ok(view, layout: str) -> bool:
    """The view really is non-contiguous (or offset) as intended."""
    if hasattr(view, "is_contiguous"):
        return layout == "offset" and view.storage_offset() > 0 or not view.is_contiguous()
    return layout == "offset" or not view.flags.c_contiguous
