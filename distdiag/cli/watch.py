"""`distdiag watch [torchrun options] [watch options] -- train.py ARGS...`: the zero-code
watchdog under torchrun, launched for the user (distdiag.launcher.watch). Arguments are taken
as typed, from sys.argv (click would drop the `--`), as `distdiag gate`."""

from __future__ import annotations

import typer

from distdiag.cli.options import raw_args, register_passthrough, write_junit_for

__all__ = ["register"]


def watch(ctx: typer.Context) -> None:
    """Run a training script under torchrun with the hang watchdog armed (see: distdiag watch -h)."""
    from distdiag.launcher.watch import run_watch

    raise typer.Exit(run_watch(raw_args(ctx, "watch"), lambda report, path: write_junit_for(report, path, "watch")))


def register(app: typer.Typer) -> None:
    register_passthrough(app, "watch", watch)
