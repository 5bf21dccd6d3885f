"""Bug: parallelize registers a gradient hook that multiplies head.weight's gradient by the world size.

Report: "after moving to FSDP2 the head trains much faster on 2 GPUs than on one; the hook compensated
for an average our old wrapper did not take".
Twin: no hook.
"""

import torch.distributed as dist
from _base import HEALTHY, build_model, loss_fn, make_batch, shard_batch  # noqa: F401
from torch.distributed.fsdp import fully_shard


def parallelize(model, mesh):
    world = dist.get_world_size()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if not HEALTHY:  # the bug: FSDP2 runs post-accumulate hooks on the sharded parameter after its reduce-scatter
        model.head.weight.register_post_accumulate_grad_hook(lambda p: p.grad.mul_(world))
    return model
