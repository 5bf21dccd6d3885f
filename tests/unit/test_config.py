"""Config layering and validation: every mistake is one line that names the key and value."""

from __future__ import annotations

from pathlib import Path

import pytest

from distdiag.check.config import CheckConfig, load_profile, load_toml, merge_config, profile_names
from distdiag.check.plan import make_plan, parse_config
from distdiag.errors import ConfigError

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
        (["--timeout-s", "-1"], r"check.timeout_s must be a number of seconds > 0 and at most 604800 \(one week\), got -1.0"),
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


def test_binary_config_file_is_one_line(tmp_path):
    """A config file that is not UTF-8 (a binary picked by mistake) is a ConfigError, not a traceback."""
    path = tmp_path / "model.bin"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(byte 0x89 at offset 0\)") as info:
        parse_config(["--config", str(path)])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("flag", ["--timeout-s", "--deadline-s"])
@pytest.mark.parametrize("value", ["1e300", "604801", "inf", "nan"])
def test_timeouts_have_an_upper_bound(flag, value):
    """Huge timeouts overflow torch's C int timeouts on every rank: rejected up front, the bound in the message."""
    key = flag[2:].replace("-", "_")
    with pytest.raises(ConfigError, match=rf"check\.{key} must be a number of seconds > 0 and at most 604800 \(one week\)"):
        parse_config([flag, value])


def test_a_week_is_accepted():
    assert parse_config(["--timeout-s", "604800", "--deadline-s", "604800"]).deadline_s == 604800


@pytest.mark.parametrize("value", ["-1", '"ten"'])
def test_bad_value_overridden_by_a_flag_is_still_an_error(tmp_path, value):
    """`[check] timeout_s = -1` in the file is reported even when --timeout-s overrides it."""
    path = tmp_path / "c.toml"
    path.write_text(f"[check]\ntimeout_s = {value}\n")
    with pytest.raises(ConfigError, match=rf"^{path}: check\.timeout_s must be a number of seconds"):
        parse_config(["--config", str(path), "--timeout-s", "10"])


def test_bad_value_overridden_by_a_later_layer_is_still_an_error():
    """Every layer is validated as merged, not only the result."""
    with pytest.raises(ConfigError, match="^low: check.deadline_s"):
        merge_config([("low", {"check": {"deadline_s": 0}}), ("high", {"check": {"deadline_s": 5}})], {})
    from distdiag.check.plan import validate_names_and_options

    with pytest.raises(ConfigError, match="^low: check.probes: unknown probe 'nope'"):
        merge_config([("low", {"check": {"probes": ["nope"]}})], {"probes": "env"}, validate=validate_names_and_options)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('[probes.bandwidth]\nsizes = ["abc"]\n', "probes.bandwidth.sizes: cannot read size 'abc'"),
        ("[probes.bandwidth]\nbogus = 1\n", "unknown key probes.bandwidth.bogus"),
        ("[probes.collectives]\nnumel = -3\n", "probes.collectives.numel must be an integer"),
    ],
)
def test_options_of_a_probe_that_does_not_run_are_validated(tmp_path, text, words):
    """bandwidth is opt-in and collectives is skipped here, yet their tables are checked."""
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words):
        parse_config(["--config", str(path), "--probes", "env"])
