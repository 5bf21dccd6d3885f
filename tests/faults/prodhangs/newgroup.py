"""Group creation. Every rank must call dist.new_group for every group (it is collective over
the default group). --mode fault: the pair groups are created only by their members
('if rank in pair: g = new_group(pair)'): ranks 0-1 create [0,1], ranks 2-3 never call it for
[0,1] and go on (torch 2.13 gloo: this does not hang, the job finishes: no report is right).
--mode fault_order: overlapping groups [0,1,2] and [1,2,3] created in another order on the
last rank. Truth: the last rank."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import torch.distributed as dist
from _common import args, compute, done, init

a = args()
rank, world = init()
x = torch.ones(4)
dist.all_reduce(x)
if a.mode == "fault_order":
    # overlapping subgroups created in another order on the last rank (its config lists them
    # in another order): every rank must create groups in one global order
    if rank == world - 1:
        gb = dist.new_group([1, 2, 3]); ga = dist.new_group([0, 1, 2])
    else:
        ga = dist.new_group([0, 1, 2]); gb = dist.new_group([1, 2, 3])
    mine = ga if rank == 0 else gb
    g01 = g23 = None
elif a.mode == "fault":
    g01 = dist.new_group([0, 1]) if rank in (0, 1) else None   # the bug: created by its members only
else:
    g01 = dist.new_group([0, 1])
if a.mode != "fault_order":
    g23 = dist.new_group([2, 3])
    mine = g01 if rank in (0, 1) else g23
for step in range(a.steps):
    compute(20)
    t = torch.randn(8)
    dist.all_reduce(t, group=mine)
    dist.all_reduce(t)
done()
