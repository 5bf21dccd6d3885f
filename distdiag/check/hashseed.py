"""Whether this rank shares the launching process's Python hash seed: forked ranks do (PYTHONHASHSEED
is read once, at interpreter start), torchrun's spawned ranks each draw their own. Set by the fork
launcher (distdiag.launcher.forkrun), read by the check's end (distdiag.check.finish) for the report's
note; a module of its own so that neither imports the other.
"""

from __future__ import annotations

import os

__all__ = ["HASH_PROBE", "PARENT_HASH_ENV", "shared_hash_seed_note"]

PARENT_HASH_ENV = "DISTDIAG_FORK_PARENT_HASH"
"""Set by this process for its ranks: its hash of `HASH_PROBE`. A rank whose own hash of it is
the same shares this process's hash seed (it was forked; a spawned rank draws its own)."""

HASH_PROBE = "distdiag.check.forkrun: hash seed"


def shared_hash_seed_note() -> str | None:
    """The report's note when this rank shares the launching process's Python hash seed where
    torchrun would give it its own: it was forked (its hash of a probe string is the parent's)
    and PYTHONHASHSEED does not fix one seed for every process (then torchrun's share it too)."""
    parent = os.environ.get(PARENT_HASH_ENV, "")
    if parent != str(hash(HASH_PROBE)) or os.environ.get("PYTHONHASHSEED", "").strip().isdigit():
        return None
    return (
        "forked ranks share one Python hash seed (torchrun gives each rank its own): a bug that depends on "
        "set or dict order differing across ranks cannot show here; rerun with `distdiag check --launch "
        "torchrun` to see it"
    )
