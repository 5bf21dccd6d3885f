"""docs/report-schema.json, the published JSON Schema of a report, holds for real reports: the
check's (every probe's consolidation on the synthetic payloads of tests/unit/check_payloads.py,
healthy and faulty), the watchdog's hang report, a report built from flight-recorder dumps,
analyze's and a bad-input one. Checked by a small validator of the part of JSON Schema the file
uses (type, enum, required, properties, additionalProperties, items, minimum, maximum, $ref):
`jsonschema` is not a dependency."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "docs" / "report-schema.json"
SCHEMA = json.loads(SCHEMA_PATH.read_text())
USED = {"$schema", "title", "description", "type", "enum", "required", "properties", "additionalProperties",
        "items", "minimum", "maximum", "$ref", "$defs"}

_TYPES = {
    "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool), "null": lambda v: v is None,
}


def problems(value: Any, schema: dict[str, Any], where: str = "$", root: dict[str, Any] = SCHEMA) -> list[str]:
    """Every place `value` breaks `schema` (the subset above), as 'path: what'."""
    unknown = set(schema) - USED
    assert not unknown, f"the schema uses {unknown}: teach the test's validator first"
    if "$ref" in schema:
        node: Any = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        return problems(value, node, where, root)
    out = []
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not any(_TYPES[k](value) for k in kinds):
            return [f"{where}: {type(value).__name__} is not {'/'.join(kinds)}"]
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{where}: {value!r} not one of {schema['enum']}")
    if "minimum" in schema and _TYPES["number"](value) and value < schema["minimum"]:
        out.append(f"{where}: {value} < {schema['minimum']}")
    if "maximum" in schema and _TYPES["number"](value) and value > schema["maximum"]:
        out.append(f"{where}: {value} > {schema['maximum']}")
    if isinstance(value, dict):
        out += [f"{where}: missing {k}" for k in schema.get("required", []) if k not in value]
        props = schema.get("properties", {})
        for k, v in value.items():
            if k in props:
                out += problems(v, props[k], f"{where}.{k}", root)
            elif schema.get("additionalProperties") is False:
                out.append(f"{where}: {k} is not in the schema")
            elif isinstance(schema.get("additionalProperties"), dict):
                out += problems(v, schema["additionalProperties"], f"{where}.{k}", root)
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            out += problems(item, schema["items"], f"{where}[{i}]", root)
    return out


def test_the_validator_catches_what_it_checks():
    good = {"schema": "distdiag.report/1", "verdict": "pass", "exit_code": 0, "outcome": "completed", "summary": "",
            "world_size": 1, "probes": []}
    assert problems(good, SCHEMA) == []
    bad = {**good, "exit_code": 300, "verdict": "ok", "extra": 1, "probes": [{"name": "p", "status": "pass",
                                                                            "findings": [{"severity": "bad"}]}]}
    del bad["summary"]
    found = problems(bad, SCHEMA)
    assert any("exit_code: 300 > 255" in p for p in found) and any("verdict" in p for p in found)
    assert any("extra is not in the schema" in p for p in found) and any("missing summary" in p for p in found)
    assert any("findings[0]: missing issue" in p for p in found) and any("severity" in p for p in found)


def _check_reports() -> list[tuple[str, Any]]:
    from distdiag.probes import PROBES
    from distdiag.probes.base import ConsolidationView
    from distdiag.report.model import Report, exit_code_for, verdict_for
    from tests.unit.check_payloads import SCENARIOS, payloads, rank_infos

    out = []
    world = 8
    for scenario in SCENARIOS:
        results = []
        for probe in ("env", "gpu", "collectives", "bandwidth"):
            cls = PROBES[probe]
            view = ConsolidationView(world, rank_infos(world), cls.Config() if cls.Config else None)
            results.append(cls().consolidate(payloads(probe, world, scenario), view))
        code = exit_code_for(results)
        out.append((f"check/{scenario}", Report(world_size=world, probes=results, ranks=rank_infos(world),
                                                exit_code=code, verdict=verdict_for(code, results),
                                                summary=scenario, notes=["a note"], not_run=["data_shards"])))
    return out


def _other_reports() -> list[tuple[str, Any]]:
    from distdiag.hang.dumpreport import report_from_dumps
    from distdiag.report.model import EXIT_BAD_INPUT, Report
    from tests.unit.test_hang_picture import _report
    from tests.unit.test_watchdog_cli import dump, entry

    dumps = {0: dump([entry(1), entry(2), entry(3)]), 1: dump([entry(1), entry(2, op="all_gather")])}
    return [("watchdog", _report(64)), ("dumps", report_from_dumps(dumps)),
            ("bad_input", Report(world_size=4, exit_code=EXIT_BAD_INPUT, verdict="error", outcome="bad_input",
                                 summary="check.timeout_s must be > 0"))]


@pytest.mark.parametrize("name,report", _check_reports() + _other_reports(), ids=lambda x: x if isinstance(x, str) else "")
def test_real_reports_follow_the_published_schema(name, report):
    data = json.loads(report.to_json())
    assert problems(data, SCHEMA) == [], name


def test_an_analyze_report_follows_the_schema(tmp_path):
    from distdiag.analyze import AnalyzeConfig, load_run
    from distdiag.analyze import analyze as run_analysis

    log = tmp_path / "run.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 2.0 / (s + 1) if s != 30 else float("nan")}) + "\n"
                           for s in range(60)))
    report = run_analysis([load_run(log, strict=False, label="run")], AnalyzeConfig())
    assert report.probes and problems(json.loads(report.to_json()), SCHEMA) == []

