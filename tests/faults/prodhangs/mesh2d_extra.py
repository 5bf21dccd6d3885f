"""2-D device mesh dp=2 x tp=2 on 4 ranks (init_device_mesh, cpu/gloo). Each step: a tp
all_reduce of activations, a dp all_reduce of gradients. With --mode fault, tp-rank --rank
(default 3) alone adds an all_reduce on its dp group at step --at (a 'log grad norm on the
last tp shard' branch). Truth: that rank (an extra collective).
--mode fault_big: the same with a large flat tensor (bigger than the peer's next op)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import torch.distributed as dist
from _common import args, compute, done
from torch.distributed.device_mesh import init_device_mesh

a = args()
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
rank, world = dist.get_rank(), dist.get_world_size()
bad = a.rank if a.rank >= 0 else world - 1
dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
m, opt = __import__("_common").model(rank)
for step in range(a.steps):
    compute(20)
    h = torch.randn(8, 16)
    dist.all_reduce(h, group=tp)                       # row-parallel output
    loss = m(h).pow(2).mean()
    loss.backward()
    for p in m.parameters():
        dist.all_reduce(p.grad, group=dp)             # data-parallel grad sync
    if a.mode == "fault" and rank == bad and step == a.at:
        norm = torch.tensor([sum(p.grad.norm() ** 2 for p in m.parameters()).item()])
        dist.all_reduce(norm, group=dp)               # only this tp rank logs the global grad norm
    if a.mode == "fault_big" and rank == bad and step == a.at:
        flat = torch.cat([p.grad.flatten() for p in m.parameters()] + [torch.zeros(4096)])
        dist.all_reduce(flat, group=dp)               # only this tp rank syncs a flat grad copy for an EMA
    opt.step(); opt.zero_grad()
done()
