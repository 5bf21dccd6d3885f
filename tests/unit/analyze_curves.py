"""Synthetic training curves with known events, shared by the analyze tests."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path


def clean_curve(n: int = 600, seed: int = 0, noise: float = 0.08) -> list[float]:
    """Exponential decay with warmup-free start, two learning-rate drops and multiplicative noise."""
    rng = random.Random(seed)
    out = []
    for t in range(n):
        base = 0.5 + 3 * math.exp(-t / 80) - (0.1 if t >= n // 3 else 0) - (0.05 if t >= 2 * n // 3 else 0)
        out.append(base * (1 + noise * rng.gauss(0, 1)))
    return out


def steep_curve(n: int = 600, seed: int = 0, noise: float = 0.05) -> list[float]:
    """A fast early decay (17x in the first 100 steps, as a language model's first steps fall):
    the loss of 100 steps ago is far above the current level."""
    rng = random.Random(seed)
    return [(0.3 + 5 * math.exp(-t / 30)) * (1 + noise * rng.gauss(0, 1)) for t in range(n)]


def grad_curve(n: int = 600, seed: int = 1) -> list[float]:
    rng = random.Random(seed)
    return [1.0 * (1 + 0.1 * rng.gauss(0, 1)) for _ in range(n)]


def write_jsonl(path: Path, **series: list[float]) -> Path:
    n = max(len(v) for v in series.values())
    with open(path, "w") as f:
        for i in range(n):
            rec = {"step": i}
            rec.update({k: v[i] for k, v in series.items() if i < len(v)})
            f.write(json.dumps(rec) + "\n")
    return path
