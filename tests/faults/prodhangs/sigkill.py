"""--mode fault: rank --rank (default 2) SIGKILLs itself mid-training (the OOM killer) at step
--at. Truth: that rank, its process gone."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import torch.distributed as dist
from _common import args, compute, done, init, model

a = args()
rank, world = init()
bad = a.rank if a.rank >= 0 else 2
m, opt = model(0)
for step in range(a.steps):
    compute(20)
    m(torch.randn(8, 16)).pow(2).mean().backward()
    if a.mode == "fault" and rank == bad and step == a.at:
        os.kill(os.getpid(), 9)
    for p in m.parameters():
        dist.all_reduce(p.grad)
    opt.step(); opt.zero_grad()
done()
