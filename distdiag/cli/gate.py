"""`distdiag gate [torchrun options] -- TRAINING COMMAND...`: the cluster gate, from the package.

A user who installed distdiag with pip has no launch/gate.sh; this is the same gate (and
launch/gate.sh now just runs it). Its arguments belong to torchrun and to the training
command, so they are taken as typed, from sys.argv: click would drop the `--` that separates
the two.
"""

from __future__ import annotations

import typer

from distdiag.cli.options import raw_args, register_passthrough

__all__ = ["register"]


def gate(ctx: typer.Context) -> None:
    """Run the check on this node (torchrun options before --), then the training command if it passed (see: distdiag gate -h)."""
    from distdiag.check.launcher import run_gate

    raise typer.Exit(run_gate(raw_args(ctx, "gate")))


def register(app: typer.Typer) -> None:
    register_passthrough(app, "gate", gate)
