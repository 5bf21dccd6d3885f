"""launch/k8s/pytorchjob-gate.yaml parses as a PyTorchJob whose pods run the README's gate command."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is in the test extra: pip install -e '.[test]'")

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "launch" / "k8s" / "pytorchjob-gate.yaml"


def _readme_command() -> list[str]:
    lines = (ROOT / "README.md").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if "launch/k8s/pytorchjob-gate.yaml" in line and line.startswith("#"))
    return shlex.split(lines[at + 1])


def test_manifest_is_a_pytorchjob_running_the_documented_gate_command():
    """Master and Worker: same image command as the README, gate.sh first, training after `--`."""
    job = yaml.safe_load(MANIFEST.read_text())
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    assert int(job["spec"]["nprocPerNode"]) >= 1
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and specs["Master"]["replicas"] == 1
    documented = _readme_command()
    assert documented[:2] == ["bash", "/opt/distdiag/launch/gate.sh"] and "--" in documented
    for role, spec in specs.items():
        (container,) = spec["template"]["spec"]["containers"]
        assert container["name"] == "pytorch", role  # the operator injects PET_* into this container
        assert container["command"] == documented, role
        assert spec["restartPolicy"] == "Never", role  # a failed gate must not loop into restarts
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["DISTDIAG_REPORT"].startswith("/var/log/distdiag/"), role
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert {"/dev/shm", "/var/log/distdiag"} <= mounts, role


def test_gate_script_documents_the_pet_variables_torchrun_reads():
    """gate.sh passes no options of its own to torchrun here: torchrun reads PET_* (Kubeflow's)."""
    import torch.distributed.argparse_util as au

    assert "PET_" in Path(au.__file__).read_text()
    assert "PET_*" in (ROOT / "launch" / "gate.sh").read_text()
