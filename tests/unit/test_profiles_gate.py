"""The shipped profiles plan what docs/gate.md promises (configs/ copies: tests/unit/test_config.py)."""

from __future__ import annotations

from distdiag.check.plan import make_plan, parse_config
from distdiag.probes import PROBES


def _names(*argv: str) -> list[str]:
    return make_plan(parse_config(list(argv)), 8).names


def test_gate_quick_full_and_default_suites():
    """gate: env, gpu, collectives, bandwidth; full: every registered probe; quick and default: no bandwidth."""
    assert _names("--profile", "gate") == ["env", "gpu", "collectives", "bandwidth"]
    assert set(_names("--profile", "full")) == set(PROBES)
    assert "bandwidth" not in _names("--profile", "quick")
    assert "bandwidth" not in _names() and "gpu" in _names()


def test_flags_still_override_the_gate_profile():
    """--probes and --skip win over the profile's list; --junit lands in the config."""
    config = parse_config(["--profile", "gate", "--skip", "bandwidth", "--junit", "g.xml"])
    assert make_plan(config, 4).names == ["env", "gpu", "collectives"] and config.junit == "g.xml"
