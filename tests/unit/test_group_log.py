"""The watchdog's log of the process groups a rank makes, on torch's own group creation."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist

from distdiag.watchdog.groupnames import GroupLog


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def world_of_one(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_numbered_groups_are_logged_hashed_ones_not_and_torch_gets_its_own_names(world_of_one):
    log = GroupLog()
    assert log.install()
    try:
        g1 = dist.new_group([0])
        dist.new_group([0], use_local_synchronization=True)  # a hashed name: the same on every rank
        g3 = dist.new_group([0])
    finally:
        log.remove()
    snap = log.snapshot()
    assert snap["from"] == "calls"
    names = [n for n, _ in snap["names"]]
    assert names == [dist.distributed_c10d._get_process_group_name(g) for g in (g1, g3)], snap
    assert all(m == "0" for _, m in snap["names"])
    assert snap["count"] == int(names[-1]) + 1
    # removed: torch's own function is back
    assert not hasattr(dist.distributed_c10d._process_group_name, "__distdiag_group_log__")


@pytest.mark.timeout(60)
def test_without_calls_seen_the_registry_of_own_groups_stands_in(world_of_one):
    g = dist.new_group([0])
    snap = GroupLog().snapshot()
    assert snap["from"] == "registry"
    assert snap["names"] == [[dist.distributed_c10d._get_process_group_name(g), "0"]]
