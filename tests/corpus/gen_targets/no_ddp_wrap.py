"""Bug: parallelize returns the bare model when a config flag is off (the DDP/FSDP wrap was behind `--distributed`): nothing reduces gradients.

Report: "each rank's weights drift apart; 2-GPU training is no better than 1 GPU on half the data".
Twin: the model wrapped in DDP.
"""

from _base import HEALTHY, build_model, loss_fn, make_batch, shard_batch  # noqa: F401
from torch.nn.parallel import DistributedDataParallel


def parallelize(model, mesh):
    if HEALTHY:
        return DistributedDataParallel(model)
    return model  # the bug: no wrapper, no gradient reduction
