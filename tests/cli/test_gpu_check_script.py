"""`.ci/gpu-check` (docs/gpu-check.md) on a box without a GPU: valid bash, one line saying
there is no GPU, every step listed as skipped with that reason, exit 77. Its GPU steps run on a
GPU machine only; their decisions are unit-tested in tests/unit/test_gpu_paths.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / ".ci" / "gpu-check"
STEPS = ROOT / ".ci" / "gpu_steps.py"
ALL_STEPS = ("env", "install", "check1", "gpuprobe", "check2gloo", "watch1", "hangreport", "capture", "units", "fork",
             "check2auto")

pytestmark = pytest.mark.timeout(120)


def test_the_script_is_valid_bash() -> None:
    out = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert os.access(SCRIPT, os.X_OK)


def test_without_a_gpu_every_step_says_so_and_skips(tmp_path) -> None:
    if shutil.which("nvidia-smi"):
        pytest.skip("nvidia-smi is here: run .ci/gpu-check itself")
    env = {k: v for k, v in os.environ.items() if k not in ("GPU_CHECK_FORCE", "OUT")}
    env.update(GPU_CHECK_WORK=str(tmp_path / "work"), PY=sys.executable)
    out = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
    assert out.returncode == 77, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("no GPU: nvidia-smi lists no GPU")
    rows = {line.split()[0]: line for line in lines if line.split() and line.split()[0] in ALL_STEPS}
    assert set(rows) == set(ALL_STEPS) and all(" skip " in row and "no GPU:" in row for row in rows.values())
    assert (tmp_path / "work" / "summary.txt").read_text().count("skip") == len(ALL_STEPS)


@pytest.mark.parametrize("command", [["units"], ["capture"], ["fork", "clean"]])
def test_gpu_steps_skip_with_77_without_cuda(command) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the step would run")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(STEPS), *command], capture_output=True, text=True, timeout=90, env=env)
    assert out.returncode == 77 and out.stdout.startswith("SKIP no GPU:"), out.stdout + out.stderr
