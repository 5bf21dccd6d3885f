"""Bug: the training loop's DataLoader has no DistributedSampler: every rank iterates the whole
dataset in the same order. Twin: DistributedSampler(num_replicas=world_size, rank=rank)."""

from _data import BATCH, HEALTHY, dataset
from torch.utils.data import DataLoader, DistributedSampler


def batches(rank, world_size, epoch):
    ds = dataset()
    if not HEALTHY:
        return DataLoader(ds, batch_size=BATCH)
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=False)
    return DataLoader(ds, batch_size=BATCH, sampler=sampler)
