"""The probes' causes are one enum (distdiag/probes/causes.py ProbeCause): every cause a probe
sets or compares is a member, never a string literal, and a report written with members reads
byte for byte as one written with the words they replaced."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from distdiag.probes.causes import ProbeCause
from distdiag.report.model import Finding, ProbeResult, Report, read_report, write_report

ROOT = Path(__file__).resolve().parents[2]
PROBES = ROOT / "distdiag" / "probes"
CAUSE_CARRIERS = {"Diagnosis": 0, "Divergence": 0, "SpDiagnosis": 3}
"""Records that carry a cause as a positional argument, and its position."""


def test_every_member_is_its_snake_case_word() -> None:
    values = [m.value for m in ProbeCause]
    assert len(values) == len(set(values))
    for member in ProbeCause:
        assert re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)+", member.value), member
        assert member.name.lower() == member.value


def _literal_causes(tree: ast.AST) -> list[int]:
    """Lines where a cause is a string literal: a `cause=` argument, a cause record's cause
    argument, a comparison with a `.cause`, or any string equal to a member's word."""
    words = {m.value for m in ProbeCause}
    found = []
    for node in ast.walk(tree):
        exprs: list[ast.expr] = []
        if isinstance(node, ast.Call):
            exprs += [k.value for k in node.keywords if k.arg == "cause"]
            pos = CAUSE_CARRIERS.get(getattr(node.func, "id", ""))
            if pos is not None and len(node.args) > pos:
                exprs.append(node.args[pos])
        elif isinstance(node, ast.Compare) and "cause" in ast.unparse(node):
            exprs += [node.left, *node.comparators]
        elif isinstance(node, ast.Constant) and node.value in words:
            found.append(node.lineno)
        found += [e.lineno for e in exprs if _spells_a_word(e)]
    return sorted(set(found))


def _spells_a_word(expr: ast.expr) -> bool:
    """A non-empty string or an f-string in the expression (a subscript's key is not a cause)."""
    keys = {id(n.slice) for n in ast.walk(expr) if isinstance(n, ast.Subscript)}
    return any(isinstance(n, ast.JoinedStr) or (isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value
                                                 and id(n) not in keys) for n in ast.walk(expr))


def test_no_probe_spells_a_cause_as_a_string() -> None:
    found = []
    for path in sorted(PROBES.rglob("*.py")):
        if path.name == "causes.py":
            continue
        found += [f"{path.relative_to(ROOT)}:{line}" for line in _literal_causes(ast.parse(path.read_text()))]
    assert not found, f"a cause spelled as a string where a ProbeCause member is meant: {found}"


def test_the_scan_sees_a_literal_cause() -> None:
    src = ('Finding("error", "x", cause="identical_data")\nDiagnosis("grad_reduction", "m")\n'
           'if f.cause == "a_b": pass\nFinding("error", "x", cause=f"{what}_differs")\nx = "left_on_meta"\n'
           'SpDiagnosis("loss", "i", "e", "c_d", "fix", 0.4)')
    assert _literal_causes(ast.parse(src)) == [1, 2, 3, 4, 5, 6]
    ok = ('Finding("error", "x", cause=ProbeCause.IDENTICAL_DATA)\nif f.cause == ProbeCause.GRAD_REDUCTION: pass\n'
          'Finding("error", "x", cause=k["cause"] or "")')
    assert _literal_causes(ast.parse(ok)) == []


def test_a_report_with_members_writes_the_words(tmp_path: Path) -> None:
    """Written and read back, a finding's cause is the word it always was, byte for byte."""
    def report(cause: str) -> Report:
        finding = Finding("error", "ranks 0-1 read the same samples", ranks=[0, 1], fix="shard", confidence=0.95,
                          cause=cause)
        return Report(world_size=2, probes=[ProbeResult("data_shards", "fail", [finding])])

    for member in ProbeCause:
        typed, plain = tmp_path / "typed.json", tmp_path / "plain.json"
        write_report(report(member), typed)
        write_report(report(member.value), plain)
        assert typed.read_bytes() == plain.read_bytes()
        assert json.loads(typed.read_text())["probes"][0]["findings"][0]["cause"] == member.value
        back = read_report(typed).probes[0].findings[0].cause
        assert back == member and type(back) is str
