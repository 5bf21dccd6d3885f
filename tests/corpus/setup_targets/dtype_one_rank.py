"""Bug: the head is cast to float16 inside a rank-dependent branch (a debugging leftover:
rank 1 "saves memory"), so ranks hold different dtypes. Twin: no cast."""

from _common import HEALTHY, RANK, Net, loss_fn, make_batch  # noqa: F401


def build_model():
    model = Net()
    if not HEALTHY and RANK == 1:
        model.head.half()
    return model
