"""docs/adding-an-op.md and docs/adding-a-backend.md, followed literally.

Each test writes the docs' own code blocks (parsed from the Markdown, so the pages cannot drift) into a
throwaway package in a temporary folder, registers it the documented way (an entry point in a
`<dist>.dist-info` folder on PYTHONPATH, as `pip install` would leave it), and runs in a fresh
interpreter the checks `make test` runs, narrowed to what concerns the new op or backend: ruff, the
tests that iterate over every op or backend (each must select and pass at least one test for it), and
the conformance gate.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINT_GROUP = re.compile(r'^\[project\.entry-points\."(?P<group>[\w.]+)"\]\n(?P<items>(?:[\w.-]+ = "[\w.:]+"\n?)+)', re.M)
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>\w*)[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)

# the tests that iterate over every op (or its backward) and over every backend
OP_TESTS = ("tests/test_validation.py", "tests/test_bench.py", "tests/test_integration_torch.py",
            "tests/test_integration_jax.py", "tests/ops/test_grad.py", "tests/test_training.py")
BACKEND_TESTS = ("tests/test_backend_threads.py", "tests/test_hardening.py")


def code_blocks(doc: str) -> list[tuple[str, str]]:
    """(language, dedented text) of every fenced code block of docs/<doc>."""
    text = (ROOT / "docs" / doc).read_text(encoding="utf-8")
    return [(m["lang"], textwrap.dedent(m["body"])) for m in FENCE.finditer(text)]


def block(doc: str, lang: str, marker: str) -> str:
    """The one `lang` block of docs/<doc> that contains `marker`."""
    found = [body for kind, body in code_blocks(doc) if kind == lang and marker in body]
    assert len(found) == 1, f"docs/{doc}: expected one {lang} block containing {marker!r}, found {len(found)}"
    return found[0]


def entry_points(pyproject: str) -> dict[str, dict[str, str]]:
    """{group: {name: value}} of the `[project.entry-points."<group>"]` tables of a pyproject.toml excerpt."""
    groups = {m["group"]: dict(re.findall(r'^([\w.-]+) = "([\w.:]+)"', m["items"], re.M))
              for m in ENTRY_POINT_GROUP.finditer(pyproject)}
    assert groups, f"no entry-point table in {pyproject!r}"
    return groups


def install(site: Path, dist: str, files: dict[str, str], pyproject: str) -> list[Path]:
    """Write a package's files into `site` and the metadata pip would write for its entry points."""
    written = []
    for rel, text in files.items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    groups = entry_points(pyproject)
    info = site / f"{dist}-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in items.items()) for group, items in groups.items()))
    return [p for p in written if p.suffix == ".py"]


