"""Bug: a DistributedSampler with shuffle=True, but the loop never calls set_epoch: every epoch
repeats epoch 0's order. Twin: sampler.set_epoch(epoch) at the start of each epoch."""

from _data import BATCH, HEALTHY, dataset
from torch.utils.data import DataLoader, DistributedSampler


def batches(rank, world_size, epoch):
    ds = dataset()
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    if HEALTHY:
        sampler.set_epoch(epoch)
    return DataLoader(ds, batch_size=BATCH, sampler=sampler)
