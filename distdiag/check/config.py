"""Check configuration: defaults < profile < --config file < command-line flags.

Every field is validated in `__post_init__` with a one-line message that names the dotted
key, the value and the valid range; the check turns it into exit code 2 on every rank.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from distdiag.errors import ConfigError, did_you_mean, shown

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = [
    "CheckConfig",
    "load_toml",
    "load_profile",
    "profile_names",
    "merge_config",
    "layered_config",
    "check_output_paths",
    "dataclass_from_dict",
]

FORMATS = ("text", "json")
BACKENDS = ("auto", "nccl", "gloo")
"""--backend (distdiag.runtime.context.BACKENDS, which this module may not import: no torch here)."""

MAX_PROBE_NAMES = 256
"""At most this many names in `probes`/`skip` (there are a dozen probes; a list of thousands is a
mistake, and checking it would cost every rank)."""

MAX_SECONDS = 7 * 24 * 3600
"""Upper bound of every timeout and deadline (one week): larger values overflow the store's and
the process group's C int/duration timeouts, so every rank would die instead of waiting."""


@dataclass
class CheckConfig:
    """What `distdiag.check` runs and how; the `[check]` table of a config file."""

    probes: list[str] | None = None
    """Probes to run, in order; None runs every probe that applies to this world."""
    skip: list[str] = field(default_factory=list)
    """Probes to leave out."""
    timeout_s: float = 60.0
    """Deadline of one probe on every rank, in seconds; past it the run ends as a hang."""
    deadline_s: float = 600.0
    """Deadline of the whole check, in seconds."""
    report: str = "distdiag-report.json"
    """Where rank 0 (or whichever rank writes it) puts the JSON report."""
    format: str = "text"
    """text: the table on stdout; json: the report on stdout."""
    quiet: bool = False
    """Print only the verdict line (text format)."""
    verbose: bool = False
    """Text format: also print info findings and every probe's detail tables (by default a
    probe's tables are shown only when it has a warning or worse; the JSON report has all)."""
    target: str | None = None
    """The user's target: a module name or a .py file exposing hook functions."""
    junit: str | None = None
    """Also write the verdict as JUnit XML here (for CI systems and schedulers); None: don't."""
    backend: str = "auto"
    """The main process group's backend: auto (NCCL on each rank's GPU when CUDA is present, else
    gloo), nccl, or gloo (the CPU, even where CUDA is visible: a check of the CPU path on a GPU
    node, or more ranks than GPUs)."""
    probe_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per-probe options, the `[probes.NAME]` tables; each probe validates its own."""

    def __post_init__(self) -> None:
        if self.probes is not None:
            self.probes = _str_list("check.probes", self.probes)
        self.skip = _str_list("check.skip", self.skip)
        self.timeout_s = _positive("check.timeout_s", self.timeout_s)
        self.deadline_s = _positive("check.deadline_s", self.deadline_s)
        if not isinstance(self.report, str) or not self.report:
            raise ConfigError(f"check.report must be a file path, got {self.report!r}")
        if self.format not in FORMATS:
            raise ConfigError(f"check.format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        for key in ("quiet", "verbose"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"check.{key} must be true or false, got {getattr(self, key)!r}")
        if self.target is not None and (not isinstance(self.target, str) or not self.target):
            raise ConfigError(f"check.target must be a module name or a .py path, got {self.target!r}")
        if self.junit is not None and (not isinstance(self.junit, str) or not self.junit):
            raise ConfigError(f"check.junit must be a file path, got {self.junit!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"check.backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not isinstance(self.probe_options, dict):
            raise ConfigError("[probes] must be a table of per-probe tables")
        for name, opts in self.probe_options.items():
            if not isinstance(opts, dict):
                raise ConfigError(f"probes.{name} must be a table, got {opts!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


T = TypeVar("T", bound="DataclassInstance")

def _str_list(key: str, value: object) -> list[str]:
    if isinstance(value, str):
        if len(value) > MAX_PROBE_NAMES * 64:
            raise ConfigError(f"{key} is {len(value)} characters long; name the probes to run (distdiag probes lists them)")
        value = [v for v in (s.strip() for s in value.split(",")) if v]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{key} must be a list of probe names, got {shown(value)}")
    if len(value) > MAX_PROBE_NAMES:
        raise ConfigError(f"{key} names {len(value)} probes, at most {MAX_PROBE_NAMES}; name each probe once")
    return list(value)


def _positive(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_SECONDS:
        raise ConfigError(
            f"{key} must be a number of seconds > 0 and at most {MAX_SECONDS} (one week), got {shown(value)}"
        )
    return float(value)


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file; a missing, malformed, non-regular (FIFO, device) or oversized file,
    or one nested too deeply to parse, is a ConfigError of one line naming it."""
    from distdiag.report.safefile import MAX_CONFIG_BYTES, RefusedFile, read_bytes_limited

    target = Path(path)
    try:
        return tomllib.loads(read_bytes_limited(target, MAX_CONFIG_BYTES, "a TOML config file").decode("utf-8"))
    except RefusedFile as exc:
        raise ConfigError(f"config file {exc}") from None
    except FileNotFoundError:
        raise ConfigError(f"config file {target} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {target} is not valid TOML: {exc}") from None
    except RecursionError:  # tomllib recurses once per nested array or inline table
        raise ConfigError(f"config file {target} nests arrays or tables too deeply to be a config") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {target} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
            "pass a TOML file"
        ) from None
    except ValueError as exc:  # an integer past Python's digit limit (tomllib calls int() on it)
        raise ConfigError(f"config file {target} holds a number too long to be a setting: {exc}".split(";")[0]) from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {target}: {exc.strerror}") from None


