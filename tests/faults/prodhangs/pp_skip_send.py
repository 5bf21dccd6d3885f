"""Hand-written pipeline with isend/irecv; at step --at the LAST stage skips sending one
microbatch's gradient back (a rank-dependent branch: 'no loss on an empty microbatch').
Truth: the last stage (it skipped the send); the stage before it waits in irecv for it."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import torch.distributed as dist
from _common import args, compute, done, init

a = args()
rank, world = init()
torch.manual_seed(rank)
lin = torch.nn.Linear(32, 32)
opt = torch.optim.SGD(lin.parameters(), lr=0.01)
MB = 2
for step in range(a.steps):
    acts = []
    for mb in range(MB):
        if rank == 0:
            x = torch.randn(8, 32)
        else:
            x = torch.empty(8, 32)
            dist.irecv(x, src=rank - 1).wait()
        x.requires_grad_(True)
        compute(10)
        y = lin(x)
        acts.append((x, y))
        if rank < world - 1:
            dist.isend(y.detach(), dst=rank + 1).wait()
    for mb, (x, y) in reversed(list(enumerate(acts))):
        if rank == world - 1:
            g = torch.ones_like(y)
        else:
            g = torch.empty_like(y)
            dist.irecv(g, src=rank + 1).wait()
        y.backward(g)
        skip = a.mode == "fault" and rank == world - 1 and step == a.at and mb == 0
        if rank > 0 and not skip:
            dist.isend(x.grad, dst=rank - 1).wait()
    opt.step(); opt.zero_grad()
done()
