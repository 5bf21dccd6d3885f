"""Bug: DistributedSampler(seed=base_seed + rank): each rank shuffles with its own seed, so the ranks' strided slices overlap.

Report: "some samples are seen twice per epoch and others never; we seed everything with seed + rank".
Twin: one seed on every rank.
"""

from _base import HEALTHY, RANK  # noqa: F401
from _data import BATCH, dataset
from torch.utils.data import DataLoader, DistributedSampler


def batches(rank, world_size, epoch):
    sampler = DistributedSampler(dataset(), num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=17 if HEALTHY else 17 + rank)
    sampler.set_epoch(epoch)
    return DataLoader(dataset(), batch_size=BATCH, sampler=sampler)
