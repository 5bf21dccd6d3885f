"""The house rules of issue 13, checked on the source: packages that say what they hold, no
import cycles, and no unit too long to read on one screen without a reason written beside it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "distdiag"
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 300
REASON_TAG = "# long:"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """distdiag modules a module imports, at its top or inside a function (a lazy import is
    still a dependency: it only moves the moment a cycle would bite)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    found.add(sub)
                elif base in modules:
                    found.add(base)
    found.discard(name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {name: _imports(path, name, modules) for name, path in modules.items()}
    # importing a.b.c runs a/__init__ and a/b/__init__ first: a package's __init__ is part of
    # every import of its modules, so an edge to a.b.c is an edge to its packages too
    for name in graph:
        graph[name] = graph[name] | {p for dep in graph[name] for p in _parents(dep) if p in modules and p != name and not name.startswith(p + ".")}
    assert _cycles(graph) == []


# What each top-level package may import, as its __init__ docstring and docs/architecture.md
# say: the leaves (errors, report) at the bottom, the CLI at the top. A new edge is a design
# decision: make it here and in those two places, not by accident.
MAY_IMPORT: dict[str, set[str]] = {
    "errors": set(),
    "report": {"errors"},
    "hang": {"errors", "report"},
    "runtime": {"errors", "report", "hang"},
    "workloads": {"errors"},
    "probes": {"errors", "report", "runtime", "workloads"},
    "check": {"distdiag", "errors", "report", "hang", "runtime", "probes", "launcher.ranks"},
    "analyze": {"errors", "report"},
    "monitor": {"errors", "report", "analyze", "check.config", "runtime.settle"},
    "watchdog": {"errors", "report", "hang", "runtime", "launcher.ranks"},
    "watch": {"errors", "hang", "watchdog", "launcher.ranks"},
    "launcher": {"errors", "report", "runtime", "check", "watch", "watchdog"},
    "integrations": {"errors", "report", "watchdog", "watch", "monitor", "check.config"},
}


def _top(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_packages_import_only_what_they_may() -> None:
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        mine = _top(name)
        if mine not in MAY_IMPORT:
            continue  # the CLI and the package root may import anything
        for dep in sorted(_imports(path, name, modules)):
            theirs = _top(dep)
            if theirs == mine:
                continue
            sub = ".".join(dep.split(".")[1:3])
            if theirs not in MAY_IMPORT[mine] and sub not in MAY_IMPORT[mine]:
                wrong.append(f"{name} imports {dep}")
    assert wrong == []


@pytest.mark.parametrize("package", sorted(str(p.parent.relative_to(PKG.parent)) for p in PKG.rglob("__init__.py")))
def test_every_package_says_what_it_holds(package: str) -> None:
    tree = ast.parse((PKG.parent / package / "__init__.py").read_text())
    doc = ast.get_docstring(tree)
    assert doc and len(doc.splitlines()) >= 2, f"{package}/__init__.py needs a docstring saying what lives there"
    names = [t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)]
    assert "__all__" in names, f"{package}/__init__.py needs an explicit __all__"


def _long_units() -> list[str]:
    found = []
    for path in sorted(PKG.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            length = node.end_lineno - node.lineno + 1
            beside = " ".join(lines[max(0, start - 3): node.lineno + 1])
            if length > limit and REASON_TAG not in beside:
                found.append(f"{path.relative_to(PKG.parent)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_unit_too_long_without_a_reason() -> None:
    """A function over 60 lines or a class over 300 carries `# long: why` just above it."""
    assert _long_units() == []


def test_the_check_package_is_light_and_keeps_its_old_entry_points() -> None:
    """`import distdiag.check` loads neither run.py nor torch; `distdiag.check.main` and
    `run_check` (public before the check became a package) still resolve, to run.py's."""
    import subprocess
    import sys

    code = (
        "import sys, distdiag.check as c; "
        "assert 'distdiag.check.run' not in sys.modules and 'torch' not in sys.modules; "
        "from distdiag.check import run_check; import distdiag.check.run as r; "
        "assert c.main is r.main and run_check is r.run_check; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=PKG.parent)
    assert out.stdout.strip() == "ok", out.stderr


def test_comments_cite_facts_inside_the_repository() -> None:
    """The facts a comment relies on live in docs/facts.md: a comment citing FACTS.md (a file
    outside the checkout) or ../shared/ points a reader at nothing."""
    cited = [
        f"{path.relative_to(PKG.parent)}:{n}"
        for path in sorted(PKG.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "FACTS.md" in line or "../shared" in line
    ]
    assert cited == []
