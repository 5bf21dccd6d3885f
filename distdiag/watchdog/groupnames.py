"""Each rank's process-group creation, in torch's own numbering.

torch names a group made by `new_group` (and `new_subgroups`, DeviceMesh's groups, ...) from a
per-process counter, `str(_world.group_count)`, unless it asks for a hashed name
(`use_local_synchronization=True`, `split_group`): so every rank must create every such group,
member or not, in one global order. The backend then meets its peers under that name in the
store (gloo connects there at once; NCCL at the group's first collective, or at once when the
default group is bound to a device). A rank that creates its groups in another order, or skips
one it is not a member of, binds a name to other members than its peers do: the ranks meet the
wrong peers, and the job hangs in the group's creation or its first collective.

While armed, the name function is wrapped (it runs on every such call, member or not, before the
backend is made) and the last `KEEP` numbered names are kept with their members; where the log
is empty (armed after the groups were made) the registry torch keeps of this rank's own groups
stands in. `snapshot()` is what the hang analysis reads (`distdiag.hang.creation_rules`).
Nothing here changes what torch does: the wrapper returns torch's own name.
"""

from __future__ import annotations

import collections
import logging
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from distdiag.hang.members import encode_members
from distdiag.watchdog.intercept import _skip_prefixes

__all__ = ["GroupLog", "KEEP"]

log = logging.getLogger("distdiag.watchdog")

KEEP = 32
"""Numbered group names kept per rank (a conflict that hangs is at the newest ones)."""
_NAME_FN = "_process_group_name"
_MARK = "__distdiag_group_log__"


class GroupLog:
    """The numbered group names this process created, with their members, newest last."""

    def __init__(self, keep: int = KEEP) -> None:
        self.entries: collections.deque[tuple[str, str, str]] = collections.deque(maxlen=keep)
        self.calls = 0
        self._lock = threading.Lock()
        self._saved: Callable[..., Any] | None = None

    def record(self, ranks: Any, hashed: bool, name: Any, site: str = "?") -> None:
        if hashed:
            return  # a hashed name is the same on every rank that asks for it: no order to keep
        try:
            members = encode_members([int(r) for r in ranks]) if ranks else "*"
        except (TypeError, ValueError):
            return
        with self._lock:
            self.entries.append((str(name), members, site))
            self.calls += 1

    def install(self) -> bool:
        """Wrap torch's group-name function; False where this torch has none (nothing kept)."""
        try:
            from torch.distributed import distributed_c10d as c10d
        except ImportError:  # pragma: no cover - torch without distributed
            return False
        fn = getattr(c10d, _NAME_FN, None)
        if fn is None or not callable(fn) or hasattr(fn, _MARK):
            return False
        recorder = self
        skip, site_pkgs = _skip_prefixes()

        def named(ranks: Any, use_hashed_name: Any = False, *args: Any, **kwargs: Any) -> Any:
            name = fn(ranks, use_hashed_name, *args, **kwargs)
            try:
                recorder.record(ranks, bool(use_hashed_name), name, _caller(skip, site_pkgs))
            except Exception:  # never let the record break the user's group creation
                log.debug("group name not recorded", exc_info=True)
            return name

        setattr(named, _MARK, fn)
        self._saved = fn
        c10d._process_group_name = named
        return True

    def remove(self) -> None:
        fn, self._saved = self._saved, None
        if fn is None:
            return
        from torch.distributed import distributed_c10d as c10d

        if getattr(getattr(c10d, _NAME_FN, None), _MARK, None) is fn:
            setattr(c10d, _NAME_FN, fn)

    def snapshot(self) -> dict[str, Any]:
        """{"count": torch's counter, "names": [[name, members, the user's line], ...] newest last, "from":
        "calls" (seen while armed: every numbered name, member or not) or "registry" (only
        the groups this rank is a member of)}."""
        with self._lock:
            entries = list(self.entries)
        out: dict[str, Any] = {"count": None, "names": [list(e) for e in entries], "from": "calls"}
        try:
            from torch.distributed import distributed_c10d as c10d

            world = c10d._world
            out["count"] = int(world.group_count)
            if not entries:
                out["names"], out["from"] = _registry(world), "registry"
        except Exception:  # a torch without these internals: the calls seen are all there is
            log.debug("group registry not read", exc_info=True)
        return out


def _caller(skip: tuple[str, ...], site_pkgs: str) -> str:
    """The user's line that made the group (the first frame outside torch, distdiag and the
    standard library; a library in site-packages counts as the user's): the evidence a person
    reads when two sides' groups cannot be told apart. Group creation is rare: cheap enough."""
    frame: FrameType | None = sys._getframe(2)
    torch_own = skip[:3]
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(skip) or (site_pkgs in name and not name.startswith(torch_own)):
            return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def _registry(world: Any) -> list[list[str]]:
    """This rank's own numbered groups from torch's registry, oldest first."""
    rows: list[tuple[int, list[str]]] = []
    for pg, name in list(world.pg_names.items()):
        if not str(name).isdigit():
            continue
        ranks = world.pg_group_ranks.get(pg) or {}
        members = [g for g, _ in sorted(ranks.items(), key=lambda kv: kv[1])]
        if members and int(name) > 0:  # "0" is the default group
            rows.append((int(name), [str(name), encode_members(members)]))
    return [r for _, r in sorted(rows)][-KEEP:]
