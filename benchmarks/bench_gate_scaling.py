"""How the verdict's exchange and consolidation grow with the number of ranks (issues 6, 21).

    python benchmarks/bench_gate_scaling.py [--worlds 2 8 32 128 512 1024 4096 16384]

One process plays every rank against a real TCPStore (the one torchrun's agent hosts):
each pretend rank posts a gate-sized result (Exchange.post, what every rank does once per
probe), then the writer collects them (Exchange.collect: one counter read and a multi_get per
256 keys), and consolidates the bandwidth, gpu, collectives, env and data_shards probes over
synthetic payloads of that many ranks (healthy: tests/unit/check_payloads.py has their faulty
twins), builds the report, serialises it, groups it by node, renders the JUnit XML - with the
cyclic garbage collector paused as the writer pauses it (distdiag/check/finish.py).
Printed: milliseconds per stage and per rank, and the growth factor from the previous world
size against the growth in ranks (linear: equal; quadratic: its square).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch.distributed as dist

from distdiag.check.consolidate import build_report
from distdiag.probes.base import ConsolidationView
from distdiag.probes.cluster.bandwidth import OPS, BandwidthConfig, BandwidthProbe
from distdiag.probes.cluster.collectives import CollectivesProbe
from distdiag.probes.cluster.env import EnvConfig, EnvProbe
from distdiag.probes.cluster.gpu import GpuConfig, GpuProbe
from distdiag.probes.data.probe import DataShardsProbe
from distdiag.report.junit import junit_xml
from distdiag.report.model import RankInfo, group_by_node
from distdiag.runtime.exchange import Exchange
from distdiag.runtime.gcpause import collector_paused

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.unit.check_payloads

SIZES = (4096, 262144, 4194304)


def _bandwidth_payload(rank: int, world: int) -> dict:
    samples = [{"op": op, "size": s, "bytes": s, "iters": 8, "total_s": 0.01, "incall_s": 0.001 + rank * 1e-7}
               for op in OPS for s in SIZES]
    links = [{"pair": [rank, (rank + 1) % world], "bytes": 2**20, "time_s": 0.001, "mean_s": 0.001}]
    return {"samples": samples, "links": links, "gpu": False}


def _gpu_payload(rank: int) -> dict:
    reading = {"unsupported": [], "errors": {}, "name": "NVIDIA H100", "uuid": f"GPU-{rank}", "pci_bus_id": f"0000:{rank % 8:02x}:00.0",
               "driver": "550", "cuda_driver": "12.4", "ecc_uncorrected_volatile": 0, "ecc_uncorrected_aggregate": 0,
               "ecc_corrected_volatile": 0, "temperature_c": 40, "slowdown_temp_c": 87, "throttle_mask": 1,
               "pcie_gen": 5, "pcie_gen_max": 5, "pcie_width": 16, "pcie_width_max": 16, "power_mw": 70000,
               "power_limit_mw": 700000, "memory_total": 80 * 2**30, "memory_free": 79 * 2**30,
               "persistence_mode": True, "mig_mode": {"current": False, "pending": False}}
    return {"host": f"h{rank // 8}", "node": rank // 8, "local_rank": rank % 8, "status": "ok", "device": f"cuda:{rank % 8}",
            "gpu_count": 8, "reading": reading}


def _payloads(world: int) -> dict[str, dict[int, dict]]:
    """The other four probes' payloads of `world` healthy ranks (as the writer has them once collected)."""
    from tests.unit.check_payloads import data_payload, env_payload

    return {
        "gpu": {r: _gpu_payload(r) for r in range(world)},
        "collectives": {r: {"failures": [], "checks": 30, "timings_s": {"all_reduce": 0.001}} for r in range(world)},
        "env": {r: env_payload(r) for r in range(world)},
        "data_shards": {r: data_payload(r) for r in range(world)},
    }


def _consolidated(world: int, ranks: list[RankInfo], posted: dict[int, dict], others: dict[str, dict[int, dict]]) -> list:
    """The five probes' results over `world` ranks (bandwidth's payloads as collected)."""
    return [
        BandwidthProbe().consolidate({r: p["payload"] for r, p in posted.items()},
                                     ConsolidationView(world, ranks, BandwidthConfig())),
        GpuProbe().consolidate(others["gpu"], ConsolidationView(world, ranks, GpuConfig())),
        CollectivesProbe().consolidate(others["collectives"], ConsolidationView(world, ranks, None)),
        EnvProbe().consolidate(others["env"], ConsolidationView(world, ranks, EnvConfig())),
        DataShardsProbe().consolidate(others["data_shards"], ConsolidationView(world, ranks, None)),
    ]


def _one(world: int, store) -> dict[str, float]:
    ranks = [RankInfo(r, f"h{r // 8}", r // 8, r % 8, f"cuda:{r % 8}", 1000 + r) for r in range(world)]
    others = _payloads(world)
    key = f"w{world}/res/0"
    t0 = time.perf_counter()
    for r in range(world):
        Exchange(store, r, world).post(key, {"status": "ok", "payload": _bandwidth_payload(r, world)})
    t1 = time.perf_counter()
    with collector_paused():  # as the writer consolidates (distdiag/check/finish.py)
        posted = Exchange(store, 0, world).collect(key)
        t2 = time.perf_counter()
        assert len(posted) == world
        results = _consolidated(world, ranks, posted, others)
        t3 = time.perf_counter()
        report = build_report(world_size=world, ranks=ranks, probes=results, not_run=[], outcome="completed", hung=False,
                              restart_count=0, run_id="bench", duration_s=1.0, config={}, written_by=0)
        report.to_json()
        group_by_node(report)
        junit_xml(report)
        t4 = time.perf_counter()
    return {"post (all ranks)": t1 - t0, "collect": t2 - t1, "consolidate": t3 - t2, "report+junit": t4 - t3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 8, 32, 128, 512, 1024, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    store = dist.TCPStore("127.0.0.1", server.port, 1, is_master=False)
    rows = []
    for world in args.worlds:
        runs = [_one(world, dist.PrefixStore(f"rep{i}/", store)) for i in range(args.repeats)]
        rows.append((world, {k: statistics.median(r[k] for r in runs) for k in runs[0]}))
    stages = list(rows[0][1])
    print(f"{'ranks':>6}  " + "  ".join(f"{s:>18}" for s in stages) + "  per-rank total   growth (ranks x)")
    prev = None
    for world, t in rows:
        total = sum(t.values())
        growth = f"{total / prev[1]:6.1f}x ({world / prev[0]:.0f}x)" if prev else ""
        print(f"{world:>6}  " + "  ".join(f"{t[s] * 1e3:15.2f} ms" for s in stages) + f"  {total / world * 1e6:9.0f} us   {growth}")
        prev = (world, total)


if __name__ == "__main__":
    main()
