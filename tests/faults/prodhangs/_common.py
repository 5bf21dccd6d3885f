"""Shared bits of the production-shaped hang corpus: plain torch, gloo, CPU."""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

FOREVER = 10**6  # a stall: the watchdog (or the runner's wall limit) ends it


def args(extra=None):
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="healthy")
    p.add_argument("--rank", type=int, default=-1, help="the faulted rank (-1: the last)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--at", type=int, default=3, help="the step the fault happens at")
    for a, kw in (extra or {}).items():
        p.add_argument(a, **kw)
    return p.parse_args()


def init():
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def faulted(a, world):
    return a.rank if a.rank >= 0 else world - 1


def model(seed=0, d=16):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Tanh(), torch.nn.Linear(d, d))
    return m, torch.optim.SGD(m.parameters(), lr=0.01)


def compute(ms=30):
    """A bit of real work standing for a forward/backward."""
    x = torch.randn(64, 64)
    t0 = time.time()
    while (time.time() - t0) * 1000 < ms:
        x = torch.tanh(x @ x.T / 64)
    return x


def done():
    dist.barrier()
    dist.destroy_process_group()
