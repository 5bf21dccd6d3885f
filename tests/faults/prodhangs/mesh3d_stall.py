"""3-D mesh pp=2 x dp=1 x tp=2 on 4 ranks: stage 0 = ranks 0,1, stage 1 = ranks 2,3 (tp pairs),
activations sent pp-wise rank r -> r+2, gradients back, tp all_reduce inside each stage, a dp
all_reduce (1-rank groups) and a global loss all_reduce each step. With --mode fault, rank
--rank (default 2) stalls forever before its tp all_reduce at step --at. Truth: that rank."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import torch.distributed as dist
from _common import FOREVER, args, compute, done
from torch.distributed.device_mesh import init_device_mesh

a = args()
mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
rank, world = dist.get_rank(), dist.get_world_size()
bad = a.rank if a.rank >= 0 else 2
pp_rank = mesh.get_local_rank("pp")
tp, dp = mesh.get_group("tp"), mesh.get_group("dp")
torch.manual_seed(rank)
lin = torch.nn.Linear(16, 16)
opt = torch.optim.SGD(lin.parameters(), lr=0.01)
for step in range(a.steps):
    if pp_rank == 0:
        x = torch.randn(8, 16)
    else:
        x = torch.empty(8, 16)
        dist.recv(x, src=rank - 2)
    x.requires_grad_(True)
    compute(15)
    if a.mode == "fault" and rank == bad and step == a.at:
        time.sleep(FOREVER)                           # e.g. a host-side lock in a custom kernel
    y = lin(x)
    yr = y.detach().clone()
    dist.all_reduce(yr, group=tp)
    y = y + (yr - y.detach())
    if pp_rank == 0:
        dist.send(y.detach(), dst=rank + 2)
        g = torch.empty_like(y)
        dist.recv(g, src=rank + 2)
        y.backward(g)
    else:
        loss = y.pow(2).mean()
        loss.backward()
        dist.send(x.grad, dst=rank - 2)
    for p in lin.parameters():
        dist.all_reduce(p.grad, group=dp)
    l = torch.tensor([float(step)])
    dist.all_reduce(l)                                # global loss for logging
    opt.step(); opt.zero_grad()
done()
