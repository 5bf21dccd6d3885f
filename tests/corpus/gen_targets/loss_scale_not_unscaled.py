"""Bug: a static fp16-style loss scale (x1024) multiplies the loss before backward and is never undone before optimizer.step.

Report: "after porting from apex the effective learning rate is 1000x; the loss explodes in a few steps".
Twin: the gradients divided by the scale before the step.
"""

from _base import HEALTHY, build_model, loss_fn, make_batch, shard_batch  # noqa: F401

SCALE = 1024.0


def train_step(model, batch, optimizer):
    loss = loss_fn(model, batch)
    (loss * SCALE).backward()
    if HEALTHY:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(SCALE)
    optimizer.step()
    return loss
