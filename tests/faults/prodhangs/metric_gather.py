"""A trainer's own metric sync (torchmetrics-like): each rank accumulates (sum, count) of its
validation loss and all_gathers the state; a rank that computed no metric skips the sync
('nothing to sync'). --mode fault: rank --rank (default 1) saw no validation batch at step
--at (its shard of a tiny eval set is empty) and skips. Truth: that rank."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import torch.distributed as dist
from _common import args, compute, done, init, model


class MeanMetric:
    def __init__(self):
        self.total, self.count = torch.zeros(1), torch.zeros(1)

    def update(self, v):
        self.total += v; self.count += 1

    def compute(self):
        if self.count.item() == 0:
            return None                      # the bug: a rank with no update skips the sync
        out_t = [torch.zeros(1) for _ in range(dist.get_world_size())]
        out_c = [torch.zeros(1) for _ in range(dist.get_world_size())]
        dist.all_gather(out_t, self.total)
        dist.all_gather(out_c, self.count)
        return (sum(out_t) / sum(out_c).clamp(min=1)).item()


a = args()
a.rank = a.rank if a.rank >= 0 else 1
rank, world = init()
m, opt = model(0)
for step in range(a.steps):
    compute(20)
    m(torch.randn(8, 16)).pow(2).mean().backward()
    for p in m.parameters():
        dist.all_reduce(p.grad)
    opt.step(); opt.zero_grad()
    metric = MeanMetric()
    n_val = 0 if (a.mode == "fault" and rank == a.rank and step == a.at) else 2
    with torch.no_grad():
        for _ in range(n_val):
            metric.update(m(torch.randn(4, 16)).pow(2).mean())
    val = metric.compute()
done()
