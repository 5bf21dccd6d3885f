"""The typed vocabularies read and write as the strings they replace, and probes' ctx stays typed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distdiag.report.model import SEVERITIES, STATUSES, Finding, ProbeResult, Severity, Status

ROOT = Path(__file__).resolve().parents[2]


def test_the_vocabularies_keep_their_strings_and_order() -> None:
    """SEVERITIES and STATUSES are the enums' values, plain strings, in the documented order."""
    assert SEVERITIES == ("info", "warning", "error", "critical")
    assert STATUSES == ("pass", "warn", "fail", "skip", "error")
    assert all(type(v) is str for v in SEVERITIES + STATUSES)


@pytest.mark.parametrize("member", [*Severity, *Status])
def test_a_member_is_its_value_everywhere(member: Severity | Status) -> None:
    """Compared, hashed, printed, formatted and written as JSON, a member is its string."""
    value = member.value
    assert member == value and value == member and value in (member,)
    assert {value: 1}[member] == 1
    assert str(member) == f"{member}" == f"{member:>3}".strip() == format(member) == value
    assert json.dumps(member) == json.dumps(value)
    assert json.dumps({member: [member]}) == json.dumps({value: [value]})


def test_a_finding_built_with_members_writes_the_same_json() -> None:
    """A Finding and a ProbeResult given members write byte for byte what strings write."""
    plain = ProbeResult("p", "fail", [Finding("critical", "issue", ranks=[1])])
    typed = ProbeResult("p", Status.FAIL, [Finding(Severity.CRITICAL, "issue", ranks=[1])])
    assert json.dumps(typed.to_dict(), sort_keys=True) == json.dumps(plain.to_dict(), sort_keys=True)


def test_no_probe_context_is_any() -> None:
    """Every `ctx` parameter under distdiag/ names its type (RankContext for the probes); only
    torch's autograd context in a workload stays Any (benchmarks/type_counts.py counts them)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("type_counts", ROOT / "benchmarks" / "type_counts.py")
    assert spec is not None and spec.loader is not None
    counts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(counts)
    assert counts.count([ROOT / "distdiag" / "probes", ROOT / "distdiag" / "check"])["ctx_any"] == 0
