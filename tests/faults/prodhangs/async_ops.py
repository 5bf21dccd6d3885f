"""Async work. --mode fault: each step two async all_reduces (two gradient buckets of the same
size) are issued and then waited; at step --at rank --rank (default 1) issues only the first
(its second bucket is empty: 'no params required grad this step'). Truth: that rank.
--mode fault_ring: a ring exchange with isend/irecv each step plus a loss all_reduce; at step
--at the last rank skips its isend. Truth: the last rank (rank 0 waits in irecv for it)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import torch.distributed as dist
from _common import args, compute, done, init

a = args()
rank, world = init()
bad = a.rank if a.rank >= 0 else (1 if a.mode == "fault" else world - 1)
for step in range(a.steps):
    compute(20)
    if a.mode in ("fault", "healthy"):
        b1, b2 = torch.randn(256), torch.randn(256)
        works = [dist.all_reduce(b1, async_op=True)]
        if not (a.mode == "fault" and rank == bad and step == a.at):
            works.append(dist.all_reduce(b2, async_op=True))
        for w in works:
            w.wait()
    if a.mode in ("fault_ring", "healthy"):
        send = torch.full((16,), float(rank))
        recv = torch.empty(16)
        ops = []
        if not (a.mode == "fault_ring" and rank == bad and step == a.at):
            ops.append(dist.isend(send, (rank + 1) % world))
        ops.append(dist.irecv(recv, (rank - 1) % world))
        for w in ops:
            w.wait()
        loss = torch.tensor([recv.sum().item()])
        dist.all_reduce(loss)
done()
