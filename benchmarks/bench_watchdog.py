"""Hang watchdog: detection latency and overhead, as ratios measured in the same run.

    python benchmarks/bench_watchdog.py [--repeats 5] [--blocks 6] [--latency-runs 3]

Overhead: 2 gloo ranks (forkserver harness). In each process run, blocks of a small FSDP2
MLP loop and of a loop of small all_reduces alternate without and with the watchdog armed
(off, on, off, on ...), so machine drift hits both alike; the ratio is per block pair.
TORCH_DISTRIBUTED_DEBUG=DETAIL and the flight recorder need their setting before init, so
they run in their own processes, interleaved run by run with plain ones, and are compared
with the plain runs' unarmed blocks. Reported: median ratio and [min, max] spread.
Each process run also has blocks armed with the wrappers off (`wrap=False`: detection from
torch's flight recorder only), so the training thread's CPU per collective is measured with
and without the wrappers in the same run.
Latency: with a 3 s timeout, the time from the hang to the report on disk (and to every
process gone, action abort) for each case: a rank blocked outside any collective (plain
all_reduce loop), DDP with uneven data (the short rank leaves the loop while the others wait
in DDP's all-reduce inside backward), DDP with an unused parameter on one rank (it raises),
FSDP2 with a rank blocked in data loading, and a compiled step whose all-reduce is a
functional collective inside the graph (tests/faults/engine_workers.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from common import fsdp_mlp  # benchmarks/common.py

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def _fsdp_block(model, opt, steps: int, wd) -> float:
    import torch

    x = torch.randn(32, 128)
    cpu = time.thread_time()
    started = time.perf_counter()
    for i in range(steps):
        if wd is not None:
            wd.step(i)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return (time.perf_counter() - started) / steps, (time.thread_time() - cpu) / steps


def _ar_block(n: int, wd) -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(256)
    cpu = time.thread_time()
    started = time.perf_counter()
    for i in range(n):
        if wd is not None and i % 10 == 0:
            wd.step(i)
        dist.all_reduce(t)
    return (time.perf_counter() - started) / n, (time.thread_time() - cpu) / n


def worker(argv: list[str]) -> int:
    """One process run: alternate unarmed/armed blocks (armed only in mode plain)."""
    import torch
    import torch.distributed as dist

    from distdiag import HangWatchdog

    mode, blocks = argv[0], int(argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    model = fsdp_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _fsdp_block(model, opt, 3, None)
    _ar_block(50, None)
    out: dict[str, list[float]] = {
        f"{k}_{a}{c}": [] for k in ("fsdp", "ar") for a in ("off", "on", "nowrap") for c in ("", "_cpu")
    }

    def add(key: str, value: tuple[float, float]) -> None:
        out[key].append(value[0])
        out[key + "_cpu"].append(value[1])

    for _ in range(blocks):
        for armed in ("off", "on", "nowrap") if mode == "plain" else ("off",):
            dist.barrier()
            if armed != "off":
                with HangWatchdog(timeout=timedelta(seconds=60), dump_dir="hang-report", wrap=armed == "on") as wd:
                    add(f"fsdp_{armed}", _fsdp_block(model, opt, 5, wd))
                    add(f"ar_{armed}", _ar_block(100, wd))
            else:
                add("fsdp_off", _fsdp_block(model, opt, 5, None))
                add("ar_off", _ar_block(100, None))
    if dist.get_rank() == 0:
        Path("times.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _spread(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.3f}x [{min(ratios):.3f}, {max(ratios):.3f}] (n={len(ratios)})"


def overhead(repeats: int, blocks: int) -> dict[str, str]:
    from tests.harness import run_ranks

    envs = {
        "plain": {},
        "detail": {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
        "recorder": {"TORCH_FR_BUFFER_SIZE": "2000"},
    }
    runs: dict[str, list[dict[str, list[float]]]] = {m: [] for m in envs}
    for _ in range(repeats):
        for mode, env in envs.items():
            with tempfile.TemporaryDirectory() as tmp:
                res = run_ranks(2, [mode, str(blocks)], tmp, entry="bench_watchdog:worker", env=env, timeout=300)
                if res.codes != [0, 0]:
                    raise SystemExit(f"benchmark run {mode} failed: {res.codes}\n{res.stderr[-2000:]}")
                runs[mode].append(json.loads((Path(tmp) / "times.json").read_text()))
    table: dict[str, str] = {}
    for loop in ("fsdp", "ar"):
        pairs = [on / off for r in runs["plain"] for off, on in zip(r[f"{loop}_off"], r[f"{loop}_on"], strict=True)]
        table[f"{loop}: watchdog armed / off (same process), wall"] = _spread(pairs)
        cpu = [on / off for r in runs["plain"] for off, on in zip(r[f"{loop}_off_cpu"], r[f"{loop}_on_cpu"], strict=True)]
        table[f"{loop}: watchdog armed / off, training-thread CPU"] = _spread(cpu)
        pairs = [on / off for r in runs["plain"] for off, on in zip(r[f"{loop}_off"], r[f"{loop}_nowrap"], strict=True)]
        table[f"{loop}: armed without wrappers / off, wall"] = _spread(pairs)
        cpu = [on / off for r in runs["plain"] for off, on in zip(r[f"{loop}_off_cpu"], r[f"{loop}_nowrap_cpu"], strict=True)]
        table[f"{loop}: armed without wrappers / off, training-thread CPU"] = _spread(cpu)
        if loop == "ar":  # one collective per iteration: the added CPU per collective, in us
            for label, key in (("wrappers on", "ar_on_cpu"), ("wrappers off", "ar_nowrap_cpu")):
                extra = [(on - off) * 1e6 for r in runs["plain"] for off, on in zip(r["ar_off_cpu"], r[key], strict=True)]
                table[f"ar: training-thread CPU added per collective, {label}"] = (
                    f"{statistics.median(extra):.1f} us [{min(extra):.1f}, {max(extra):.1f}]"
                )
        for mode in ("detail", "recorder"):
            ratios = [
                statistics.median(r[f"{loop}_off"]) / statistics.median(p[f"{loop}_off"])
                for r, p in zip(runs[mode], runs["plain"], strict=True)
            ]
            table[f"{loop}: {mode} / plain (runs interleaved)"] = _spread(ratios)
        base = statistics.median([statistics.median(r[f"{loop}_off"]) for r in runs["plain"]])
        table[f"{loop}: plain step time"] = f"{base * 1e3:.3f} ms"
    return table


LATENCY_CASES = {
    "blocked outside a collective (all_reduce loop)": (2, "tests.faults.watchdog_workers:train", ["fault=block", "rank=1", "step=2"]),
    "DDP, uneven data (rank leaves the loop)": (3, "tests.faults.engine_workers:train", ["kind=ddp", "fault=uneven", "rank=2", "steps=4"]),
    "DDP, unused parameter (rank raises)": (3, "tests.faults.engine_workers:train", ["kind=ddp", "fault=unused", "rank=1"]),
    "FSDP2, rank blocked in data loading": (2, "tests.faults.engine_workers:train", ["kind=fsdp", "fault=block", "rank=1"]),
    "compiled step, rank blocked": (2, "tests.faults.engine_workers:train", ["kind=compile", "fault=block", "rank=1"]),
}


def latency(runs: int, timeout_s: float = 3.0) -> dict[str, str]:
    """Per case: hang start (the worker's `hang_started` stamp) -> report on disk, -> all gone."""
    from tests.harness import run_ranks

    table: dict[str, str] = {}
    for case, (world, entry, words) in LATENCY_CASES.items():
        to_report, to_gone = [], []
        for _ in range(runs):
            with tempfile.TemporaryDirectory() as tmp:
                res = run_ranks(world, [*words, f"timeout={timeout_s}"], tmp, entry=entry, timeout=120)
                done = time.time()
                report = Path(tmp) / "hang-report" / "hang-report.json"
                if res.timed_out or not report.exists():
                    raise SystemExit(f"latency run failed ({case}): {res.codes}\n{res.stderr[-2000:]}")
                started = float((Path(tmp) / "hang_started").read_text())
                to_report.append(os.path.getmtime(report) - started)
                to_gone.append(done - started)
        rep, gone = statistics.median(to_report), statistics.median(to_gone)
        table[f"{case}: hang -> report (timeout {timeout_s:g}s)"] = (
            f"median {rep:.2f}s [{min(to_report):.2f}, {max(to_report):.2f}] = timeout + {rep - timeout_s:.2f}s"
        )
        table[f"{case}: hang -> every process gone"] = (
            f"median {gone:.2f}s [{min(to_gone):.2f}, {max(to_gone):.2f}] = timeout + {gone - timeout_s:.2f}s"
        )
    return table


def per_collective_worker(argv: list[str]) -> int:
    """One rank, back-to-back small all_reduces: the training thread's CPU per collective
    unarmed, armed without wrappers, armed with wrappers (blocks alternate)."""
    import torch
    import torch.distributed as dist

    from distdiag import HangWatchdog

    dist.init_process_group("gloo")
    t = torch.ones(16)

    def loop(n: int) -> float:
        cpu = time.thread_time()
        for _ in range(n):
            dist.all_reduce(t)
        return (time.thread_time() - cpu) / n * 1e6

    loop(2000)
    out: dict[str, list[float]] = {"off": [], "nowrap": [], "on": []}
    for _ in range(int(argv[0])):
        out["off"].append(loop(5000))
        for mode in ("nowrap", "on"):
            with HangWatchdog(timeout=timedelta(seconds=60), dump_dir="hang-report", wrap=mode == "on"):
                out[mode].append(loop(5000))
    Path("per_collective.json").write_text(json.dumps(out))
    dist.destroy_process_group()
    return 0


def per_collective(blocks: int = 7) -> dict[str, str]:
    from tests.harness import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        res = run_ranks(1, [str(blocks)], tmp, entry="bench_watchdog:per_collective_worker", timeout=300)
        if res.codes != [0]:
            raise SystemExit(f"per-collective run failed: {res.codes}\n{res.stderr[-2000:]}")
        out = json.loads((Path(tmp) / "per_collective.json").read_text())
    return {
        f"one rank, training-thread CPU per all_reduce, {label}": f"{statistics.median(out[key]):.1f} us (median of {blocks})"
        for key, label in (("off", "unarmed"), ("nowrap", "armed, wrappers off"), ("on", "armed, wrappers on"))
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--latency-runs", type=int, default=3)
    args = parser.parse_args()
    results = {}
    results.update(latency(args.latency_runs))
    results.update(per_collective())
    results.update(overhead(args.repeats, args.blocks))
    width = max(len(k) for k in results)
    for key, value in results.items():
        print(f"{key.ljust(width)}  {value}")


if __name__ == "__main__":
    main()
