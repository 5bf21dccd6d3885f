"""Flight-recorder dump files (one per rank) as `distdiag hang-report DIR` reads them.

Live reads of the recorder are distdiag.hang.recorder's. Dumps are read as JSON; pickle dumps
(NCCL's default, the only form with stacks) only when the caller trusts them, because
unpickling runs code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["load_dump"]


def load_dump(path: Path, *, trust_pickle: bool = False) -> dict[str, Any]:
    """One rank's recorder dump. Raises ValueError with a one-line reason."""
    data = path.read_bytes()
    if data[:1] == b"\x80":
        if not trust_pickle:
            raise ValueError(
                f"{path} is a pickle dump; reading it runs code from the file - pass --trust-pickle if you trust it"
            )
        import pickle

        loaded = pickle.loads(data)  # noqa: S301 - the user asked for it explicitly
    else:
        try:
            loaded = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ValueError(f"{path} is neither JSON nor a pickle flight-recorder dump") from None
    if not isinstance(loaded, dict) or "entries" not in loaded:
        raise ValueError(f"{path} is not a flight-recorder dump (no 'entries')")
    return loaded
