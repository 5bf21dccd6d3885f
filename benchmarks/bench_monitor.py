"""Overhead of distdiag.TrainingMonitor(every=10) on a small FSDP2 training loop.

    python benchmarks/bench_monitor.py [--world 2] [--repeats 40] [--steps 10] [--every 10]

Two gloo ranks on CPU run the same loop in the same processes: blocks of `--steps` steps
(one look each) without the monitor and with it, interleaved (A B A B ...) so that machine load drifts hit
both alike. Reported: the median ratio (monitor / baseline) of the step times and its spread
over the repeats. Target: median ratio <= 1.03 at every=10.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import fsdp_mlp  # benchmarks/common.py

_INSIDE: list[float] = []
"""Seconds spent in after_backward per monitored step (the optimizer hooks' snapshot of the
local shard at each look is not in it; it is in the ratios)."""


def _block(model, opt, monitor, steps: int, start: int, batch: int, width: int) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) per step."""
    gen = torch.Generator().manual_seed(start)
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(steps):
        x = torch.randn(batch, width, generator=gen)
        loss = model(x).pow(2).mean()
        loss.backward()
        if monitor is not None:
            m0 = time.perf_counter()
            monitor.after_backward(loss, start + i)
            _INSIDE.append(time.perf_counter() - m0)
        opt.step()
        opt.zero_grad()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    dist.barrier()
    return wall / steps, cpu / steps


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from distdiag.monitor import TrainingMonitor

    model = fsdp_mlp(args.width, args.depth)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = 0
    _block(model, opt, None, 20, step, args.batch, args.width)  # warm up
    step += 20
    # one monitor for the whole run (its optimizer hooks are no-ops outside its looks); blocks
    # of `every` steps alternate without and with it, a with-block starting on a look
    monitor = TrainingMonitor(model, optimizer=opt, every=args.every)
    base, mon = [], []
    for _ in range(args.repeats):
        base.append(_block(model, opt, None, args.steps, step, args.batch, args.width))
        step += args.steps
        mon.append(_block(model, opt, monitor, args.steps, step, args.batch, args.width))
        step += args.steps
    monitor.close()
    # CPU time is reported beside wall time: on a shared, loaded machine the wall-clock ratio
    # mostly measures the neighbours, the CPU-time ratio what the monitor itself costs
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"base": base, "mon": mon, "inside": sum(_INSIDE) / max(1, len(_INSIDE))})
    if rank == 0:
        result = {
            "world": world, "every": args.every, "steps_per_block": args.steps, "repeats": args.repeats,
            "model": f"FSDP2 MLP {args.depth}x{args.width}, batch {args.batch}",
        }
        for idx, kind in ((0, "wall"), (1, "cpu")):
            b = [x[idx] for x in gathered[0]["base"]]
            m = [x[idx] for x in gathered[0]["mon"]]
            if kind == "cpu":  # both ranks' CPU, summed
                b = [sum(g["base"][i][1] for g in gathered) for i in range(len(b))]
                m = [sum(g["mon"][i][1] for g in gathered) for i in range(len(m))]
            ratios = [y / x for y, x in zip(m, b, strict=True)]
            q1, _, q3 = statistics.quantiles(ratios, n=4)
            result[kind] = {
                "baseline_step_ms_median": round(1e3 * statistics.median(b), 3),
                "monitor_step_ms_median": round(1e3 * statistics.median(m), 3),
                "ratio_median": round(statistics.median(ratios), 4),
                "ratio_iqr": [round(q1, 4), round(q3, 4)],
                "ratio_min": round(min(ratios), 4),
                "ratio_max": round(max(ratios), 4),
            }
        # direct: time inside after_backward per step, to set against the baseline's step time;
        # less exposed to the neighbours than the ratios
        result["inside_monitor_ms_per_step"] = round(1e3 * gathered[0]["inside"], 3)
        with open(out_path, "w") as fh:
            json.dump(result, fh)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--steps", type=int, default=10, help="steps per block: a multiple of --every")
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args()
    if args.steps % args.every:
        p.error(f"--steps must be a multiple of --every, got {args.steps} and {args.every}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_path = os.path.join("/tmp", f"bench_monitor_{os.getpid()}.json")
    mp.start_processes(_worker, args=(args.world, port, args, out_path), nprocs=args.world, join=True, start_method="spawn")
    with open(out_path) as fh:
        result = json.load(fh)
    os.unlink(out_path)
    print(json.dumps(result, indent=2))
    for kind in ("wall", "cpu"):
        r = result[kind]
        verdict = "within" if r["ratio_median"] <= 1.03 else "ABOVE"
        print(
            f"{kind:>4} time: monitor overhead at every={args.every}: {100 * (r['ratio_median'] - 1):+.2f}% median "
            f"(interquartile {100 * (r['ratio_iqr'][0] - 1):+.2f}%..{100 * (r['ratio_iqr'][1] - 1):+.2f}%, range "
            f"{100 * (r['ratio_min'] - 1):+.2f}%..{100 * (r['ratio_max'] - 1):+.2f}% over {args.repeats} pairs), {verdict} the 3% target"
        )


if __name__ == "__main__":
    main()
