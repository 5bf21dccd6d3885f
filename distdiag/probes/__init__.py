"""The probes and their registry: a literal dict, in the default order of the suite.

    base.py             Probe (the contract every probe follows), ConsolidationView, helpers
    training.py         building, sharding and stepping a model: shared by every probe that trains
    cluster/            env, collectives, bandwidth, gpu: is the cluster fit for the job?
    numerics/           setup_sync, fsdp_plan, loss_parity, param_sync, determinism: are the numbers right?
    sequence_parallel/  does the user's sequence split lose or shift tokens?
    data/               data_shards: do the ranks see different samples?
    moe/                is the MoE router deterministic and its dispatch consistent?
    checkpoint/         does a DCP round trip give back every key, shape and value?

One probe, one family folder with its helpers beside it. Probes may import distdiag.report,
distdiag.errors, distdiag.workloads and each other's family helpers through
distdiag.probes.training only; never the check, the runtime's internals or the CLI.
"""

from __future__ import annotations

from distdiag.probes.base import ConsolidationView, Probe
from distdiag.probes.checkpoint.probe import CheckpointProbe
from distdiag.probes.cluster.bandwidth import BandwidthProbe
from distdiag.probes.cluster.collectives import CollectivesProbe
from distdiag.probes.cluster.env import EnvProbe
from distdiag.probes.cluster.gpu import GpuProbe
from distdiag.probes.data.probe import DataShardsProbe
from distdiag.probes.moe.probe import MoeRoutingProbe
from distdiag.probes.numerics.determinism import DeterminismProbe
from distdiag.probes.numerics.fsdp_plan import FsdpPlanProbe
from distdiag.probes.numerics.loss_parity import LossParityProbe
from distdiag.probes.numerics.param_sync import ParamSyncProbe
from distdiag.probes.numerics.setup_sync import SetupSyncProbe
from distdiag.probes.sequence_parallel.probe import SequenceParallelProbe

__all__ = ["PROBES", "Probe", "ConsolidationView", "get_probe"]

PROBES: dict[str, type[Probe]] = {
    "env": EnvProbe,
    "collectives": CollectivesProbe,
    "gpu": GpuProbe,
    "bandwidth": BandwidthProbe,
    "setup_sync": SetupSyncProbe,
    "data_shards": DataShardsProbe,
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
