"""Bug: FSDP2 gradient sync switched on at the first micro-step instead of the last.

Two micro-batches per step; set_requires_gradient_sync(True) belongs before the LAST
micro-batch's backward. Here it is on for the first one: the reduce-scatter carries only the
first micro-batch's gradients. Twin: sync on the last micro-step.
"""

from _par_base import workload
from _twin import HEALTHY

_w = workload
build_model, make_batch, shard_batch, loss_fn = _w.build_model, _w.make_batch, _w.shard_batch, _w.loss_fn
MICRO = 2


def train_step(model, batch, optimizer):
    rows = batch["tokens"].shape[0] // MICRO
    total = 0.0
    for i in range(MICRO):
        if hasattr(model, "set_requires_gradient_sync"):  # the reference process has a plain model
            model.set_requires_gradient_sync(i == (MICRO - 1 if HEALTHY else 0))
        micro = {**batch, "tokens": batch["tokens"][i * rows:(i + 1) * rows], "mask": batch["mask"][i * rows:(i + 1) * rows]}
        loss = loss_fn(model, micro)  # token sum x world / global count: micro losses add up to the step's
        loss.backward()
        total += loss.detach()
    optimizer.step()
    return total
