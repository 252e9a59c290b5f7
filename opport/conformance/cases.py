"""Which cases a run checks: the op's fixed cases, layout variants of them, Hypothesis examples, bad inputs.

Everything here is deterministic from (op, backend, dtype, Selection): a worker process rebuilds
the same list the parent asked for, and a repro command rebuilds the single case it names.

Case names: fixed cases keep their declared name; a layout variant is `<name>@<layout>`; Hypothesis
examples keep the strategy's name (`hyp-<seed>`, de-duplicated with `~2`, `~3`); bad inputs are
`bad-<constraint id>`. A case id is `<op>/<backend>/<dtype>/<name>` (`n/a` as dtype for bad inputs).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import numpy as np

from opport.spec import Case, ErrorCase, OpSpec

LAYOUTS = ("transposed", "sliced", "expanded", "offset")
OFFSET = 3  # elements before an offset view: odd, so the start is also misaligned
# Per tier: Hypothesis examples per op x dtype, element caps (all array arguments together), and how
# many fixed cases also run under a non-contiguous layout. A `<knob>_emulated` value replaces `<knob>` on
# a backend that emulates a device on this CPU (its Capabilities.emulated()). smoke: every op, backend and
# dtype in about a minute (make run); fast: the CI gate; full: thousands of examples, every layout.
TIERS = {
    "smoke": {"examples": 10, "examples_emulated": 3, "hyp_max": 1 << 16, "hyp_max_emulated": 1 << 12,
              "case_max": 1 << 16, "case_max_emulated": 1 << 14, "layout_max": 1 << 14, "layouts": 2,
              "skip_tags": ("large", "slow")},
    "fast": {"examples": 100, "examples_emulated": 100, "hyp_max": 1 << 20, "hyp_max_emulated": 1 << 15,
             "case_max_emulated": 1 << 18, "layout_max": 1 << 16, "layouts_emulated": 4, "skip_tags": ("large", "slow")},
    "full": {"examples": 1000, "examples_emulated": 1000, "hyp_max": None, "hyp_max_emulated": 1 << 20,
             "case_max_emulated": None, "layout_max": 1 << 20, "layouts_emulated": None, "skip_tags": ()},
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

    def n_examples(self) -> int:
        return self.examples if self.examples is not None else self.knob("examples")

    def knob(self, key: str):
        t = TIERS[self.tier]
        return t.get(f"{key}_emulated", t.get(key)) if self.emulated else t.get(key)

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
    source: str = "fixed"  # fixed | layout | hypothesis | error
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
    fixed = []
    for c in spec.get_cases(dtype):
        tier_ok = not (set(c.tags) & set(skip_tags)) and (case_max is None or elements(c) <= case_max)
        if explicit or tier_ok:
            fixed.append(c)
    out = [Item(spec.name, backend, dtype, c.name, c, tags=tuple(c.tags)) for c in fixed if sel.wants(c.name)]
    if sel.layouts:
        out += [it for it in _layout_items(spec, backend, dtype, fixed, sel) if sel.wants(it.name)]
    if sel.cases and not any(fnmatch.fnmatchcase("hyp-0", p) or "hyp" in p for p in sel.cases):
        return out  # a named fixed case: no need to draw examples
    out += [Item(spec.name, backend, dtype, c.name, c, source="hypothesis", tags=tuple(c.tags))
            for c in hypothesis_cases(spec, dtype, sel) if sel.wants(c.name)]
    return out


def _layout_items(spec, backend, dtype, fixed, sel) -> list[Item]:
    """smoke and fast rotate one layout per eligible case (capped where the tier says); full runs all four."""
    limit = sel.knob("layout_max")
    cap = sel.knob("layouts")
    every = bool(sel.cases) or sel.tier == "full"
    items, k = [], 0
    for c in fixed:
        if elements(c) == 0 or elements(c) > limit and not sel.cases:
            continue
        # an op that writes in place is not given a broadcast (stride-0) view to write through
        usable = [lay for lay in LAYOUTS if applies(lay, c) and not (spec.writes and lay == "expanded")]
        if not usable:
            continue
        chosen = usable if every else [usable[k % len(usable)]]
        k += 1
        items += [Item(spec.name, backend, dtype, f"{c.name}@{lay}", c, lay, "layout", tuple(c.tags)) for lay in chosen]
        if cap is not None and not every and len(items) >= cap:
            break
    return items


def hypothesis_cases(spec: OpSpec, dtype: str, sel: Selection) -> list[Case]:
    """`n` examples of the op's strategy, reproducible from `sel.seed` (and `n`).

    Drawn through `@given` with a fixed `@seed` (the derandomized CI profile at seed 0); elements
    above the tier's cap are dropped, drawing up to twice as many to make up the count.
    """
    n = sel.n_examples()
    strategy = spec.get_strategy(dtype)
    if strategy is None or n <= 0:
        return []
    cap = sel.knob("hyp_max")
    drawn = draw_examples(strategy, 2 * n if cap else n, sel.seed)
    kept = [c for c in drawn if cap is None or elements(c) <= cap][:n]
    seen: dict = {}
    for c in kept:
        seen[c.name] = seen.get(c.name, 0) + 1
        if seen[c.name] > 1:
            c.name = f"{c.name}~{seen[c.name]}"
    return kept


def draw_examples(strategy, n: int, seed: int) -> list:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    out = []

    @hseed(seed)
    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(case):
        out.append(case)

    collect()
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


def lay_out(case: Case, layout: str | None, torch_device: str | None) -> Laid:
    """Build the kernel's inputs: NumPy arrays as given (layout None), or views of padded buffers.

    With `torch_device`, views are torch tensors on that device (the buffer is moved first, then
    viewed there, so strides survive); otherwise NumPy views. `expanded` replaces an array by its
    first entry broadcast along axis 0 (stride 0), so the reference sees those values.
    """
    if layout is None:
        arrs = _arrays(case)
        return Laid(case.args, case.kwargs, case.args, case.kwargs, arrs)
    buffers, views = [], []

    def one(a):
        if not isinstance(a, np.ndarray) or not _arg_applies(layout, a):
            return a, a
        view, values, buf = _view(a, layout, torch_device)
        buffers.append(buf)
        views.append(view)
        return view, values

    pairs = [one(a) for a in case.args]
    kw = {k: one(v) for k, v in case.kwargs.items()}
    return Laid(tuple(p[0] for p in pairs), {k: p[0] for k, p in kw.items()},
                tuple(p[1] for p in pairs), {k: p[1] for k, p in kw.items()}, buffers, views)


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
