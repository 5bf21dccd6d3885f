"""torch.distributed.checkpoint. Each step an all_reduce of gradients; at step --at a DCP save.
--mode fault: only rank 0 calls dcp.save ('if rank == 0: save(...)'). Truth: rank 0.
--mode fault_io: every rank saves, rank --rank (default last) stalls in its storage writer's
write_data (a hung NFS write). Truth: that rank."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _common import FOREVER, args, compute, done, faulted, init, model
from torch.distributed.checkpoint import FileSystemWriter

a = args()
rank, world = init()
bad = faulted(a, world)
ckpt = os.path.join(os.getcwd(), "ckpt")


class SlowWriter(FileSystemWriter):
    def write_data(self, plan, planner):
        if a.mode == "fault_io" and dist.get_rank() == bad:
            time.sleep(FOREVER)  # the write never returns
        return super().write_data(plan, planner)


m, opt = model(0)
for step in range(a.steps):
    compute(20)
    m(torch.randn(8, 16)).pow(2).mean().backward()
    for p in m.parameters():
        dist.all_reduce(p.grad)
    opt.step(); opt.zero_grad()
    if step == a.at:
        state = {"model": m.state_dict()}
        if a.mode == "fault":
            if rank == 0:
                dcp.save(state, storage_writer=FileSystemWriter(ckpt))
        else:
            dcp.save(state, storage_writer=SlowWriter(ckpt))
done()
