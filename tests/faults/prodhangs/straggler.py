"""No hang: rank --rank (default last) is 3 s slower than the others each step (timeout 5 s):
the others wait ~3 s in each all_reduce. Must stay quiet."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import torch.distributed as dist
from _common import args, compute, done, faulted, init, model

a = args({"--slow-s": dict(type=float, default=3.0)})
rank, world = init()
m, opt = model(0)
for step in range(4):
    compute(20)
    if rank == faulted(a, world):
        time.sleep(a.slow_s)
    m(torch.randn(8, 16)).pow(2).mean().backward()
    for p in m.parameters():
        dist.all_reduce(p.grad)
    opt.step(); opt.zero_grad()
done()
