"""Training jobs whose collectives torch issues itself - DDP, FSDP2, a compiled graph - with one fault.

Issue 11: the watchdog must see these from torch's flight recorder, not from Python wrappers.
`train(argv)` is the harness entry (in-code API: `HangWatchdog` around the loop unless
`wd=none`); run as a script (`python -m distdiag.watch -- engine_workers.py ...`) it is an
unchanged user script: no watchdog code at all, steps come from torch's optimizer hook.

Words (key=value):
  kind=ddp|fsdp|compile  the model and loop
  fault=none|uneven|unused|block
      uneven: rank K gets one batch fewer, leaves the loop and writes its checkpoint
      unused: rank K leaves a parameter out of the loss at step S (DDP raises on that rank)
      block:  rank K blocks in data loading at step S (outside any collective)
      op_mismatch (kind=compile): rank K's compiled graph all-gathers where the others all-reduce
  rank=K step=S steps=N timeout=T (watchdog seconds) pg_timeout=T wd=code|none marks=0|1
  healthy variations at step S:  eval=SEC (rank 0 evaluates alone while the others go on to
  the next all-reduce), compute=SEC (every rank computes, no collective), ckpt=SEC (rank 0
  saves inside wd.phase('checkpoint'); in-code only), import=SEC (before building its model,
  rank K imports a module that takes SEC to load, as torch's lazy imports do on a busy CPU,
  while the others wait in DDP's first all_gather)
Each fault is one line with a marker comment, so tests can find its line.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

if __name__ == "__main__":  # run as an unchanged script: the repository root for `tests`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.faults.watchdog_workers import _NoWatchdog  # noqa: E402

__all__ = ["train"]


def _opts(argv: list[str]) -> dict[str, str]:
    out = {"kind": "ddp", "fault": "none", "rank": "1", "step": "2", "steps": "6", "timeout": "3", "wd": "code",
           "marks": "0", "eval": "0", "compute": "0", "ckpt": "0", "step_s": "0.1", "pg_timeout": "120",
           "import": "0"}
    for word in argv:
        key, _, value = word.partition("=")
        out[key] = value
    return out


def _hang_started() -> None:
    """When the fault starts (for the detection-latency benchmark, benchmarks/bench_watchdog.py)."""
    with open("hang_started", "w") as handle:
        handle.write(repr(time.time()))


def load_batch(i: int, o: dict[str, str], me: int, data: list[torch.Tensor]) -> torch.Tensor:
    if o["fault"] == "block" and me == int(o["rank"]) and i == int(o["step"]):
        _hang_started()
        threading.Event().wait()  # FAULT:block (stuck in data loading, outside any collective)
    return data[i]


def save_checkpoint(o: dict[str, str]) -> None:
    _hang_started()
    time.sleep(600)  # FAULT:uneven (the short rank writes its checkpoint while the others still train)


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "ddp":

        class TwoHeads(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.body = torch.nn.Linear(8, 16)
                self.head_a = torch.nn.Linear(16, 1)
                self.head_b = torch.nn.Linear(16, 1)
                self.skip_b = False

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                h = torch.relu(self.body(x))
                if self.skip_b:
                    return self.head_a(h)  # FAULT:unused (head_b gets no gradient on this rank)
                return self.head_a(h) + self.head_b(h)

        return TwoHeads()
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _parallel(kind: str, model: torch.nn.Module) -> torch.nn.Module:
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model)
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _compiled_step() -> Any:
    """A step whose gradient all-reduce is a functional collective inside a compiled graph:
    no Python wrapper sees it; torch's recorder does."""
    import torch.distributed._functional_collectives as funcol

    @torch.compile(backend="eager", fullgraph=True)
    def grad_step(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        g = (x.t() @ (x @ w)) / x.shape[0]
        return funcol.all_reduce(g, "sum", dist.group.WORLD) / dist.get_world_size()

    return grad_step


def _compiled_gather_step() -> Any:
    """The same step where one rank's graph all-gathers instead (a rank-dependent code path)."""
    import torch.distributed._functional_collectives as funcol

    @torch.compile(backend="eager", fullgraph=True)
    def gather_step(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        g = (x.t() @ (x @ w)) / x.shape[0]
        return funcol.all_gather_tensor(g, 0, dist.group.WORLD)[: g.shape[0]]  # FAULT:op_mismatch

    return gather_step


def _slow_import(seconds: float) -> None:
    """Import a module (written to the working directory) whose body takes `seconds`."""
    import importlib
    import tempfile

    folder = tempfile.mkdtemp(prefix="slow_import", dir=".")
    with open(os.path.join(folder, "slow_module.py"), "w") as fh:
        fh.write(f"import time\ntime.sleep({seconds})\n")
    sys.path.insert(0, folder)
    try:
        importlib.import_module("slow_module")
    finally:
        sys.path.remove(folder)


def _loop(o: dict[str, str], wd: Any, me: int, world: int) -> None:
    kind, k, s = o["kind"], int(o["rank"]), int(o["step"])
    steps = int(o["steps"])
    torch.manual_seed(1)
    data = [torch.randn(4, 8) for _ in range(steps * world)]
    mine = data[me::world]
    if o["fault"] == "uneven" and me == k:
        mine = mine[:-1]  # one batch fewer: the dataset does not divide evenly across ranks
    if kind == "compile":
        w = torch.nn.Parameter(torch.zeros(8, 1))
        opt = torch.optim.SGD([w], lr=0.01)
        grad_step = _compiled_step()
    else:
        if float(o["import"]) and me == k:
            _slow_import(float(o["import"]))
        model = _parallel(kind, _model(kind))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(len(mine)):
        if o["marks"] == "1":
            wd.step(i)
        x = load_batch(i, o, me, mine)
        if kind == "compile":
            if o["fault"] == "op_mismatch" and me == k and i == s:
                _hang_started()
                w.grad = _compiled_gather_step()(w.detach(), x)
            else:
                w.grad = grad_step(w.detach(), x)
        else:
            if kind == "ddp":
                model.module.skip_b = o["fault"] == "unused" and me == k and i == s
                if model.module.skip_b:
                    _hang_started()
            model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        if i == s and float(o["eval"]) and me == 0:
            time.sleep(float(o["eval"]))  # healthy: rank 0 evaluates alone; the others wait in the next all-reduce
        if i == s and float(o["compute"]):
            time.sleep(float(o["compute"]))  # healthy: long compute on every rank, no collective
        if i == s and float(o["ckpt"]) and me == 0:
            with wd.phase("checkpoint", timeout=timedelta(seconds=float(o["ckpt"]) * 3)):
                time.sleep(float(o["ckpt"]))  # healthy: a long save declared as a phase
        time.sleep(float(o["step_s"]))
    if o["fault"] == "uneven" and me == k:
        save_checkpoint(o)


def train(argv: list[str]) -> int:
    o = _opts(argv)
    dist.init_process_group("gloo", timeout=timedelta(seconds=float(o["pg_timeout"])))
    me, world = dist.get_rank(), dist.get_world_size()
    if o["wd"] == "none":
        wd: Any = _NoWatchdog()
    else:
        from distdiag import HangWatchdog

        wd = HangWatchdog(timeout=timedelta(seconds=float(o["timeout"])), dump_dir="hang-report")
    with wd:
        _loop(o, wd, me, world)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(train(sys.argv[1:] + ["wd=none"]))
