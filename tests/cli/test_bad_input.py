"""Careless input reaches every rank of a real torchrun job as one line and exit 2, with a report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(180)]


def _torchrun_check(args, env, cwd):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "distdiag.check", *args]
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=150, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize(
    ("make_args", "words"),
    [
        (lambda p: ["--config", str(p)], "is not UTF-8 text"),
        (lambda p: ["--timeout-s", "1e300"], "at most 604800 (one week)"),
        (lambda p: ["--deadline-s", "1e300"], "at most 604800 (one week)"),
    ],
    ids=["binary-config", "timeout-1e300", "deadline-1e300"],
)
def test_bad_input_is_exit_2_on_every_rank(cli_env, tmp_path, make_args, words):
    """A binary --config or a 1e300 timeout: each rank says one line, the report says bad input (exit 2)."""
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(128, 256)) * 4)
    out = _torchrun_check(make_args(binary), cli_env, tmp_path)
    said = [line for line in out.stderr.splitlines() if line.startswith("distdiag: error:")]
    assert len(said) == 2 and all(words in line for line in said), out.stderr[-3000:]
    # torchrun prints its own ChildFailedError traceback; no rank printed one of ours
    assert "distdiag/" not in "".join(line for line in out.stderr.splitlines() if line.lstrip().startswith("File "))
    report = json.loads((tmp_path / "distdiag-report.json").read_text())
    assert report["exit_code"] == 2 and report["outcome"] == "bad_input", report


def test_bad_input_ends_in_exit_2_when_the_store_host_is_frozen(cli_env, tmp_path):
    """Rank 1 of 2 with a bad probe name, its job's store a listening socket that never answers
    (a stopped or frozen store host: the kernel accepts, nobody replies): it says its one line
    and exits 2 on its own - waiting for its peer through the store is bounded - instead of
    waiting forever in the store client."""
    import socket

    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(16)
    env = {**cli_env, "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(frozen.getsockname()[1]), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    try:
        out = subprocess.run([sys.executable, "-m", "distdiag.check", "--probes", "no_such_probe"], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    finally:
        frozen.close()
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    said = [line for line in out.stderr.splitlines() if line.startswith("distdiag: error:")]
    assert len(said) == 1 and "no_such_probe" in said[0], out.stderr[-3000:]


def test_more_local_ranks_than_gpus_is_exit_2_on_every_rank(cli_env, tmp_path):
    """Two local ranks where CUDA shows one GPU (a stand-in: this host has none, so torch.cuda's
    answers are patched in each rank by a sitecustomize): one line naming the local ranks and the
    GPU count, exit 2 on every rank, instead of both ranks on cuda:0 and NCCL's refusal at init."""
    fake = tmp_path / "pretend_one_gpu"
    fake.mkdir()
    (fake / "sitecustomize.py").write_text(
        "import torch\ntorch.cuda.is_available = lambda: True\ntorch.cuda.device_count = lambda: 1\n")
    env = {**cli_env, "PYTHONPATH": f"{fake}:{cli_env['PYTHONPATH']}"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    out = _torchrun_check(["--probes", "env"], env, tmp_path)
    said = [line for line in out.stderr.splitlines() if line.startswith("distdiag: error:")]
    assert len(said) == 2, out.stderr[-3000:]
    assert all("2 local ranks on host" in line and "but 1 GPU(s)" in line and "--backend gloo" in line for line in said)
    report = json.loads((tmp_path / "distdiag-report.json").read_text())
    assert report["exit_code"] == 2 and report["outcome"] == "bad_input", report
