"""The CI gate: known failures per backend, the metrics baseline, and the exit code.

Known failures live next to each backend's kernels in `known_failures.txt` (format in
docs/conformance.md): `<case id pattern> | <reason>` per line. A matching case that fails, errors,
crashes or times out is `xfail`; one that passes is `xpass`, which fails the run so the entry gets
removed. Entries that matched no case of a run that covered their op and dtype are reported stale; an
entry written `full: <pattern> | <reason>` names a full-tier draw and is judged stale in full runs only.

The baseline is a JSON file of per-case status and metrics: a ratchet. Against it, a case that fails now
and failed (or was a known failure) in the baseline is known-in-baseline: `xfail`, with the reason, and
does not fail the run; a case that passes now is fine whatever the baseline says; the run fails on a new
failure (a case that failed now but passed in, or is missing from, the baseline), or on a metric
(`tol_ratio`, `floor_ratio`) more than 2x its baseline value (and worse by more than a small absolute
slack, so noise near zero is not a regression). `xpass` and `lost` are never excused by a baseline.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

BAD = ("fail", "error", "crash", "timeout")
# lost: a cluster run could not run the case (its node died with no other node to take it, or Ctrl-C);
# it fails the run but is never a known failure: it says nothing about the kernel
FAILING = BAD + ("xpass", "lost")
STATUSES = ("pass", "fail", "error", "crash", "timeout", "lost", "skip", "xfail", "xpass")
KNOWN_FILE = "known_failures.txt"
TIERS = ("fast", "full")
REGRESSION_FACTOR = 2.0
SLACK = {"tol_ratio": 0.05, "floor_ratio": 0.1}  # absolute increase that must also be exceeded


@dataclass
class KnownFailure:
    pattern: str
    reason: str
    where: str  # file:line
    matched: int = 0
    tier: str | None = None  # "full": a full-tier draw, not expected in (nor stale for) other tiers


class KnownFailureFileError(ValueError):
    pass


def known_failures_path(backend) -> Path | None:
    """`known_failures.txt` in the backend's package folder (None if the package has no folder)."""
    spec = importlib.util.find_spec(backend.package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / KNOWN_FILE


def load_known(path: Path) -> list[KnownFailure]:
    """Parse a known-failures file; every entry needs a reason."""
    if path is None or not Path(path).exists():
        return []
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#"):  # a '#' later in the line belongs to the reason (issue links)
            continue
        pattern, sep, reason = text.partition("|")
        if not sep or not reason.strip() or not pattern.strip():
            raise KnownFailureFileError(f"{path}:{n}: expected '<case id pattern> | <reason>', got {line!r}")
        tier, colon, rest = pattern.partition(":")
        tier = tier.strip() if colon and tier.strip() in TIERS else None
        pattern = rest if tier else pattern
        if pattern.strip().count("/") != 3:
            raise KnownFailureFileError(f"{path}:{n}: pattern {pattern.strip()!r} is not <op>/<backend>/<dtype>/<case>")
        out.append(KnownFailure(pattern.strip(), reason.strip(), f"{path}:{n}", tier=tier))
    return out


def apply_known(res: dict, entries: list[KnownFailure]) -> dict:
    """xfail / xpass for a case matched by a known-failure entry (first match wins)."""
    for e in entries:
        if fnmatch.fnmatchcase(res["id"], e.pattern):
            e.matched += 1
            res["known_failure"] = f"{e.reason} ({e.where})"
            if res["status"] in BAD:
                res["status"] = "xfail"
            elif res["status"] == "pass":
                res["status"] = "xpass"
                res["message"] = f"passes but is listed as a known failure: {e.reason} ({e.where})"
            break
    return res


def stale_known(entries: list[KnownFailure], covered: set, tier: str | None = None) -> list[dict]:
    """Entries that matched nothing although this run covered their (op, backend, dtype) (and tier)."""
    out = []
    for e in entries:
        if e.matched or (e.tier is not None and e.tier != tier):
            continue
        op, backend, dtype, _ = e.pattern.split("/")
        if any(fnmatch.fnmatchcase(o, op) and fnmatch.fnmatchcase(b, backend) and fnmatch.fnmatchcase(d, dtype)
               for o, b, d in covered):
            out.append({"pattern": e.pattern, "reason": e.reason, "where": e.where})
    return out


# --------------------------------------------------------------------------- baseline


def load_baseline(path) -> dict:
    """{case id: {"status", "metrics"}} from a baseline file or a full JSON report."""
    data = json.loads(Path(path).read_text())
    cases = data.get("cases", {})
    if isinstance(cases, list):  # a JSON report used as a baseline
        return {c["id"]: {"status": c["status"], "metrics": c.get("metrics", {})} for c in cases}
    return cases


def baseline_problem(data, allow_empty: bool = False) -> str | None:
    """What is wrong with parsed JSON as a baseline (or a JSON report used as one), or None."""
    cases = data.get("cases") if isinstance(data, dict) else None
    if isinstance(cases, list):
        ok = all(isinstance(c, dict) and isinstance(c.get("id"), str) and c.get("status") in STATUSES for c in cases)
    elif isinstance(cases, dict):
        ok = all(isinstance(v, dict) and v.get("status") in STATUSES and isinstance(v.get("metrics", {}), dict)
                 for v in cases.values())
    else:
        return "not a conformance baseline or JSON report (no 'cases')"
    if not ok:
        return "a case entry lacks an id or a valid status"
    return None if cases or allow_empty else "it holds no cases"


def write_baseline(path, cases: list, old: dict | None = None):
    """Merge this run's cases into the baseline (cases not run keep their entry)."""
    merged = dict(old or {})
    for c in cases:
        keep = {k: c["metrics"][k] for k in ("max_abs", "max_rel", "max_ulp", "tol_ratio", "floor_ratio", "rmse_ratio")
                if c.get("metrics", {}).get(k) is not None}
        merged[c["id"]] = {"status": c["status"], "metrics": keep}
    body = {"opport_conformance_baseline": 1, "cases": dict(sorted(merged.items()))}
    Path(path).write_text(json.dumps(body, indent=1) + "\n")


def regressions(cases: list, baseline: dict) -> list[dict]:
    """Judge a run's cases against a baseline (the ratchet, see the module docstring): a failure the baseline
    already holds becomes `xfail` (known in the baseline) in `cases`, in place, so it does not fail the run;
    returned are the new failures and the metrics more than 2x their baseline, each of which does."""
    out = []
    for c in cases:
        old = baseline.get(c["id"])
        if c["status"] in BAD:
            if old is not None and old["status"] in BAD + ("xfail",):
                c["known_failure"] = f"known in the baseline (status there: {old['status']})"
                c["status"] = "xfail"
            else:
                out.append({"id": c["id"], "kind": "new failure", "detail": f"{c['status']} (baseline: "
                            f"{old['status'] if old else 'not in baseline'})"})
            continue
        if old is None or c["status"] != "pass" or old["status"] != "pass":
            continue
        for key, slack in SLACK.items():
            new, was = c.get("metrics", {}).get(key), old.get("metrics", {}).get(key)
            if new is not None and was is not None and new > REGRESSION_FACTOR * was and new - was > slack:
                out.append({"id": c["id"], "kind": "metric regression", "detail": f"{key} {new:.3g} vs baseline {was:.3g}"})
    return out


def exit_code(summary: dict, regressions_found: list) -> int:
    """docs/design.md section 6: 0 only if nothing failed, errored, crashed, timed out or xpassed, and a case ran."""
    ran = sum(summary.get(s, 0) for s in STATUSES if s != "skip")
    if ran == 0:
        return 1
    if any(summary.get(s, 0) for s in FAILING) or regressions_found:
        return 1
    return 0
