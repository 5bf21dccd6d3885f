"""Bug: train_step's gradient accumulation calls `optimizer.zero_grad()` at the top of every micro-batch instead of once before the loop: each micro-batch's backward starts from cleared gradients, so the optimizer steps with the last micro-batch's gradient only.

Report: "optimizer.zero_grad(set_to_none=True) is called inside the inner loop, so gradients are cleared
every microbatch instead of being accumulated" (bytetriper/RAE issue #67); "we call it at the wrong place
(fwd/bwd instead of optimizer step), zeroing grad from all micro-batches except the last one, i.e. no
accumulation" (pytorch/torchtitan pull request #3575); huggingface/accelerate issue #1299 (zero_grad at the
start of each iteration discards the accumulated gradient). Symptom: "with 2 micro-batches per step the
2-GPU run no longer matches 1 GPU on the same global batch; the loss at step 1 matches".
Twin: one `zero_grad()` before the accumulation loop (the micro-batch losses, each over the global count,
sum to the global batch's loss).
"""

from _base import HEALTHY, build_model, loss_fn, make_batch, shard_batch  # noqa: F401

MICRO = 2


def train_step(model, batch, optimizer):
    rows = batch["tokens"].shape[0]
    total = 0.0
    if HEALTHY:
        optimizer.zero_grad(set_to_none=True)
    for i in range(MICRO):
        if not HEALTHY:
            optimizer.zero_grad(set_to_none=True)  # the bug: clears what the earlier micro-batches accumulated
        part = {k: (v[i * rows // MICRO:(i + 1) * rows // MICRO] if hasattr(v, "shape") and v.dim() else v)
                for k, v in batch.items()}
        loss = loss_fn(model, part)
        loss.backward()
        total += float(loss.detach())
    optimizer.step()
    return total
