"""`python -m distdiag.launcher.forkrun [torchrun options] -- [check options]`: torchrun, with the
imports paid once per node instead of once per rank.

Every rank of `torchrun -m distdiag.check` is a fresh interpreter: it imports torch (2 CPU s
on the CI machine) and, for the default suite, FSDP2, DTensor, torch._dynamo and DCP (1.5 CPU
s more). Where ranks outnumber cores they queue for the CPU, and the check costs 1.5-1.9x a
bare torchrun at 4-8 ranks on 2 cores (docs/benchmarks.md). This process imports torch, the
check and what the planned probes need (`Probe.preload`) once, then runs torchrun's own
launcher in-process with its documented `--run-path --start-method fork`: the elastic agent
forks each rank from here, and a rank starts with all of it imported. The rest is torchrun's:
its options (and PET_* variables), rendezvous, each rank's environment, restarts, and what it
does when a worker fails or the agent gets SIGTERM.

Fork is safe only while CUDA is not initialised in the parent: nothing here touches CUDA
(importing torch does not; the user's target is imported by the ranks, after the fork). If
CUDA was initialised anyway, the ranks are spawned instead (fresh interpreters).
`distdiag check --launch torchrun` (or DISTDIAG_LAUNCH=torchrun) starts each rank as its own
`python -m distdiag.check`, as before.

What a fork cannot give: each rank its own Python hash seed. A fresh interpreter draws one at
start (PYTHONHASHSEED unset), so under torchrun the order of a set of strings differs from rank
to rank; forked ranks keep this process's seed, and the seed cannot be changed after start (every
string made so far caches its hash: a new seed would break the dicts already built). A bug that
depends on set or dict order across ranks therefore passes here; the report says so
(`shared_hash_seed_note`) and points to `--launch torchrun`.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from distdiag.check.hashseed import HASH_PROBE, PARENT_HASH_ENV, shared_hash_seed_note
from distdiag.launcher.argv import split_dashes, world_size

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

__all__ = [
    "main", "plan_preloads", "start_method", "cuda_in_parent", "shared_hash_seed_note",
    "RANK_ENTRY", "PARENT_HASH_ENV",
]

log = logging.getLogger(__name__)

RANK_ENTRY = Path(__file__).resolve().parent.parent / "check" / "forked_rank.py"
"""The file torchrun's --run-path runs as `__main__` in each forked rank (the check's own: it
runs in the rank)."""


USAGE = "usage: python -m distdiag.launcher.forkrun [torchrun options] -- [check options]"


def plan_preloads(check_args: list[str], world: int | None) -> list[str]:
    """Validate the check's command line as every rank will (ConfigError: bad input, said once
    here instead of by every rank), and return the modules its probes import (`Probe.preload`).

    Without a world size (torchrun's options did not parse) the plan is made for a world too
    large for any probe to be left out: an import too many costs this process once."""
    from distdiag.check.plan import make_plan, parse_config, validate_injection

    plan = make_plan(parse_config(check_args), world or 1 << 16)
    validate_injection(world)
    names: dict[str, None] = {}
    for planned in plan.probes:
        if planned.skip_reason is None:
            names.update(dict.fromkeys(type(planned.probe).preload))
    return list(names)


def _leave_bad_input_report(message: str, check_args: list[str], world: int) -> None:
    """Where the check's report goes (the config's or profile's path when they parse, else
    --report or the default), leave one saying nothing ran: an earlier run's must not stay."""
    from distdiag.check.plan import parse_config
    from distdiag.errors import ConfigError
    from distdiag.launcher.ranks import report_path_in, write_bad_input_report

    try:
        path = parse_config(check_args).report
    except ConfigError:
        path = report_path_in(check_args)
    write_bad_input_report(message, path, world)


def _note_first_failure(exc: ChildFailedError) -> None:
    import socket

    from distdiag.launcher.ranks import note_first_failure

    try:
        rank, failure = exc.get_first_failure()
        note_first_failure(int(rank), int(failure.pid), int(failure.exitcode), socket.gethostname())
    except Exception as err:  # noqa: BLE001 - only a better message is lost
        log.debug("could not note the first failure: %s", err)


