"""The env probe's cross-rank findings on hand-made payloads (its real run is in tests/dist)."""

from __future__ import annotations

from distdiag.probes.base import ConsolidationView
from distdiag.probes.cluster.env import EnvConfig, EnvProbe


def payload(rank, host="h0", **over):
    base = {
        "host": host, "pid": 100 + rank, "local_rank": rank, "local_world_size": 2, "node": 0,
        "device": "cpu", "python": "3.11.7", "torch": "2.13.0", "cuda": None, "nccl": None, "driver": None,
        "platform": "linux", "env": {"MASTER_ADDR": "a"}, "cores": 8, "cores_logical": 8, "threads": 1,
        "mem_total": 2**34, "mem_available": 2**33, "shm": {"total": 2**33, "free": 2**33},
        "executable": "python", "clock": 1000.0,
    }
    base.update(over)
    return base


def consolidate(payloads, **opts):
    return EnvProbe().consolidate(payloads, ConsolidationView(len(payloads), [], EnvConfig(**opts)))


def test_healthy_has_no_findings():
    result = consolidate({0: payload(0), 1: payload(1)})
    assert result.findings == [] and result.status == "pass"


def test_torch_version_mismatch_names_odd_rank():
    result = consolidate({0: payload(0), 1: payload(1), 2: payload(2, torch="2.12.0")})
    (f,) = result.findings
    assert f.severity == "error" and f.ranks == [2] and "2.12.0 on rank 2" in f.issue


def test_two_ranks_on_one_gpu():
    result = consolidate({0: payload(0, device="cuda:0"), 1: payload(1, device="cuda:0")})
    assert any(f.severity == "error" and f.ranks == [0, 1] and "same device cuda:0" in f.issue for f in result.findings)


def test_oversubscription_warning_and_info():
    warn = consolidate({r: payload(r, threads=4, cores=4) for r in range(2)})
    assert any(f.severity == "warning" and "8 threads on 4 usable cores" in f.issue for f in warn.findings)
    info = consolidate({r: payload(r, cores=2) for r in range(4)})
    assert [f.severity for f in info.findings] == ["info"]


def test_small_shm_and_clock_skew_and_env_mismatch():
    payloads = {
        0: payload(0, host="a", shm={"total": 64 * 2**20, "free": 0}),
        1: payload(1, host="b", clock=1005.0, env={"MASTER_ADDR": "a", "NCCL_SOCKET_IFNAME": "eth1"}),
    }
    issues = [f.issue for f in consolidate(payloads).findings]
    assert any("/dev/shm is 64 MiB" in i for i in issues)
    assert any("host clocks differ by 5.00 s" in i for i in issues)
    assert any("NCCL_SOCKET_IFNAME differs" in i for i in issues)


def test_per_rank_visible_devices_is_not_a_collision():
    """Slurm --gpus-per-task=1 / --gpu-bind: every rank sees one GPU as cuda:0, each another one."""
    healthy = {r: payload(r, device="cuda:0", env={"CUDA_VISIBLE_DEVICES": str(r)}) for r in range(4)}
    assert consolidate(healthy).findings == []
    by_uuid = {r: payload(r, device="cuda:0", device_uuid=f"GPU-{r:04d}") for r in range(2)}
    assert consolidate(by_uuid).findings == []
    listed = {r: payload(r, device=f"cuda:{r}", env={"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}) for r in range(2)}
    assert consolidate(listed).findings == []


def test_two_ranks_given_the_same_physical_gpu_are_named():
    """A collision is the same physical GPU: by UUID, or by the CUDA_VISIBLE_DEVICES entry each
    rank's cuda:N resolves to (cuda:1 of "3,5" and cuda:0 of "5" are both GPU 5)."""
    (f,) = consolidate({0: payload(0, device="cuda:0", device_uuid="GPU-x"),
                        1: payload(1, device="cuda:0", device_uuid="GPU-x")}).findings
    assert f.severity == "error" and f.ranks == [0, 1] and "same GPU (GPU-x)" in f.issue
    (f,) = consolidate({0: payload(0, device="cuda:1", env={"CUDA_VISIBLE_DEVICES": "3,5"}),
                        1: payload(1, device="cuda:0", env={"CUDA_VISIBLE_DEVICES": "5"})}).findings
    assert f.ranks == [0, 1] and "same GPU (GPU 5)" in f.issue
    assert "CUDA_VISIBLE_DEVICES per rank: '3,5', '5'" in f.evidence
