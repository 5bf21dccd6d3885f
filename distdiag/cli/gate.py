"""`distdiag gate [torchrun options] -- TRAINING COMMAND...`: the cluster gate, from the package.

A user who installed distdiag with pip has no launch/gate.sh; this is the same gate (and
launch/gate.sh now just runs it). Its arguments belong to torchrun and to the training
command, so they are taken as typed, from sys.argv: click would drop the `--` that separates
the two.
"""

from __future__ import annotations

import sys

import typer

__all__ = ["register"]


def _raw_args(ctx: typer.Context) -> list[str]:
    argv = sys.argv[1:]
    if "gate" in argv:
        return argv[argv.index("gate") + 1 :]
    return list(ctx.args)  # called in-process (typer's test runner): the best we have


def gate(ctx: typer.Context) -> None:
    """Run the check on this node (torchrun options before --), then the training command if it passed (see: distdiag gate -h)."""
    from distdiag.check.launcher import run_gate

    raise typer.Exit(run_gate(_raw_args(ctx)))


def register(app: typer.Typer) -> None:
    app.command(
        "gate",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
        add_help_option=False,
    )(gate)
