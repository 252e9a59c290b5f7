"""sample: one token per row from logits, by temperature, top-k, top-p and min-p, deterministic given uniforms.

The filter semantics live here and are shared with `sampling_probs` (its module imports `filter_row`,
`sampling_args_check`, `make_args` and the constraint table from this one), so both ops keep the same tokens.
"""

from __future__ import annotations

import numpy as np

from opport import casegen as cg
from opport.errors import ArgumentError, DTypeError, ShapeError
from opport.spec import FLOAT32, INT32, Case, Cost, ErrorCase, check, check_domain, check_float, op

NAME = "sample"
PARAMS = ("temperature", "top_k", "top_p", "min_p")
MARGIN = 1e-4  # the cases keep min_p this far (relative) from every weight
MASS_MARGIN = 2e-5  # and every cumulative mass this far (relative to the mass it is cut from) from its cut


def constraints(name: str, with_uniforms: bool) -> dict:
    """The constraint table of sample (with_uniforms) or sampling_probs."""
    c = {
        f"{name}.dtype": "logits is float32, float16, bfloat16 or float64",
        f"{name}.logits_rank": "logits is 2-d [B, V] with V >= 1",
    }
    if with_uniforms:
        c[f"{name}.uniforms_dtype"] = "uniforms is float32"
        c[f"{name}.uniforms_shape"] = "uniforms is [B]"
        c[f"{name}.uniforms_range"] = "every uniform is in [0, 1)"
    c.update({
        f"{name}.temperature_dtype": "temperature is float32",
        f"{name}.temperature_shape": "temperature is [B]",
        f"{name}.temperature_range": "every temperature is >= 0 and finite (0: greedy)",
        f"{name}.top_k_dtype": "top_k is int32",
        f"{name}.top_k_shape": "top_k is [B]",
        f"{name}.top_k_range": "every top_k is >= 0 (0 or >= V: off)",
        f"{name}.top_p_dtype": "top_p is float32",
        f"{name}.top_p_shape": "top_p is [B]",
        f"{name}.top_p_range": "every top_p is in (0, 1] (1: off)",
        f"{name}.min_p_dtype": "min_p is float32",
        f"{name}.min_p_shape": "min_p is [B]",
        f"{name}.min_p_range": "every min_p is in [0, 1] (0: off)",
    })
    return c


DOMAINS = {"uniforms": FLOAT32, "temperature": FLOAT32, "top_k": INT32, "top_p": FLOAT32, "min_p": FLOAT32}


def check_args(name: str, logits, per_row: dict) -> None:
    """Metadata validation shared by sample and sampling_probs: logits [B, V], each per-row array [B] of its domain."""
    check_float(name, "logits", logits)
    check(logits.ndim == 2 and logits.shape[1] >= 1, ShapeError, name, "logits", f"{name}.logits_rank",
          "2-d [B, V], V >= 1", tuple(logits.shape))
    b = logits.shape[0]
    for arg, meta in per_row.items():
        check_domain(name, arg, meta, DOMAINS[arg], f"{name}.{arg}_dtype")
        check(tuple(meta.shape) == (b,), ShapeError, name, arg, f"{name}.{arg}_shape", f"({b},) = (B,)",
              tuple(meta.shape))


def _first_bad(a, bad) -> str | None:
    return repr(a[bad][0].item()) if bad.any() else None


def check_ranges(name: str, per_row: dict) -> None:
    """The per-row values' ranges (NaN is out of every range), before any kernel."""
    with np.errstate(invalid="ignore"):
        rules = {
            "uniforms": (lambda a: ~((a >= 0) & (a < 1)), "in [0, 1)"),
            "temperature": (lambda a: ~((a >= 0) & np.isfinite(a)), ">= 0 and finite"),
            "top_k": (lambda a: a < 0, ">= 0"),
            "top_p": (lambda a: ~((a > 0) & (a <= 1)), "in (0, 1]"),
            "min_p": (lambda a: ~((a >= 0) & (a <= 1)), "in [0, 1]"),
        }
        for arg, a in per_row.items():
            a = np.asarray(a)
            fn, expected = rules[arg]
            bad = fn(a)
            check(not bad.any(), ArgumentError, name, arg, f"{name}.{arg}_range", expected, _first_bad(a, bad))


