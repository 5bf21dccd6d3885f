"""The decisions on distdiag's CUDA, NCCL and NVML paths, as plain functions tested on CPU (no
GPU here, issue 35): which GPU a rank takes, when NCCL's start events are turned on, how a
collective is timed, what GPU memory another process holds, when fork is unsafe, how closely a
GPU's attention must match, and what a hang report says where the recorder is blind. The GPU
itself is exercised by benchmarks/gpu_check.sh (docs/benchmarks.md, "GPU check")."""

from __future__ import annotations

import pytest

from distdiag.errors import ConfigError
from distdiag.runtime.context import choose_device


def test_one_gpu_per_local_rank() -> None:
    assert choose_device(0, 4, 8) == (0, "nccl")
    assert choose_device(3, 4, 8) == (3, "nccl")
    assert choose_device(0, 1, 0) == (None, "gloo")  # no CUDA: the CPU


def test_more_local_ranks_than_gpus_is_bad_input_on_every_local_rank() -> None:
    """`local_rank % gpus` put two ranks on one GPU, and NCCL refused them at init."""
    for rank in range(4):  # every local rank says it, not only the ones past the last GPU
        with pytest.raises(ConfigError) as err:
            choose_device(rank, 4, 2, host="node7", visible="0,1")
        line = str(err.value)
        assert "\n" not in line and "4 local ranks on host node7 but 2 GPU(s)" in line
        assert "--nproc-per-node 2" in line and "--backend gloo" in line and "CUDA_VISIBLE_DEVICES='0,1'" in line


def test_one_visible_gpu_per_rank_is_a_binding_not_a_collision() -> None:
    """Slurm --gpus-per-task=1: each of 8 local ranks sees one GPU, its own, as cuda:0."""
    assert choose_device(5, 8, 1, visible="5") == (0, "nccl")
    with pytest.raises(ConfigError):
        choose_device(1, 2, 1)  # one GPU and nothing hides the others: shared


def test_backend_choice() -> None:
    assert choose_device(0, 4, 2, backend="gloo") == (None, "gloo")  # CUDA visible, gloo asked: the CPU
    assert choose_device(0, 4, 0, backend="gloo") == (None, "gloo")
    assert choose_device(1, 2, 2, backend="nccl") == (1, "nccl")
    with pytest.raises(ConfigError, match="--backend nccl needs a GPU"):
        choose_device(0, 1, 0, backend="nccl")
    with pytest.raises(ConfigError, match="check.backend must be one of auto, nccl, gloo"):
        choose_device(0, 1, 0, backend="mpi")


def test_backend_is_a_check_option() -> None:
    from distdiag.check.plan import parse_config

    assert parse_config([]).backend == "auto"
    assert parse_config(["--backend", "gloo"]).backend == "gloo"
    with pytest.raises(ConfigError, match="invalid choice"):
        parse_config(["--backend", "mpi"])
