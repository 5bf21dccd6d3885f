"""The rank runtime: who this process is, the store, the process groups, teardown.

Out-of-band first: under torchrun the agent hosts the c10d TCPStore, so the store outlives
any worker; distdiag keeps its own keys under a prefix per run and restart, and talks through
the store whenever the main process group may be broken.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distdiag.runtime.comm import Comm
from distdiag.runtime.faults import FaultPlan
from distdiag.runtime.tracker import Tracker

__all__ = ["BACKENDS", "LaunchInfo", "RankContext", "choose_device", "connect_store", "init_process_groups", "pick_device"]


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        from distdiag.errors import ConfigError

        raise ConfigError(f"environment variable {name} must be an integer, got {value!r}") from None


@dataclass
class LaunchInfo:
    """What the launcher (torchrun, Slurm, our test harness) told this process."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node: int
    host: str
    pid: int
    restart_count: int
    run_id: str
    master_addr: str | None
    master_port: int | None
    agent_store: bool
    """True when the launcher's agent hosts the store (torchrun), so it outlives rank 0."""

    @classmethod
    def from_env(cls) -> LaunchInfo:
        world = _env_int("WORLD_SIZE", 1)
        addr = os.environ.get("MASTER_ADDR") or None
        port = _env_int("MASTER_PORT", 0) or None
        return cls(
            rank=_env_int("RANK", 0),
            world_size=world,
            local_rank=_env_int("LOCAL_RANK", 0),
            local_world_size=_env_int("LOCAL_WORLD_SIZE", world),
            node=_env_int("GROUP_RANK", 0),
            host=socket.gethostname(),
            pid=os.getpid(),
            restart_count=_env_int("TORCHELASTIC_RESTART_COUNT", 0),
            run_id=os.environ.get("TORCHELASTIC_RUN_ID", "none"),
            master_addr=addr,
            master_port=port,
            agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        )

    @property
    def distributed(self) -> bool:
        return self.master_addr is not None and self.master_port is not None

    @property
    def key_prefix(self) -> str:
        return f"distdiag/{self.run_id}/{self.restart_count}/"


_LOCAL_STORE: dist.Store | None = None


def connect_store(info: LaunchInfo, timeout: timedelta, *, prefix: str = "") -> dist.Store:
    """A new client of the job's store (one per thread that talks to it), under our prefix.

    Without a launcher (a world of 1 run as plain `python -m distdiag.check`) every call
    returns the same in-process HashStore.
    """
    global _LOCAL_STORE
    if not info.distributed:
        if _LOCAL_STORE is None:
            _LOCAL_STORE = dist.HashStore()
        base = _LOCAL_STORE
    else:
        is_master = (not info.agent_store) and info.rank == 0 and not _server_started.get("up")
        assert info.master_addr is not None and info.master_port is not None  # info.distributed says so
        base = dist.TCPStore(
            info.master_addr,
            info.master_port,
            info.world_size,
            is_master=is_master,
            timeout=timeout,
            wait_for_workers=False,
            multi_tenant=True,
        )
        if is_master:
            _server_started["up"] = base
    return dist.PrefixStore(info.key_prefix + prefix, base)


_server_started: dict[str, dist.TCPStore] = {}


BACKENDS = ("auto", "nccl", "gloo")
"""The check's --backend: auto (NCCL on the rank's GPU when CUDA is present, else gloo), nccl
(an error without CUDA), gloo (the CPU, even where CUDA is visible)."""