def profile_names() -> list[str]:
    """Profiles shipped inside the package (distdiag/profiles/*.toml)."""
    folder = resources.files("distdiag") / "profiles"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".toml"))


def load_profile(name: str) -> dict[str, Any]:
    names = profile_names()
    if name not in names:
        raise ConfigError(f"unknown profile {shown(name)}{did_you_mean(name, names)}; available: {', '.join(names)}")
    text = (resources.files("distdiag") / "profiles" / f"{name}.toml").read_text("utf-8")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:  # pragma: no cover - shipped files are tested
        raise ConfigError(f"profile {name!r} is not valid TOML: {exc}") from None


_TOP_KEYS = {"check", "probes"}


def merge_config(
    layers: list[tuple[str, dict[str, Any]]],
    overrides: dict[str, Any],
    validate: Callable[[CheckConfig], None] | None = None,
) -> CheckConfig:
    """Merge TOML layers (lowest first, each named for messages) and CLI overrides.

    Every layer is validated as it is merged, not only the result: a bad value that a higher
    layer or a flag overrides is still a mistake in that file (`timeout_s = -1` under
    `--timeout-s 10`). `validate` checks more of each merged state (the probe names and every
    `[probes.NAME]` table, see distdiag.check.plan); its errors are prefixed with the layer's name.
    """
    fields = {f.name for f in dataclasses.fields(CheckConfig)} - {"probe_options"}
    merged: dict[str, Any] = {}
    probe_options: dict[str, dict[str, Any]] = {}
    for origin, data in layers:
        unknown = set(data) - _TOP_KEYS
        if unknown:
            raise ConfigError(
                f"{origin}: unknown table or key {sorted(unknown)[0]!r}; "
                f"known: {', '.join(sorted(_TOP_KEYS))}"
            )
        check = data.get("check", {})
        if not isinstance(check, dict):
            raise ConfigError(f"{origin}: [check] must be a table")
        for key, value in check.items():
            if key not in fields:
                raise ConfigError(
                    f"{origin}: unknown key check.{str(key)[:80]}{did_you_mean(key, fields)}; known: {', '.join(sorted(fields))}"
                )
            merged[key] = value
        probes = data.get("probes", {})
        if not isinstance(probes, dict):
            raise ConfigError(f"{origin}: [probes] must be a table of [probes.NAME] tables")
        for name, opts in probes.items():
            if not isinstance(opts, dict):
                raise ConfigError(f"{origin}: probes.{name} must be a table, got {opts!r}")
            probe_options.setdefault(name, {}).update(opts)
        try:
            _build(merged, probe_options, validate)
        except ConfigError as exc:
            raise ConfigError(f"{origin}: {exc}") from None
    merged.update({k: v for k, v in overrides.items() if v is not None})
    return _build(merged, probe_options, validate)