@op(arrays=("logits", "uniforms", *PARAMS), domains=DOMAINS, constraints=constraints(NAME, True), out_dtype="int32")
def sample(logits, uniforms, temperature, top_k, top_p, min_p):
    """One token id per row, int32 [B]: logits [B, V], and per row a uniform in [0, 1) (float32), temperature
    (float32, 0: greedy), top_k (int32, 0 or >= V: off), top_p (float32 in (0, 1], 1: off), min_p (float32 in
    [0, 1], 0: off). Deterministic: the randomness is the caller's uniforms.

    The order of a row: descending logit, ties to the lowest index (-0 and +0 tie). With m the row's max logit
    and w_i = exp((x_i - m) / T) (so p_i = w_i / sum w):
    top_k keeps the first k tokens of the order (ties at the k-th logit: the lowest indices);
    top_p, on the distribution top_k left (vLLM's and FlashInfer's top-k-first order), keeps the shortest prefix
    of the order whose mass reaches top_p times the mass top_k kept (a token enters if the mass before it is
    below that; at least one token);
    min_p keeps the tokens with p_i >= min_p * p_max, i.e. w_i >= min_p (renormalising changes no ratio, so it is
    the same before or after the other two).
    The kept set is the intersection (the max-logit token is always in it). The token is then the inverse CDF
    in vocabulary order: the first index whose cumulative kept weight exceeds u times the kept mass (tokens of
    zero weight are never drawn). temperature == 0 is greedy: the argmax, ties to the lowest index, whatever
    the filters (they all keep it), so top_k = 1 is the argmax too. A row with a NaN or +inf logit, or all
    -inf, returns -1; -inf logits have weight 0 and are never drawn.

    Boundaries: the float64 reference decides. Kernels compute in float32, so where u times the kept mass, top_p
    times a mass or min_p lies within float32 rounding of a cumulative sum or a weight, a kernel may choose the
    neighbouring token (docs/serving.md, Sampling); the conformance cases keep those decisions away (MARGIN).
    """
    check_args(NAME, logits, {"uniforms": uniforms, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                              "min_p": min_p})


@sample.check_values(("uniforms", *PARAMS))
def _check_values(logits, uniforms, temperature, top_k, top_p, min_p):
    check_ranges(NAME, {"uniforms": uniforms, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                        "min_p": min_p})


@sample.outputs(("tokens",))
def _outputs(logits, uniforms, temperature, top_k, top_p, min_p):
    return [((logits.shape[0],), "int32")]


# --------------------------------------------------------------------------- the filter (float64), shared


def row_order(x: np.ndarray, highest_first: bool = False) -> np.ndarray:
    """The row's order: descending logit, ties to the lowest index (highest_first: to the highest, a mutant)."""
    idx = np.arange(x.shape[0])
    with np.errstate(invalid="ignore"):
        key = np.where(x == 0, 0.0, -x)  # -0 ties +0
    return np.lexsort((-idx if highest_first else idx, key))


def invalid_row(x: np.ndarray) -> bool:
    """A row without a distribution: a NaN or +inf logit, or every logit -inf."""
    return bool(np.isnan(x).any() or np.isposinf(x).any() or np.all(np.isneginf(x)))


def filter_row(x, t, k, top_p, min_p, topp_first=False, highest_first=False):
    """(kept [V] bool, w [V] float64) for one valid row with t > 0 (see sample's docstring); topp_first and
    highest_first are mutants (top-p judged against the whole mass before top-k; ties to the highest index)."""
    v = x.shape[0]
    m = np.max(x)
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        w = np.exp((x - m) / t)
    order = row_order(x, highest_first)
    kk = int(k) if 0 < k < v else v
    in_k = np.zeros(v, bool)
    in_k[order[:kk]] = True
    keep_n = kk
    if top_p < 1:
        cs = np.cumsum(w[order])
        target = top_p * (cs[-1] if topp_first else cs[kk - 1])
        keep_n = min(kk, int(np.argmax(cs >= target)) + 1 if (cs >= target).any() else v)
    in_p = np.zeros(v, bool)
    in_p[order[:keep_n]] = True
    return in_k & in_p & (w >= min_p), w


def greedy(x: np.ndarray) -> int:
    """The argmax, ties to the lowest index."""
    return int(np.argmax(x == np.max(x)))


