"""Bug: a DDP communication hook that all-reduces (sums) gradient buckets and forgets to divide.

A custom comm hook replaces DDP's averaging: the gradients come out as the SUM over ranks.
Twin: the same hook dividing by the world size first (what DDP's default does).
"""

import torch.distributed as dist
from _par_base import workload
from _twin import HEALTHY
from torch.nn.parallel import DistributedDataParallel as DDP

_w = workload
build_model, make_batch, shard_batch, loss_fn = _w.build_model, _w.make_batch, _w.shard_batch, _w.loss_fn


def _allreduce_hook(group, bucket):
    buffer = bucket.buffer()
    if HEALTHY:
        buffer.div_(dist.get_world_size(group))
    # the bug (without the division): the sum of the ranks' gradients, not their average
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def parallelize(model, mesh):
    ddp = DDP(model, process_group=mesh.get_group())
    ddp.register_comm_hook(mesh.get_group(), _allreduce_hook)
    return ddp
