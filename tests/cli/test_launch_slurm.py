"""launch/slurm/gate.sbatch for real on a one-node Slurm cluster started here (skips without Slurm)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "launch" / "slurm"

# One local cluster (the module fixture) for both tests: they stay on one xdist worker.
pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(400), pytest.mark.xdist_group("slurm")]

TRAIN = """import os
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
open(f"trained.{os.environ['RANK']}", "w").write("ok")
"""


@pytest.fixture(scope="module")
def slurm_conf(tmp_path_factory):
    if os.environ.get("CI") != "true" and os.environ.get("DISTDIAG_CI_SLURM") != "1":
        # The cluster runs as root and starts munged (with a key in /etc/munge if none is
        # there): a change to the host, made only on the CI box or when asked for.
        pytest.skip("the Slurm test starts munged and a local Slurm cluster on this host; it runs with CI=true or DISTDIAG_CI_SLURM=1")
    missing = [b for b in ("slurmctld", "slurmd", "sbatch", "munged") if shutil.which(b) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing); launch/slurm/ci-setup.sh installs it as root with CI=true or DISTDIAG_CI_SLURM=1")
    if os.geteuid() != 0:
        pytest.skip("starting a local Slurm cluster needs root")
    state = tmp_path_factory.mktemp("slurm")
    start = subprocess.run(["bash", str(SLURM / "local-cluster.sh"), "start", str(state)], capture_output=True, text=True, timeout=60)
    if start.returncode != 0:
        pytest.skip(f"the local Slurm cluster did not start: {start.stderr.strip()[-500:]}")
    try:
        yield str(state / "slurm.conf")
    finally:
        subprocess.run(["bash", str(SLURM / "local-cluster.sh"), "stop", str(state)], timeout=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sbatch(tmp_path: Path, slurm_conf: str, cli_env: dict[str, str], **extra: str) -> subprocess.CompletedProcess:
    (tmp_path / "train.py").write_text(TRAIN)
    env = dict(
        cli_env, SLURM_CONF=slurm_conf, NPROC_PER_NODE="2", DISTDIAG_GATE=str(ROOT / "launch" / "gate.sh"),
        PYTHON=sys.executable, DISTDIAG_RDZV_PORT=str(_free_port()), DISTDIAG_REPORT=str(tmp_path / "report.json"),
        **extra,
    )
    cmd = ["sbatch", "--wait", "--nodes", "1", f"--output={tmp_path / 'job.out'}", "--job-name", f"distdiag-test-{tmp_path.name}",
           str(SLURM / "gate.sbatch"), str(tmp_path / "train.py")]
    try:
        return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", "--name", f"distdiag-test-{tmp_path.name}"], env=env, timeout=30)
        raise


def test_sbatch_gate_passes_then_trains(tmp_path, slurm_conf, cli_env):
    """A healthy node: the gate passes, the training script runs on both ranks, the job exits 0."""
    proc = _sbatch(tmp_path, slurm_conf, cli_env, DISTDIAG_CHECK_ARGS="--probes env,collectives,bandwidth")
    out = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert proc.returncode == 0, (proc.stderr, out[-3000:])
    assert "verdict: PASS" in out and "the distdiag gate passed" in out
    assert sorted(p.name for p in tmp_path.glob("trained.*")) == ["trained.0", "trained.1"]
    assert (tmp_path / "report.json").exists()


def test_sbatch_gate_drains_and_the_job_exits_4(tmp_path, slurm_conf, cli_env):
    """A required GPU check on this CPU node: the job's exit code is the gate's 4, no training."""
    cfg = tmp_path / "gate.toml"
    cfg.write_text("[probes.gpu]\nrequired = true\ngpus_per_node = 8\n")
    proc = _sbatch(tmp_path, slurm_conf, cli_env, DISTDIAG_CONFIG=str(cfg), DISTDIAG_CHECK_ARGS="--probes env,gpu")
    out = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert proc.returncode == 4, (proc.stderr, out[-3000:])
    assert "exit 4" in out and not list(tmp_path.glob("trained.*"))