def cuda_in_parent(maps: str | None = None) -> str | None:
    """Why the CUDA driver is already in use in this process (so a forked rank could not use
    CUDA), or None: torch initialised CUDA here, or the driver library (libcuda.so) is mapped
    into the process (`maps`: the text of /proc/self/maps, read when None). torch links only
    CUDA's runtime and opens the driver at its first CUDA call; a CUDA build imports on a host
    without a driver, so a mapped libcuda means something asked the driver already: torch, or
    another library (CuPy, Numba, JAX, a plugin), which torch's own fork check does not see."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            return "torch initialised CUDA in this process"
    except Exception:  # noqa: BLE001 - a torch without the call: the maps still tell
        pass
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:  # not Linux: torch's own check (start_method) still runs
            return None
    for line in maps.splitlines():
        fields = line.split()
        path = fields[5] if len(fields) >= 6 else ""
        if os.path.basename(path).startswith("libcuda.so"):
            return f"the CUDA driver library is loaded in this process ({path}): a library asked the driver something"
    return None


def start_method() -> str:
    """fork, unless a forked rank could not use CUDA: once this process has asked the CUDA
    driver anything (`torch.cuda.is_available()` does; so may another library), a forked rank
    raises "Cannot re-initialize CUDA in forked subprocess" or worse. Nothing distdiag imports
    here asks, but a torch release or a plugin might: `cuda_in_parent` looks (is CUDA initialised,
    is the driver library mapped), then a child forked now asks torch whether it poisoned fork
    (a few ms); either way the ranks are spawned instead (fresh interpreters, nothing shared,
    still correct: what `--launch torchrun` does, with the imports paid once per rank)."""
    import torch

    if not hasattr(os, "fork"):
        return "spawn"
    if not torch.cuda._is_compiled():
        return "fork"  # a CPU build has no CUDA to lose
    reason = cuda_in_parent()
    if reason is not None:
        log.warning("%s; spawning the ranks instead of forking them (a forked rank could not use CUDA)", reason)
        return "spawn"
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child only answers
        os._exit(1 if torch.cuda._is_in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        log.warning("CUDA was initialised before the ranks started; spawning them instead of forking")
        return "spawn"
    return "fork"


def main(argv: list[str] | None = None) -> int:
    """Import once, then run torchrun's launcher forking the ranks. Returns 2 for bad input
    (one line, no rank started), else torchrun's status: 1 when a rank failed (the check's
    exact code is in its report, see exit_code.py)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        torchrun_args, check_args = split_dashes(argv, USAGE)
    except ValueError as exc:
        sys.stderr.write(f"distdiag: error: {exc}\n")
        return 2
    import torch  # noqa: F401 - the import every rank would pay

    import distdiag.check.run  # noqa: F401 - the ranks' own code
    from distdiag.errors import ConfigError

    world = world_size(torchrun_args)
    try:
        preloads = plan_preloads(check_args, world)
    except ConfigError as exc:
        sys.stderr.write(f"distdiag: error: {exc}\n")
        _leave_bad_input_report(str(exc), check_args, world or 1)
        return 2
    from distdiag.check.plan import parse_config
    from distdiag.launcher.ranks import say_started

    say_started(parse_config(check_args), world or 1)
    for name in preloads:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - the rank that needs it reports the failure
            log.debug("preloading %s failed: %s", name, exc)
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    os.environ[PARENT_HASH_ENV] = str(hash(HASH_PROBE))  # the ranks tell from it whether they share the seed
    command = [*torchrun_args, "--run-path", "--start-method", start_method(), str(RANK_ENTRY), *check_args]
    sys.stdout.flush()  # what is buffered now would be written again by every forked rank
    sys.stderr.flush()
    try:
        torchrun.main(command)
    except ChildFailedError as exc:
        # A rank exited non-zero: the verdict (or why none came) is in the report and on the
        # ranks' stderr already; torchrun's summary of it only with DISTDIAG_DEBUG=1. The rank
        # that failed first goes to the launcher, which names it when no report came.
        if os.environ.get("DISTDIAG_DEBUG") == "1":
            sys.stderr.write(f"{exc}\n")
        _note_first_failure(exc)
        return 1
    except SignalException as exc:
        # The agent was told to stop and stopped the ranks (they wrote a 'terminated' report).
        sys.stderr.write(f"distdiag: torchrun's agent received {exc.sigval.name}; the ranks were stopped\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
