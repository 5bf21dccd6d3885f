"""The launcher: torchrun run for the user by `distdiag check`, `distdiag gate` and `distdiag
watch`, and the exit code of this run alone.

    argv.py       the launchers' command lines: the one `--` splitter, a launcher option taken
                  from before it, the one reader of torchrun's world size, the check's torchrun
                  command and how its ranks start (--launch)
    child.py      torchrun as a child: our signals forwarded, cancellation, a job that cannot
                  end killed, orphaned ranks ended, stderr collected; exec of the training command
    stderr.py     torchrun's stderr as the user should see it (its log lines and its closing
                  traceback left out)
    launch.py     one launch: its id, its private folder, its job watch, this run's report
    ranks.py      the ranks' side of a launch (in-rank code): the launch id, the verdict note,
                  the cancel marker, the phase notes
    jobwatch.py   the job seen from outside: what nobody inside can end, by the rules of a
                  check (minutes) or of a training job (days)
    exit_code.py  the exit code from this run's report, said in one line when the report
                  alone does not say it
    check.py      `distdiag check`'s launch
    gate.py       `distdiag gate`: the check, then the training command if it passed
    watch.py      `distdiag watch`: a training script under torchrun with the hang watchdog
    forkrun.py    what the check's launch runs by default: torch and the planned probes imported
                  once, then torchrun's agent in-process forks the ranks (--run-path)

May import distdiag.errors, distdiag.report, distdiag.runtime, distdiag.check (the check's
options, plan and rank code: forkrun.py runs them), distdiag.watch and distdiag.watchdog
(`distdiag watch` parses the wrapper's options and names its report). Imported by the CLI,
and, for ranks.py alone, by the code that runs in the ranks (distdiag.check, distdiag.watch,
distdiag.watchdog). Nothing here imports typer: `python -m distdiag.check` runs on ranks
without it. Importing this package imports nothing.
"""

__all__ = ["argv", "check", "child", "exit_code", "forkrun", "gate", "jobwatch", "launch", "ranks", "stderr", "watch"]
