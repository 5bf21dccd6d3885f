"""Gate outputs on real gloo ranks: by-node grouping, drain -> exit 4, JUnit XML on both paths."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from tests.harness import run_check

pytestmark = pytest.mark.timeout(120)


def _cases(path):
    root = ET.parse(path).getroot()
    return root, {c.get("name"): c for c in root.iter("testcase")}


def test_drain_exit_4_findings_grouped_per_node_and_junit(workdir):
    """2 pretend nodes; required GPUs missing (CPU box) drain both; rank 3's straggling lands on node 1 only."""
    cfg = workdir / "gate.toml"
    cfg.write_text(
        '[probes.gpu]\nrequired = true\ngpus_per_node = 8\n'
        '[probes.bandwidth]\nsizes = ["4KiB"]\np2p = false\ndelay_rank = 3\ndelay_s = 0.01\n'
    )
    args = ["--probes", "gpu,bandwidth", "--config", str(cfg), "--junit", "gate.xml"]
    result = run_check(4, args, workdir, timeout=90, hosts=2)
    assert result.codes == [4] * 4, result.stderr
    data = json.loads((workdir / "distdiag-report.json").read_text())
    nodes = {n["node"]: n for n in data["by_node"]["nodes"]}
    assert sorted(nodes) == [0, 1] and nodes[0]["ranks"] == [0, 1] and nodes[1]["ranks"] == [2, 3]
    assert nodes[0]["drain"] and nodes[1]["drain"]
    assert all("required GPU check failed" in f["issue"] for f in nodes[0]["findings"]), nodes[0]
    straggler = [f for f in nodes[1]["findings"] if f["probe"] == "bandwidth"]
    assert [f["ranks"] for f in straggler] == [[3]], nodes[1]["findings"]
    root, cases = _cases(workdir / "gate.xml")
    assert root.get("failures") == "3"  # the gpu probe and both nodes
    assert cases["gpu"].find("failure") is not None and cases["bandwidth"].find("failure") is None
    host = data["ranks"][0]["host"]
    assert cases[f"node 1 ({host})"].find("failure").get("type") == "drain"


def test_abort_path_writes_junit_too(workdir):
    """A rank hangs: exit 3, and the JUnit XML carries the probe as an error with the hang finding."""
    args = ["--probes", "env", "--timeout-s", "3", "--junit", "out/gate.xml"]
    result = run_check(2, args, workdir, inject="hang:env:1", timeout=60)
    assert result.codes == [3, 3], result.stderr
    root, cases = _cases(workdir / "out" / "gate.xml")
    props = {p.get("name"): p.get("value") for p in root.iter("property")}
    assert props["exit_code"] == "3" and props["verdict"] == "fail"
    err = cases["env"].find("error")
    assert err is not None and "rank 1" in err.text
