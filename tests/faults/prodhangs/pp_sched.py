"""torch.distributed.pipelining: each rank one stage of a small MLP, ScheduleGPipe (--sched
gpipe) or Schedule1F1B (--sched 1f1b), 4 microbatches. With --mode fault the stage --rank
(default: a middle one) stalls forever in its forward at step --at. Truth: that stage only."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
from _common import FOREVER, args, compute, done, init
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

a = args({"--sched": dict(default="gpipe")})
rank, world = init()
bad = a.rank if a.rank >= 0 else world // 2
state = {"step": 0}


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, x):
        if a.mode == "fault" and rank == bad and state["step"] == a.at:
            time.sleep(FOREVER)  # stuck inside this stage's forward
        compute(5)
        return torch.tanh(self.lin(x))


torch.manual_seed(rank)
stage = PipelineStage(Block(), rank, world, torch.device("cpu"))
loss_fn = lambda out, target: ((out - target) ** 2).mean()  # noqa: E731
Sched = ScheduleGPipe if a.sched == "gpipe" else Schedule1F1B
sched = Sched(stage, n_microbatches=4, loss_fn=loss_fn)
opt = torch.optim.SGD(stage.submod.parameters(), lr=0.01)
for step in range(a.steps):
    state["step"] = step
    x = torch.randn(16, 32)
    y = torch.randn(16, 32)
    if rank == 0:
        sched.step(x)
    elif rank == world - 1:
        sched.step(target=y)
    else:
        sched.step()
    opt.step(); opt.zero_grad()
done()