def draw(kept, w, u, renormalise=True) -> int:
    """The first index whose cumulative kept weight exceeds u times the kept mass (renormalise=False: u times the
    whole mass, a mutant; past the end it returns the last kept token)."""
    c = np.cumsum(np.where(kept, w, 0.0))
    total = c[-1] if renormalise else np.sum(w)
    hit = c > u * total
    return int(np.argmax(hit)) if hit.any() else int(np.flatnonzero(kept)[-1])


def sample_rows(logits, uniforms, temperature, top_k, top_p, min_p, topp_first=False, highest_first=False,
                renormalise=True) -> np.ndarray:
    b = logits.shape[0]
    out = np.empty(b, np.int64)
    for i in range(b):
        x = logits[i]
        if invalid_row(x):
            out[i] = -1
        elif temperature[i] == 0:
            out[i] = greedy(x)
        else:
            kept, w = filter_row(x, float(temperature[i]), int(top_k[i]), float(top_p[i]), float(min_p[i]),
                                 topp_first, highest_first)
            out[i] = draw(kept, w, float(uniforms[i]), renormalise)
    return out


# batch invariance (docs/conformance.md): the arrays whose leading axis is the batch
sample.batched("logits", "uniforms", "temperature", "top_k", "top_p", "min_p")  # rows


@sample.reference
def _reference(logits, uniforms, temperature, top_k, top_p, min_p):
    return sample_rows(logits, uniforms, temperature, top_k, top_p, min_p)


# --------------------------------------------------------------------------- cases, with their margins


def margin_ok(x, t, k, top_p, min_p, margin=MARGIN, mass_margin=MASS_MARGIN) -> bool:
    """Whether every filter decision of a valid row is away from its boundary: min_p against each weight
    (`margin`, relative to min_p), top_p times top_k's mass against each cumulative mass of the order
    (`mass_margin`, relative to that mass). Exact logit ties are fine (the order is exact)."""
    if invalid_row(x) or t == 0:
        return True
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        w = np.exp((x - np.max(x)) / t)
    if min_p > 0 and np.any(np.abs(w - min_p) <= margin * min_p):
        return False
    if top_p < 1:
        kk = int(k) if 0 < k < x.shape[0] else x.shape[0]
        cs = np.cumsum(w[row_order(x)[:kk]])
        if np.any(np.abs(cs - top_p * cs[-1]) <= mass_margin * cs[-1]):
            return False
    return True


def draw_margin_ok(kept, w, u, mass_margin=MASS_MARGIN) -> bool:
    """Whether u times the kept mass is `mass_margin` (relative) away from every cumulative kept weight."""
    c = np.cumsum(np.where(kept, w, 0.0))
    return not np.any(np.abs(c[kept] - u * c[-1]) <= mass_margin * c[-1])


def make_args(name: str, case: str, dtype: str, b: int, v: int, temperature=(0.0, 0.7, 1.0, 1.5),
              top_k=(0, 1, 5, 40), top_p=(1.0, 0.95, 0.8, 0.5), min_p=(0.0, 0.0, 0.05, 0.2), scale=2.0,
              levels=None, uniforms=True, edit=None) -> tuple:
    """(logits, [uniforms,] temperature, top_k, top_p, min_p) for a case: logits normal times `scale` (or drawn
    from `levels` values: exact ties), per-row settings drawn from the given choices, `edit(logits, settings)`
    applied; then the uniforms, top_p and min_p of rows too near a boundary (`margin_ok`) are redrawn."""
    rng = cg.rng_for(name, case, dtype)
    if levels is None:
        logits = cg.array((b, v), dtype, rng, "normal", scale)
    else:
        logits = cg.cast(rng.integers(0, levels, (b, v)) * (scale / levels), dtype)
    s = {
        "temperature": rng.choice(np.asarray(temperature, np.float32), b).astype(np.float32),
        "top_k": rng.choice(np.asarray(top_k, np.int32), b).astype(np.int32),
        "top_p": rng.choice(np.asarray(top_p, np.float32), b).astype(np.float32),
        "min_p": rng.choice(np.asarray(min_p, np.float32), b).astype(np.float32),
    }
    if edit is not None:
        edit(logits, s, rng)
    u = rng.random(b).astype(np.float32) if uniforms else None
    x64 = logits.astype(np.float64)
    for i in range(b):
        x, t, k = x64[i], float(s["temperature"][i]), int(s["top_k"][i])
        for _ in range(200):
            if margin_ok(x, t, k, float(s["top_p"][i]), float(s["min_p"][i])):
                break
            if s["top_p"][i] < 1:
                s["top_p"][i] = np.float32(np.clip(s["top_p"][i] + rng.uniform(-0.02, 0.02), 0.05, 0.999))
            if s["min_p"][i] > 0:
                s["min_p"][i] = np.float32(np.clip(s["min_p"][i] * rng.uniform(0.8, 1.25), 1e-3, 1.0))
        else:
            raise AssertionError(f"{name} {case}: row {i}: no top_p, min_p away from the boundaries")
        if u is None or invalid_row(x) or t == 0:
            continue
        kept, w = filter_row(x, t, k, float(s["top_p"][i]), float(s["min_p"][i]))
        for _ in range(500):
            if draw_margin_ok(kept, w, float(u[i])):
                break
            u[i] = np.float32(rng.random())
        else:
            raise AssertionError(f"{name} {case}: row {i}: no uniform away from the boundaries")
    head = (logits,) if u is None else (logits, u)
    return (*head, s["temperature"], s["top_k"], s["top_p"], s["min_p"])


