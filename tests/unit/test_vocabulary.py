"""One vocabulary: every exception distdiag defines is a DistDiagError, and the hang exit code
is spelled EXIT_HANG, never a bare 3 (a reader greps one name to find every way to it)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import distdiag
from distdiag.errors import DistDiagError

ROOT = Path(distdiag.__file__).parent
CONTROL_FLOW = {"_ExitAtImport"}
"""BaseException subclasses used to unwind a target's import, never reported as errors."""


def _modules() -> list[str]:
    names = []
    for info in pkgutil.walk_packages([str(ROOT)], "distdiag."):
        if info.name.rsplit(".", 1)[-1] == "__main__":  # running it is its import
            continue
        names.append(info.name)
    return names


def test_every_exception_class_is_a_distdiag_error() -> None:
    strays = []
    for name in _modules():
        try:
            module = importlib.import_module(name)
        except ImportError:  # an optional dependency (matplotlib, transformers) absent
            continue
        for cls_name, cls in vars(module).items():
            if (inspect.isclass(cls) and issubclass(cls, BaseException) and cls.__module__ == name
                    and cls_name not in CONTROL_FLOW and not issubclass(cls, DistDiagError)):
                strays.append(f"{name}.{cls_name}")
    assert not strays, f"not under DistDiagError: {strays}"


EXIT_NAMES = {"code", "exit_code", "rc", "returncode", "exitcode"}
"""Names that hold a process's exit code where it is compared."""


def _bare_hang_codes(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if "exit" in func.lower() and any(isinstance(a, ast.Constant) and a.value == 3 for a in node.args):
                lines.append(node.lineno)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and node.value.value == 3:
            if any(isinstance(t, ast.Name) and t.id.startswith("EXIT_") and t.id != "EXIT_HANG" for t in node.targets):
                lines.append(node.lineno)
        elif isinstance(node, ast.Compare):
            names = {ast.unparse(n).rsplit(".", 1)[-1] for n in (node.left, *node.comparators)
                     if isinstance(n, ast.Name | ast.Attribute)}
            if names & EXIT_NAMES and any(
                    isinstance(c, ast.Constant) and c.value == 3 for c in (node.left, *node.comparators)):
                lines.append(node.lineno)
    return sorted(lines)


def test_no_bare_hang_exit_code() -> None:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        for line in _bare_hang_codes(ast.parse(path.read_text(), str(path))):
            found.append(f"{path.relative_to(ROOT.parent)}:{line}")
    assert not found, f"a bare 3 where EXIT_HANG is meant: {found}"


def test_the_scan_sees_a_bare_three() -> None:
    assert _bare_hang_codes(ast.parse("sys.exit(3)\nEXIT_X = 3\nif code == 3: pass\nos._exit(3)")) == [1, 2, 3, 4]
    assert _bare_hang_codes(ast.parse("sys.exit(EXIT_HANG)\nEXIT_HANG = 3\nif x.ndim == 3: pass")) == []
