"""The launchers' command lines: the one `--` splitter, the one reader of torchrun's world size,
the torchrun command of `distdiag check` / `distdiag gate`, and how their ranks start."""

from __future__ import annotations

import os
import sys

__all__ = ["split_dashes", "take_option", "world_size", "torchrun_command", "launch_mode", "LAUNCH_ENV"]

LAUNCH_ENV = "DISTDIAG_LAUNCH"


def split_dashes(argv: list[str], usage: str, *, command: bool = False) -> tuple[list[str], list[str]]:
    """(the words before the first `--`, the words after it); ValueError(`usage`) without one,
    or, with `command`, when nothing follows it (a training command is needed there)."""
    if "--" not in argv:
        raise ValueError(usage)
    split = argv.index("--")
    if command and split == len(argv) - 1:
        raise ValueError(usage)
    return argv[:split], argv[split + 1 :]


def take_option(argv: list[str], name: str, missing: str) -> tuple[str | None, list[str]]:
    """(the value of the launcher's own option `name` or None, the words without it): looked for
    only before the first `--` (after it, the words belong to the command run there). A later
    one wins. ValueError(`missing`) when it has no value."""
    before, after = split_dashes(argv, "") if "--" in argv else (argv, None)
    value, rest, i = None, [], 0
    while i < len(before):
        word = before[i]
        if word == name:
            if i + 1 >= len(before):
                raise ValueError(missing)
            value, i = before[i + 1], i + 2
            continue
        if word.startswith(f"{name}="):
            value = word.split("=", 1)[1]
            if not value:
                raise ValueError(missing)
        else:
            rest.append(word)
        i += 1
    return value, rest if after is None else [*rest, "--", *after]


def world_size(torchrun_args: list[str]) -> int | None:
    """The job's largest world as torchrun would start it (its own parser, PET_* variables
    included): max nodes x ranks per node; None when torchrun cannot parse them (it will say so
    itself when it runs). Imports torch's launcher: call it where torch is imported anyway, or
    on a failure path."""
    from torch.distributed import run as torchrun

    try:
        args = torchrun.get_args_parser().parse_args([*torchrun_args, "_"])
        _, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
        return max_nodes * torchrun.determine_local_world_size(args.nproc_per_node)
    except (Exception, SystemExit):  # noqa: BLE001 - torchrun reports its own usage errors
        return None


def launch_mode(flag: str | None) -> str:
    """How the ranks start: the --launch flag, else DISTDIAG_LAUNCH, else fork (ConfigError
    for a value that is neither fork nor torchrun)."""
    from distdiag.check.options import LAUNCHES
    from distdiag.errors import ConfigError

    value = flag or os.environ.get(LAUNCH_ENV, "").strip() or "fork"
    if value not in LAUNCHES:
        source = "--launch" if flag else LAUNCH_ENV
        raise ConfigError(f"{source}: {value!r} is not one of {', '.join(LAUNCHES)}")
    return value


def torchrun_command(check_args: list[str], torchrun_args: list[str], launch: str = "fork") -> list[str]:
    """fork: torchrun's launcher in distdiag.launcher.forkrun (imports once, forks the ranks);
    torchrun: `torchrun ... -m distdiag.check`, every rank a fresh interpreter."""
    if launch == "fork":
        return [sys.executable, "-m", "distdiag.launcher.forkrun", *torchrun_args, "--", *check_args]
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args, "-m", "distdiag.check", *check_args]