def _build(
    merged: dict[str, Any], probe_options: dict[str, dict[str, Any]], validate: Callable[[CheckConfig], None] | None
) -> CheckConfig:
    config = CheckConfig(**merged, probe_options={k: dict(v) for k, v in probe_options.items()})
    if validate is not None:
        validate(config)
    return config


def dataclass_from_dict(cls: type[T], data: dict[str, Any], prefix: str) -> T:
    """Build a config dataclass from a TOML table; unknown keys name the dotted key."""
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            raise ConfigError(
                f"unknown key {prefix}.{str(key)[:80]}{did_you_mean(key, known)}; known: {', '.join(sorted(known)) or '(none)'}"
            )
        _check_finite(data[key], f"{prefix}.{key}")
    try:
        return cls(**data)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{prefix}: {exc}") from None


def _check_finite(value: object, key: str) -> None:
    """No setting is infinite or NaN (TOML allows `inf` and `nan`): a sleep, a deadline or a
    threshold of inf would hang or disable a check silently."""
    import math

    values = value if isinstance(value, list) else list(value.values()) if isinstance(value, dict) else [value]
    for item in values:
        if isinstance(item, float) and not math.isfinite(item):
            raise ConfigError(f"{key} must be a finite number, got {item!r}")


def _check_checkpoint_path(path: str) -> None:
    """--checkpoint names a DCP checkpoint folder on this machine: a path that is not there is
    bad input (exit 2 before anything runs), not a probe failure found after the ranks start."""
    import os

    if "://" in path:  # a storage URL: the probe's reader says what it finds there
        return
    if not os.path.exists(path):
        raise ConfigError(f"--checkpoint {shown(path)} does not exist; pass the directory that holds the checkpoint's .metadata file")


def _check_target_file(spec: str | None) -> None:
    """A target file that is not there is said once, before torch is imported or a rank starts
    (distdiag.check.target says the same when it loads the target)."""
    import os

    if spec and (spec.endswith(".py") or "/" in spec) and not os.path.exists(spec):
        raise ConfigError(f"target file {spec if len(spec) <= 200 else shown(spec)} does not exist")


def layered_config(args: Any, validate: Callable[[CheckConfig], None] | None = None) -> CheckConfig:
    """Parsed options (of either front end, see distdiag.check.options) -> the config: the
    profile, the --config file and --checkpoint layered under the flags, each layer checked.

    `validate` adds the checks that need the probes (their names and option tables:
    distdiag.check.plan passes them); without it nothing here imports torch, so `distdiag
    check` learns where the report goes at once and leaves those checks to the process that
    imports torch anyway (distdiag.launcher.forkrun)."""
    layers: list[tuple[str, dict[str, Any]]] = []
    if args.profile is not None:  # `--profile ""` is a mistake, not "no profile"
        layers.append((f"profile {args.profile!r}", load_profile(args.profile)))
    if args.config:
        layers.append((args.config, load_toml(args.config)))
    if args.checkpoint:
        _check_checkpoint_path(args.checkpoint)
        layers.append(("--checkpoint", {"probes": {"checkpoint": {"load": args.checkpoint}}}))
    overrides = {
        "probes": args.probes,
        "skip": args.skip,
        "report": args.report,
        "timeout_s": args.timeout_s,
        "deadline_s": args.deadline_s,
        "format": args.format,
        "quiet": args.quiet,
        "verbose": args.verbose,
        "target": args.target,
        "junit": args.junit,
        "backend": getattr(args, "backend", None),
    }
    config = merge_config(layers, overrides, validate=validate)
    check_output_paths(config)
    _check_target_file(config.target)
    return config


def check_output_paths(config: CheckConfig) -> None:
    """The report and JUnit paths must be files to (re)write: a symbolic link (never written
    through), a FIFO, device or directory there is bad input before anything runs, not a
    report lost (or a linked file overwritten) at the end."""
    from distdiag.report.safefile import RefusedFile, check_output_path

    for key, flag, path in (("check.report", "--report", config.report), ("check.junit", "--junit", config.junit)):
        try:
            if path:
                check_output_path(path, f"pass {flag} a file path")
        except RefusedFile as exc:
            raise ConfigError(f"{key}: {exc}") from None
        except OSError as exc:  # a name too long (ENAMETOOLONG), a folder not searchable, ...
            raise ConfigError(f"{key}: cannot write {shown(path)}: {exc.strerror} ({flag} a shorter or other path)") from None
