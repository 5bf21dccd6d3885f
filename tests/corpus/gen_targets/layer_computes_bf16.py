"""Bug: layers.1 is sharded with a bfloat16 param_dtype (a copy-pasted MixedPrecisionPolicy) while the model and reference are float32.

Report: "one transformer block shows 1e-3 relative differences against the single-GPU run, the rest match".
Twin: float32 param_dtype for every layer.
"""

import torch
from _base import HEALTHY, build_model, loss_fn, make_batch, shard_batch  # noqa: F401
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def parallelize(model, mesh):
    for i, layer in enumerate(model.layers):
        low = not HEALTHY and i == 1
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if low else torch.float32, output_dtype=torch.float32)
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh)
    return model
