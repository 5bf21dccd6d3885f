"""Synthetic per-rank payloads of every probe of the default suite (and bandwidth) for
consolidation tests and the scale benchmarks: a healthy job and its faulty variants (a
straggler, a bad link, a mismatched env, a sick GPU, a wrong collective, ...), deterministic
for a given world size.

The cluster probes' layout follows what each probe's `run` returns (distdiag/probes/cluster/*.py),
with the values of a healthy 8-GPU-per-node job unless a scenario changes them. The other
probes' payloads are scaled from what the real probes posted on 4 ranks (check_suite_templates.json,
see tests/unit/check_suite_payloads.py).
"""

from __future__ import annotations

import random
from typing import Any

from distdiag.probes.cluster.bandwidth import OPS
from distdiag.report.model import RankInfo
from tests.unit.check_suite_payloads import SUITE_BUILDERS, SUITE_SCENARIOS  # noqa: F401 - the suite's scenarios, here with the others

PER_NODE = 8
SIZES = (4096, 262144, 4194304)
SCENARIOS = ("healthy", "straggler", "bad_link", "slow_rank", "env_mismatch", "gpu_sick", "wrong_values", "ragged")


def host_of(rank: int) -> str:
    return f"node{rank // PER_NODE:04d}"


def rank_infos(world: int) -> list[RankInfo]:
    return [RankInfo(r, host_of(r), r // PER_NODE, r % PER_NODE, f"cuda:{r % PER_NODE}", 10000 + r) for r in range(world)]


NODE_GPUS = ",".join(map(str, range(PER_NODE)))
"""CUDA_VISIBLE_DEVICES as a node-wide launcher sets it: every rank sees the node's GPUs, cuda:N is GPU N
(it read str(local rank) before issue 35, which would make every rank's cuda:0 another GPU)."""


def env_payload(rank: int, scenario: str = "healthy") -> dict[str, Any]:
    p: dict[str, Any] = {
        "host": host_of(rank), "pid": 10000 + rank, "local_rank": rank % PER_NODE, "local_world_size": PER_NODE,
        "node": rank // PER_NODE, "device": f"cuda:{rank % PER_NODE}", "python": "3.12.3", "torch": "2.13.0",
        "cuda": "12.4", "nccl": "2.21.5", "driver": "550.54", "platform": "Linux-5.15-x86_64",
        "env": {"NCCL_DEBUG": "WARN", "MASTER_ADDR": "n0", "CUDA_VISIBLE_DEVICES": NODE_GPUS},
        "cores": 96, "cores_logical": 192, "threads": 12, "mem_total": 2**41, "mem_available": 2**40,
        "shm": {"total": 2**39, "free": 2**39}, "executable": "/usr/bin/python3", "clock": 1000.0 + rank * 1e-6,
    }
    if scenario == "env_mismatch":
        if rank == 5:
            p["torch"] = "2.12.0"
        if rank // PER_NODE == 1:
            p["env"] = {**p["env"], "NCCL_SOCKET_IFNAME": "eth1"}
            p["clock"] += 4.5
        if rank == 17:
            p["device"] = "cuda:0"  # the same GPU as rank 16
        if rank // PER_NODE == 2:
            p["shm"] = {"total": 64 * 2**20, "free": 2**20}
            p["threads"] = 16  # 8 x 16 on 96 cores: oversubscribed
    return p


def gpu_payload(rank: int, scenario: str = "healthy") -> dict[str, Any]:
    reading: dict[str, Any] = {
        "unsupported": [], "errors": {}, "name": "NVIDIA H100", "uuid": f"GPU-{rank:06d}",
        "pci_bus_id": f"0000:{rank % PER_NODE:02x}:00.0", "driver": "550", "cuda_driver": "12.4",
        "ecc_uncorrected_volatile": 0, "ecc_uncorrected_aggregate": 0, "ecc_corrected_volatile": 0,
        "temperature_c": 40 + rank % 7, "slowdown_temp_c": 87, "throttle_mask": 1, "pcie_gen": 5, "pcie_gen_max": 5,
        "pcie_width": 16, "pcie_width_max": 16, "power_mw": 70000 + rank, "power_limit_mw": 700000,
        "memory_total": 80 * 2**30, "memory_free": 79 * 2**30, "persistence_mode": True,
        "mig_mode": {"current": False, "pending": False},
    }
    p: dict[str, Any] = {"host": host_of(rank), "node": rank // PER_NODE, "local_rank": rank % PER_NODE, "status": "ok",
                         "device": f"cuda:{rank % PER_NODE}", "gpu_count": PER_NODE, "reading": reading}
    if scenario == "gpu_sick":
        if rank == 3:
            reading.update(ecc_uncorrected_volatile=2, ecc_uncorrected_aggregate=5)
        if rank == 9:
            reading.update(temperature_c=90, throttle_mask=0x8 | 0x40)
        if rank == 10:
            reading.update(pcie_width=8, pcie_gen=3)
        if rank == 11:
            reading["uuid"] = "GPU-000010"  # shares rank 10's GPU
        if rank == 20:
            reading["name"] = "NVIDIA A100"
        if rank // PER_NODE == 3:
            p["gpu_count"] = PER_NODE - 1
        if rank == 30:
            p = {"host": host_of(rank), "node": rank // PER_NODE, "local_rank": rank % PER_NODE, "status": "missing",
                 "reason": "NVML sees no GPU on this host"}
    return p


def collectives_payload(rank: int, scenario: str = "healthy") -> dict[str, Any]:
    failures = []
    if scenario == "wrong_values" and rank in (6, 7):
        failures.append({"op": "all_reduce(sum)", "dtype": "bfloat16", "group": "world", "bad_elements": 3,
                         "numel": 1024, "max_abs_err": 0.5, "first_bad_index": 7, "got": 2.5, "expected": 2.0})
    return {"failures": failures, "checks": 30, "timings_s": {"all_reduce": 0.001 + rank * 1e-6, "broadcast": 0.0005}}


def bandwidth_payload(rank: int, world: int, scenario: str = "healthy") -> dict[str, Any]:
    rng = random.Random(rank * 7919 + world)
    late = 0.0
    if scenario == "straggler" and rank == 13:
        late = 0.004
    samples = []
    for op in OPS:
        for size in SIZES:
            if scenario == "ragged" and rank % 5 == 0 and size == SIZES[-1]:
                continue  # some ranks lack a size: keys with fewer ranks
            loop = 0.01 * (1 + size / 2**22)
            # A late rank waits least in every call: the others waited for it.
            incall = max(0.0, 0.002 + rng.random() * 1e-4 - late) if op != "broadcast" else 0.002 + rng.random() * 1e-4
            totals = [loop + rng.random() * 1e-3 for _ in range(2 if scenario == "ragged" and rank == 1 else 3)]
            samples.append({"op": op, "size": size, "bytes": size, "iters": 8, "totals_s": totals,
                            "total_s": sorted(totals)[len(totals) // 2], "incall_s": round(incall, 7)})
    links = [{"pair": [rank, (rank + 1) % world], "bytes": 2**20, "time_s": 0.001 + rng.random() * 1e-4, "mean_s": 0.0012}]
    if rank > 0:  # each rank times both of its links; the pair's slower side counts
        links.append({"pair": [rank - 1, rank], "bytes": 2**20, "time_s": 0.001 + rng.random() * 1e-4, "mean_s": 0.0012})
    slow = {"bad_link": {(20, 21)}, "slow_rank": {(29, 30), (30, 31)}}.get(scenario, set())
    for link in links:
        if tuple(link["pair"]) in slow:
            link["time_s"] = 0.05
    return {"samples": samples, "links": links, "gpu": True}


def payloads(probe: str, world: int, scenario: str = "healthy") -> dict[int, dict[str, Any]]:
    """Every rank's payload of one probe."""
    if probe == "bandwidth":
        return {r: bandwidth_payload(r, world, scenario) for r in range(world)}
    if probe == "data_shards":
        return {r: data_payload(r, scenario) for r in range(world)}
    if probe in SUITE_BUILDERS:
        return SUITE_BUILDERS[probe](world, scenario)
    build = {"env": env_payload, "gpu": gpu_payload, "collectives": collectives_payload}[probe]
    return {r: build(r, scenario) for r in range(world)}


DATA_SCENARIOS = ("healthy", "identical", "overlapping", "identical_overlapping", "repeated", "setup_error")


def data_payload(rank: int, scenario: str = "healthy", batches: int = 2, rows: int = 4) -> dict[str, Any]:
    """data_shards' payload: row hashes of the first batches, of epochs 0 and 1 when shuffled."""
    if scenario == "setup_error" and rank in (3, 4, 9):
        return {"setup_error": f"hook batches raised on rank {rank % 2}"}
    owner = rank
    if scenario in ("identical", "identical_overlapping"):
        owner = rank // 4  # groups of 4 ranks see the same data
    start = owner * batches * rows
    if scenario in ("overlapping", "identical_overlapping"):
        start = owner * batches * rows // 2  # half of each one's samples are its neighbour's
    ids = list(range(start, start + batches * rows))
    if rank in (0, 1) and scenario == "healthy":
        ids[-1] = 10**6  # one of the dataset's own duplicate samples: no finding
    epoch0 = [[f"{i:016x}" for i in ids[b * rows:(b + 1) * rows]] for b in range(batches)]
    epoch1 = epoch0 if scenario == "repeated" and rank % 3 == 0 else [list(reversed(b)) for b in reversed(epoch0)]
    return {"source": "synthetic", "epochs": [epoch0, epoch1], "shuffles": True}