def _ties(logits, s, rng):
    """Whole rows of one value, and top_k cutting inside tied logits."""
    logits[0] = logits[0, 0]
    s["temperature"][0], s["top_k"][0] = 1.0, 3
    s["temperature"][1], s["top_k"][1], s["top_p"][1] = 1.0, 0, 0.5
    logits[1] = logits[1, 0]


def _masked(logits, s, rng):
    """-inf logits (a grammar mask): every other token, rows with one or three finite tokens, top_k past them."""
    dt = logits.dtype
    logits[:, 1::2] = np.asarray(-np.inf).astype(dt)
    logits[2, :] = np.asarray(-np.inf).astype(dt)
    logits[2, 5] = logits[3, 4]
    logits[3, 7:] = np.asarray(-np.inf).astype(dt)
    s["top_k"][3] = 10
    s["temperature"][2:4] = 1.0


def _invalid(logits, s, rng):
    """A NaN, a +inf, an all -inf row (-1 each, whatever the temperature), a lone finite logit among -inf."""
    dt = logits.dtype
    logits[0, 3] = np.asarray(np.nan).astype(dt)
    logits[1, 0] = np.asarray(np.inf).astype(dt)
    logits[2] = np.asarray(-np.inf).astype(dt)
    logits[3] = np.asarray(-np.inf).astype(dt)
    logits[3, 6] = np.asarray(1.5).astype(dt)
    s["temperature"][0], s["temperature"][1], s["temperature"][2] = 0.0, 1.0, 0.0
    s["temperature"][4] = 0.0
    logits[4, 2] = np.asarray(np.nan).astype(dt)  # greedy does not see past a NaN either


def cases_for(name: str, dtype: str, uniforms: bool):
    """The cases of sample (uniforms=True) and sampling_probs: the same rows and settings."""
    big = 3.0 if dtype == "float16" else 40.0

    def mk(case, b, v, tags=(), **kw):
        return Case(case, make_args(name, case, dtype, b, v, uniforms=uniforms, **kw), tags=tags)

    yield mk("llama3-vocab-decode", 8, 128256, ("llm",), scale=6.0, temperature=(0.0, 1.0), top_k=(0, 1, 50),
             top_p=(1.0, 0.9), min_p=(0.0, 0.05))
    yield mk("mixed-b8-v1000", 8, 1000)  # rows few: the interpreter runs a program per row
    yield mk("mixed-b7-v129", 7, 129)
    yield mk("greedy", 6, 300, temperature=(0.0,))
    yield mk("greedy-ties", 6, 64, ("edge",), temperature=(0.0,), levels=3)
    yield mk("top-k-1", 5, 500, top_k=(1,), top_p=(1.0,), min_p=(0.0,))
    yield mk("top-k-only", 10, 257, top_p=(1.0,), min_p=(0.0,), temperature=(1.0,), top_k=(2, 10, 50, 256, 257, 300))
    yield mk("top-p-only", 10, 257, top_k=(0,), min_p=(0.0,), temperature=(1.0, 0.5), top_p=(0.9, 0.6, 0.3))
    yield mk("min-p-only", 10, 257, top_k=(0,), top_p=(1.0,), temperature=(1.0, 2.0), min_p=(0.02, 0.1, 0.5))
    yield mk("top-k-then-top-p", 6, 300, temperature=(1.0,), top_k=(3, 8, 20), top_p=(0.6, 0.8), min_p=(0.0,))
    yield mk("ties-levels", 8, 96, ("edge",), levels=4, temperature=(1.0, 0.5), top_k=(1, 3, 7, 30),
             top_p=(1.0, 0.5, 0.3), min_p=(0.0, 0.5))
    yield mk("ties-rows", 4, 50, ("edge",), edit=_ties)
    yield mk("peaked-large-logits", 6, 200, scale=big, temperature=(1.0, 0.3, 4.0))
    yield mk("tiny-temperature", 6, 100, temperature=(1e-3,), levels=8)
    yield mk("masked-minus-inf", 6, 40, ("edge",), edit=_masked)
    yield mk("invalid-rows", 6, 32, ("edge",), edit=_invalid)
    yield mk("v1", 3, 1, ("edge",))
    yield mk("v2", 5, 2, ("edge",), temperature=(1.0,), top_k=(0, 1, 2), top_p=(1.0, 0.5))
    yield mk("no-rows", 0, 8, ("edge",))


