"""Object collectives. Each step: an all_reduce of gradients; every 2 steps rank 0 broadcasts
a config dict (broadcast_object_list) and metrics are gathered (all_gather_object).
--mode fault: only rank 0 calls all_gather_object for its metrics at step --at (the classic
'if rank == 0: log(gather(metrics))'). Truth: rank 0.
--mode fault_bcast: rank --rank (default last) skips the broadcast_object_list at step --at
(its 'config cache' says it already has it). Truth: that rank."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import torch.distributed as dist
from _common import args, compute, done, faulted, init, model

a = args()
rank, world = init()
bad = faulted(a, world)
m, opt = model(rank)
for step in range(a.steps):
    compute(20)
    loss = m(torch.randn(8, 16)).pow(2).mean()
    loss.backward()
    for p in m.parameters():
        dist.all_reduce(p.grad)
    opt.step(); opt.zero_grad()
    if step % 2 == 1 or step == a.at:
        cfg = [{"lr": 0.01, "step": step}] if rank == 0 else [None]
        if not (a.mode == "fault_bcast" and rank == bad and step == a.at):
            dist.broadcast_object_list(cfg, src=0)
        metrics = {"loss": loss.item(), "rank": rank}
        if a.mode == "fault" and step == a.at:
            if rank == 0:
                out = [None] * world
                dist.all_gather_object(out, metrics)
        else:
            out = [None] * world
            dist.all_gather_object(out, metrics)
done()
