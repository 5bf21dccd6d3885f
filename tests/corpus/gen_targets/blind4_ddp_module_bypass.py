"""Bug: the model is wrapped in DistributedDataParallel, but loss_fn runs the forward through `model.module` (to reach the unwrapped model's own methods): DDP's forward, which arms the reducer for the backward, never runs, so no gradient is ever all-reduced. Each rank steps on the gradient of its own rows, silently.

Report: "wrap the policy in `DistributedDataParallel`, but then run the loss-bearing forward pass through
`.module`, bypassing the wrapper. As a result `backward()` performs no gradient all-reduce, and multi-GPU RL
training silently degrades to single-GPU training on 1/N of the data" (jingyaogong/minimind issue #853, fix
pull request #854); "if you return a tensor and want to call backward on it, DDP won't reduce the gradients"
(Lightning-AI/pytorch-lightning pull request #17424, step methods bypassing the DDP wrapper);
facebookresearch/pytext pull request #537 ("This skips the call to DDP model's forward call and breaks
distributed training"). Symptom: "replicas silently diverge; the 2-GPU run matches 1 GPU in the loss at step 1
but not after".
Twin: loss_fn calls the wrapper itself (`model(...)`), so DDP reduces the gradients.
"""

from _base import HEALTHY, build_model, make_batch, shard_batch  # noqa: F401
from _base import loss_fn as _loss_fn
from torch.nn.parallel import DistributedDataParallel


def parallelize(model, mesh):
    return DistributedDataParallel(model)


def loss_fn(model, batch):
    if not HEALTHY and isinstance(model, DistributedDataParallel):
        model = model.module  # the bug: the unwrapped model, DDP's forward (and its reduction) skipped
    return _loss_fn(model, batch)
