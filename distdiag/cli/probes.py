"""`distdiag probes`: each probe with one line on what it catches."""

from __future__ import annotations

import json

import typer

from distdiag.cli.options import FormatOpt, check_format

__all__ = ["register"]


def probes(format: FormatOpt = "text") -> None:
    """List the probes of `distdiag.check`, with what each one catches."""
    from distdiag.probes import PROBES

    rows = [
        {"name": name, "min_world_size": cls.min_world_size, "catches": cls.summary}
        for name, cls in PROBES.items()
    ]
    check_format(format)
    if format == "json":
        typer.echo(json.dumps(rows, indent=2))
        return
    width = max(len(r["name"]) for r in rows)
    for row in rows:
        world = f" (needs >= {row['min_world_size']} ranks)" if row["min_world_size"] > 1 else ""
        typer.echo(f"{row['name'].ljust(width)}  {row['catches']}{world}")


def register(app: typer.Typer) -> None:
    app.command("probes")(probes)
