"""Bug: a hand-written strided split that forgets the stride: rank r takes range(r, N) instead
of range(r, N, world_size), so the ranks' samples are shifted copies of each other.
Twin: range(r, N, world_size)."""

from _data import BATCH, HEALTHY, SAMPLES, dataset
from torch.utils.data import DataLoader, Subset


def batches(rank, world_size, epoch):
    step = world_size if HEALTHY else 1
    return DataLoader(Subset(dataset(), range(rank, SAMPLES, step)), batch_size=BATCH)