def choose_device(
    local_rank: int, local_world_size: int, gpus: int, *, backend: str = "auto", visible: str | None = None, host: str = "",
) -> tuple[int | None, str]:
    """(the GPU index this rank uses, or None for the CPU; the main backend), from what the
    process sees: `gpus` = torch.cuda.device_count() (0 without CUDA), `visible` its
    CUDA_VISIBLE_DEVICES. A ConfigError (bad input: one line, exit 2) when NCCL cannot run.

    More local ranks than visible GPUs is an error, not `local_rank % gpus`: two ranks would
    share a GPU and NCCL refuses them at init ("Duplicate GPU detected"), which surfaced as a
    setup failure. One exception: exactly one visible GPU with CUDA_VISIBLE_DEVICES set is taken
    as a per-rank binding (Slurm's --gpus-per-task=1 or --gpu-bind: every rank sees its own GPU
    as cuda:0); if that GPU is shared after all, NCCL's init says so and the env probe names the
    ranks by the GPU's UUID.
    """
    if backend not in BACKENDS:
        from distdiag.errors import ConfigError

        raise ConfigError(f"check.backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "gloo":
        return None, "gloo"
    if gpus <= 0:
        if backend == "nccl":
            from distdiag.errors import ConfigError

            raise ConfigError(f"--backend nccl needs a GPU, but this process on host {host or '?'} sees none "
                              "(torch.cuda.is_available() is False); use --backend gloo or auto")
        return None, "gloo"
    if gpus == 1 and visible is not None and visible.strip():
        return 0, "nccl"
    if local_world_size > gpus or local_rank >= gpus:
        from distdiag.errors import ConfigError

        shown = f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
        ranks = max(local_world_size, local_rank + 1)
        raise ConfigError(
            f"{ranks} local ranks on host {host or '?'} but {gpus} GPU(s) visible to each (torch.cuda.device_count()"
            f"{shown}): NCCL needs a GPU per rank; start at most {gpus} rank(s) per node (--nproc-per-node {gpus}), "
            "or run the check on the CPU with --backend gloo"
        )
    return local_rank, "nccl"


def pick_device(info: LaunchInfo, backend: str = "auto") -> tuple[torch.device, str]:
    """(device, main backend): NCCL on LOCAL_RANK's GPU when CUDA is present, else gloo on CPU
    (choose_device decides; `backend` gloo never asks CUDA anything)."""
    gpus = 0
    if backend != "gloo" and torch.cuda.is_available():
        gpus = torch.cuda.device_count()
    # LOCAL_WORLD_SIZE defaults to the world when a launcher does not set it (torchrun does):
    # then only this rank's own index is known to be on this host.
    local = info.local_world_size if os.environ.get("LOCAL_WORLD_SIZE") else info.local_rank + 1
    index, main = choose_device(info.local_rank, local, gpus, backend=backend,
                                visible=os.environ.get("CUDA_VISIBLE_DEVICES"), host=info.host)
    if index is None:
        return torch.device("cpu"), main
    torch.cuda.set_device(index)
    return torch.device("cuda", index), main


def init_process_groups(info: LaunchInfo, store: dist.Store, backend: str, device: torch.device,
                        timeout: timedelta) -> dist.ProcessGroup | None:
    """The default group on the main backend, and a gloo side group for CPU tensors.

    Returns the side group (the default group itself when the main backend is gloo).
    """
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("pg/", store),
        rank=info.rank,
        world_size=info.world_size,
        timeout=timeout,
        device_id=device if backend == "nccl" else None,
    )
    if backend == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo", timeout=timeout)


@dataclass
class RankContext:
    """Everything a probe gets: who it is, where it runs, how to talk, its options."""

    info: LaunchInfo
    device: torch.device
    backend: str
    tracker: Tracker
    comm: Comm
    store: dist.Store
    side_group: dist.ProcessGroup | None = None
    options: Any = None
    """This probe's validated config dataclass (None when it has none)."""
    target: Any = None
    """The user's loaded target (distdiag.check.target.Target) or None."""
    faults: FaultPlan = field(default_factory=FaultPlan)

    @property
    def rank(self) -> int:
        return self.info.rank

    def caught(self, exc: BaseException, where: str = "") -> None:
        """Publish, before any further collective, an exception this probe caught and goes on
        from (distdiag.errors.publish_caught): if it stranded other ranks in a collective,
        the hang report leads with it."""
        from distdiag.errors import publish_caught

        publish_caught(exc, where)

    @property
    def world_size(self) -> int:
        return self.info.world_size

    def seed(self, seed: int = 1234) -> None:
        """Seed every RNG identically on every rank (before calling a user hook)."""
        import random

        random.seed(seed)
        torch.manual_seed(seed)
        try:
            import numpy

            numpy.random.seed(seed)
        except ImportError:
            pass