def run(site: Path, *argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python ARGV` in a fresh interpreter (discovery caches) with the package and this checkout first on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPPORT_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])
    env["COLUMNS"] = "250"  # tables wide enough for kernel names
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def check(proc: subprocess.CompletedProcess, what: str):
    __tracebackhide__ = True
    assert proc.returncode == 0, f"{what}: exit {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"


def ruff(site: Path, files: list[Path], first_party: list[str]):
    """The repository's lint rules, with the package treated as first-party like opport itself."""
    known = "lint.isort.known-first-party = " + repr(["opport", *first_party]).replace("'", '"')
    check(run(site, "-m", "ruff", "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), "--config", known,
              *map(str, files)), "ruff check")


def pytest_selected(site: Path, files: tuple, word: str, whole: tuple = ()):
    """Run `-k word` over `files`, and every test of `whole` (files, or `file::test` ids) in the same run (one
    interpreter start): every test must pass, and each of `files` must have run at least one for `word`."""
    names = [w.rsplit("::", 1)[-1].rsplit("/", 1)[-1] for w in whole]  # -k matches a test's file and its own name
    files_run = [*files, *(w.split("::")[0] for w in whole if w.split("::")[0] not in files)]
    proc = run(site, "-m", "pytest", "-q", "-rfEsp", "-p", "no:cacheprovider", "-k", " or ".join([word, *names]),
               *dict.fromkeys(files_run))
    check(proc, f"pytest -k {word}")
    for name in names:
        assert re.search(rf"^PASSED \S*{re.escape(name)}", proc.stdout, re.M), f"{name} did not run\n{proc.stdout[-4000:]}"
    passed = re.findall(r"^PASSED (\S+)", proc.stdout, re.M)
    empty = [f for f in files if not any(p.startswith(f + "::") and word in p for p in passed)]
    assert not empty, f"no test for {word} ran in {empty}\n{proc.stdout[-4000:]}"


def listed(site: Path) -> str:
    """`opport list`: the op x backend matrix of kernels."""
    proc = run(site, "-m", "opport", "list")
    check(proc, "opport list")
    return proc.stdout


def conformance_kernels(site: Path, tmp: Path, *argv: str) -> set:
    """`opport conformance ARGV` (the gate must pass): the kernels of the cases that passed."""
    out = tmp / "conformance.json"
    check(run(site, "-m", "opport", "conformance", *argv, "-q", "--json", str(out)), f"opport conformance {' '.join(argv)}")
    return {c["kernel"] for c in json.loads(out.read_text())["cases"] if c["status"] == "pass"}


def bench_rows(site: Path, tmp: Path, *argv: str) -> list:
    """`opport bench --smoke ARGV`: its opport rows (the run must succeed)."""
    out = tmp / "bench.json"
    check(run(site, "-m", "opport", "bench", "--smoke", *argv, "--json", str(out)), f"opport bench {' '.join(argv)}")
    return [r for r in json.loads(out.read_text())["rows"] if r["impl"] == "opport"]


def test_adding_an_op_with_a_cpu_kernel_only(tmp_path):
    doc = "adding-an-op.md"
    declaration = block(doc, "python", "@square.reference") + "\n\n" + block(doc, "python", ".backward(")
    kernel = block(doc, "python", "square as spec")
    pyproject = block(doc, "toml", '"opport.ops"')
    site, pkg = tmp_path / "site", "recipe_square"  # the docs' "mypackage"
    files = {f"{pkg}/__init__.py": "", f"{pkg}/ops/__init__.py": "", f"{pkg}/backends/__init__.py": "",
             f"{pkg}/backends/cpu/__init__.py": "",
             f"{pkg}/ops/square.py": declaration,
             f"{pkg}/backends/cpu/square.py": kernel.replace("from opport.ops.square", f"from {pkg}.ops.square")}
    written = install(site, "recipe-square", files, pyproject.replace("mypackage", pkg))

    ruff(site, written, [pkg])
    found = run(site, "-c", "import opport; print(sorted(opport.all_ops())); print(opport.square.__doc__)")
    check(found, "discovery")
    assert "'square'" in found.stdout and "x * x, elementwise." in found.stdout, found.stdout
    pytest_selected(site, OP_TESTS, "square", whole=("tests/test_cli.py",))
    assert "cpu.square" in listed(site)
    assert "cpu.square" in conformance_kernels(site, tmp_path, "--backend", "cpu", "--op", "square")
    rows = bench_rows(site, tmp_path, "--op", "square")  # its case tagged llm, forward and forward+backward
    assert sorted((r["op"], r["pass"]) for r in rows) == [("square", "fwd"), ("square", "fwd+bwd")], rows
    if importlib.util.find_spec("triton") and importlib.util.find_spec("torch"):  # as tests/test_cuda_aot.py
        report = tmp_path / "aot.json"  # the sm_90 check leaves out ops without cuda kernels (smoke shapes only here)
        aot = run(site, "tools/cuda_aot.py", "--tier", "smoke", "--no-cases", "--dtype", "float32", "--json", str(report))
        check(aot, "tools/cuda_aot.py")
        aot = json.loads(report.read_text())
        compiled = {p.split()[0] for b in aot["builds"] for p in b["problems"]}
        assert aot["failures"] == aot["skipped"] == [] and "square" not in compiled and len(compiled) >= 10, aot


def test_adding_an_op_with_an_integer_argument_and_two_outputs(tmp_path):
    """The page's second op: an integer argument with its declared domain, a value check, two outputs."""
    doc = "adding-an-op.md"
    declaration, kernel = block(doc, "python", "@pick_rows.outputs"), block(doc, "python", "pick_rows as spec")
    pyproject = block(doc, "toml", '"opport.ops"').replace("square", "pick_rows")
    site, pkg = tmp_path / "site", "recipe_pick"
    files = {f"{pkg}/__init__.py": "", f"{pkg}/ops/__init__.py": "", f"{pkg}/backends/__init__.py": "",
             f"{pkg}/backends/cpu/__init__.py": "", f"{pkg}/ops/pick_rows.py": declaration,
             f"{pkg}/backends/cpu/pick_rows.py": kernel.replace("from opport.ops.pick_rows", f"from {pkg}.ops.pick_rows")}
    written = install(site, "recipe-pick", files, pyproject.replace("mypackage", pkg))

    ruff(site, written, [pkg])
    call = ("import numpy as np, opport; rows, sums = opport.pick_rows(np.ones((3, 2), np.float32), np.array([2, 0])); "
            "print(rows.shape, sums.tolist())")
    found = run(site, "-c", call)
    check(found, "a call")
    assert "(2, 2) [2.0, 2.0]" in found.stdout, found.stdout
    pytest_selected(site, ("tests/test_validation.py", "tests/test_explain_every_op.py"), "pick_rows")
    explained = run(site, "-m", "opport", "explain", "pick_rows", "--shape", "64,130", "--shape", "7", "--backend", "cpu")
    check(explained, "opport explain")
    assert "cpu.pick_rows" in explained.stdout
    assert "cpu.pick_rows" in conformance_kernels(site, tmp_path, "--backend", "cpu", "--op", "pick_rows")


def test_adding_a_backend_with_one_kernel(tmp_path):
    doc = "adding-a-backend.md"
    declaration = block(doc, "python", "BACKEND = Backend(")
    kernel = block(doc, "python", "@impl(")
    pyproject = block(doc, "toml", '"opport.backends"')
    name = re.search(r'name="(\w+)"', declaration)[1]
    (pkg,) = entry_points(pyproject)["opport.backends"].values()
    op = re.search(r"from opport\.ops\.(\w+) import", kernel)[1]
    site = tmp_path / "site"
    written = install(site, f"recipe-{name}", {f"{pkg}/__init__.py": declaration, f"{pkg}/{op}.py": kernel}, pyproject)

    ruff(site, written, [pkg])
    doctor = run(site, "-m", "opport", "doctor")
    check(doctor, "opport doctor")
    assert re.search(rf"^\W*{name}\W+ok\W", doctor.stdout, re.M), doctor.stdout
    assert f"{name}.{op}" in listed(site)
    pytest_selected(site, BACKEND_TESTS, name, whole=("tests/test_cli.py", "tests/test_conformance_runner.py",
                    "tests/test_bench.py::test_bench_and_conformance_name_no_backend_and_read_no_mode"))
    assert f"{name}.{op}" in conformance_kernels(site, tmp_path, "--backend", name)
    assert {r["call"].rsplit("-> ", 1)[-1] for r in bench_rows(site, tmp_path, "--backend", name, "--op", op)} == {f"{name}.{op}"}
