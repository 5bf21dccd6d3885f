"""The options of the check, defined once for both of its front ends.

`torchrun ... -m distdiag.check` (every rank) and `distdiag check` (the local launcher) used
to declare their options twice, in argparse and in typer, and drifted apart. Both are now
built from `CHECK_OPTIONS`: each rank parses with `build_parser()`, and `distdiag check`
parses its whole command line with `build_parser(launcher=True)` (the same table plus the
launcher's own options), then hands the ranks `to_check_argv()` of what it parsed. No typer
and no torch here: every rank imports this before anything else.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from distdiag.check.config import BACKENDS, FORMATS, MAX_SECONDS
from distdiag.errors import ConfigError, unknown_option_hint

__all__ = [
    "CheckOption",
    "CHECK_OPTIONS",
    "LAUNCHER_OPTIONS",
    "LAUNCHES",
    "build_parser",
    "to_check_argv",
    "version_line",
]

EXIT_CODES = (
    "exit codes: 0 pass (warnings allowed), 1 a probe failed, 2 bad input (nothing ran), "
    "3 a rank hung, died or never reported, 4 take a node out (cluster gate)"
)


@dataclass(frozen=True)
class CheckOption:
    """One command-line option of the check."""

    flags: tuple[str, ...]
    """Its names, the canonical one first (its dest: `--timeout-s` -> timeout_s)."""
    help: str
    metavar: str | None = None
    type: Callable[[str], Any] | None = str
    """How the text becomes a value; None: a switch that takes no value."""
    choices: tuple[str, ...] | None = None
    default: Any = None

    @property
    def dest(self) -> str:
        return self.flags[0].lstrip("-").replace("-", "_")


CHECK_OPTIONS: tuple[CheckOption, ...] = (
    CheckOption(("--probes",), "probes to run, in order (default: every probe that applies; `distdiag probes` "
                "lists them and which are opt-in)", "A,B"),
    CheckOption(("--skip",), "probes to leave out", "A,B"),
    CheckOption(("--profile",), "a profile shipped with distdiag: default, quick, gate, full (configs/ has copies)", "NAME"),
    CheckOption(("--config",), "a TOML config file ([check] and [probes.NAME] tables); flags override it; every "
                "table in it is validated, even of probes that do not run", "PATH"),
    CheckOption(("--report",), "where to write the JSON report (default: distdiag-report.json)", "PATH"),
    CheckOption(("--timeout-s",), f"deadline of one probe on every rank, in seconds, at most {MAX_SECONDS} "
                "(a week) (default: 60)", "S", float),
    CheckOption(("--deadline-s",), f"deadline of the whole check, in seconds, at most {MAX_SECONDS} (default: 600)",
                "S", float),
    CheckOption(("--format",), "text: a table on stdout (default); json: the report on stdout", None, str, FORMATS),
    CheckOption(("--verbose", "-v"), "also print every probe's info findings and detail tables (the JSON report "
                "always has them)", type=None),
    CheckOption(("--quiet",), "print only the verdict line", type=None),
    CheckOption(("--target",), "your target exposing hook functions (module name or .py path)", "MODULE|FILE.py"),
    CheckOption(("--junit",), "also write the verdict as JUnit XML to PATH (on every node, like the report)", "PATH"),
    CheckOption(("--backend",), "the main process group's backend: auto (default: NCCL on each rank's GPU when CUDA is "
                "present, else gloo), nccl, or gloo (the CPU even where CUDA is visible)", None, str, BACKENDS),
    CheckOption(("--checkpoint",), "an existing DCP checkpoint to load into the target model (probe checkpoint; "
                "sets probes.checkpoint.load)", "PATH"),
)
"""The check's options, in the order --help lists them."""


MAX_NPROC_PER_NODE = 65536
"""Ranks one machine may start: far above any machine's devices or cores (a typo such as 2**31
would otherwise make the launcher plan billions of ranks until memory runs out)."""


