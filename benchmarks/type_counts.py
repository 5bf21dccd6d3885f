"""How much of distdiag's typing says `Any`: a reproducible count, read from the source with ast.

    python benchmarks/type_counts.py            # distdiag/
    python benchmarks/type_counts.py PATH ...   # other folders or files (another project's)

An annotation is a function parameter's (an unannotated `self` is none), a return type, or an annotated
assignment (`x: T = ...`, a dataclass field). It "mentions Any" when the name `Any` (or
`typing.Any`) appears anywhere in it: `Any`, `dict[str, Any]`, `list[Any] | None`. Prints one
JSON object: the annotations, those mentioning Any and their share, and how many parameters
named `ctx` are annotated `Any`.
"""

from __future__ import annotations

import ast
import json
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _annotations(tree: ast.AST) -> Iterator[tuple[str, ast.expr]]:
    """(parameter name or "", annotation) for every annotation in the module."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
            params += [a for a in (args.vararg, args.kwarg) if a is not None]
            for arg in params:
                if arg.annotation is not None:
                    yield arg.arg, arg.annotation
            if node.returns is not None:
                yield "", node.returns
        elif isinstance(node, ast.AnnAssign):
            yield "", node.annotation


def _mentions_any(annotation: ast.expr) -> bool:
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:  # a quoted annotation: "dict[str, Any]"
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return False
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name) and node.id == "Any":
            return True
        if isinstance(node, ast.Attribute) and node.attr == "Any":
            return True
    return False


def count(paths: list[Path]) -> dict[str, object]:
    files = sorted(f for p in paths for f in ([p] if p.is_file() else p.rglob("*.py")))
    total = with_any = ctx_any = 0
    for path in files:
        for name, annotation in _annotations(ast.parse(path.read_text(), str(path))):
            total += 1
            if _mentions_any(annotation):
                with_any += 1
                if name == "ctx" and isinstance(annotation, ast.Name):
                    ctx_any += 1
    share = round(100 * with_any / total, 1) if total else 0.0
    return {"files": len(files), "annotations": total, "mention_any": with_any, "any_share_pct": share, "ctx_any": ctx_any}


def main() -> None:
    paths = [Path(a) for a in sys.argv[1:]] or [ROOT / "distdiag"]
    print(json.dumps(count(paths)))


if __name__ == "__main__":
    main()
