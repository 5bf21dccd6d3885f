"""The README's first command at world sizes that do not divide 8: the default suite passes, nothing above info."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(150)

NUMERICS = ("fsdp_plan", "loss_parity", "param_sync", "determinism")


@pytest.mark.parametrize("world", [3, 5])
def test_default_suite_passes_on_a_healthy_box_at_odd_world_sizes(cli_env, tmp_path, world):
    """`distdiag check --nproc-per-node 3` (and 5), no target: the built-in workloads size to the world;
    exit 0, every numerics probe ran and passed, no warning (fsdp_plan's uneven shards, moe_routing's load)."""
    cmd = [sys.executable, "-m", "distdiag", "check", "--nproc-per-node", str(world)]
    out = subprocess.run(cmd, env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "distdiag-report.json").read_text())
    assert report["exit_code"] == 0 and report["world_size"] == world
    status = {p["name"]: p["status"] for p in report["probes"]}
    assert all(status[name] == "pass" for name in (*NUMERICS, "moe_routing", "sequence_parallel", "checkpoint")), status
    above_info = [(p["name"], f["issue"]) for p in report["probes"] for f in p["findings"] if f["severity"] != "info"]
    assert above_info == []
    assert f"passed on {world} rank(s)" in out.stdout
