"""The probe registry: a literal dict, in the default order of the suite."""

from __future__ import annotations

from distdiag.probes.bandwidth import BandwidthProbe
from distdiag.probes.base import ConsolidationView, Probe
from distdiag.probes.collectives import CollectivesProbe
from distdiag.probes.env import EnvProbe
from distdiag.probes.gpu import GpuProbe

__all__ = ["PROBES", "Probe", "ConsolidationView", "get_probe"]

PROBES: dict[str, type[Probe]] = {
    "env": EnvProbe,
    "collectives": CollectivesProbe,
    "gpu": GpuProbe,
    "bandwidth": BandwidthProbe,
}


def get_probe(name: str) -> Probe:
    return PROBES[name]()
