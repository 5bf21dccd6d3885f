"""Bug: DistributedSampler(drop_last=...) from a per-node flag: rank 0 pads its share to 25 batches' worth, rank 1 drops to 24.

Report: "the last step of each epoch hangs on one node only after we changed drop_last in the node config".
Twin: drop_last=True on every rank.
"""

from _base import HEALTHY, RANK
from _data import dataset
from torch.utils.data import DataLoader, DistributedSampler

SAMPLES = 97  # an odd dataset: padding and dropping give different shares


def batches(rank, world_size, epoch):
    data = dataset()
    data = type(data)(*(t[:SAMPLES] for t in data.tensors))
    drop = True if HEALTHY else RANK == 1
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=False, drop_last=drop)
    return DataLoader(data, batch_size=2, sampler=sampler)
