"""Config of `distdiag.check` from its command line (options: distdiag.check.options), and the
plan of probes to run."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from distdiag.check.config import CheckConfig, dataclass_from_dict, layered_config
from distdiag.check.options import build_parser
from distdiag.errors import ConfigError, did_you_mean
from distdiag.probes import PROBES, Probe

__all__ = [
    "Plan",
    "build_parser",
    "parse_config",
    "config_from_args",
    "make_plan",
    "validate_injection",
    "validate_names_and_options",
]


def parse_config(argv: list[str]) -> CheckConfig:
    """Every rank's command line -> the validated config (ConfigError on any mistake)."""
    return config_from_args(build_parser().parse_args(argv))


def config_from_args(args: argparse.Namespace) -> CheckConfig:
    """Parsed options (of either front end, see distdiag.check.options) -> the validated config."""
    return layered_config(args, validate=validate_names_and_options)


def validate_names_and_options(config: CheckConfig) -> None:
    """What a config says must hold whatever runs: every probe it names exists, and every
    `[probes.NAME]` table is valid for its probe, run or not (bandwidth is opt-in, yet a bad
    `[probes.bandwidth]` table is still a mistake the user wants to hear about)."""
    known = ", ".join(PROBES)
    for key, names in (("check.probes", [] if config.probes == ["all"] else config.probes or []), ("check.skip", config.skip)):
        for name in names:
            if name not in PROBES:
                raise ConfigError(f"{key}: unknown probe {name!r}{did_you_mean(name, PROBES)}; available: {known}")
    for name, opts in config.probe_options.items():
        if name not in PROBES:
            raise ConfigError(f"probes.{name}: unknown probe {name!r}{did_you_mean(name, PROBES)}; available: {known}")
        _probe_options(PROBES[name], opts, name)


def validate_injection(world_size: int | None) -> None:
    """DISTDIAG_INJECT is bad input when malformed or when it names a rank outside the job (with
    `world_size`) or a point that is no probe, `setup` or `final`: that fault would never fire
    and the run would pass as if it had been tested."""
    from distdiag.runtime.faults import FaultPlan

    FaultPlan.from_env(0, world_size=world_size, points=[*PROBES, "setup", "final"])


def _probe_options(cls: type[Probe], opts: dict[str, Any], name: str) -> object:
    if cls.Config is not None:
        return dataclass_from_dict(cls.Config, opts, f"probes.{name}")
    if opts:
        raise ConfigError(f"probes.{name} takes no options, got {sorted(opts)}")
    return None


@dataclass
class PlannedProbe:
    probe: Probe
    options: object
    """The probe's validated Config dataclass, or None."""
    skip_reason: str | None = None
    """Set when the probe does not apply to this world (listed as skipped, never run)."""


@dataclass
class Plan:
    config: CheckConfig
    probes: list[PlannedProbe] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [p.probe.name for p in self.probes]


def make_plan(config: CheckConfig, world_size: int) -> Plan:
    """Which probes run, with their options. Every problem is a ConfigError, the same on every rank."""
    known = ", ".join(PROBES)
    every = config.probes == ["all"]  # `probes = ["all"]` (the full profile): opt-in probes too
    requested = None if every else config.probes
    for name in (requested or []) + config.skip:
        if name not in PROBES:
            raise ConfigError(f"unknown probe {name!r}{did_you_mean(name, PROBES)}; available: {known}")
    for name in config.probe_options:
        if name not in PROBES:
            raise ConfigError(f"probes.{name}: unknown probe {name!r}{did_you_mean(name, PROBES)}; available: {known}")
    explicit = requested is not None
    # Probes with default_enabled = False (slow ones, e.g. bandwidth) run only when a profile
    # or --probes names them.
    names = list(dict.fromkeys(requested if requested is not None else [n for n, p in PROBES.items() if p.default_enabled or every]))
    plan = Plan(config)
    for name in names:
        if name in config.skip:
            continue
        probe = PROBES[name]()
        options = _probe_options(PROBES[name], config.probe_options.get(name, {}), name)
        bad = probe.options_problem(options, world_size)
        if bad:
            raise ConfigError(bad)
        problem = probe.world_problem(world_size)
        if problem and explicit:
            raise ConfigError(problem)
        plan.probes.append(PlannedProbe(probe, options, problem))
    if not any(p.skip_reason is None for p in plan.probes):
        raise ConfigError(
            f"nothing to run: every selected probe was skipped or does not apply to a world of {world_size}"
        )
    return plan
