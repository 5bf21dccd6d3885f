"""Cost of TrainingMonitor's NaN scan (a dispatch mode over the forward at each look step,
distdiag/monitor/trace.py NaNScan) on a small transformer, one process, CPU.

    python benchmarks/bench_nan_scan.py [--repeats 15] [--every 10]

Blocks of `every` steps (one look each) run in turn without a monitor, with the default monitor
(trace="auto": step 0 and every `nan_scan_every`=100th step scanned), with trace="off" (no scan)
and with nan_scan_every=1 (every step scanned: the price of one scanned step), each kind on its
own copy of the model, interleaved in rotating order so that machine load hits all alike.
Reported: median step time of each and the median ratio to no monitor over the blocks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from distdiag.monitor import TrainingMonitor


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True, dropout=0.0)
    return torch.nn.Sequential(torch.nn.Embedding(256, 64), torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False), torch.nn.Linear(64, 256))


def _block(model, opt, monitor, steps: int, start: int) -> float:
    gen = torch.Generator().manual_seed(start)
    t0 = time.perf_counter()
    for i in range(steps):
        ids = torch.randint(0, 256, (8, 32), generator=gen)
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
        loss.backward()
        if monitor is not None:
            monitor.after_backward(loss, start + i)
        opt.step()
        opt.zero_grad()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--every", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    # one model per kind: an armed scan stays on its model until the next step of its monitor
    kinds = ("none", "default", "trace_off", "scan_each_step")
    models = {k: _model() for k in kinds}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    monitors = {"default": TrainingMonitor(models["default"], every=args.every),
                "trace_off": TrainingMonitor(models["trace_off"], every=args.every, trace="off"),
                # the price of one scanned forward, on every step
                "scan_each_step": TrainingMonitor(models["scan_each_step"], every=args.every, nan_scan_every=1)}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for k in models:
        _block(models[k], opts[k], None, 20, 0)  # warm up
    step = {k: 0 for k in models}
    for r in range(args.repeats):
        for kind in kinds[r % 4 :] + kinds[: r % 4]:  # the order rotates: no kind always runs first
            # each monitor sees its own consecutive steps: a block starts on a look step
            times[kind].append(_block(models[kind], opts[kind], monitors.get(kind), args.every, step[kind]))
            step[kind] += args.every
    for m in monitors.values():
        m.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = {k: statistics.median(t / b for t, b in zip(v, times["none"], strict=True)) for k, v in times.items() if k != "none"}
    print(json.dumps({"every": args.every, "repeats": args.repeats, "step_ms": {k: round(v * 1e3, 3) for k, v in med.items()},
                      "ratio_to_none": {k: round(v, 3) for k, v in ratios.items()}}, indent=1))


if __name__ == "__main__":
    main()
