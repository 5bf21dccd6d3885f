"""Bug: the dataset is sharded by file (files of 40, 30 and 28 samples; rank r takes files r, r + 2, ...): rank 0 gets 68 samples, rank 1 30.

Report: "training hangs at the end of every epoch on 2 GPUs: one rank waits in all_reduce for a batch the other never has".
Twin: the samples split by index (a strided slice of the same length on every rank).
"""

from _base import HEALTHY
from _data import BATCH, dataset
from torch.utils.data import DataLoader, Subset

FILES = [range(0, 40), range(40, 70), range(70, 98)]


def batches(rank, world_size, epoch):
    if HEALTHY:
        n = 98 // world_size
        indices = list(range(rank, n * world_size, world_size))
    else:  # the bug: whole files per rank, of different sizes
        indices = [i for f in FILES[rank::world_size] for i in f]
    return DataLoader(Subset(dataset(), indices), batch_size=BATCH)
