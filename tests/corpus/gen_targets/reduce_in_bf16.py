"""Bug: FSDP2 reduces gradients in bfloat16 (MixedPrecisionPolicy(reduce_dtype=bfloat16)) while parameters and the reference are float32.

Report: "parity against the single-GPU run fails at 1e-3 relative error in every tensor; nothing else changed".
Twin: reduce_dtype float32.
"""

import torch
from _base import HEALTHY, build_model, loss_fn, make_batch, shard_batch  # noqa: F401
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def parallelize(model, mesh):
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float32 if HEALTHY else torch.bfloat16)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model
