"""Bug: the model is built on meta (deferred init) and materialised block by block after
fully_shard, but the head is forgotten: it stays on meta. Twin: to_empty on the root, then
every parameter initialised."""

import torch
from _common import HEALTHY, Net, loss_fn, make_batch  # noqa: F401
from torch.distributed.fsdp import fully_shard


def build_model():
    with torch.device("meta"):
        return Net()


def _init(module):
    with torch.no_grad():
        for p in module.parameters():
            p.to_local().normal_(0, 0.1) if hasattr(p, "to_local") else p.normal_(0, 0.1)
        for name, b in module.named_buffers():
            local = b.to_local() if hasattr(b, "to_local") else b
            local.fill_(1.0 if name.endswith("running_var") else 0.0)


def parallelize(model, mesh):
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    parts = [model] if HEALTHY else [model.frozen, model.norm, *model.blocks]
    for part in parts:
        part.to_empty(device="cpu")
        _init(part)