def _positive_int(text: str) -> int:
    want = f"must be a whole number of ranks from 1 to {MAX_NPROC_PER_NODE}"
    try:
        value = int(text[:20]) if len(text) <= 20 else None
    except ValueError:
        value = None
    if value is None:
        raise argparse.ArgumentTypeError(f"{want}, got {text[:40]!r}")
    if not 1 <= value <= MAX_NPROC_PER_NODE:
        raise argparse.ArgumentTypeError(f"{want}, got {value}")
    return value


LAUNCHES: tuple[str, ...] = ("fork", "torchrun")
"""How `distdiag check` starts the ranks (--launch, DISTDIAG_LAUNCH; distdiag.launcher.argv)."""

LAUNCHER_OPTIONS: tuple[CheckOption, ...] = (
    CheckOption(("--nproc-per-node", "--nproc"), "ranks to start on this machine, as torchrun's --nproc-per-node "
                "(default: 2)", "N", _positive_int, default=2),
    CheckOption(("--launch",), "fork (default): import torch and the planned probes' modules once, then fork the "
                "ranks from that process (torchrun's --run-path --start-method fork; 1.5-2x faster to a verdict "
                "where ranks outnumber cores); torchrun: every rank its own `python -m distdiag.check`, as under "
                "your own torchrun (default: DISTDIAG_LAUNCH, else fork)", None, str, LAUNCHES),
)
"""Options of `distdiag check` only: they shape the torchrun it launches, not the check."""


def version_line() -> str:
    from distdiag import __version__

    return f"distdiag {__version__}"


def _rank0() -> bool:
    """Print --help/--version once per job, not once per rank."""
    return os.environ.get("RANK", "0") == "0"


class _Help(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        if _rank0():
            parser.print_help()
        parser.exit(0)


class _Version(_Help):
    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        if _rank0():
            print(version_line())
        parser.exit(0)


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError (one line, exit 2 on every rank) instead of printing usage."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{unknown_option_hint(self, message)} (see: {self.prog} -h)")


def build_parser(prog: str | None = None, *, launcher: bool = False) -> argparse.ArgumentParser:
    """The parser of every rank, or (`launcher`) of `distdiag check`, from the one table."""
    if launcher:
        prog = prog or "distdiag check"
        description = (
            "Run distdiag's probes on N local ranks through torchrun and exit with the verdict's exact code "
            "(torchrun alone exits 1 for any failure); rank 0 prints the verdict and writes a JSON report."
        )
        epilog = f"{EXIT_CODES}. Example: distdiag check --nproc-per-node 4 --profile quick"
    else:
        prog = prog or "python -m distdiag.check"
        description = (
            "Run distdiag's probes on every rank of a torchrun job; rank 0 prints one verdict and writes a JSON report."
        )
        epilog = f"{EXIT_CODES}. Example: torchrun --nproc-per-node 4 -m distdiag.check --profile quick"
    parser = _Parser(prog=prog, description=description, epilog=epilog, add_help=False, allow_abbrev=False)
    parser.add_argument("-h", "--help", action=_Help, help="show this help and exit")
    parser.add_argument("--version", action=_Version, help="print distdiag's version and exit")
    for option in (LAUNCHER_OPTIONS if launcher else ()) + CHECK_OPTIONS:
        if option.type is None:
            parser.add_argument(*option.flags, dest=option.dest, action="store_true", default=None, help=option.help)
        else:
            parser.add_argument(
                *option.flags, dest=option.dest, type=option.type, choices=option.choices,
                metavar=option.metavar, default=option.default, help=option.help,
            )
    return parser


def to_check_argv(args: argparse.Namespace) -> list[str]:
    """The check's own options among parsed `args`, as the command line each rank parses."""
    argv: list[str] = []
    for option in CHECK_OPTIONS:
        value = getattr(args, option.dest, None)
        if option.type is None:
            argv += [option.flags[0]] if value else []
        elif value is not None:
            argv += [option.flags[0], str(value)]
    return argv
