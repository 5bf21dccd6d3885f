"""A target whose rank 0 cannot decode torch's object collectives (numpy missing there).

What a user hit: DCP's save raised "Numpy is not available" on its coordinator, rank 0,
inside gather_object, while ranks 1-3 waited in scatter_object_list. Here torch's object
decoding is made to raise the same way on rank 0 only, so the library raises, not distdiag.
"""

import os

import torch
import torch.distributed.distributed_c10d as c10d

if os.environ.get("RANK") == "0":

    def _tensor_to_object(*args, **kwargs):
        raise RuntimeError("Numpy is not available")

    c10d._tensor_to_object = _tensor_to_object


def build_model():
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
