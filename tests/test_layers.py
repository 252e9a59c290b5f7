"""The import rules of docs/layout.md, checked on the source: no circle, kernels take from opport/ops only
their op, declarations import no backend."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "opport"


def _modules() -> dict:
    """Module name -> path, for every file of the package."""
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


MODULES = _modules()


def _imports(path: Path) -> list:
    """(imported opport module, line) for every import in the file, at any depth (lazy imports included)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.startswith("opport")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("opport"):
            for a in node.names:  # `from opport.x import y`: module opport.x.y if there is one, else opport.x
                sub = f"{node.module}.{a.name}"
                found.append((sub if sub in MODULES else node.module, node.lineno))
    return found


def _graph() -> dict:
    """Module -> modules it imports, packages' __init__ left out (importing a package's module is not a tie to
    everything its __init__ hands on)."""
    packages = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    return {m: {i for i, _ in _imports(p) if i in MODULES and i not in packages and i != m}
            for m, p in MODULES.items() if m not in packages}


def _circles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    assert _circles(_graph()) == []


def test_the_circle_finder_finds_circles():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


KERNEL_FILES = sorted(p for p in ROOT.glob("backends/*/*.py") if not p.name.startswith("_"))


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_kernel_file_takes_from_ops_only_its_op(path):
    """A kernel never imports the code that judges it: from opport/ops it takes its op's spec only."""
    op = path.stem.removesuffix("_backward")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("opport.ops"):
            names = [a.name for a in node.names]
            assert (node.module, names) == (f"opport.ops.{op}", [op]), (
                f"{path.name}:{node.lineno} imports {names} from {node.module}: shared helpers live in opport/arraymath.py")
        if isinstance(node, ast.Import):
            assert not any(a.name.startswith("opport.ops") for a in node.names), f"{path.name}:{node.lineno}"


def test_helpers_of_a_backend_import_no_declaration():
    for path in sorted(ROOT.glob("backends/**/_*.py")):
        bad = [(m, line) for m, line in _imports(path) if m.startswith("opport.ops")]
        assert not bad, f"{path.relative_to(ROOT)} imports declarations: {bad}"


@pytest.mark.parametrize("layer", ["ops", "spec"])
def test_declarations_import_no_backend_or_dispatcher(layer):
    files = [ROOT / f"{layer}.py"] if (ROOT / f"{layer}.py").exists() else sorted((ROOT / layer).rglob("*.py"))
    for path in files:
        bad = [(m, line) for m, line in _imports(path) if m.startswith(("opport.backends", "opport.dispatch"))]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_few_consumers_switch_on_the_kind_of_spec():
    """Specs answer for themselves (opport/spec/base.py): outside the spec package `direction` is data for reports,
    compared nowhere."""
    found = []
    for path in ROOT.rglob("*.py"):
        if "spec" in path.relative_to(ROOT).parts[:1]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(
                    isinstance(n, ast.Attribute) and n.attr == "direction" for n in (node.left, *node.comparators)):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []
