"""The gate end to end with real torchrun, as `distdiag gate` and as launch/gate.sh (which runs it):
two agents (--nnodes 2, c10d on localhost), a drain, a passing gate handing over to the job."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GATE = ROOT / "launch" / "gate.sh"

pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(240)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(cli_env, **extra) -> dict[str, str]:
    env = dict(cli_env, PYTHON=sys.executable, **extra)
    return env


FRONTS = {"gate.sh": ["bash", str(GATE)], "distdiag gate": [sys.executable, "-m", "distdiag", "gate"]}


def test_two_nodes_on_one_machine_one_report_grouped_per_node(tmp_path, cli_env):
    """Two gate.sh agents rendezvous over c10d; each node gets the same report; rank 1's delay is under node 1."""
    cfg = tmp_path / "gate.toml"
    cfg.write_text('[probes.bandwidth]\nsizes = ["4KiB"]\np2p = false\ndelay_rank = 1\ndelay_s = 0.01\n')
    port = _free_port()
    procs = []
    for node in (0, 1):
        cwd = tmp_path / f"node{node}"
        cwd.mkdir()
        cmd = [
            "bash", str(GATE), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "gatetest",
            "--", sys.executable, "-c", f"open('trained', 'w').write('{node}')",
        ]
        env = _env(cli_env, DISTDIAG_CONFIG=str(cfg), DISTDIAG_CHECK_ARGS="--probes env,bandwidth", DISTDIAG_JUNIT="gate.xml")
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=180))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    reports = [json.loads((tmp_path / f"node{n}" / "distdiag-gate-report.json").read_text()) for n in (0, 1)]
    # The same report on both nodes, each carrying its own node's launch id (its gate takes only that).
    ids = [r.pop("launch_id") for r in reports]
    assert reports[0] == reports[1] and ids[0] != ids[1] and all(len(i) == 32 for i in ids)
    assert (tmp_path / "node1" / "gate.xml").exists()
    assert [(tmp_path / f"node{n}" / "trained").read_text() for n in (0, 1)] == ["0", "1"]
    nodes = {n["node"]: n for n in reports[0]["by_node"]["nodes"]}
    assert nodes[0]["ranks"] == [0] and nodes[1]["ranks"] == [1]
    assert any(f["probe"] == "bandwidth" and "straggler" in f["issue"] for f in nodes[1]["findings"]), nodes
    assert not any(f["probe"] == "bandwidth" for f in nodes[0]["findings"]), nodes


@pytest.mark.parametrize("front", list(FRONTS))
def test_failed_gate_passes_the_drain_code_and_skips_the_job(tmp_path, cli_env, front):
    """A required GPU check on this CPU box drains the node: the gate exits 4 and never starts the job."""
    cfg = tmp_path / "gate.toml"
    cfg.write_text("[probes.gpu]\nrequired = true\ngpus_per_node = 8\n")
    cmd = [*FRONTS[front], "--nproc-per-node", "2", "--", sys.executable, "-c", "open('trained', 'w')"]
    env = _env(cli_env, DISTDIAG_CONFIG=str(cfg), DISTDIAG_CHECK_ARGS="--probes env,gpu")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert not (tmp_path / "trained").exists()
    assert "the distdiag gate failed" in proc.stderr and "exit 4" in proc.stderr


@pytest.mark.parametrize("front", list(FRONTS))
@pytest.mark.parametrize("args", [["--nproc-per-node", "2"], ["--nproc-per-node", "2", "--"]])
def test_usage_error_is_one_line_exit_2(tmp_path, cli_env, front, args):
    """No `--` or no command after it: one usage line, exit 2, nothing launched."""
    env = _env(cli_env)
    proc = subprocess.run([*FRONTS[front], *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "usage" in proc.stderr, proc.stderr
    assert os.listdir(tmp_path) == []


def test_passing_gate_becomes_the_job_with_its_exit_code(tmp_path, cli_env):
    """`distdiag gate`, as installed by pip (no launch/ folder): on a pass it execs the job, whose code it returns."""
    cmd = [*FRONTS["distdiag gate"], "--nproc-per-node", "1", "--", sys.executable, "-c",
           "import os; open('trained', 'w').write(str(os.getppid())); raise SystemExit(7)"]
    env = _env(cli_env, DISTDIAG_CHECK_ARGS="--probes env")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 7, proc.stderr[-3000:]
    assert "the distdiag gate passed" in proc.stderr
    assert (tmp_path / "trained").read_text() == str(os.getpid())  # exec'd: the job's parent is ours, not a gate
    assert json.loads((tmp_path / "distdiag-gate-report.json").read_text())["exit_code"] == 0


def test_gate_help(tmp_path, cli_env):
    out = subprocess.run([*FRONTS["distdiag gate"], "-h"], cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.startswith("usage: distdiag gate [torchrun options] -- TRAINING COMMAND")
    assert "DISTDIAG_REPORT" in out.stdout


@pytest.mark.parametrize("debug", [False, True])
def test_gate_is_as_quiet_as_check(tmp_path, cli_env, debug):
    """Without OMP_NUM_THREADS set, torchrun logs its OMP_NUM_THREADS banner for 2 ranks: the gate
    drops it (and torchrun's other log lines) as `distdiag check` does. Twin: with
    DISTDIAG_DEBUG=1, which the errors tell users to rerun with, the banner is shown."""
    env = _env(cli_env, DISTDIAG_CHECK_ARGS="--probes env")
    env.pop("OMP_NUM_THREADS", None)
    env.pop("DISTDIAG_DEBUG", None)
    if debug:
        env["DISTDIAG_DEBUG"] = "1"
    cmd = [*FRONTS["distdiag gate"], "--nproc-per-node", "2", "--", sys.executable, "-c", "pass"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if debug:
        assert "Setting OMP_NUM_THREADS environment variable" in proc.stderr, proc.stderr
    else:
        assert proc.stderr.splitlines() == [
            f"distdiag gate: the distdiag gate passed on {socket.gethostname()}; starting: {sys.executable} -c pass"
        ], proc.stderr
