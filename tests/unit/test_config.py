"""Config layering and validation: every mistake is one line that names the key and value."""

from __future__ import annotations

from pathlib import Path

import pytest

from distdiag.config import CheckConfig, load_profile, load_toml, merge_config, profile_names
from distdiag.errors import ConfigError
from distdiag.plan import make_plan, parse_config

ROOT = Path(__file__).resolve().parents[2]


def test_profiles_ship_in_package_and_configs_copies_match():
    """Each shipped profile loads, and configs/ holds an identical copy of it."""
    names = profile_names()
    assert {"default", "quick", "full"} <= set(names)
    for name in names:
        load_profile(name)
        shipped = (ROOT / "distdiag" / "profiles" / f"{name}.toml").read_text()
        assert (ROOT / "configs" / f"{name}.toml").read_text() == shipped, name


def test_cli_overrides_config_overrides_profile(tmp_path):
    """Flags beat the --config file, which beats the profile."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('[check]\ntimeout_s = 7\nreport = "x.json"\n')
    config = parse_config(["--profile", "quick", "--config", str(cfg), "--report", "y.json"])
    assert config.timeout_s == 7
    assert config.report == "y.json"
    assert config.probes == ["env", "collectives"]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--timeout-s", "-1"], "check.timeout_s must be a number of seconds > 0, got -1.0"),
        (["--deadline-s", "0"], "check.deadline_s"),
        (["--profile", "nope"], "unknown profile 'nope'"),
        (["--format", "xml"], "invalid choice"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--config", "/nonexistent.toml"], "does not exist"),
    ],
)
def test_bad_flags(argv, words):
    """Bad flags raise ConfigError with one line naming the value."""
    with pytest.raises(ConfigError, match=words) as info:
        parse_config(argv)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[check\n", "not valid TOML"),
        ("[check]\ntimeout = 5\n", "unknown key check.timeout"),
        ("[chek]\n", "unknown table or key 'chek'"),
        ('[check]\nprobes = "env, foo"\n', "unknown probe 'foo'"),
        ("[probes.collectives]\nnumel = -3\n", "probes.collectives.numel must be an integer"),
        ("[probes.collectives]\nsize = 3\n", "unknown key probes.collectives.size"),
        ("[probes.nothing]\nx = 1\n", "probes.nothing: unknown probe"),
        ("[check]\ntimeout_s = \"soon\"\n", "check.timeout_s must be a number"),
    ],
)
def test_bad_config_files(tmp_path, text, words):
    """Malformed TOML, unknown keys and bad values are ConfigErrors naming the dotted key."""
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words):
        make_plan(parse_config(["--config", str(path)]), 4)


def test_world_too_small_is_bad_input_only_when_asked_by_name():
    """collectives needs 2 ranks: asked by name it is an error; by default it is skipped."""
    with pytest.raises(ConfigError, match="WORLD_SIZE must be >= 2 for probe 'collectives', got 1"):
        make_plan(CheckConfig(probes=["collectives"]), 1)
    plan = make_plan(CheckConfig(), 1)
    skipped = {p.probe.name: p.skip_reason for p in plan.probes}
    assert skipped["env"] is None
    assert "WORLD_SIZE must be >= 2" in skipped["collectives"]


def test_skip_and_nothing_to_run():
    """--skip removes probes; skipping everything is bad input."""
    plan = make_plan(CheckConfig(skip=["collectives"]), 2)
    assert "collectives" not in plan.names
    with pytest.raises(ConfigError, match="nothing to run"):
        make_plan(CheckConfig(probes=["env"], skip=["env"]), 2)


def test_load_toml_reads_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[check]\nquiet = true\n")
    assert merge_config([("c", load_toml(path))], {}).quiet is True


def test_probe_with_missing_private_api_skips_with_reason():
    """A private torch API that moved is a skip naming it, not an exception."""
    from distdiag.probes.base import Probe

    class Needs(Probe):
        name = "needs"
        summary = "test"
        private_apis = ("torch.distributed:_no_such_api_anywhere",)

        def run(self, ctx):
            return {}

    reason = Needs().missing_api_reason()
    assert "torch.distributed._no_such_api_anywhere" in reason and "private torch API missing" in reason
    from distdiag.probes import PROBES

    assert all(cls().missing_api_reason() is None for cls in PROBES.values())
