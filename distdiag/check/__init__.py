"""The check: `torchrun -m distdiag.check`, from the command line to the verdict's exit code.

    __main__.py     `python -m distdiag.check` (calls run.main)
    options.py      every option, defined once for both front ends (argparse and typer)
    config.py       CheckConfig and its layers: defaults < profile < --config < flags
    plan.py         the command line parsed, validated, and turned into the probes to run
    target.py       loading the user's target module or file and its hooks
    run.py          CheckRun: the phases of one check on one rank (set up, probes under
                    deadlines and their exchange through the store, the normal end)
    finish.py       RunEnd: how a rank's check ends (consolidate, write and share the report,
                    publish the verdict, leave together; the report of a broken run)
    consolidate.py  what every rank posted -> one Report and its verdict (on the writing rank)
    leftovers.py    what the user's code left running at the end (threads, children, a chdir):
                    said in the report's notes, ended, the verdict's code kept
    starting.py     ranks lost before they checked in, told by their phase notes
    forked_rank.py  the file each forked rank starts in (made like a fresh rank, then run.main)
    hashseed.py     whether a rank shares its launcher's Python hash seed (forked ranks do)

Launching the ranks is distdiag.launcher's (`distdiag check`, `distdiag gate`, and forkrun.py,
which forks them); what runs in a rank stays here. May import distdiag.runtime,
distdiag.probes, distdiag.hang, distdiag.report, distdiag.errors and distdiag.launcher.ranks
(the ranks' side of a launch). Importing this package imports nothing (options.py and
config.py stay free of torch so the CLI's --help is fast); `main` and `run_check`, the entry
points callers had as `distdiag.check.main` before the check became a package, load run.py
on first use.
"""

from typing import Any

__all__ = [
    "config", "consolidate", "finish", "forked_rank", "hashseed", "leftovers", "options", "plan", "run", "starting", "target",
    "main", "run_check",
]


def __getattr__(name: str) -> Any:
    if name in ("main", "run_check"):
        from distdiag.check import run

        return getattr(run, name)
    raise AttributeError(f"module 'distdiag.check' has no attribute {name!r}")
