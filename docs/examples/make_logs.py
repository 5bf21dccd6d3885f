"""Writes the logs docs/analyze.md's examples read, from one healthy run's curve (loss falling
with batch noise): metrics.jsonl, runs/gpu1.csv and runs/gpu8.csv (the same run logged twice)
and tb_logdir/ (TensorBoard event files, through tensorboardX). Run it in an empty directory:

    python docs/examples/make_logs.py && distdiag analyze metrics.jsonl
"""

import csv
import json
import math
import random
from pathlib import Path


def curve(seed: int) -> list[tuple[int, float, float]]:
    rng = random.Random(seed)
    return [(s, 0.3 + 2.0 * math.exp(-s / 150) + rng.gauss(0, 0.02), 1.0 + 0.5 * math.exp(-s / 100) + rng.gauss(0, 0.02))
            for s in range(400)]


def main() -> None:
    points = curve(0)
    with open("metrics.jsonl", "w") as f:
        for step, loss, grad_norm in points:
            f.write(json.dumps({"step": step, "loss": loss, "grad_norm": grad_norm}) + "\n")
    Path("runs").mkdir(exist_ok=True)
    for name, seed in (("gpu1", 0), ("gpu8", 1)):
        with open(f"runs/{name}.csv", "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["step", "loss", "grad_norm"])
            out.writerows(curve(seed))
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        print("tensorboardX is not installed: no tb_logdir/ (pip install tensorboardX)")
        return
    with SummaryWriter("tb_logdir") as tb:
        for step, loss, grad_norm in points:
            tb.add_scalar("train/loss", loss, step)
            tb.add_scalar("train/grad_norm", grad_norm, step)


if __name__ == "__main__":
    main()
