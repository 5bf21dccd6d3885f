"""Bug: on two nodes the DistributedSampler gets the node's LOCAL_RANK and LOCAL_WORLD_SIZE (copied
from a one-node script), so rank r and rank r + local world size (the same local rank on the other
node) read the same slice. Twin: the global RANK and WORLD_SIZE (the hook's own arguments)."""

import os

from _data import BATCH, HEALTHY, dataset
from torch.utils.data import DataLoader, DistributedSampler


def batches(rank, world_size, epoch):
    ds = dataset()
    if HEALTHY:
        sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    else:
        local, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
        sampler = DistributedSampler(ds, num_replicas=local_world, rank=local, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return DataLoader(ds, batch_size=BATCH, sampler=sampler)
