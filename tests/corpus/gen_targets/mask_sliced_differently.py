"""Bug: shard_batch takes the tokens with a strided slice (rows rank::world) but the mask with a contiguous one.

Report: "2-GPU loss differs from 1-GPU; padding seems to be counted on some rows and real tokens masked on others".
Twin: the same strided slice for both.
"""

from _base import HEALTHY, build_model, loss_fn, make_batch  # noqa: F401


def shard_batch(batch, rank, world_size):
    rows = batch["tokens"].shape[0]
    n = rows // world_size
    mask = batch["mask"][rank::world_size] if HEALTHY else batch["mask"][rank * n:(rank + 1) * n]  # the bug
    return {"tokens": batch["tokens"][rank::world_size], "mask": mask, "world_size": world_size,
            "global_count": int(batch["mask"].sum())}
