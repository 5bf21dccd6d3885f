"""Healthy: a model with an integer buffer (BatchNorm's num_batches_tracked) and a frozen layer.

The checkpoint round trip perturbs every tensor before loading it back and makes up Adam
state when the target has no optimizer; neither may be what fails: an integer tensor takes an
integer change, and a frozen parameter gets no optimizer state (as in training).
"""

from torch import nn


def build_model():
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    model[0].requires_grad_(False)  # a frozen embedding-like layer
    return model
