"""The README's first command at world sizes that do not divide 8, and on targets whose layout is not
data parallel: the default suite passes, and a probe that does not apply skips with the reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(150)

NUMERICS = ("fsdp_plan", "loss_parity", "param_sync", "determinism")
ROOT = Path(__file__).resolve().parents[2]


def _check(cli_env, cwd, world, *args):
    cmd = [sys.executable, "-m", "distdiag", "check", "--nproc-per-node", str(world), *args]
    out = subprocess.run(cmd, env=cli_env, cwd=cwd, capture_output=True, text=True, timeout=120)
    return out, json.loads((cwd / "distdiag-report.json").read_text())


@pytest.mark.parametrize("world", [3, 5])
def test_default_suite_passes_on_a_healthy_box_at_odd_world_sizes(cli_env, tmp_path, world):
    """`distdiag check --nproc-per-node 3` (and 5), no target: the built-in workloads size to the world;
    exit 0, every numerics probe ran and passed, no warning (fsdp_plan's uneven shards, moe_routing's load)."""
    out, report = _check(cli_env, tmp_path, world)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert report["exit_code"] == 0 and report["world_size"] == world
    status = {p["name"]: p["status"] for p in report["probes"]}
    assert all(status[name] == "pass" for name in (*NUMERICS, "moe_routing", "sequence_parallel", "checkpoint")), status
    above_info = [(p["name"], f["issue"]) for p in report["probes"] for f in p["findings"] if f["severity"] != "info"]
    assert above_info == []
    assert f"passed on {world} rank(s)" in out.stdout


def test_an_sp_and_moe_target_skips_the_data_parallel_probes_under_the_default_profile(cli_env, tmp_path):
    """configs/example_sp_moe_target.py (split_sequence, parallelize_sp, route; no shard_batch): the four
    numerics probes skip naming the layout instead of failing loss_parity; SP, MoE and checkpoint pass."""
    target = str(ROOT / "configs" / "example_sp_moe_target.py")
    out, report = _check(cli_env, tmp_path, 2, "--target", target)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    probes = {p["name"]: p for p in report["probes"]}
    for name in NUMERICS:
        assert probes[name]["status"] == "skip" and "does not apply to target" in probes[name]["reason"], probes[name]
        assert "route()" in probes[name]["reason"]
    assert all(probes[name]["status"] == "pass" for name in ("sequence_parallel", "moe_routing", "checkpoint"))
