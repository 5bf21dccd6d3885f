"""Ending a broken run together, once: the incident protocol the check and the watchdog share.

    1. declare      a rank says why (`Incident.declare`: the check's `abort_reason`, the
                    watchdog's `event/N`)
    2. snapshot     every rank posts a RankSnapshot (distdiag/hang/records.py), capped
    3. claim        one rank claims the writer role (compare_set)
    4. gather       the writer waits (bounded) for the snapshots, bumping its progress
    5. write        the writer writes the report stamped with its launch id (`write`)
    6. publish      the small Verdict FIRST (exit code, outcome, summary, where the report is),
                    then the report's JSON for the other nodes in chunks, sized for them
                    (`publish`)
    7. wait         every other rank waits for the verdict while the writer's progress moves
                    (`wait_verdict`; the check's normal end: `wait_published`); a writer
                    stalled WRITER_STALL_S ends the wait (exit 3, one line)
    8. mirror       local rank 0 of every other node writes its copy there, stamped with its
                    own launch id (`mirror`)
    9. leave        each rank acts on the verdict (the caller)

The check's sentinel (distdiag/runtime/sentinel.py, distdiag/check/finish.py) and the watchdog
(distdiag/watchdog/watcher.py, writer.py) drive it; what the writer analyses stays theirs.
Nothing written here is larger than MAX_STORE_VALUE, and a store error at the writer is
survived by a new client.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any, Protocol

import psutil

from distdiag.errors import print_line
from distdiag.hang.records import EventKind, IncidentEvent, RankSnapshot, Silence, SilentReason, Verdict
from distdiag.report.model import Report, write_json_atomic, write_report
from distdiag.runtime import deathnote, snapwire
from distdiag.runtime.exchange import Exchange, bounded, poll_interval
from distdiag.runtime.keys import MAX_STORE_VALUE, IncidentKeys, Keys, StoreValueTooLarge, checked_value
from distdiag.runtime.lastword import blamed_ranks, remember
from distdiag.runtime.launchid import launch_id, with_this_launch_id

__all__ = [
    "Incident", "Seat", "write_stamped", "StoreValueTooLarge", "post_snapshot", "collect_snapshots", "collect_histories", "WRITER_STALL_S", "checked_value", "compact_snapshot", "silent_rank_reasons",
    "process_state", "kill_pid", "kill_stopped_local",
]

log = logging.getLogger("distdiag.runtime.incident")


class HasHost(Protocol):
    """What a seat is read from: a LaunchInfo, a RankInfo (node, local_rank and local_world_size
    are read when present)."""

    @property
    def host(self) -> str: ...

WRITER_STALL_S = 20.0
"""How long a rank waiting for the verdict waits for the writer's progress counter to move
before it leaves with exit 3 on its own. Not a bound on the whole wait: a writer that gathers
16k snapshots for a minute keeps everyone waiting as long as it moves."""


REPORT_STALL_S = 10.0
"""After the verdict, how long a host's copier waits for the writer's progress to move while
the report's chunks are not all there."""
SHARED_TOTAL_MAX = 256 * 2**20
"""What all other hosts fetching the report's copy may cost the store together: every job of a
few nodes gets the whole report on each (what each node's gate wants), a 16k-rank job's 2047
other nodes get a cut copy (issue 21: N/8 hosts fetching an O(N) report is O(N^2) bytes)."""
SHARED_REPORT_MAX = 4 * 1024 * 1024
"""The largest report copied through the store for the other hosts (64 chunks). Past it the
copy leaves out the probes' details (the per-rank tables, stacks, recorder tails: what grows
with the ranks) and says where the full report is: each host's copy is read by its local rank
0, so a 16k-rank job's full copies would move N/8 x the report through the store."""
NEWS_STEP = 1 << 32
"""What the writer adds to its progress counter when the waiters must look (the verdict is out,
ranks are asked to re-read), where it adds 1 for "still going": each waiter reads the verdict
only on news (count // NEWS_STEP moved), not at every stage (16k ranks x 2 requests a stage).
Far above any count of stages and heartbeats; far below the store's 64-bit counter."""
LONG_STAGE_MAX_S = 300.0
"""The longest a stage of the writer keeps its progress moving by itself (`Incident.moving`):
the analysis of 16k ranks' snapshots is estimated at a minute or two (issue 21)."""
CHUNK_BYTES = MAX_STORE_VALUE - 1024
"""One chunk of the shared report: raw JSON bytes, under MAX_STORE_VALUE."""


