"""Where each rank's data stands: batches drawn from each DataLoader pass, and whether it ran out.

Uneven data is the most common hang of real trainers: one rank's loader ends a batch or more
before its peers' (an IterableDataset that shards unevenly, a custom sampler, `drop_last=False`
on an uneven split), that rank leaves its epoch and issues the epoch's end collectives (a metric
sync, a barrier, validation) while its peers issue the next step's. Step counts cannot tell it
from a rank-dependent branch: a trainer that prefetches finishes the short rank's last step
before the loader's end is seen, so both ranks took the same number of steps. The loader
itself can: the short rank's iterator raised StopIteration after n batches while a peer drew
more than n from the same pass.

The tap wraps `_BaseDataLoaderIter.__next__` (torch's DataLoader iterator, single- and
multi-process: every trainer's loader ends there, Lightning's fetchers, accelerate's
DataLoaderShard and the HF Trainer included) and reads torch's own count of the pass's batches
(`_num_yielded`), so a pass begun before the watchdog was armed (a callback arms it after the
trainer made its iterator) is counted whole. Per batch it costs one Python call. A loader is
known by its sampler (one per DataLoader), numbered in the order this rank first drew from it (SPMD code iterates
its loaders in the same order on every rank); a pass is one iterator, or one reset of it. Each rank keeps the last PASSES_KEPT passes of each
of the LOADERS_KEPT loaders it drew from most recently.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

__all__ = ["LoaderTap", "LOADERS_KEPT", "PASSES_KEPT"]

LOADERS_KEPT = 8
PASSES_KEPT = 3
_MARK = "__distdiag_loader_tap__"


class LoaderTap:
    """Counts batches per DataLoader pass on the training thread; `snapshot()` for the watchdog."""

    def __init__(self, steps: Any = None, ended: Any = None) -> None:
        """`steps`: a callable giving the rank's step count, stamped on a pass that runs out;
        `ended`: called with `snapshot()` each time a pass runs out (the death note's copy)."""
        self._steps = steps
        self._ended = ended
        self._loaders: dict[int, tuple[int, str, Any]] = {}
        """id(the loader's sampler) -> (its index on this rank, its dataset's type, a weak reference
        to the sampler: the id is that sampler's only while it lives)"""
        self._passes: list[dict[str, Any]] = []
        self._draws = 0
        self._numbered = 0
        self._counts: dict[int, int] = {}
        """loader index -> passes seen"""
        self._lock = threading.Lock()
        self._saved: list[tuple[Any, str, Any]] = []

    # -- the training thread ------------------------------------------------------------------
    def _record(self, it: Any) -> dict[str, Any] | None:
        """The pass `it` is in: a new one for an iterator not seen before (created before the
        tap was installed, too) or one torch reset for a new epoch (persistent workers)."""
        drawn = int(getattr(it, "_num_yielded", 0))
        record = it.__dict__.get(_MARK)
        if record is not None and drawn >= record["drawn"]:
            return record
        # the loader's own sampler object (its batch sampler, or the constant one of an
        # IterableDataset): one per DataLoader, where a dataset may serve two (train and val).
        # Held weakly: the tap keeps no user data alive.
        owner = getattr(it, "_index_sampler", None)
        entry = self._loaders.get(id(owner))
        if entry is not None and entry[2]() is not owner:
            entry = None  # that id was another, collected sampler's
        if entry is None:
            entry = self._new_loader(owner, type(getattr(it, "_dataset", None)).__name__)
        index = entry[0]
        self._counts[index] = self._counts.get(index, 0) + 1
        record = {"loader": index, "label": entry[1], "pass": self._counts[index], "drawn": 0, "exhausted": False}
        try:  # the pass's planned length (the sampler's): a trainer that plans its steps from it
            record["len"] = int(len(it))  # (the HF Trainer) stops at the end without a StopIteration
        except Exception:  # noqa: BLE001 - an IterableDataset without __len__
            pass
        with self._lock:
            self._passes.append(record)
            mine = [p for p in self._passes if p["loader"] == index]
            if len(mine) > PASSES_KEPT:
                self._passes.remove(mine[0])
        it.__dict__[_MARK] = record
        return record

    def _new_loader(self, owner: Any, label: str) -> tuple[int, str, Any]:
        """Number a loader (in the order this rank first draws from it, the same on every rank of
        SPMD code); past LOADERS_KEPT the one drawn from least recently is forgotten, so a loader
        built anew each epoch is always followed."""
        with self._lock:
            gone = [key for key, e in self._loaders.items() if e[2]() is None]  # loaders the job dropped
            if len(self._loaders) - len(gone) >= LOADERS_KEPT:
                drawn = {p["loader"]: p.get("last", 0) for p in self._passes}
                gone.append(min(self._loaders, key=lambda key: drawn.get(self._loaders[key][0], 0)))
            dropped = {self._loaders.pop(key)[0] for key in gone}
            self._passes = [p for p in self._passes if p["loader"] not in dropped]
        try:
            ref: Any = weakref.ref(owner)
        except TypeError:  # a sampler without weak references: held (rare, and one per loader)
            ref = lambda owner=owner: owner  # noqa: E731
        entry = (self._numbered, label, ref)
        self._numbered += 1
        self._loaders[id(owner)] = entry
        return entry

    def _drew(self, it: Any) -> None:
        record = self._record(it)
        if record is not None:
            record["drawn"] = int(getattr(it, "_num_yielded", record["drawn"] + 1))
            self._draws += 1
            record["last"] = self._draws  # which pass this rank drew from last: the one it is in

    def _ran_out(self, it: Any) -> None:
        record = self._record(it)
        if record is not None and not record["exhausted"]:
            record["drawn"] = int(getattr(it, "_num_yielded", record["drawn"]))
            record["exhausted"] = True
            record["at_wall_ns"] = time.time_ns()
            if self._steps is not None:
                record["at_steps"] = self._steps()
            if self._ended is not None:
                self._ended(self.snapshot())

    # -- wrappers ----------------------------------------------------------------------------
    def install(self) -> bool:
        """Wrap torch's DataLoader iterator (False where it has no such class)."""
        try:
            from torch.utils.data.dataloader import _BaseDataLoaderIter
        except ImportError:  # pragma: no cover - every torch >= 1.x has it
            return False
        nxt = _BaseDataLoaderIter.__next__
        if getattr(nxt, _MARK, False):
            return False  # another watchdog's tap is in place
        tap = self

        def __next__(it: Any) -> Any:
            try:
                batch = nxt(it)
            except StopIteration:
                _quietly(tap._ran_out, it)
                raise
            _quietly(tap._drew, it)
            return batch

        setattr(__next__, _MARK, True)
        self._saved = [(_BaseDataLoaderIter, "__next__", nxt)]
        _BaseDataLoaderIter.__next__ = __next__  # type: ignore[method-assign,assignment]  # torch's method, patched
        return True

    def remove(self) -> None:
        """Put torch's method back, unless something patched it after us (then leave theirs)."""
        for owner, name, fn in reversed(self._saved):
            if getattr(getattr(owner, name, None), _MARK, False):
                setattr(owner, name, fn)
        self._saved = []

    # -- the watchdog's thread ----------------------------------------------------------------
    def snapshot(self) -> list[dict[str, Any]]:
        """The kept passes, oldest first (JSON-able copies)."""
        with self._lock:
            return [dict(p) for p in self._passes]


def _quietly(fn: Any, it: Any) -> None:
    try:
        fn(it)
    except Exception:  # noqa: BLE001 - evidence only: never in the job's way
        pass
