"""Bad input: build_model returns a dict instead of an nn.Module."""

from distdiag.workloads import get_workload

_w = get_workload("mlp")
make_batch = _w.make_batch


def build_model():
    return {"model": _w.build_model()}
