"""Every document the code and docs cite is in the repository, and so is the section a citation names.

A citation is a `name.md` token (bare, `docs/name.md`, or relative to the citing file), a `docs/...` path,
or a relative Markdown link target. A bare name resolves against the citing file's folder, the repository
root or docs/. Where a section follows the name ("docs/numerics.md 3.1 rule 6", "design.md section 4",
"performance.md 2e", "numerics.md G4", "style.md 7/8"), the cited document must have it: a numbered
heading (`## 3.`, `### 3.1`, `### 2e.`), a numbered list item N under heading S for "S.N" or "S rule N",
or a label such as **G4**. Paths into the shared folder outside the repository are refused outright.
"""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = {".py", ".md", ".sh", ".txt", ".toml"}
NAMES = {"Makefile"}

# URLs are matched first so that their .md files are skipped; then Markdown links, then bare paths.
CITATION = re.compile(
    r"(?P<url>\bhttps?://\S+)"
    r"|\]\((?P<link>[^)\s#]*(?:\.\w+|/))(?:#[^)\s]*)?\)"  # a target with an extension or a folder
    r"|(?<![\w/.-])(?P<path>(?:[\w.-]+/)*[\w-]+\.md|docs/[\w./-]*\w)(?![\w/])"
)
ID = r"(?:G\d+|\d+(?:\.\d+)*[a-z]?)"
SECTION = re.compile(rf"[`')\]]*,?\s+(?:sections?\s+|§\s*)?(?P<ids>{ID}(?:\s*(?:/|,|-|and)\s*{ID})*)"
                     rf"(?:\s+rule\s+(?P<rule>\d+))?(?![\w.]?\w)")
SHARED = re.compile(r"\.\./shared/|/work/share[d]/")
HEADING = re.compile(rf"^#{{1,6}}\s+(?P<id>{ID})[.)]?\s")
LIST_ITEM = re.compile(r"^(?P<n>\d+)\.\s")
LABEL = re.compile(r"^\s*(?:[-*]\s+)?\**(?P<id>G\d+)\b")


def tracked_files() -> list[Path]:
    """The text files git tracks; without git (an unpacked sdist), every such file outside hidden and build folders."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, text=True).stdout
        paths = [ROOT / p for p in out.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        skip = {"build", "dist", "venv", "__pycache__"}
        paths = [p for p in ROOT.rglob("*")
                 if not any(part.startswith(".") or part in skip for part in p.relative_to(ROOT).parts)]
    return sorted(p for p in paths if p.is_file() and (p.suffix in SUFFIXES or p.name in NAMES))


@cache
def sections(doc: Path) -> tuple[set[str], set[tuple[str, str]]]:
    """(heading numbers and labels, (section, list item number) pairs) of a Markdown document."""
    ids, items, current = set(), set(), ""
    for line in doc.read_text(encoding="utf-8").splitlines():
        if m := HEADING.match(line):
            current = m["id"]
            ids.add(current)
        elif m := LIST_ITEM.match(line):
            items.add((current, m["n"]))
        if m := LABEL.match(line):
            ids.add(m["id"])
    return ids, items


def has_section(doc: Path, sid: str, rule: str | None) -> bool:
    ids, items = sections(doc)
    if rule:
        return (sid, rule) in items
    if sid in ids:
        return True
    head, _, item = sid.rpartition(".")
    return bool(head) and (head, item) in items  # "5.8": list item 8 of section 5


def resolve(cited: str, citing: Path, link: bool) -> Path | None:
    bases = [citing.parent] if link else [citing.parent, ROOT, ROOT / "docs"]
    for base in bases:
        target = (base / cited).resolve()
        if target.is_relative_to(ROOT) and target.exists():
            return target
    return None


def problems_in(citing: Path, text: str) -> list[str]:
    """file:line: what is wrong, for every citation in `text` (the contents of `citing`)."""
    found = []

    def report(pos: int, msg: str):
        found.append(f"{citing.relative_to(ROOT)}:{text.count(chr(10), 0, pos) + 1}: {msg}")

    for m in SHARED.finditer(text):
        report(m.start(), f"{m.group()!r}: outside the repository")
    for m in CITATION.finditer(text):
        if m["url"] or (m["link"] and citing.suffix != ".md"):  # `f[i](x)` in code is no link
            continue
        cited, link = (m["link"], True) if m["link"] else (m["path"], False)
        if link and re.match(r"[a-z]+:", cited):  # mailto:, data: and the like
            continue
        target = resolve(cited, citing, link)
        if target is None:
            report(m.start(), f"{cited}: no such file in the repository")
            continue
        ref = SECTION.match(text, m.end())
        if target.suffix != ".md" or not ref:
            continue
        for sid in re.findall(ID, ref["ids"]):
            if not has_section(target, sid, ref["rule"]):
                what = f"{sid} rule {ref['rule']}" if ref["rule"] else sid
                report(m.start(), f"{cited} {what}: no such section in {target.relative_to(ROOT)}")
    return found


def test_every_cited_document_and_section_exists():
    problems = []
    for path in tracked_files():
        if path == Path(__file__).resolve():  # its docstring and the bad examples below are not citations
            continue
        problems += problems_in(path, path.read_text(encoding="utf-8", errors="replace"))
    assert not problems, "dangling references:\n" + "\n".join(problems)


def test_the_check_catches_bad_references():
    citing = ROOT / "opport" / "example.py"
    text = ("# docs/numerics.md 3.1 rule 6 and numerics.md G4 are fine\n"
            "# see docs/nowhere.md, numerics.md 9.9, docs/numerics.md 3.1 rule 42, design.md section 8\n"
            "# and ../shared/docs/nki.md, but not https://example.org/README.md\n")
    problems = problems_in(citing, text)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "'../shared/': outside the repository",
        "docs/nowhere.md: no such file in the repository",
        "numerics.md 9.9: no such section in docs/numerics.md",
        "docs/numerics.md 3.1 rule 42: no such section in docs/numerics.md",
        "design.md 8: no such section in docs/design.md",
        "../shared/docs/nki.md: no such file in the repository",
    ], problems
    assert all(p.startswith("opport/example.py:") for p in problems)
    assert problems[0].startswith("opport/example.py:3:")
