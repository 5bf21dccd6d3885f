"""Bug: each rank shuffles the whole dataset with a RandomSampler whose generator is seeded
with the same seed on every rank: the same shuffled order everywhere. Twin: DistributedSampler
(shuffle=True, one seed: the same permutation, each rank its own slice), set_epoch each epoch."""

import torch
from _data import BATCH, HEALTHY, dataset
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler


def batches(rank, world_size, epoch):
    ds = dataset()
    if not HEALTHY:
        gen = torch.Generator().manual_seed(42 + epoch)
        return DataLoader(ds, batch_size=BATCH, sampler=RandomSampler(ds, generator=gen))
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=42)
    sampler.set_epoch(epoch)
    return DataLoader(ds, batch_size=BATCH, sampler=sampler)
