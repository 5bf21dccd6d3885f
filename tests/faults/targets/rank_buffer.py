"""Bug: a buffer initialised differently on each rank (from the rank number)."""

from _twin import HEALTHY, RANK

from distdiag.workloads import get_workload

_w = get_workload("transformer", batch=12)  # splits across 2 or 3 ranks
make_batch, loss_fn, shard_batch = _w.make_batch, _w.loss_fn, _w.shard_batch


def build_model():
    model = _w.build_model()
    if not HEALTHY:
        model.scale.fill_(1.0 + 0.25 * RANK)
    return model
