"""What a program reads of a report: the versions that wrote it, structured fields beside the
sentences, host lists a scheduler reads, and the published JSON Schema."""

from __future__ import annotations

import json
import subprocess
import sys

from distdiag.report.model import Finding, ProbeResult, Report, read_report, write_report


def _report() -> Report:
    return Report(world_size=2, probes=[ProbeResult.from_findings("p", [Finding("warning", "x", ranks=[1])])])


def test_versions_at_the_top_level(tmp_path) -> None:
    import torch

    import distdiag

    data = _report().to_dict()
    assert data["distdiag_version"] == distdiag.__version__
    assert data["torch_version"] == torch.__version__
    path = write_report(_report(), tmp_path / "r.json")
    back = read_report(path)
    assert (back.distdiag_version, back.torch_version) == (distdiag.__version__, torch.__version__)


def test_an_old_report_reads_back_without_versions(tmp_path) -> None:
    data = _report().to_dict()
    del data["distdiag_version"], data["torch_version"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    back = read_report(tmp_path / "old.json")
    assert back.to_dict()["distdiag_version"] == "" and back.to_dict()["torch_version"] == ""


def test_torch_version_without_importing_torch() -> None:
    code = ("import sys; from distdiag.report.model import Report; "
            "v = Report(world_size=1).torch_version; print(v, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    version, imported = out.split()
    assert version and imported == "False"
