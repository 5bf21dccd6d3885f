"""`distdiag check` forks its ranks from one process that imported torch and the planned probes'
modules (distdiag.launcher.forkrun, torchrun's --run-path --start-method fork). The decisions are
unit-tested here; the runs are real torchrun agents with forked gloo ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from distdiag.errors import ConfigError
from distdiag.launcher import forkrun
from distdiag.launcher.argv import launch_mode, split_dashes, torchrun_command, world_size


def test_split_argv_needs_the_separator() -> None:
    assert split_dashes(["--nproc-per-node=2", "--", "--probes", "env"], forkrun.USAGE) == (["--nproc-per-node=2"], ["--probes", "env"])
    assert split_dashes(["--"], forkrun.USAGE) == ([], [])
    with pytest.raises(ValueError, match="usage"):
        split_dashes(["--nproc-per-node=2"], forkrun.USAGE)


def test_world_size_is_torchruns_own_reading_of_its_options() -> None:
    assert world_size(["--nproc-per-node=4"]) == 4
    assert world_size(["--nnodes", "1:3", "--nproc-per-node", "2"]) == 6
    assert world_size(["--no-such-torchrun-option"]) is None  # torchrun will say so itself


def test_preloads_follow_the_plan() -> None:
    """The default suite's FSDP2/DTensor/DCP modules are imported once; quick needs none; bad
    input is said here, once, before any rank starts."""
    default = forkrun.plan_preloads([], 4)
    assert {"torch.distributed.fsdp", "torch._dynamo", "torch.distributed.checkpoint"} <= set(default)
    assert len(default) == len(set(default))
    assert forkrun.plan_preloads(["--profile", "quick"], 4) == []
    assert forkrun.plan_preloads(["--probes", "checkpoint"], None)[-1] == "torch.distributed.checkpoint.state_dict"
    with pytest.raises(ConfigError, match="unknown probe 'nope'"):
        forkrun.plan_preloads(["--probes", "nope"], 2)
    with pytest.raises(ConfigError, match="WORLD_SIZE must be >= 2 for probe 'collectives', got 1"):
        forkrun.plan_preloads(["--probes", "collectives"], 1)


def test_a_cpu_build_forks() -> None:
    import torch

    if torch.cuda._is_compiled():
        pytest.skip("a CUDA build: start_method forks a child to ask; run on a GPU machine")
    assert forkrun.start_method() == "fork"


def test_a_cuda_build_spawns_when_fork_is_poisoned(monkeypatch) -> None:
    """On a CUDA build the parent forks a child that asks torch whether fork is poisoned (the
    parent asked the CUDA driver something); the answer picks fork or spawn. The CUDA answers
    are stand-ins here (no GPU on CI); the fork and the exit status are real."""
    import torch

    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    assert forkrun.start_method() == "spawn"
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: False)
    assert forkrun.start_method() == "fork"


def test_launch_mode_flag_then_environment(monkeypatch) -> None:
    monkeypatch.delenv("DISTDIAG_LAUNCH", raising=False)
    assert launch_mode(None) == "fork"
    monkeypatch.setenv("DISTDIAG_LAUNCH", "torchrun")
    assert launch_mode(None) == "torchrun"
    assert launch_mode("fork") == "fork"
    monkeypatch.setenv("DISTDIAG_LAUNCH", "spawn")
    with pytest.raises(ConfigError, match="DISTDIAG_LAUNCH: 'spawn' is not one of fork, torchrun"):
        launch_mode(None)


def test_commands() -> None:
    fork = torchrun_command(["--probes", "env"], ["--nproc-per-node=2"])
    assert fork[1:] == ["-m", "distdiag.launcher.forkrun", "--nproc-per-node=2", "--", "--probes", "env"]
    plain = torchrun_command(["--probes", "env"], ["--nproc-per-node=2"], "torchrun")
    assert plain[1:] == ["-m", "torch.distributed.run", "--nproc-per-node=2", "-m", "distdiag.check", "--probes", "env"]


@pytest.mark.torchrun
@pytest.mark.timeout(120)
def test_forked_ranks_start_as_fresh_ones(cli_env, tmp_path) -> None:
    """torchrun sets OMP_NUM_THREADS=1 per rank after the parent imported torch (which read no
    value then): each forked rank must still run one intra-op thread, or 2 ranks on 2 cores are
    oversubscribed; and a passing run of forked ranks ends with exit 0 (the agent got every
    rank's result)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 usable cores: on 1, two ranks oversubscribe at one thread each")
    env = dict(cli_env)
    env.pop("OMP_NUM_THREADS", None)
    report = tmp_path / "r.json"
    out = subprocess.run(
        [sys.executable, "-m", "distdiag.launcher.forkrun", "--nproc-per-node=2", "--", "--probes", "env,collectives",
         "--report", str(report), "--verbose"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=100, stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(report.read_text())
    assert data["exit_code"] == 0 and data["world_size"] == 2
    issues = [f["issue"] for p in data["probes"] for f in p["findings"]]
    assert not any("oversubscription" in i for i in issues), issues


@pytest.mark.torchrun
@pytest.mark.timeout(120)
def test_bad_input_is_said_once_before_any_rank_starts(cli_env, tmp_path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "distdiag", "check", "--nproc", "2", "--probes", "env,nope"],
        env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=100, stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "distdiag: error: check.probes: unknown probe 'nope'; available: env, collectives, gpu, bandwidth, setup_sync, "
        "data_shards, fsdp_plan, "
        "loss_parity, param_sync, determinism, sequence_parallel, moe_routing, checkpoint"
    ], out.stderr
    # The report says this run's bad input (an earlier run's verdict must not stay there).
    report = json.loads((tmp_path / "distdiag-report.json").read_text())
    assert report["exit_code"] == 2 and report["outcome"] == "bad_input" and "'nope'" in report["summary"]


@pytest.mark.torchrun
@pytest.mark.timeout(150)
def test_spawned_ranks_when_fork_is_unsafe_still_pass(cli_env, tmp_path) -> None:
    """The fallback when CUDA poisoned fork: torchrun's agent spawns the ranks (each imports
    torch itself) and a passing run still ends with exit 0 and a report."""
    script = tmp_path / "spawned.py"
    script.write_text(
        "import sys\n"
        "from distdiag.launcher import forkrun\n"
        "if __name__ == '__main__':\n"
        "    forkrun.start_method = lambda: 'spawn'\n"
        "    sys.exit(forkrun.main(['--nproc-per-node=2', '--', '--probes', 'env,collectives', '--quiet']))\n"
    )
    out = subprocess.run([sys.executable, str(script)], env=cli_env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=130, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "verdict: PASS" in out.stdout
    assert json.loads((tmp_path / "distdiag-report.json").read_text())["exit_code"] == 0


MAPS = """\
7f0a00000000-7f0a00200000 r-xp 00000000 08:01 1234   /usr/lib/x86_64-linux-gnu/libc.so.6
7f0a10000000-7f0a10400000 r-xp 00000000 08:01 2345   /opt/venv/lib/python3.11/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12
7f0a20000000-7f0a20010000 rw-p 00000000 00:00 0
"""


def test_cuda_in_parent_sees_the_driver_whoever_loaded_it(monkeypatch) -> None:
    """torch's fork check sees only torch's own CUDA init; a library that asked the driver
    (CuPy, Numba) leaves libcuda.so mapped, which is what a forked rank inherits. CUDA's runtime
    alone (torch links it; a CUDA build imports on a host without a driver) is not the driver."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert forkrun.cuda_in_parent(MAPS) is None
    loaded = MAPS + "7f0a30000000-7f0a31000000 r-xp 00000000 08:01 3456   /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15\n"
    reason = forkrun.cuda_in_parent(loaded)
    assert reason is not None and "libcuda.so.550.54.15" in reason
    assert forkrun.cuda_in_parent() is None  # this process: a CPU box, nothing asked the driver
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert forkrun.cuda_in_parent(MAPS) == "torch initialised CUDA in this process"


def test_a_cuda_build_spawns_when_the_driver_is_in_use_without_asking_a_child(monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(forkrun, "cuda_in_parent", lambda: "the CUDA driver library is loaded in this process (x)")
    monkeypatch.setattr(forkrun.os, "fork", lambda: pytest.fail("no child needed: the parent already knows"))
    assert forkrun.start_method() == "spawn"
