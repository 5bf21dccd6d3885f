"""How the verdict's exchange and consolidation grow with the number of ranks (issues 6, 21).

    python benchmarks/bench_gate_scaling.py [--worlds 1024 4096 16384] [--repeats 3] [--probes A,B]

One process plays every rank against a real TCPStore (the one torchrun's agent hosts): each
pretend rank posts its result of every probe of the default suite (env, collectives, gpu,
setup_sync, data_shards, fsdp_plan, loss_parity, param_sync, determinism, sequence_parallel,
moe_routing, checkpoint; `--probes` may add bandwidth) as distdiag/check/run.py posts it
(Exchange.post, shared fields stored once), with healthy payloads of that many ranks
(tests/unit/check_payloads.py, scaled from what the real probes posted; its faulty twins are
for the tests). Then the writer, probe by probe as RunEnd._completed does, collects them
(Exchange.collect: one counter read and a multi_get per 256 keys, and the shared values once)
and consolidates them (distdiag.check.consolidate.consolidate_probe); it builds the report, serialises it, groups it by
node, renders the JUnit XML - with the cyclic garbage collector paused as the writer pauses it
(distdiag/check/finish.py). moe_routing's built-in layer posts by expert-parallel groups of up
to 8 ranks (distdiag/probes/moe/probe.py ep_size_for), as the probe runs it since issue 21:
what a rank posts no longer grows with the world.
Printed: milliseconds per stage and per rank, the growth factor from the previous world size
against the growth in ranks (linear: equal; quadratic: its square); then each probe's
consolidation in ms per world size, their total, and the total with the report's build.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from distdiag.check.consolidate import build_report, consolidate_probe
from distdiag.check.shared_values import resolve_shared
from distdiag.probes import PROBES
from distdiag.probes.base import ConsolidationView
from distdiag.probes.cluster.bandwidth import OPS
from distdiag.report.junit import junit_xml
from distdiag.report.model import RankInfo, group_by_node
from distdiag.runtime.exchange import Exchange
from distdiag.runtime.gcpause import collector_paused
from distdiag.runtime.keys import Keys

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.unit.check_payloads

from tests.unit.check_suite_payloads import SUITE_BUILDERS  # noqa: E402 - found through the path above

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


DEFAULT_SUITE = [name for name, cls in PROBES.items() if cls.default_enabled]


def made(name: str, world: int, ranks: Any = None) -> dict[int, dict]:
    """Each of `ranks`' (default: every rank's) healthy payload of probe `name` in a job of
    `world` ranks (tests/unit/check_payloads.py; benchmarks/bench_scale.py posts them too)."""
    from tests.unit.check_payloads import data_payload, env_payload

    which = range(world) if ranks is None else ranks
    if name == "bandwidth":
        return {r: _bandwidth_payload(r, world) for r in which}
    if name == "gpu":
        return {r: _gpu_payload(r) for r in which}
    if name == "collectives":
        return {r: {"failures": [], "checks": 30, "timings_s": {"all_reduce": 0.001}} for r in which}
    if name == "env":
        return {r: env_payload(r) for r in which}
    if name == "data_shards":
        return {r: data_payload(r) for r in which}
    if name == "moe_routing":  # the built-in layer in expert-parallel groups of up to 8 ranks
        from distdiag.probes.moe.probe import ep_size_for

        return SUITE_BUILDERS[name](world, "healthy", ranks, ep=ep_size_for(world))
    return SUITE_BUILDERS[name](world, "healthy", ranks)


def suite(world: int, names: list[str] | None = None) -> list[str]:
    """The probes posted at this world size: `names` (default: the default suite)."""
    return list(names or DEFAULT_SUITE)


def _post_all(world: int, store, names: list[str]) -> float:
    """Every rank posts its entry of each probe as distdiag/check/run.py posts it (shared fields
    stored once, distdiag/check/shared_values.py); the seconds it took (payloads built apart)."""
    from distdiag.check.shared_values import share_fields

    spent = 0.0
    for index, name in enumerate(names):
        made_, probe = made(name, world), PROBES[name]()
        t0 = time.perf_counter()
        for r in range(world):
            ex = Exchange(store, r, world)
            ex.post(Keys.result(index), share_fields(ex, index, {"status": "ok", "payload": made_[r]}, probe.shared_fields))
        spent += time.perf_counter() - t0
        del made_
    return spent


def _one(world: int, store, names: list[str]) -> tuple[dict[str, float], dict[str, float]]:
    """(seconds per stage, seconds per probe's consolidation) of one world size."""
    ranks = [RankInfo(r, f"h{r // 8}", r // 8, r % 8, f"cuda:{r % 8}", 1000 + r) for r in range(world)]
    names = suite(world, names)
    posting = _post_all(world, store, names)
    per_probe: dict[str, float] = {}
    results = []
    with collector_paused():  # as the writer consolidates (distdiag/check/finish.py)
        writer = Exchange(store, 0, world)
        collecting = 0.0
        t1 = time.perf_counter()
        # Probe by probe, as RunEnd._completed: one probe's payloads held at a time.
        for index, name in enumerate(names):
            c0 = time.perf_counter()
            entries = resolve_shared(writer, index, writer.collect(Keys.result(index)))
            c1 = time.perf_counter()
            assert len(entries) == world
            cls = PROBES[name]
            results.append(consolidate_probe(cls(), entries, ConsolidationView(world, ranks, cls.Config() if cls.Config else None)))
            per_probe[name] = time.perf_counter() - c1
            collecting += c1 - c0
            del entries
        t3 = time.perf_counter()
        report = build_report(world_size=world, ranks=ranks, probes=results, not_run=[], outcome="completed", hung=False,
                              restart_count=0, run_id="bench", duration_s=1.0, config={}, written_by=0)
        report.to_json()
        group_by_node(report)
        junit_xml(report)
        t4 = time.perf_counter()
    bad = [f"{r.name}: {f.issue}" for r in results for f in r.findings if f.severity not in ("info",)]
    assert not bad, bad  # healthy payloads: a finding would mean the builders or the probe drifted
    return {"post (all ranks)": posting, "collect": collecting, "consolidate": t3 - t1 - collecting, "report+junit": t4 - t3}, per_probe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--probes", default=",".join(DEFAULT_SUITE),
                        help="probes to post and consolidate, in the suite's order (default: the default suite)")
    args = parser.parse_args()
    names = args.probes.split(",")
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    store = dist.TCPStore("127.0.0.1", server.port, 1, is_master=False)
    rows = []
    for world in args.worlds:
        runs = [_one(world, dist.PrefixStore(f"w{world}/rep{i}/", store), names) for i in range(args.repeats)]
        stages = {k: statistics.median(r[0][k] for r in runs) for k in runs[0][0]}
        probes = {k: statistics.median(r[1][k] for r in runs) for k in runs[0][1]}
        rows.append((world, stages, probes))
        print(f"{world} ranks done", file=sys.stderr, flush=True)
    _print_stages(rows)
    _print_probes(rows, names)


def _print_stages(rows: list[tuple[int, dict[str, float], dict[str, float]]]) -> None:
    stages = list(rows[0][1])
    print(f"{'ranks':>6}  " + "  ".join(f"{s:>18}" for s in stages) + "  per-rank total   growth (ranks x)")
    prev = None
    for world, t, _ in rows:
        total = sum(t.values())
        growth = f"{total / prev[1]:6.1f}x ({world / prev[0]:.0f}x)" if prev else ""
        print(f"{world:>6}  " + "  ".join(f"{t[s] * 1e3:15.2f} ms" for s in stages) + f"  {total / world * 1e6:9.0f} us   {growth}")
        prev = (world, total)


def _print_probes(rows: list[tuple[int, dict[str, float], dict[str, float]]], names: list[str]) -> None:
    """Each probe's consolidation (ms) per world size; the total, and consolidation + report."""
    print()
    print(f"{'probe (consolidate, ms)':<26}" + "".join(f"{w:>12}" for w, _, _ in rows))
    for name in names:
        cells = [f"{p[name] * 1e3:12.1f}" if name in p else f"{'n/a':>12}" for _, _, p in rows]
        print(f"{name:<26}" + "".join(cells))
    print(f"{'total':<26}" + "".join(f"{sum(p.values()) * 1e3:12.1f}" for _, _, p in rows))
    print(f"{'+ report+junit':<26}" + "".join(f"{(sum(p.values()) + t['report+junit']) * 1e3:12.1f}" for _, t, p in rows))


if __name__ == "__main__":
    main()
