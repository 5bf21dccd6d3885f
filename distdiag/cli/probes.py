"""`distdiag probes`: each probe with one line on what it catches."""

from __future__ import annotations

import json
from typing import Any

import typer

from distdiag.cli.options import FormatOpt, check_format

__all__ = ["register"]


def probes(format: FormatOpt = "text") -> None:
    """List the probes of `distdiag.check`, with what each one catches and which are opt-in."""
    from distdiag.check.config import load_profile, profile_names
    from distdiag.probes import PROBES

    check_format(format)
    # the shipped profiles that run each probe (an empty list runs the default probes)
    profiles = {name: load_profile(name).get("check", {}).get("probes") or [] for name in profile_names()}
    rows: list[dict[str, Any]] = [
        {
            "name": name,
            "default": cls.default_enabled,
            "min_world_size": cls.min_world_size,
            "catches": cls.summary,
            "profiles": sorted(
                p for p, names in profiles.items()
                if names == ["all"] or name in names or (not names and cls.default_enabled)
            ),
        }
        for name, cls in PROBES.items()
    ]
    if format == "json":
        typer.echo(json.dumps(rows, indent=2))
        return
    width = max(len(r["name"]) for r in rows)
    for row in rows:
        notes = []
        if not row["default"]:
            notes.append("opt-in")
        if row["min_world_size"] > 1:
            notes.append(f"needs >= {row['min_world_size']} ranks")
        typer.echo(f"{row['name'].ljust(width)}  {row['catches']}" + (f" ({'; '.join(notes)})" if notes else ""))
    opt_in = [r for r in rows if not r["default"]]
    if opt_in:
        typer.echo("")
        for row in opt_in:
            via = " or ".join(f"--profile {p}" for p in row["profiles"])
            typer.echo(
                f"{row['name']} is opt-in: a default run leaves it out; run it with --probes "
                f"{row['name']} (e.g. --probes env,{row['name']})" + (f", or {via}" if via else "")
            )
def register(app: typer.Typer) -> None:
    app.command("probes")(probes)
