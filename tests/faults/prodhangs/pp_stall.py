"""Hand-written pipeline (forward via send, backward via recv of grads) over every rank as a
stage; with --mode fault the stage --rank (default: a middle one) stalls forever in compute at
step --at. Truth: that stage; the stages before/after it wait in send/recv and are stranded."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import torch.distributed as dist
from _common import FOREVER, args, compute, done, init

a = args()
rank, world = init()
bad = a.rank if a.rank >= 0 else world // 2
torch.manual_seed(rank)
lin = torch.nn.Linear(32, 32)
opt = torch.optim.SGD(lin.parameters(), lr=0.01)
MB = 2
for step in range(a.steps):
    acts = []
    for mb in range(MB):                      # forward of every microbatch (GPipe order)
        if rank == 0:
            x = torch.randn(8, 32)
        else:
            x = torch.empty(8, 32)
            dist.recv(x, src=rank - 1)
        x.requires_grad_(True)
        if a.mode == "fault" and rank == bad and step == a.at and mb == 1:
            time.sleep(FOREVER)               # a stage stuck in its compute (a host-side deadlock, a slow op)
        compute(10)
        y = lin(x)
        acts.append((x, y))
        if rank < world - 1:
            dist.send(y.detach(), dst=rank + 1)
    for x, y in reversed(acts):               # backward
        if rank == world - 1:
            g = torch.ones_like(y)
        else:
            g = torch.empty_like(y)
            dist.recv(g, src=rank + 1)
        y.backward(g)
        if rank > 0:
            dist.send(x.grad, dst=rank - 1)
    opt.step(); opt.zero_grad()
done()