_SHEDDABLE = ("recent", "step_walls")
"""What a snapshot can lose first when it is too big: the analysis reads them when present."""
HISTORY_MAX_BYTES = 1024 * 1024
"""The most one rank's packed history may take in the store (in parts under 64 KB): 512
records pack to ~10 KB; a history past this keeps its newest records."""


@dataclass(frozen=True)
class Seat:
    """Where a rank runs, as its launcher says. A node is one launcher's share of the job
    (torchrun's agent: GROUP_RANK, LOCAL_WORLD_SIZE ranks), not a hostname: two agents on one
    machine are two nodes sharing a hostname, each with its own launcher waiting for its copy
    of the report."""

    host: str
    node: int = 0
    local_rank: int = 0
    local_world_size: int = 1

    @classmethod
    def of(cls, info: HasHost) -> Seat:
        """The seat of a LaunchInfo (or anything with its fields; missing ones take defaults)."""
        return cls(str(info.host), int(getattr(info, "node", 0)), int(getattr(info, "local_rank", 0)),
                   int(getattr(info, "local_world_size", 1) or 1))

    def nodes(self, world: int) -> int:
        """How many nodes a job of `world` ranks has, this node's size taken for every node's."""
        return max(world // max(self.local_world_size, 1), 1)

    def other_node(self, host: str | None, node: int | None) -> bool:
        """Whether (`host`, `node`) is another node than this one."""
        return (host, node) != (self.host, self.node)


def write_stamped(report: Report, path: str) -> tuple[str, str | None, str]:
    """Write the report at `path` atomically, stamped with this node's launch id, serialised
    once (the file, stdout and the other nodes' copy share the text: a second a time at 16k
    ranks). (the JSON, the absolute path written or None, why not)."""
    report.launch_id = launch_id()
    text = report.to_json()
    try:
        write_report(report, path, text=text)
    except OSError as exc:
        return text, None, str(exc.strerror or exc)
    return text, os.path.abspath(path), ""


def _remembered(verdict: Verdict) -> Verdict:
    """A verdict received: remembered for torchrun's error file (runtime/lastword.py)."""
    remember(verdict)
    return verdict


def _packed(snap: RankSnapshot) -> tuple[bytes, bytes | None]:
    return snapwire.pack(snap.to_dict())


def compact_snapshot(snap: RankSnapshot, limit: int = MAX_STORE_VALUE) -> tuple[bytes, bytes | None]:
    """(the snapshot, its long history) packed for the store (distdiag/runtime/snapwire.py:
    labels by reference, compressed, the history under its own key). The snapshot fits `limit`:
    it drops the recent records, the recorder's entries, then the stack's deepest frames,
    saying what it dropped in `trimmed`; the history keeps its newest records within
    HISTORY_MAX_BYTES."""
    core, hist = _packed(snap)
    trimmed: list[str] = []
    steps: list[tuple[str, Callable[[], object]]] = [(k, partial(snap.extra.pop, k, None)) for k in _SHEDDABLE]
    engine = snap.engine
    if engine is not None:
        engine.extra = dict(engine.extra)  # read from a dict the caller keeps: drop from a copy
        steps.append(("engine.entries", lambda: engine.extra.pop("entries", None)))
    records = snap.extra.get("history")
    while hist is not None and len(hist) > HISTORY_MAX_BYTES and isinstance(records, list) and len(records) > 16:
        records = snap.extra["history"] = records[len(records) // 2:]
        trimmed.append("history (oldest)")
        snap.extra["trimmed"] = sorted(set(trimmed))
        core, hist = _packed(snap)
    while len(core) > limit and (steps or len(snap.stack) > 4):
        if steps:
            name, drop = steps.pop(0)
            if drop() is None:
                continue  # nothing of that kind in it
            trimmed.append(name)
        else:
            snap.stack = snap.stack[-max(4, len(snap.stack) // 2):]
            trimmed.append("stack")
        snap.extra["trimmed"] = sorted(set(trimmed))
        core, hist = _packed(snap)
    if len(core) > limit:
        # Still too big (thousands of groups of members in no order): who it is and where,
        # without the recorder's view; the writer judges it from its stack.
        bare = RankSnapshot(rank=snap.rank, host=snap.host, pid=snap.pid, phase=snap.phase, probe_index=snap.probe_index,
                            step=snap.step, steps=snap.steps, event=snap.event, event_key=snap.event_key,
                            stack=[str(f)[:500] for f in snap.stack[-4:]], extra={"trimmed": ["engine", "history", "stack"]})
        core, hist = _packed(bare)
    if len(core) > MAX_STORE_VALUE:
        raise StoreValueTooLarge(f"store value 'snap' is {len(core)} bytes, over distdiag's limit of {MAX_STORE_VALUE}")
    return core, hist


def post_snapshot(ex: Exchange, key: str, snap: RankSnapshot, *, count: bool = True) -> None:
    """Post a snapshot under `key` as Exchange.post does (KEY/<rank>, counted), packed; its
    history first (under snapwire.history_key(key), in parts), so a writer that counts the
    snapshot finds the history there. `count` False: a re-read replacing a snapshot."""
    core, hist = compact_snapshot(snap)
    if hist is not None:
        ex.put(f"{snapwire.history_key(key)}/{ex.rank}", hist)
    with bounded(f"set {key}"):
        ex.store.set(f"{key}/{ex.rank}", core)
        if count:
            ex.store.add(f"{key}/n", 1)


def collect_snapshots(ex: Exchange, key: str, ranks: list[int] | None = None,
                      cache: dict[str, str] | None = None, *, histories: bool = False) -> dict[int, dict[str, Any]]:
    """The snapshots posted under `key` (of `ranks`, default all), as dicts with their labels
    restored (`cache`: one string per distinct label across the gather); with `histories`,
    each with its long history."""
    cache = {} if cache is None else cache
    snaps = {int(r): snapwire.unpack(s, cache) for r, s in ex.collect(key, ranks).items()}
    if histories and snaps:
        for r, history in collect_histories(ex, key, None if ranks is None else sorted(snaps), cache).items():
            if r in snaps:
                snaps[r]["history"] = history
    return snaps


def collect_histories(ex: Exchange, key: str, ranks: list[int] | None = None,
                      cache: dict[str, str] | None = None) -> dict[int, list[dict[str, Any]]]:
    """The long histories posted with the snapshots under `key`, by rank (ranks that posted none
    are absent)."""
    cache = {} if cache is None else cache
    out = {}
    for r, value in ex.collect(snapwire.history_key(key), ranks).items():
        value = snapwire.unpack(value, cache)
        if isinstance(value, dict) and isinstance(value.get("history"), list):
            out[int(r)] = value["history"]
    return out


# long: the one protocol object: every step both the check and the watchdog take (declare,
# snapshot, claim, gather's progress, write, publish, wait, mirror) in one place
class Incident:
    """One incident seen by one rank: its keys, its store client, and the writer's progress."""

    def __init__(self, ex: Exchange, keys: IncidentKeys, world: int, store_factory: Callable[[], Any] | None = None,
                 seat: Seat | None = None) -> None:
        self.ex = ex
        self.keys = keys
        self.world = world
        self.rank = ex.rank
        self.store_factory = store_factory
        self.seat = seat if seat is not None else Seat("")
        """Where this rank runs: what `publish` says of the writer and `mirror` compares with it."""
        self.stage_text = ""
        self.gathered: dict[str, int] = {}
        """The writer's: how the snapshots came (distdiag/runtime/nodes.py gather_snapshots)."""

    # -- every rank ------------------------------------------------------------------------
    def declare(self, event: IncidentEvent) -> None:
        """Say why the run stops. The check's incident (no epoch): each rank's reason under
        `abort_reason` (a PEER event only follows a reason already there, and adds none); the
        watchdog's event #N: the first rank's event, the others' are ignored (`declared`)."""
        if self.keys.epoch is None:
            if event.kind is not EventKind.PEER:
                self.ex.post(Keys.ABORT_REASON, event.to_dict())
            return
        key = Keys.event(self.keys.epoch)
        self.ex.store.compare_set(key, "", checked_value(key, event.to_dict()))

    def declared(self) -> IncidentEvent:
        """The watchdog's event #N, as the first rank declared it."""
        assert self.keys.epoch is not None, "the check's incident has one reason per rank (abort_reason)"
        with bounded(f"get {Keys.event(self.keys.epoch)}"):
            return IncidentEvent.from_dict(json.loads(self.ex.store.get(Keys.event(self.keys.epoch))))

    def post_snapshot(self, snap: RankSnapshot) -> None:
        """Post this rank's snapshot (capped) and count it."""
        post_snapshot(self.ex, self.keys.snap, snap)

    def repost_snapshot(self, snap: RankSnapshot) -> None:
        """Replace this rank's snapshot (the writer asked again); the count stays as it is."""
        snap.reread = True
        post_snapshot(self.ex, self.keys.snap, snap, count=False)

    def wait_snapshots(self, deadline: float, *, poll_s: float = 0.05) -> bool:
        return self.ex.wait_count(self.keys.snap, self.world, deadline, poll_s=poll_s)

    def claim_writer(self, who: str = "") -> bool:
        return self.ex.claim(self.keys.writer, who)

    def snapshots(self, ranks: list[int] | None = None) -> dict[int, RankSnapshot]:
        """The snapshots of `ranks` (a few: the writer's re-reads) with their long histories."""
        snaps = collect_snapshots(self.ex, self.keys.snap, ranks, histories=True)
        return {r: RankSnapshot.from_dict(s) for r, s in snaps.items()}

    # -- the writer ------------------------------------------------------------------------
    def advance(self, stage: str, *, news: bool = False) -> None:
        """The writer moved on (a stage, or k more snapshots): waiters keep waiting. `news`:
        something the waiters must read (a request to re-read) came with it (NEWS_STEP)."""
        self.stage_text = stage
        try:
            with bounded(f"add {self.keys.progress}"):
                self.ex.store.add(self.keys.progress, NEWS_STEP if news else 1)
                self.ex.store.set(self.keys.stage, checked_value(self.keys.stage, stage[:200]))
        except Exception as exc:  # noqa: BLE001 - progress is advisory; the verdict is what matters
            log.debug("could not note the writer's progress: %s", exc)

    @contextmanager
    def moving(self, stage: str, *, every_s: float = 1.0, at_most_s: float = LONG_STAGE_MAX_S) -> Iterator[None]:
        """A long stage of the writer (the analysis of thousands of snapshots): its progress
        keeps moving while the stage runs, for at most `at_most_s` (a writer stuck inside the
        stage stalls then, and the waiters leave)."""
        self.advance(stage)
        done = threading.Event()
        store, key = self.ex.store, self.keys.progress

        def beat() -> None:
            end = time.monotonic() + at_most_s
            while not done.wait(every_s) and time.monotonic() < end:
                try:
                    store.add(key, 1)
                except Exception:  # noqa: BLE001 - advisory; the stage's own end says more
                    return

        thread = threading.Thread(target=beat, name="distdiag-writer-progress", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join(every_s + 1.0)

    def publish_verdict(self, verdict: Verdict) -> bool:
        """The small verdict, first; one new store client if the first try fails (the old one
        may be broken by an earlier failed write). False when no verdict could be published:
        the caller says so in one line."""
        remember(verdict)  # torchrun's error file says it when this rank leaves (runtime/lastword.py)
        text = checked_value(self.keys.verdict, verdict.to_dict())
        for attempt in (1, 2):
            try:
                with bounded(f"set {self.keys.verdict}"):
                    self.ex.store.set(self.keys.verdict, text)
                    self.ex.store.add(self.keys.progress, NEWS_STEP)  # the waiters read the verdict on news
                return True
            except Exception as exc:  # noqa: BLE001 - reconnect once, then give up loudly
                log.debug("publishing the verdict failed (attempt %d): %s", attempt, exc)
                if attempt == 2 or not self.reconnect():
                    print_line(f"distdiag[rank {self.rank}]: could not publish the verdict through the job's store "
                               f"({type(exc).__name__}: {exc}); the other ranks will leave on their own (exit 3)")
                    return False
        return False

    def reconnect(self) -> bool:
        """A new client of the job's store in place of one a failed call may have broken."""
        if self.store_factory is None:
            return False
        try:
            self.ex = Exchange(self.store_factory(), self.rank, self.world)
        except Exception as exc:  # noqa: BLE001 - no store: the caller falls back
            log.debug("could not reconnect to the job's store: %s", exc)
            return False
        return True

    @staticmethod
    def _parts(text: str) -> list[bytes]:
        data = text.encode()
        return [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]

    def chunk_count(self, text: str) -> int:
        """How many chunks `publish_report` will write for this text (the verdict says it first)."""
        return len(self._parts(text))

    def shared_copy(self, text: str, where: str, host: str, readers: int = 1, report: Report | None = None) -> str:
        """What the other hosts get of the report, within SHARED_REPORT_MAX and within what
        `readers` hosts fetching it may cost the store together (SHARED_TOTAL_MAX): the whole
        report; else without the probes' details (the per-rank tables, stacks, recorder tails:
        what grows with the ranks); else without the rank table too; else the verdict alone.
        Each cut copy says where the full report is, and stays a valid report. `report`: the
        Report `text` is the JSON of, when the caller has it (a cut copy is then made from it
        without its details, not by parsing 30-60 MB of JSON back)."""
        limit = min(SHARED_REPORT_MAX, SHARED_TOTAL_MAX // max(readers, 1))
        size = len(text.encode())
        if size <= limit:
            return text
        note = f"a copy: the details were left out (the full report is {size} bytes); the full report is on host {host} at {where}"
        data = _without_details(report, note) if report is not None else json.loads(text)
        for probe in data.get("probes") or []:
            probe["details"] = {"note": note}
        for cut in ("ranks", "probes"):
            copy_ = json.dumps(data)
            if len(copy_.encode()) <= limit:
                return copy_
            data[cut] = []
            data.pop("by_node", None)
        data["summary"] = f"{str(data.get('summary', ''))[:2000]} ({note})"
        return json.dumps(data)

    def publish_report(self, text: str, meta: dict[str, Any]) -> int:
        """The report's JSON for other hosts, after the verdict: in chunks of at most
        CHUNK_BYTES, then {meta..., chunks} under the report key. Returns the count, 0 when it
        could not be shared (the writer's copy on disk is the report then; the key then says
        so, so that nobody waits for it)."""
        parts = self._parts(text)
        self.advance(f"sharing the report ({len(parts)} chunk(s))")
        try:
            with bounded(f"set {self.keys.report}"):
                for i, part in enumerate(parts):
                    self.ex.store.set(self.keys.report_chunk(i), part)
                self.ex.store.set(self.keys.report, checked_value(self.keys.report, {**meta, "chunks": len(parts)}))
        except Exception as exc:  # noqa: BLE001 - the local copy exists; say so once
            log.warning("could not share the report through the store (%s: %s); it is on the writer's host only",
                        type(exc).__name__, exc)
            if self.reconnect():
                try:
                    with bounded(f"set {self.keys.report}"):
                        self.ex.store.set(self.keys.report, checked_value(
                            self.keys.report, {**meta, "chunks": 0, "error": f"{type(exc).__name__}: {exc}"[:300]}))
                except Exception:  # noqa: BLE001 - said once above
                    pass
            return 0
        return len(parts)

    def wait_report(self, stall_s: float = REPORT_STALL_S) -> tuple[str | None, dict[str, Any]]:
        """The shared report once the writer published it after the verdict (it comes right
        after); (None, meta) when it could not be shared or the writer stopped moving."""
        last, moved = -1, time.monotonic()
        while True:
            text, meta = self.read_report()
            if meta:
                return text, meta
            count = self.ex.bump(self.keys.progress, 0)
            if count != last:
                last, moved = count, time.monotonic()
            elif time.monotonic() - moved > stall_s:
                return None, {}
            time.sleep(0.05)

    def read_report(self) -> tuple[str | None, dict[str, Any]]:
        """(the report's JSON, its meta) as the writer shared it; (None, {}) when it did not."""
        meta = self.ex.read(self.keys.report)
        if not meta:
            return None, {}
        if "json" in meta:  # a writer of an older version: the whole report in one value
            return str(meta["json"]), meta
        n = int(meta.get("chunks", 0))
        if n <= 0:
            return None, meta
        with bounded(f"multi_get {self.keys.report}"):
            parts = self.ex.store.multi_get([self.keys.report_chunk(i) for i in range(n)])
        return b"".join(bytes(p) for p in parts).decode(), meta

    def write(self, report: Report, path: str) -> tuple[str, str | None, str]:
        """The writer's report on its disk (`write_stamped`)."""
        return write_stamped(report, path)

    def publish(self, report: Report, text: str, where: str) -> Verdict:
        """The verdict first (small: every waiting rank acts on it), then the report's JSON for
        the other nodes in chunks. Each node but the writer's fetches one copy (`mirror`), so
        the copy is sized for nodes - 1 readers (`shared_copy`). `where`: the writer's copy."""
        seat = self.seat
        shared = self.shared_copy(text, where, seat.host, readers=seat.nodes(self.world) - 1, report=report)
        verdict = Verdict(report.exit_code, self.rank, seat.host, seat.node, report.outcome, report.summary, where,
                          chunks=self.chunk_count(shared), blamed=blamed_ranks(report))
        self.publish_verdict(verdict)
        self.publish_report(shared, {"host": seat.host, "node": seat.node})
        return verdict

    def mirror(self, verdict: Verdict, path: str) -> dict[str, Any] | None:
        """On local rank 0 of every node but the writer's: this node's copy of the report at
        `path` (no shared filesystem assumed), stamped with this node's launch id (its launcher
        takes only that). Another node is another (host, node) pair (`Seat`); a copy is never
        written over the writer's own file (one host, one path). The copy written, else None;
        OSError when it cannot be written."""
        seat = self.seat
        if seat.local_rank != 0 or not seat.other_node(verdict.host, verdict.node) or verdict.chunks <= 0:
            return None
        if verdict.host == seat.host and verdict.report == os.path.abspath(path):
            return None
        text, meta = self.wait_report()
        if text is None or not seat.other_node(meta.get("host"), meta.get("node")):
            return None
        text = with_this_launch_id(text.rstrip("\n"))
        write_json_atomic(path, text)
        data: dict[str, Any] = json.loads(text)
        return data

    def wait_published(self, slice_s: float, aborted: Callable[[], bool]) -> Verdict | None:
        """The verdict of a run whose every probe finished (the check's normal end: one rank
        consolidates for as long as it takes, nobody follows a progress counter). A blocking
        wait on the store, not polls: the store answers every waiting rank the moment the
        verdict is set, and costs nothing meanwhile (16k ranks polling took a quarter of its
        core). In slices of `slice_s`; None once `aborted()` says so after one (the sentinel
        ends the run then)."""
        key = self.keys.verdict
        while True:
            try:
                with bounded(f"wait {key}"):
                    self.ex.store.wait([key], timedelta(seconds=slice_s))
            except Exception as exc:  # noqa: BLE001 - the slice's timeout; a broken store raises in read below
                log.debug("waiting for the verdict: %s", exc)
            if aborted():
                return None
            got = self.ex.read(key)
            if got is not None:
                return Verdict.from_dict(got)

    # -- the others ------------------------------------------------------------------------
    def wait_verdict(self, stall_s: float = WRITER_STALL_S, *, poll_s: float = 0.05,
                     stop: Callable[[], bool] | None = None) -> tuple[Verdict | None, str]:
        """The verdict, waiting while the writer's progress moves; (None, why) once it stood
        still for stall_s (no writer yet counts as standing still). One request a poll, the
        progress counter: the writer bumps it by 1 as it goes and by NEWS_STEP after asking
        ranks to re-read and after the verdict, so the verdict and `stop()` are read only when
        there is news (at the first poll, then twice an incident at most), not at every stage.
        Polls every `poll_interval(poll_s, N)`, the first at a random point of it (16k ranks
        polling every 50 ms with three requests each offered the store a million requests a
        second)."""
        interval = poll_interval(poll_s, self.world)
        last, seen_news, moved = -1, -1, time.monotonic()
        delay = interval * random.uniform(0.5, 1.0) if interval > poll_s else 0.0
        while True:
            time.sleep(delay)
            delay = interval
            now = time.monotonic()
            count = self.ex.bump(self.keys.progress, 0)
            if count != last:
                last, moved = count, now
                if count // NEWS_STEP != seen_news:
                    seen_news = count // NEWS_STEP
                    got = self.ex.read(self.keys.verdict)
                    if got is not None:
                        return _remembered(Verdict.from_dict(got)), ""
                    if stop is not None and stop():
                        return None, "stopped waiting"
            elif now - moved > stall_s:
                got = self.ex.read(self.keys.verdict)  # published just before the writer stopped
                if got is not None:
                    return _remembered(Verdict.from_dict(got)), ""
                stage = self._stage()
                at = f" (last at: {stage})" if stage else (" (no rank claimed the writer role)" if last <= 0 else "")
                return None, f"the writer made no progress for {stall_s:g}s{at}"

    def ask_again(self, ranks: list[int]) -> None:
        """The writer asks `ranks` to post their snapshots again (they contradicted the others);
        the progress moves after, so that the ranks waiting for the verdict look."""
        for r in ranks:
            with bounded(f"set {self.keys.again(r)}"):
                self.ex.store.set(self.keys.again(r), "1")
        self.advance(f"re-reading {len(ranks)} snapshot(s) that contradict the others", news=True)

    def _stage(self) -> str:
        try:
            with bounded(f"get {self.keys.stage}"):
                if not self.ex.store.check([self.keys.stage]):
                    return ""
                return bytes(self.ex.store.get(self.keys.stage)).decode()
        except Exception:  # noqa: BLE001 - only for the message
            return ""


# -- ranks that posted nothing -------------------------------------------------------------

_LOCAL_TEXT = {
    SilentReason.GONE: "its process (pid {pid}) is gone: killed or exited",
    SilentReason.STOPPED: "its process (pid {pid}) is stopped (SIGSTOP or a debugger)",
    SilentReason.ALIVE_SILENT: "its process (pid {pid}) is alive but its {who} did not answer (holding the GIL?)",
}


def _without_details(report: Report, note: str) -> dict[str, Any]:
    """The report's dict with each probe's details left out (they are most of a large report)."""
    import copy
    import dataclasses

    cut = copy.copy(report)
    cut.probes = [dataclasses.replace(p, details={"note": note}) for p in report.probes]
    return cut.to_dict()


def silent_rank_reasons(
    missing: list[int], infos: dict[int, Any], host: str, who: str = "sentinel", starting_host: str | None = None,
) -> dict[int, Silence]:
    """Why each rank that posted nothing is silent, as far as this host can tell.

    `infos` maps rank -> an object with `host` and `pid` (RankInfo) for the ranks that checked
    in; same-host ranks are looked at by pid, the others can only be "no answer". A rank with
    no entry never checked in; `starting_host` names its host when every rank starts on one.
    """
    lost: dict[int, Silence] = {}
    for r in missing:
        info = infos.get(r)
        if info is not None and info.host == host and info.pid > 0:
            state = process_state(info.pid)
            reason = {"gone": SilentReason.GONE, "stopped": SilentReason.STOPPED,
                      "alive": SilentReason.ALIVE_SILENT}.get(state, SilentReason.OTHER_STATE)
            text = _LOCAL_TEXT.get(reason, "its process (pid {pid}) is in state {state}").format(
                pid=info.pid, who=who, state=state)
            death = deathnote.read(info.pid) if reason is SilentReason.GONE else None
            if death is not None:
                text = f"its process (pid {info.pid}) is gone: {death.text()}"
            lost[r] = Silence(reason, text, death)
        elif info is None:
            on = f" on host {starting_host}" if starting_host else ""
            lost[r] = Silence(SilentReason.NEVER_CHECKED_IN, (
                f"it never checked in (no rank table entry){on}: it was still starting - importing torch or the "
                "target, or connecting to the job's store - or it died before connecting"
            ))
        else:
            lost[r] = Silence(SilentReason.NO_ANSWER, f"no answer from host {info.host} (dead, stopped or unreachable)")
    return lost


def kill_pid(pid: int) -> None:
    """SIGKILL, ignoring a process that is already gone."""
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def kill_stopped_local(lost: Mapping[int, Any], infos: dict[int, Any], host: str) -> None:
    """A stopped process ignores SIGTERM: end the same-host ranks `lost` calls stopped, by pid."""
    for r, why in lost.items():
        info = infos.get(r)
        if (info is not None and Silence.reason_of(why) is SilentReason.STOPPED and info.host == host
                and 0 < info.pid != os.getpid()):
            kill_pid(info.pid)


def process_state(pid: int) -> str:
    """How a same-host process looks from outside: gone, stopped, zombie or alive."""
    try:
        status = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return "gone"
    except psutil.Error:
        return "unknown"
    if status in (psutil.STATUS_STOPPED, getattr(psutil, "STATUS_TRACING_STOP", "tracing-stop")):
        return "stopped"
    if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
        return "gone"
    return "alive"
