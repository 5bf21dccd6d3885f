"""The probe registry: a literal dict, in the default order of the suite."""

from __future__ import annotations

from distdiag.probes.bandwidth import BandwidthProbe
from distdiag.probes.base import ConsolidationView, Probe
from distdiag.probes.checkpoint import CheckpointProbe
from distdiag.probes.collectives import CollectivesProbe
from distdiag.probes.determinism import DeterminismProbe
from distdiag.probes.env import EnvProbe
from distdiag.probes.fsdp_plan import FsdpPlanProbe
from distdiag.probes.gpu import GpuProbe
from distdiag.probes.loss_parity import LossParityProbe
from distdiag.probes.moe_routing import MoeRoutingProbe
from distdiag.probes.param_sync import ParamSyncProbe
from distdiag.probes.sequence_parallel import SequenceParallelProbe

__all__ = ["PROBES", "Probe", "ConsolidationView", "get_probe"]

PROBES: dict[str, type[Probe]] = {
    "env": EnvProbe,
    "collectives": CollectivesProbe,
    "gpu": GpuProbe,
    "bandwidth": BandwidthProbe,
    "fsdp_plan": FsdpPlanProbe,
    "loss_parity": LossParityProbe,
    "param_sync": ParamSyncProbe,
    "determinism": DeterminismProbe,
    "sequence_parallel": SequenceParallelProbe,
    "moe_routing": MoeRoutingProbe,
    "checkpoint": CheckpointProbe,
}


def get_probe(name: str) -> Probe:
    return PROBES[name]()
