"""Rank entry for tests/dist/test_monitor_dist.py: a small DDP loop with an injected fault.

argv: SCENARIO WORKDIR. Scenarios:
  fwd_nan   rank 1's module `body.1` multiplies its output by NaN from step 7 on
  bwd_nan   rank 0's module `body.1` returns a NaN input-gradient from step 7 on (forward clean)
  param_drift  3+ ranks, no DDP: grads all-reduced by hand, but the last rank's parameters are
            nudged at step 3, so replicas differ
  hand_reduce  param_drift's twin: the same no-DDP loop and hand all-reduce, nothing nudged
  healthy   the same loop with nothing injected (the healthy twin)
  late_nan  rank 1's loss is NaN at step 22 only, after the last look (at 20): close() finds it
  close_apart  healthy, but rank 1 reaches close() CLOSE_WAIT_S + 2 s after rank 0: both skip
            close()'s last look instead of one waiting alone in its all_reduce
Each rank writes its findings as JSON to WORKDIR/findings{rank}.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from distdiag.monitor import TrainingMonitor


class _NanGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class Faulty(torch.nn.Module):
    """Identity, unless switched on: then NaN in its forward (mode fwd) or backward (mode bwd)."""

    def __init__(self) -> None:
        super().__init__()
        self.mode = ""

    def forward(self, x):
        if self.mode == "fwd":
            return x * float("nan")
        if self.mode == "bwd":
            return _NanGrad.apply(x)
        return x


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 32)
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 32), Faulty(), torch.nn.Tanh(), torch.nn.Linear(32, 32))
        self.head = torch.nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.body(torch.relu(self.embed(x))))


def main(argv: list[str]) -> int:
    scenario, workdir = argv[0], argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        torch.manual_seed(0)
        net = Net()
        hand = scenario in ("param_drift", "hand_reduce")
        model = net if hand else torch.nn.parallel.DistributedDataParallel(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        monitor = TrainingMonitor(model, optimizer=opt, every=5, log=os.path.join(workdir, "metrics.jsonl"))
        gen = torch.Generator().manual_seed(100 + rank)
        for step in range(24):
            if scenario == "fwd_nan" and rank == 1 and step >= 7:
                net.body[1].mode = "fwd"
            if scenario == "bwd_nan" and rank == 0 and step >= 7:
                net.body[1].mode = "bwd"
            x = torch.randn(16, 8, generator=gen)
            y = x.sum(1, keepdim=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            if scenario == "late_nan" and rank == 1 and step == 22:
                loss = loss * float("nan")
            loss.backward()
            if hand:
                for p in net.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
            monitor.after_backward(loss, step)
            # skip updates with non-finite gradients, as GradScaler does: parameters stay finite
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e3)
            if torch.isfinite(norm):
                opt.step()
            opt.zero_grad()
            if scenario == "param_drift" and step == 3 and rank == world - 1:
                with torch.no_grad():
                    net.head.weight.add_(0.5)
        if scenario == "close_apart" and rank == 1:
            import time

            from distdiag.monitor.monitor import CLOSE_WAIT_S

            time.sleep(CLOSE_WAIT_S + 2)
        findings = [f.to_dict() for f in monitor.close()]
        dist.barrier()
        with open(os.path.join(workdir, f"findings{rank}.json"), "w") as fh:
            json.dump(findings, fh)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