@sample.cases
def _cases(dtype):
    yield from cases_for(NAME, dtype, True)


def error_cases(name: str, uniforms: bool):
    x = np.zeros((4, 8), np.float32)
    f = np.full(4, 0.5, np.float32)
    good = {"uniforms": f, "temperature": np.ones(4, np.float32), "top_k": np.zeros(4, np.int32),
            "top_p": np.ones(4, np.float32), "min_p": np.zeros(4, np.float32)}
    if not uniforms:
        del good["uniforms"]

    def args(logits=x, **over):
        return (logits, *({**good, **over}.values()))

    yield ErrorCase(f"{name}.dtype", DTypeError, args(x.astype(np.int32)))
    yield ErrorCase(f"{name}.logits_rank", ShapeError, args(x[0]))
    yield ErrorCase(f"{name}.logits_rank", ShapeError, args(x[:, :0]))
    for arg, a in good.items():
        wrong = a.astype(np.float64) if a.dtype == np.float32 else a.astype(np.int64)
        yield ErrorCase(f"{name}.{arg}_dtype", DTypeError, args(**{arg: wrong}))
        yield ErrorCase(f"{name}.{arg}_shape", ShapeError, args(**{arg: a[:3]}))
    bad = {"uniforms": (1.0, -0.25, np.nan), "temperature": (-1.0, np.inf, np.nan), "top_k": (-1,),
           "top_p": (0.0, 1.5, np.nan), "min_p": (-0.1, 1.01, np.nan)}
    for arg in good:
        for value in bad[arg]:
            a = good[arg].copy()
            a[2] = value
            yield ErrorCase(f"{name}.{arg}_range", ArgumentError, args(**{arg: a}))


@sample.error_cases
def _error_cases():
    yield from error_cases(NAME, True)


@sample.cost
def _cost(logits, uniforms, temperature, top_k, top_p, min_p):
    """Logits read once (the threshold searches' further passes are cache traffic), 20 bytes of settings and 4 of
    token per row; per logit an exp and a few compares and adds per search pass (~40)."""
    b, v = logits.shape
    item = np.dtype(cg.np_dtype(getattr(logits.dtype, "name", logits.dtype))).itemsize
    return Cost(bytes=b * v * item + 24 * b, flops=40 * b * v)


@sample.mutant("top-p-before-top-k")
def _mutant_topp_first(logits, uniforms, temperature, top_k, top_p, min_p):
    """top_p judged against the whole distribution's mass instead of what top_k left."""
    return sample_rows(logits, uniforms, temperature, top_k, top_p, min_p, topp_first=True)


@sample.mutant("not-renormalised")
def _mutant_not_renormalised(logits, uniforms, temperature, top_k, top_p, min_p):
    """u scaled by the whole mass instead of the kept mass."""
    return sample_rows(logits, uniforms, temperature, top_k, top_p, min_p, renormalise=False)


@sample.mutant("ties-to-highest-index")
def _mutant_ties_highest(logits, uniforms, temperature, top_k, top_p, min_p):
    """Tied logits at the top-k (or top-p) cut resolved to the highest index."""
    return sample_rows(logits, uniforms, temperature, top_k, top_p, min_p, highest_first=True)
