"""Nothing of distdiag's breaks a healthy job: 2-D FSDP2 + tensor parallel, a torchtitan-style
parallelize and a compiled DDP model run to the end under `distdiag watch` beside busy loops, and
distdiag's threads import no module while the job runs (tests/faults/parallel_job.py records them).
Before, the recorder's warm-up thread imported inductor (torch's stack symbolizer reaches for
it) while the user's parallelize_module imported it too: "cannot import name 'IndentedBuffer'
from partially initialized module 'torch._inductor.utils'"."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults.busy import busy_cpus

JOB = Path(__file__).resolve().parent / "parallel_job.py"


def _watch(cli_env: dict[str, str], cwd: Path, mode: str, nproc: int) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "distdiag", "watch", "--nproc-per-node", str(nproc), "--standalone",
           "--timeout-s", "60", "--", str(JOB), f"mode={mode}"]
    return subprocess.run(cmd, cwd=cwd, env=cli_env, capture_output=True, text=True, timeout=280)


@pytest.mark.torchrun
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("mode", "nproc", "runs"), [("tp2d", 4, 2), ("titan", 4, 1), ("compiled", 2, 1)])
def test_parallel_job_runs_to_the_end_under_the_wrapper(cli_env, tmp_path, mode, nproc, runs):
    """The job passes under the wrapper, beside two busy loops, every time; no thread of ours
    imports anything while it runs."""
    with busy_cpus(2, lifetime_s=600):
        for i in range(runs):
            proc = _watch(cli_env, tmp_path, mode, nproc)
            assert proc.returncode == 0, f"run {i}: {proc.stderr[-3000:]}"
            assert proc.stdout.count(f"rank done {mode}") == nproc, proc.stdout[-2000:]
            imports = [line for line in proc.stderr.splitlines() if line.startswith("THREAD-IMPORT")]
            assert not imports, imports[:20]
            assert "partially initialized" not in proc.stderr
