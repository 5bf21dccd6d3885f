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
of its first LOADERS_KEPT loaders.
"""

from __future__ import annotations

import threading
import time
from typing import Any

__all__ = ["LoaderTap", "LOADERS_KEPT", "PASSES_KEPT"]

LOADERS_KEPT = 8
PASSES_KEPT = 3
_MARK = "__distdiag_loader_tap__"


class LoaderTap:
    """Counts batches per DataLoader pass on the training thread; `snapshot()` for the watchdog."""

    def __init__(self, steps: Any = None) -> None:
        """`steps`: a callable giving the rank's step count, stamped on a pass that runs out."""
        self._steps = steps
        self._loaders: dict[int, tuple[int, str, Any]] = {}
        """id(the loader's sampler) -> (its index on this rank, its dataset's type, the sampler:
        held so the id stays its own)"""
        self._passes: list[dict[str, Any]] = []
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
        # IterableDataset): one per DataLoader, where a dataset may serve two (train and val)
        owner = getattr(it, "_index_sampler", None)
        entry = self._loaders.get(id(owner))
        if entry is None:
            if len(self._loaders) >= LOADERS_KEPT:
                return None
            dataset = getattr(it, "_dataset", None)
            entry = self._loaders[id(owner)] = (len(self._loaders), type(dataset).__name__, owner)
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

    def _drew(self, it: Any) -> None:
        record = self._record(it)
        if record is not None:
            record["drawn"] = int(getattr(it, "_num_yielded", record["drawn"] + 1))

    def _ran_out(self, it: Any) -> None:
        record = self._record(it)
        if record is not None and not record["exhausted"]:
            record["drawn"] = int(getattr(it, "_num_yielded", record["drawn"]))
            record["exhausted"] = True
            record["at_wall_ns"] = time.time_ns()
            if self._steps is not None:
                record["at_steps"] = self._steps()

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
        _BaseDataLoaderIter.__next__ = __next__  # type: ignore[method-assign]
        return True

    def remove(self) -> None:
        for owner, name, fn in reversed(self._saved):
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
