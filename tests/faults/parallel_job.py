"""A healthy job of the shapes users run, for `distdiag watch` to leave alone (the wrapper must
not change what the job does): `mode=tp2d` a 2-D FSDP2 + tensor-parallel MLP (init_device_mesh dp x tp,
parallelize_module, fully_shard), `mode=titan` a torchtitan-style parallelize (a plan per block,
fully_shard per block, then the root) whose first call imports dynamo and inductor after the
watchdog is armed, `mode=compiled` a torch.compile'd model under DDP. Every mode records what
distdiag's threads import (an audit hook) and prints `THREAD-IMPORT name module` for each: they must
import nothing (a thread of ours importing beside the training thread's first import of inductor
once crashed the user's parallelize_module with "partially initialized module").
"""

from __future__ import annotations

import os
import sys
import threading


def _audit(event: str, args: tuple) -> None:
    if event == "import" and threading.current_thread().name.startswith("distdiag"):
        os.write(2, f"THREAD-IMPORT {threading.current_thread().name} {args[0]}\n".encode())


sys.addaudithook(_audit)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def _mesh_model(titan: bool) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
    model = nn.Sequential(Block(), Block()) if titan else Block()
    blocks = list(model) if titan else [model]
    for block in blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        if titan:
            fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def main() -> None:
    mode = dict(a.split("=", 1) for a in sys.argv[1:]).get("mode", "tp2d")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    if mode == "compiled":
        from torch.nn.parallel import DistributedDataParallel

        model: nn.Module = torch.compile(DistributedDataParallel(Block()), backend="aot_eager")
    else:
        model = _mesh_model(titan=mode == "titan")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        loss = model(torch.randn(4, 16)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank done {mode}", flush=True)


if __name__ == "__main__":
    main()
