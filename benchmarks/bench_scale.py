"""distdiag's store traffic at cluster scale: one real TCPStore, N simulated ranks (issue 21).

    python benchmarks/bench_scale.py --ranks 1024 4096 16384 [--json] [--clients 2]

One torch TCPStore server (its own process, as torchrun's agent hosts it) and N simulated
ranks, replaying the store operations distdiag's own code issues, through its own functions:

- the hang incident: every rank's snapshot (tests/unit/hang_incident.py, a TP=8 x PP=4 x DP
  job with rank 3 stalled outside any collective) is posted under `snap/1`; then, from the
  declaration on, the writer runs `distdiag.watchdog.writer.gather_and_write` and
  `publish_outcome` (in `_hang_write`, the one place that calls them): the verdict first, then
  the report's copy in chunks, while every other rank polls for the
  verdict as distdiag/watchdog/watcher.py does and each node's local rank 0 fetches the shared
  report. `hang_report_s`: the declaration -> the verdict published (the report is on disk
  before it); `hang_writer_done_s`: -> the writer done (the other hosts' copy shared, what it
  worked on freed).
- the check's end: every rank posts its row (`info`), then, once the clock starts, its results
  of the default suite's probes one probe after another, as distdiag/check/run.py posts them
  (shared fields stored once; the JSON made beforehand, as each real rank makes its own), with
  the healthy payloads of benchmarks/bench_gate_scaling.py `made` (tests/unit/check_payloads.py:
  scaled from what the real probes posted; moe_routing's built-in layer in expert-parallel
  groups of up to 8 ranks); between two probes each client waits in the probe's barrier as
  run.py `_post_and_wait` does (a count polled at the scaled interval, 0.66 s at 16k); the
  probes themselves take no time (a real one takes its time: more lead for rank 0's thread).
  Rank 0 runs the real distdiag.check.finish.RunEnd: its thread consolidates each probe as
  its barrier returns (`consolidate_ahead`, `Ahead.ready`; distdiag/check/ahead.py), then
  `consolidate` and `emit`, and waits for acks and leaving as `_finish` does, while the
  others wait for the verdict, node leaders fetch the shared report, and every rank acks and
  leaves. `check_exchange_s`: the last result posted -> every simulated rank has read the
  verdict; `check_seen_s`: -> rank 0's barrier returned; `check_ahead_behind_s`: how long
  after that its thread finished the probes before the last (<= 0: it was done);
  `check_probes_s`: each probe's [name, barrier returned, consolidated] from that moment;
  `check_posting_s`: the clock's start -> the last result posted (the probes' spacing here).

Simulated ranks share clients: `--clients` processes each hold ONE TCPStore client and play
N/clients ranks in turn (one connection per rank would be 16k sockets and 16k interpreters'
worth of clients on a 2-core machine; the server's cost is per request, not per connection,
so the requests are the same - what is not replayed is 16k requests in flight at once, and a
rank's poll is late when its client is busy with the others: the offered poll rate is then
below the real code's, which the output says as `poll_rate_shortfall`).

Per N (`--json`: one object per line): ranks, hang_report_s, check_exchange_s,
max_store_value_bytes (every set/compare_set of every client, writer included, measured by a
wrapper around the client), writer_peak_mb (the writer process's RSS growth over the incident,
psutil peak), store_ops_per_s (requests issued by all clients / the phase's wall time), and
server_core_share (the server process's CPU time / wall time, psutil: 1.0 is one core busy).
Also: hang_writer_cpu_s / check_writer_cpu_s (the writer process's CPU seconds over the same
stretch: its own work, apart from waiting for a core it shares here with the store server and
the client processes), check_consolidate_s / check_verdict_out_s (rank 0 had consolidated / had published the
verdict, from the same moment), hang_max_value_bytes / check_max_value_bytes (the largest
value each part set), rank_value_max_bytes (the largest a simulated rank set: its posted
results, its snapshot), hang_error / check_error (what the writer raised), store_rejected_values
(values the server refused: over its 8 MiB limit), ranks_without_verdict, and late_rounds
(poll rounds a client could not finish within the real interval: the offered poll rate was
then below the real code's).
hang_cores_busy: the server's, the client processes' and the writer's CPU over the hang phase, in
cores. writer_core: "own" by default, where the writer has core 0 to itself and the store server,
the client processes and this one share the others (on a real job the 16k ranks run on other
hosts; two client processes playing them beside the writer took half of its core here);
`--shared-cores` lets them all share every core.
Snapshots are posted as the watchdog posts them (distdiag/runtime/snapwire.py: labels by
reference, compressed, the history under its own key), and each node's leader (local rank 0,
ranks 8, 16, ...) posts its node's snapshots as one value (distdiag/runtime/nodes.py). On a
real job the 2048 leaders do that at once, each on its own host, while the writer waits for
the snapshots; here two clients would do them one after another, so they run before the
declaration and each leader's time is given apart: `leader_aggregate_ms` (median and max of
one leader: its read of the node's rows, the wait for its 8 snapshots, the read and the post).

`--from-declaration` (with `--grace S`): the hang's clock starts at the declaration instead,
with what a real job adds before the report: each rank notices the event at its own watchdog
tick (`poll_interval(WatchdogConfig().poll_s, N)`), takes a snapshot shaped like a real one
(benchmarks/results/real_snapshot.json, from benchmarks/capture_snapshot.py: a real gloo run's
24-frame stack and recorder tail with call sites) in that run's measured CPU time, posts it,
node leaders wait for their ranks (nodes.py's poll and bound) and post, and the writer (every
core shared: no pinning) runs gather_and_write. `hang_from_declaration`: each stage's seconds
from the declaration (the last rank to notice, to post, the last node value; the writer's
stages, with its CPU at each), the lead finding, how the snapshots came, and how far the
client processes fell behind their ranks' schedules (`client_lag_max_s`). The check's phase
is unchanged but for the shared cores. docs/benchmarks.md "The hang report from the declaration".
`--post-only`: the ranks post on their schedule and leave (no polls for the verdict: those are
most of the clients' CPU, and their lag made leaders late); `--hang-only` (with `--json`): no
check phase.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SERVER = (
    "import sys, torch.distributed as d\n"
    "s = d.TCPStore('127.0.0.1', 0, None, True, wait_for_workers=False)\n"
    "print(s.port, flush=True)\n"
    "sys.stdin.read()\n"
)
TARGET_VALUE_BYTES = 64 * 1024
WATCHER_POLL_S = 0.05  # distdiag/watchdog/watcher.py: wait_read(verdict/epoch, poll_s=0.05)
CHECK_VERDICT_POLL_S = 0.02  # after the blocking wait (run.py _await_verdict) each rank reads the verdict once
LEAVE_POLL_S = 0.05  # distdiag/check/finish.py: wait_count("left", poll_s=0.05)
VERDICT_WAIT_S = 120.0  # watcher.py waits while the writer's progress moves (a 20 s stall ends it); it moves throughout here
CHECK_WAIT_S = 60.0  # the check's ranks wait until their sentinel ends the run (its probe timeout)


class Recorder:
    """A store client that counts the requests it sends and the largest value it sets."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.ops = 0
        self.max_value = 0
        self.verdict_at: float | None = None
        """When this client first set a verdict key (the writer publishing it)."""

    def _sized(self, value: Any) -> None:
        self.max_value = max(self.max_value, len(value))

    def set(self, key: str, value: Any) -> None:
        self.ops += 1
        self._sized(value)
        self._store.set(key, value)
        if self.verdict_at is None and key.startswith("verdict"):
            self.verdict_at = time.time()

    def compare_set(self, key: str, expected: Any, value: Any) -> Any:
        self.ops += 1
        self._sized(value)
        return self._store.compare_set(key, expected, value)

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.ops += 1
            return fn(*args, **kwargs)

        return counted


def _client(port: int, prefix: str) -> Recorder:
    from datetime import timedelta

    import torch.distributed as dist

    base = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=300))
    return Recorder(dist.PrefixStore(prefix, base))


def _info(rank: int) -> dict[str, Any]:
    from tests.unit.hang_incident import TP, host_of

    return {"rank": rank, "host": host_of(rank), "node": rank // TP, "local_rank": rank % TP,
            "device": f"cuda:{rank % TP}", "pid": 10000 + rank % TP}


# -- simulated ranks (one client process plays ranks lo..hi-1) ---------------------------------
def _snapshot(rank: int, world: int) -> dict[str, Any]:
    from tests.unit.hang_incident import coords, rank_snapshot

    dp, pp, _tp = coords(rank)
    inside = (None if rank == 3 else "tp") if (dp, pp) == (0, 0) else ("pp" if dp == 0 else "dp")
    snap = rank_snapshot(rank, world, inside)
    snap["event"] = {"kind": "timeout", "rank": 3, "detail": "no progress for 60s"}
    return snap


REAL_SNAPSHOT = ROOT / "benchmarks" / "results" / "real_snapshot.json"
"""One real rank's snapshot and what taking it cost (benchmarks/capture_snapshot.py: a real
gloo run, torch's flight recorder of 2,000 entries, a 30-frame call chain)."""


def _real() -> dict[str, Any]:
    return json.loads(REAL_SNAPSHOT.read_text())


def _real_snapshot(rank: int, world: int, real: dict[str, Any]) -> dict[str, Any]:
    """The scenario's snapshot of `rank` (its groups and positions, what the analysis judges)
    in a real rank's shape: the captured recorder tail (32 entries with their call sites) on
    this rank's groups, numbered up to its own counts, the captured 24-frame stack above the
    scenario's innermost frames, and the captured snapshot's other fields."""
    from tests.unit.hang_incident import groups_of, label

    snap = _snapshot(rank, world)
    captured = real["snapshot"]
    for key, value in captured.items():
        snap.setdefault(key, value)
    labels = {k: label(k, m) for k, m in groups_of(rank, world).items()}
    done = {g["group"]: g["completed"] for g in snap["engine"]["groups"]}
    real_groups = sorted({e["group"] for e in captured["engine"]["entries"]})
    mine = [labels["dp"], labels["tp"], labels["pp"]]
    to = {g: mine[i % len(mine)] for i, g in enumerate(real_groups)}
    last = {g: max(e["seq"] for e in captured["engine"]["entries"] if e["group"] == g) for g in real_groups}
    # torch names a group in its recorder by a short id (`pg`, `pg_id`: "0", "1", ...), the label
    # (its members) is the view's `group`: the ids of this rank's groups, as its positions say
    pg_of = {g["group"]: g["pg"] for g in snap["engine"]["groups"]}
    entries = []
    for e in captured["engine"]["entries"]:
        group = to[e["group"]]
        seq = done.get(group, 0) - (last[e["group"]] - e["seq"])
        if seq >= 1:  # the scenario's groups have done a few collectives: the tail holds those
            pg = pg_of.get(group, e["pg"])
            entries.append({**e, "group": group, "pg": pg, "pg_id": pg, "seq": seq})
    snap["engine"]["entries"] = entries
    snap["stack"] = (captured["stack"][:-3] + snap["stack"])[-len(captured["stack"]):]
    return snap


def _read_cost(real: dict[str, Any], rng: random.Random) -> float:
    """Seconds one rank takes from noticing the event to its snapshot packed, on its own core:
    the captured run's CPU for the recorder read, torch's stack dump, its parse (the call
    sites) and the pack, each drawn from its measured values."""
    parts = real["parts_cpu_s"]
    return sum(rng.choice(parts[k]) for k in ("read_without_sites", "torch_stack_dump", "parse_stack_dump")) + rng.choice(
        real["pack_s"])


def _leaders(incident_of: dict[int, Any], world: int) -> list[float]:
    """Each node leader of these ranks (local rank 0, not the writer's node) posts its node's
    snapshots as distdiag/watchdog/watcher.py `_aggregate_node` does; the seconds each took."""
    from distdiag.report.model import RankInfo
    from distdiag.runtime.keys import Keys
    from distdiag.runtime.nodes import aggregate_node, node_members

    took = []
    for r in [r for r in incident_of if r % 8 == 0]:
        incident = incident_of[r]
        start = time.perf_counter()
        rows = incident.ex.collect(Keys.INFO, list(range(r, min(r + 8, world))))
        aggregate_node(incident, node_members({k: RankInfo.from_dict(v) for k, v in rows.items()}, r))
        took.append(time.perf_counter() - start)
    return took


def _interval(poll_s: float, world: int) -> float:
    """The interval one rank's wait polls at in the code under test (distdiag/runtime/exchange.py
    scales it with the world since issue 21; before, it was the wait's own poll_s)."""
    from distdiag.runtime import exchange

    scaled = getattr(exchange, "poll_interval", None)
    return scaled(poll_s, world) if scaled is not None else poll_s


def _poll_until(ranks: list[int], period: float, poll: Any, limit_s: float) -> tuple[float, int, int]:
    """Each of `ranks` runs poll(rank) once every `period` until it returns True (the real
    code's wait loop, one rank after another on this client), for at most limit_s (the real
    wait's own limit); (when the last one got it, how many rounds ran late, how many gave up)."""
    waiting = list(ranks)
    late = 0
    end = time.monotonic() + limit_s
    while waiting and time.monotonic() < end:
        start = time.monotonic()
        waiting = [r for r in waiting if not poll(r)]
        spent = time.monotonic() - start
        if spent > period:
            late += 1
        elif waiting:
            time.sleep(period - spent)
    return time.time(), late, len(waiting)


def _hang_ranks(port: int, prefix: str, world: int, lo: int, hi: int, out: Any) -> None:
    import distdiag.runtime.incident as incident_module
    from distdiag.hang.records import RankSnapshot
    from distdiag.runtime.exchange import Exchange
    from distdiag.runtime.incident import Incident
    from distdiag.runtime.keys import IncidentKeys, Keys

    store = _client(port, prefix)
    for r in range(lo, hi):
        Exchange(store, r, world).post(Keys.INFO, _info(r))
    inc = {r: Incident(Exchange(store, r, world), IncidentKeys(1), world) for r in range(lo, hi) if r != 0}
    for r, incident in inc.items():
        incident.post_snapshot(RankSnapshot.from_dict(_snapshot(r, world)))
    leaders = _leaders(inc, world)
    store.add("ready", 1)
    store.wait(["go"])
    cpu0 = _cpu()

    last: dict[int, int] = {}

    news_step = getattr(incident_module, "NEWS_STEP", 1)  # before it, every move of the progress was news

    def poll(r: int) -> bool:  # watcher.py _await -> Incident.wait_verdict: the progress each poll,
        incident = inc[r]      # the verdict and the re-read request only on news (the verdict, a re-read)
        count = incident.ex.bump(incident.keys.progress, 0) // news_step
        if last.get(r) == count:
            return False
        last[r] = count
        verdict = incident.ex.read(incident.keys.verdict)
        if verdict is None:
            incident.ex.store.check([incident.keys.again(r)])
            return False
        if r % 8 == 0 and verdict.get("host") != _info(r)["host"]:
            incident.read_report()  # _mirror: local rank 0 of every other host
        return True

    done_at, late, gave_up = _poll_until(list(inc), _interval(WATCHER_POLL_S, world), poll, VERDICT_WAIT_S)
    out.put({"ops": store.ops, "max_value": store.max_value, "done_at": done_at, "late_rounds": late, "gave_up": gave_up,
             "leaders_s": leaders, "cpu_s": _cpu() - cpu0})


def _declared_ranks(port: int, prefix: str, world: int, lo: int, hi: int, out: Any) -> None:
    """`--from-declaration`: these ranks as a real job's watchdogs run an incident, each on its
    own schedule from the declaration (the go's time): it notices the event at its own tick
    (a random phase of the watchdog's real tick at this world: `poll_interval(poll_s, N)`),
    takes its snapshot (the captured run's measured time: its recorder read, call sites and
    pack, on its own core), posts it, tries the writer's claim, then (a node leader) waits for
    its node's snapshots and posts them as one value, and waits for the verdict as
    Incident.wait_verdict does; a leader of another host then reads the shared report. The
    store requests are the real ones, issued when each rank's schedule says (one client plays
    its ranks in turn: `lag` says how late it got to them); what a rank computes on its own
    core (the snapshot, packing a node's value) is given its measured time, not run here."""
    import heapq

    from distdiag.hang.records import RankSnapshot
    from distdiag.runtime import nodes, snapwire
    from distdiag.runtime.exchange import Exchange
    from distdiag.runtime.incident import NEWS_STEP, compact_snapshot
    from distdiag.runtime.keys import IncidentKeys, Keys
    from distdiag.runtime.nodes import AGGREGATE_WAIT_S
    from distdiag.runtime.nodes import POLL_S as NODE_POLL_S
    from distdiag.watchdog.config import WatchdogConfig

    real = _real()
    rng = random.Random(lo)
    store = _client(port, prefix)
    keys = IncidentKeys(1)
    waits = not os.environ.get(POST_ONLY_ENV)  # `--post-only`: the ranks post and leave
    index_key = f"{keys.node}/at" if hasattr(nodes, "index_key") else None  # the tree before had no index
    ex = {r: Exchange(store, r, world) for r in range(lo, hi)}
    for r in ex:
        ex[r].post(Keys.INFO, _info(r))
    ranks = [r for r in range(lo, hi) if r != 0]
    packed: dict[int, tuple[bytes, bytes | None]] = {}
    dicts: dict[int, dict[str, Any]] = {}
    for r in ranks:
        packed[r] = compact_snapshot(RankSnapshot.from_dict(_real_snapshot(r, world, real)))
        dicts[r] = snapwire.unpack(snapwire.decode(packed[r][0]), {})
    leaders = [r for r in ranks if r % 8 == 0]
    node_value: dict[int, bytes] = {}
    pack_s: dict[int, float] = {}
    for r in leaders:
        start = time.perf_counter()
        node_value[r] = snapwire.pack_many({m: dicts[m] for m in range(r, min(r + 8, world)) if m in dicts})
        pack_s[r] = time.perf_counter() - start  # plus the unpack of 8 values, done once above
    del dicts
    tick = poll_interval_of(WatchdogConfig().poll_s, world)
    wait_every = poll_interval_of(0.05, world)  # Incident.wait_verdict's poll_s
    node_every = poll_interval_of(NODE_POLL_S, world // 8)  # aggregate_node's, one leader a node of 8
    store.add("ready", 1)
    store.wait(["go"])
    t0 = float(store.get("go"))
    cpu0 = _cpu()
    queue: list[tuple[float, int, str]] = [(t0 + rng.uniform(0, tick), r, "tick") for r in ranks]
    heapq.heapify(queue)
    times: dict[str, dict[int, float]] = {"noticed": {}, "posted": {}, "node_posted": {}, "verdict": {}, "mirrored": {}}
    agg_end: dict[int, float] = {}
    seen_news: dict[int, int] = {}
    lag, late = 0.0, 0
    while queue:
        due, r, what = heapq.heappop(queue)
        now = time.time()
        if now < due:
            time.sleep(due - now)
            now = due
        else:
            lag = max(lag, now - due)
            late += now - due > 0.05
        e = ex[r]
        if what == "tick":  # watcher.py _tick: the next event's key
            if not store.check([Keys.event(1)]):
                heapq.heappush(queue, (now + tick, r, "tick"))
                continue
            store.get(Keys.event(1))  # _handle_event reads it
            times["noticed"][r] = now
            heapq.heappush(queue, (now + _read_cost(real, rng), r, "post"))
        elif what == "post":  # Incident.post_snapshot (runtime/incident.py post_snapshot), then the claim
            core, hist = packed.pop(r)
            if hist is not None:
                e.put(f"{snapwire.history_key(keys.snap)}/{r}", hist)
            store.set(f"{keys.snap}/{r}", core)
            store.add(f"{keys.snap}/n", 1)
            store.compare_set(keys.writer, "", f"{r}")  # claim_writer: rank 0 holds it
            times["posted"][r] = time.time()
            if r in node_value:  # watcher.py _aggregate_node: its node's rows, then aggregate_node
                e.collect(Keys.INFO, list(range(r, min(r + 8, world))))
                agg_end[r] = time.monotonic() + AGGREGATE_WAIT_S
                heapq.heappush(queue, (time.time(), r, "aggregate"))
            elif waits:
                heapq.heappush(queue, (time.time() + wait_every * rng.uniform(0.5, 1.0), r, "poll"))
        elif what == "aggregate":
            members = list(range(r, min(r + 8, world)))
            have = e.present(keys.snap, members)
            if len(have) < len(members) and time.monotonic() < agg_end[r]:
                heapq.heappush(queue, (now + node_every, r, "aggregate"))
                continue
            e.collect(keys.snap, have)  # the leader reads its node's values (unpacked and packed: pack_s)
            heapq.heappush(queue, (time.time() + pack_s[r], r, "node"))
        elif what == "node":
            e.put(f"{keys.node}/{r}", node_value.pop(r))
            number = int(store.add(f"{keys.node}/n", 1))
            if index_key is not None:  # nodes.py aggregate_node: which leader posted the number-th value
                store.set(f"{index_key}/{number}", str(r))
            times["node_posted"][r] = time.time()
            if waits:
                heapq.heappush(queue, (time.time() + wait_every * rng.uniform(0.5, 1.0), r, "poll"))
        elif what == "poll":  # Incident.wait_verdict: the progress each poll, the verdict on news
            news = e.bump(keys.progress, 0) // NEWS_STEP
            if seen_news.get(r) == news:
                heapq.heappush(queue, (now + wait_every, r, "poll"))
                continue
            seen_news[r] = news
            verdict = e.read(keys.verdict)
            if verdict is None:
                store.check([keys.again(r)])  # watcher.py _await's stop(): asked to re-read?
                heapq.heappush(queue, (now + wait_every, r, "poll"))
                continue
            times["verdict"][r] = time.time()
            if r % 8 == 0 and verdict.get("host") != _info(r)["host"] and verdict.get("chunks", 0) > 0:
                from distdiag.runtime.incident import Incident

                Incident(e, keys, world).wait_report()  # watcher.py _mirror
                times["mirrored"][r] = time.time()
    out.put({"ops": store.ops, "max_value": store.max_value, "done_at": max(times["verdict"].values(), default=t0),
             "late_rounds": late, "gave_up": len(ranks) - len(times["verdict"]), "leaders_s": list(pack_s.values()),
             "cpu_s": _cpu() - cpu0, "t0": t0, "lag_s": lag, "tick_s": tick,
             "last": {k: max(v.values(), default=None) for k, v in times.items()}})


def poll_interval_of(poll_s: float, world: int) -> float:
    from distdiag.runtime.exchange import poll_interval

    return poll_interval(poll_s, world)


def _check_ranks(port: int, prefix: str, world: int, lo: int, hi: int, out: Any) -> None:
    from distdiag.runtime.exchange import Exchange
    from distdiag.runtime.keys import IncidentKeys

    store = _client(port, prefix)
    ex = {r: Exchange(store, r, world) for r in range(lo, hi)}
    for r in range(lo, hi):
        ex[r].post("info", _info(r))
    entries = _entries(ex, world, range(lo, hi))
    store.add("ready", 1)
    store.wait(["go"])
    # Probe by probe: each rank posts its result, then waits in the probe's barrier (run.py
    # `_post_and_wait`: a count polled at the scaled interval) before the next probe; the probes
    # themselves take no time here (on a real job they take what they take: more lead for the
    # writer's thread, distdiag/check/ahead.py).
    barrier = _interval(0.01, world)
    for key, texts in entries:
        _post_probe(ex, range(lo, hi), key, texts)
        posted_at = time.time()
        time.sleep(random.uniform(0, barrier))  # this client's ranks' polls start at random phases
        while int(store.add(f"{key}/n", 0)) < world:
            time.sleep(barrier)
    del entries
    others = [r for r in range(lo, hi) if r != 0]
    got: dict[int, float] = {}

    def poll(r: int) -> bool:  # distdiag/check/run.py _finish: read the verdict (its wait returned)
        verdict = ex[r].read(IncidentKeys().verdict)
        if verdict is None:
            return False
        got[r] = time.time()
        return True

    def leave(r: int) -> None:  # then: RunEnd.mirror (local rank 0 of every other node), ack, leave
        if r % 8 == 0 and r // 8 != 0:
            _shared_report(ex[r])
        ex[r].post("ack", 1)
        ex[r].post("left", 1)

    # run.py `_await_verdict`: a blocking store wait, answered the moment rank 0 sets the key;
    # every rank of this client is answered then, and reads it (one after another here).
    from datetime import timedelta

    store.wait([IncidentKeys().verdict], timedelta(seconds=CHECK_WAIT_S))
    # Every rank reads the verdict first: on a real job they do it at once, each on its own
    # connection; a client playing 8k ranks would otherwise put 1024 mirror copies between
    # its first rank's read and its last's.
    _done, late, gave_up = _poll_until(others, _interval(CHECK_VERDICT_POLL_S, world), poll, CHECK_WAIT_S)
    for r in others:
        leave(r)
    _poll_until(others, _interval(LEAVE_POLL_S, world), lambda r: ex[r].count("left") >= world, 2.0)
    out.put({"ops": store.ops, "max_value": store.max_value, "done_at": max(got.values(), default=time.time()),
             "late_rounds": late, "gave_up": gave_up, "posted_at": posted_at})


def _shared_report(ex: Any) -> Any:
    """What RunEnd.mirror reads of the writer's report (distdiag/runtime/incident.py since issue 21)."""
    from distdiag.runtime.incident import Incident
    from distdiag.runtime.keys import IncidentKeys

    return Incident(ex, IncidentKeys(), ex.world_size).read_report()


def _entries(ex: dict[int, Any], world: int, ranks: range) -> list[tuple[str, list[str]]]:
    """These ranks' results of the default suite, probe by probe, as distdiag/check/run.py posts
    them (share_fields: a shared field's value stored once - set now -, a reference posted): the
    key and each rank's JSON, made before the clock starts (on a real job each rank makes its
    own, on its own core)."""
    from bench_gate_scaling import made, suite

    from distdiag.check.shared_values import share_fields
    from distdiag.probes import PROBES

    out = []
    for index, name in enumerate(suite(world)):
        payloads, fields = made(name, world, ranks), PROBES[name].shared_fields
        out.append((f"res/{index}", [json.dumps(share_fields(ex[r], index, {"status": "ok", "payload": payloads[r]}, fields))
                                     for r in ranks]))
    return out


def _post_probe(ex: dict[int, Any], ranks: range, key: str, texts: list[str]) -> None:
    """Each rank's entry of one probe, made beforehand, posted as Exchange.post posts it."""
    for r, text in zip(ranks, texts, strict=True):
        ex[r].put(f"{key}/{r}", text)
        ex[r].store.add(f"{key}/n", 1)


def _post_results(ex: dict[int, Any], world: int, ranks: range) -> None:
    """These ranks' results of the default suite, posted now."""
    for key, texts in _entries(ex, world, ranks):
        _post_probe(ex, ranks, key, texts)


# -- the writers (rank 0) ----------------------------------------------------------------------
def _hang_write(ex: Any, world: int, dump_dir: str, grace_s: float = 2.0) -> Any:
    """What rank 0's watcher does once it claimed the writer of epoch 1 (watcher.py `_write`):
    the public gather_and_write, then publish_outcome (the verdict first, then the report's
    chunks). The only call into the writer's API."""
    from distdiag.hang.records import RankSnapshot
    from distdiag.runtime.incident import Incident, Seat
    from distdiag.runtime.keys import IncidentKeys
    from distdiag.watchdog.writer import gather_and_write, publish_outcome
    from tests.unit.hang_incident import TP

    host = _info(0)["host"]
    incident = Incident(ex, IncidentKeys(1), world, seat=Seat(host, 0, 0, TP))
    incident.claim_writer()
    event = incident.declared()
    report, _lost, excuse = gather_and_write(
        incident, event=event, host=host, timeout_s=60.0, grace_s=grace_s, dump_dir=dump_dir, config={},
        started=time.monotonic(), own_snapshot=lambda: RankSnapshot.from_dict(_snapshot(0, world)),
    )
    publish_outcome(incident, report, excuse=excuse, dump_dir=dump_dir)
    return report


GRACE_ENV = "DISTDIAG_BENCH_GRACE_S"
"""`--grace`: the writer's snapshot grace in `--from-declaration` (the watchdog's default, 2 s,
unless given: a longer one keeps a client's lag from being judged as lost ranks)."""
POST_ONLY_ENV = "DISTDIAG_BENCH_POST_ONLY"
"""`--post-only`: in `--from-declaration` the ranks post their snapshots (and leaders their
nodes') on their schedule and then leave instead of waiting for the verdict."""
PIN_ENV = "DISTDIAG_BENCH_WRITER_CORE"
"""Set by main (`--shared-cores` leaves it unset): the writer gets core 0 to itself, the store
server, the simulated ranks and this process share the others."""


def _pin(role: str, pid: int = 0) -> None:
    """Keep the writer (`role` "writer") on its own core and everything else off it: on a real
    job the writer's host has cores to spare during a hang, the store server its host's, and
    the 16k ranks, played here by two client processes, run on other hosts."""
    core = os.environ.get(PIN_ENV)
    if core is None:
        return
    own = int(core)
    others = set(range(os.cpu_count() or 1)) - {own}
    os.sched_setaffinity(pid, {own} if role == "writer" or not others else others)


def _quiet() -> None:
    """The writers print the report (a 16k-rank table): not into the benchmark's output."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)


def _hang_writer(port: int, prefix: str, world: int, out: Any) -> None:
    import psutil

    _pin("writer")
    _quiet()
    from distdiag.hang.records import RankSnapshot
    from distdiag.runtime.exchange import Exchange
    from distdiag.runtime.incident import Incident
    from distdiag.runtime.keys import IncidentKeys, Keys

    store = _client(port, prefix)
    ex = Exchange(store, 0, world)
    ex.post(Keys.INFO, _info(0))
    Incident(ex, IncidentKeys(1), world).post_snapshot(RankSnapshot.from_dict(_snapshot(0, world)))
    store.compare_set(Keys.event(1), "", json.dumps({"kind": "timeout", "rank": 3, "detail": "no progress for 60s"}))
    import distdiag.watchdog.writer  # noqa: F401 - a real watcher imported it when it was armed
    store.wait(["go"])
    peak = _PeakRss(psutil.Process())
    cpu0 = _cpu()
    t0 = time.time()
    error = None
    with tempfile.TemporaryDirectory() as dump_dir:
        try:
            report = _hang_write(ex, world, dump_dir)
        except Exception as exc:  # noqa: BLE001 - today's code breaks from ~500 ranks (issue 21): say how
            report, error = None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    t1 = time.time()
    cpu = _cpu() - cpu0
    peak.stop()
    from distdiag.hang.records import SilentReason

    silent = {reason.cause for reason in SilentReason} | {"lost"}
    lost = len([f for f in report.probes[0].findings if f.cause in silent]) if report is not None else -1
    out.put({"writer": "hang", "t0": t0, "t1": t1, "cpu_s": cpu, "ops": store.ops, "max_value": store.max_value,
             "marks": {"verdict": store.verdict_at}, "peak_mb": peak.growth_mb, "lost_findings": lost, "error": error,
             "report_kb": len(report.to_json()) // 1024 if report else 0})


def _declared_writer(port: int, prefix: str, world: int, out: Any) -> None:
    """`--from-declaration`: rank 0 declares the event at the go's time (it is the rank that
    timed out: it claims the writer's role first), takes its own snapshot (its measured time),
    posts it and writes the report as watcher.py `_write` does; each stage of the writer
    (distdiag/watchdog/writer.py) timestamped from the declaration."""
    import psutil

    _quiet()
    import distdiag.watchdog.writer as writer_module
    from distdiag.hang.records import RankSnapshot
    from distdiag.runtime.exchange import Exchange
    from distdiag.runtime.incident import Incident
    from distdiag.runtime.keys import IncidentKeys, Keys

    real = _real()
    store = _client(port, prefix)
    ex = Exchange(store, 0, world)
    ex.post(Keys.INFO, _info(0))
    own = RankSnapshot.from_dict(_real_snapshot(0, world, real))
    marks: dict[str, float] = {}
    cpu_at: dict[str, float] = {}

    def timed(name: str, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            marks[name] = time.time()
            cpu_at[name] = _cpu()
            return result
        return run

    writer_module._wait_for_snapshots = timed("snapshots_in", writer_module._wait_for_snapshots)
    writer_module._gather = timed("gathered", writer_module._gather)
    writer_module.analyse_and_detail = timed("analysed", writer_module.analyse_and_detail)
    writer_module._write_and_print = timed("on_disk", writer_module._write_and_print)
    store.add("ready", 1)
    store.wait(["go"])
    t0 = float(store.get("go"))
    time.sleep(max(0.0, t0 - time.time()))
    peak = _PeakRss(psutil.Process())
    cpu0 = _cpu()
    error = None
    report = None
    with tempfile.TemporaryDirectory() as dump_dir:
        try:
            store.compare_set(Keys.event(1), "", json.dumps({"kind": "timeout", "rank": 3, "detail": "no progress for 60s"}))
            time.sleep(_read_cost(real, random.Random(0)))  # its snapshot, as every rank's
            Incident(ex, IncidentKeys(1), world).post_snapshot(own)
            marks["own_posted"] = time.time()
            report = _hang_write(ex, world, dump_dir, float(os.environ.get(GRACE_ENV, "2")))
        except Exception as exc:  # noqa: BLE001 - say how
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    t1 = time.time()
    cpu = _cpu() - cpu0
    peak.stop()
    marks["verdict"] = store.verdict_at or t1
    lead = next((f for f in report.probes[0].findings if f.severity == "critical"), None) if report else None
    from distdiag.hang.records import SilentReason

    silent = {reason.cause for reason in SilentReason} | {"lost"}
    lost = len([f for f in report.probes[0].findings if f.cause in silent]) if report is not None else -1
    out.put({"writer": "hang", "t0": t0, "t1": t1, "cpu_s": cpu, "ops": store.ops, "max_value": store.max_value,
             "marks": marks, "peak_mb": peak.growth_mb, "error": error, "lost_findings": lost,
             "cpu_at": {k: round(v - cpu0, 3) for k, v in cpu_at.items()},
             "report_kb": len(report.to_json()) // 1024 if report else 0,
             "lead": None if lead is None else {"ranks": lead.ranks[:8], "cause": lead.cause},
             "gathered": report.probes[0].details.get("gathered") if report else None})


def _check_writer(port: int, prefix: str, world: int, out: Any) -> None:
    import psutil

    _pin("writer")
    _quiet()
    from distdiag.runtime.exchange import Exchange

    store = _client(port, prefix)
    ex = Exchange(store, 0, world)
    ex.post("info", _info(0))
    _post_results({0: ex}, world, range(1))
    end = _run_end(world)
    made_at: dict[int, float] = {}
    consolidated = end.consolidated

    def timed(ex_: Any, index: int) -> Any:
        result = consolidated(ex_, index)
        made_at[index] = time.time()
        return result

    end.consolidated = timed
    store.wait(["go"])
    peak = _PeakRss(psutil.Process())
    cpu0 = _cpu()
    # distdiag/check/run.py: rank 0 starts the thread once every rank checked in (its own store
    # client), and hands it each probe when its barrier returns (every rank posted the probe).
    end.consolidate_ahead(ex, lambda: _client(port, prefix))
    count = len(end.plan.probes)
    seen_at: dict[int, float] = {}
    for index in range(count):
        ex.wait_count(f"res/{index}", world, time.monotonic() + 600, alone=True)  # run.py `_post_and_wait`, rank 0
        seen_at[index] = time.time()
        end.ahead.ready(index)
    t0 = time.time()
    marks: dict[str, float] = {}
    error = _check_verdict(ex, end, world, marks)
    t1 = time.time()
    cpu = _cpu() - cpu0
    peak.stop()
    behind = max((made_at[i] for i in range(count - 1) if i in made_at), default=t0) - t0
    out.put({"writer": "check", "t0": t0, "t1": t1, "cpu_s": cpu, "ops": store.ops, "max_value": store.max_value, "marks": marks,
             "peak_mb": peak.growth_mb, "error": error, "ahead_behind_s": round(behind, 3),
             "made_ahead": sum(1 for i in made_at if made_at[i] <= t0),
             "probes": [[end.plan.probes[i].probe.name, round(seen_at[i] - t0, 3), round(made_at.get(i, t1) - t0, 3)]
                        for i in range(count)]})


def _run_end(world: int) -> Any:
    from bench_gate_scaling import suite

    from distdiag.check.config import CheckConfig
    from distdiag.check.finish import RunEnd
    from distdiag.check.plan import Plan, PlannedProbe
    from distdiag.probes import PROBES
    from distdiag.report.render import ProgressLine
    from distdiag.runtime.context import LaunchInfo

    names = suite(world)
    config = CheckConfig(probes=names, quiet=True, report=os.path.join(tempfile.mkdtemp(), "report.json"))
    plan = Plan(config, [PlannedProbe(PROBES[n](), PROBES[n].Config() if PROBES[n].Config else None) for n in names])
    info = LaunchInfo(rank=0, world_size=world, local_rank=0, local_world_size=8, node=0, host=_info(0)["host"], pid=10000,
                      restart_count=0, run_id="bench", master_addr=None, master_port=None, agent_store=True)
    return RunEnd(config, plan, info, time.monotonic(), ProgressLine(None))


def _check_verdict(ex: Any, end: Any, world: int, marks: dict[str, float]) -> str | None:
    """Rank 0's end of the check as distdiag/check/run.py `_finish` runs it (its sentinel aside);
    `marks`: when it had consolidated and when the verdict was out."""
    from distdiag.check.run import ACK_WAIT_S

    ex.wait_count(f"res/{len(end.plan.probes) - 1}", world, time.monotonic() + 60)
    from distdiag.runtime.keys import IncidentKeys

    ex.claim(IncidentKeys().writer, "main")
    report = end.consolidate(ex)
    marks["consolidated"] = time.time()
    try:
        end.emit(report, ex)
    except Exception as exc:  # noqa: BLE001 - today's code raises at ~4.7k ranks (issue 21)
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    marks["verdict"] = time.time()
    ex.wait_count("ack", world - 1, time.monotonic() + ACK_WAIT_S)
    ex.post("left", 1)
    ex.wait_count("left", world, time.monotonic() + 2.0, poll_s=LEAVE_POLL_S)
    return None


def _cpu() -> float:
    """This process's CPU seconds (user + system, every thread): the writer's own work, apart
    from the wait for a core it shares here with the store and the simulated ranks."""
    t = os.times()
    return t.user + t.system


class _PeakRss:
    """The process's RSS growth over a stretch, sampled every 10 ms on a thread."""

    def __init__(self, proc: Any) -> None:
        self.proc = proc
        self.base = proc.memory_info().rss
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def growth_mb(self) -> float:
        return round((self.peak - self.base) / 2**20, 1)


# -- one phase, one N -------------------------------------------------------------------------
def _phase(port: int, server: Any, world: int, clients: int, kind: str, declared: bool = False) -> dict[str, Any]:
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    prefix = f"{kind}{world}/"
    cuts = [world * i // clients for i in range(clients + 1)]
    if kind == "hang" and declared:
        procs = [ctx.Process(target=_declared_writer, args=(port, prefix, world, out))]
        procs += [ctx.Process(target=_declared_ranks, args=(port, prefix, world, max(cuts[i], 1), cuts[i + 1], out))
                  for i in range(clients)]
    elif kind == "hang":
        procs = [ctx.Process(target=_hang_writer, args=(port, prefix, world, out))]
        procs += [ctx.Process(target=_hang_ranks, args=(port, prefix, world, max(cuts[i], 1), cuts[i + 1], out))
                  for i in range(clients)]
    else:
        procs = [ctx.Process(target=_check_writer, args=(port, prefix, world, out))]
        procs += [ctx.Process(target=_check_ranks, args=(port, prefix, world, max(cuts[i], 1), cuts[i + 1], out))
                  for i in range(clients)]
    for p in procs:
        p.start()
    main = dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", port, None, False))
    while int(main.add("ready", 0)) < clients + (1 if declared and kind == "hang" else 0):
        time.sleep(0.2)
    time.sleep(1.0)  # the writer has imported its modules and waits for the go too
    cpu0, wall0 = sum(server.cpu_times()[:2]), time.time()
    main.set("go", repr(wall0 + 0.3))  # the declaration's time: everyone has it by then
    results = [out.get(timeout=1800) for _ in procs]
    wall1 = max(r.get("done_at", 0.0) or r.get("t1", 0.0) for r in results)
    wall1 = max(wall1, max(r.get("t1", 0.0) for r in results))
    cpu1 = sum(server.cpu_times()[:2])
    for p in procs:
        p.join(60)
    writer = next(r for r in results if "writer" in r)
    ranks = [r for r in results if "writer" not in r]
    elapsed = max(wall1 - wall0, 1e-6)
    return {
        "writer_s": writer["t1"] - writer["t0"],
        "all_s": max(r["done_at"] for r in ranks) - max(r["posted_at"] for r in ranks) if kind == "check" else writer["t1"] - wall0,
        "posting_s": max(r["posted_at"] for r in ranks) - wall0 if kind == "check" else None,
        "posted_at": max(r["posted_at"] for r in ranks) if kind == "check" else None,
        "ops": sum(r["ops"] for r in results), "elapsed": elapsed, "server_cpu": cpu1 - cpu0,
        "max_value": max(r["max_value"] for r in results), "peak_mb": writer["peak_mb"],
        "rank_max_value": max(r["max_value"] for r in ranks),
        "late_rounds": sum(r["late_rounds"] for r in ranks), "writer": writer,
        "gave_up": sum(r["gave_up"] for r in ranks),
        "leaders_ms": _spread([t for r in ranks for t in r.get("leaders_s", [])]),
        "clients_cpu": sum(r.get("cpu_s", 0.0) for r in ranks),
        "declared": _declared_phases(writer, ranks) if declared and kind == "hang" else None,
    }


def _declared_phases(writer: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """`--from-declaration`: each stage's time from the declaration, the last rank's (the ranks'
    stages) and the writer's (its stages), in seconds."""
    t0 = writer["t0"]

    def last(name: str) -> float | None:
        got = [r["last"][name] for r in ranks if r["last"].get(name) is not None]
        return round(max(got) - t0, 3) if got else None

    marks = writer["marks"]
    at = {k: round(v - t0, 3) for k, v in marks.items() if v is not None}
    return {
        "last_noticed": last("noticed"), "last_snapshot_posted": last("posted"), "last_node_value": last("node_posted"),
        "writer_own_posted": at.get("own_posted"), "writer_saw_all_snapshots": at.get("snapshots_in"),
        "writer_gathered": at.get("gathered"), "writer_analysed": at.get("analysed"), "report_on_disk": at.get("on_disk"),
        "verdict_out": at.get("verdict"), "every_rank_has_verdict": last("verdict"), "last_mirror": last("mirrored"),
        "writer_done": round(writer["t1"] - t0, 3), "tick_s": ranks[0]["tick_s"],
        "client_lag_max_s": round(max(r["lag_s"] for r in ranks), 3), "lead": writer.get("lead"),
        "gathered": writer.get("gathered"), "lost_findings": writer.get("lost_findings"),
        "writer_cpu_s": round(writer["cpu_s"], 3), "writer_cpu_at_s": writer.get("cpu_at"),
    }


def _spread(seconds: list[float]) -> dict[str, float | None]:
    """Median and max of per-leader times, in ms."""
    if not seconds:
        return {"median": None, "max": None}
    ordered = sorted(seconds)
    return {"median": round(ordered[len(ordered) // 2] * 1000, 1), "max": round(ordered[-1] * 1000, 1)}


def _since(writer: dict[str, Any], mark: str) -> float | None:
    at = writer.get("marks", {}).get(mark)
    return None if at is None else round(at - writer["t0"], 3)


def _hang_row(world: int, clients: int, hang: dict[str, Any], rejected: int) -> dict[str, Any]:
    """`--hang-only`: the hang phase's figures alone (the check's phase is not run)."""
    return {
        "ranks": world, "hang_report_s": None if hang["writer"].get("error") else _since(hang["writer"], "verdict"),
        "hang_from_declaration": hang["declared"], "hang_writer_done_s": round(hang["writer_s"], 3),
        "store_rejected_values": rejected, "hang_writer_cpu_s": round(hang["writer"]["cpu_s"], 3),
        "hang_error": hang["writer"].get("error"), "ranks_without_verdict": {"hang": hang["gave_up"]},
        "hang_max_value_bytes": hang["max_value"], "hang_writer_peak_mb": hang["peak_mb"],
        "hang_cores_busy": {"server": round(hang["server_cpu"] / hang["elapsed"], 2),
                            "clients": round(hang["clients_cpu"] / hang["elapsed"], 2),
                            "writer": round(hang["writer"]["cpu_s"] / hang["elapsed"], 2)},
        "hang_report_kb": hang["writer"].get("report_kb"), "clients": clients,
        "writer_core": "own" if os.environ.get(PIN_ENV) else "shared",
    }


def measure(world: int, clients: int, declared: bool = False, hang_only: bool = False) -> dict[str, Any]:
    import psutil

    log = tempfile.TemporaryFile(mode="w+")  # the server's complaints (a value over its 8 MiB limit)
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                              text=True)
    try:
        port = int(server.stdout.readline())
        _pin("server", server.pid)
        proc = psutil.Process(server.pid)
        hang = _phase(port, proc, world, clients, "hang", declared)
        check = None if hang_only else _phase(port, proc, world, clients, "check")
    finally:
        server.stdin.close()
        server.wait(30)
        log.seek(0)
        rejected = log.read().count("Invalid payload size")
    if check is None:
        return _hang_row(world, clients, hang, rejected)
    ops = hang["ops"] + check["ops"]
    elapsed = hang["elapsed"] + check["elapsed"]
    return {
        "ranks": world,
        "hang_report_s": None if hang["writer"].get("error") else _since(hang["writer"], "verdict"),
        "hang_from_declaration": hang["declared"],
        "hang_writer_done_s": round(hang["writer_s"], 3),
        "store_rejected_values": rejected,
        "check_exchange_s": round(check["all_s"], 3),
        "check_writer_s": round(check["writer_s"], 3),
        "hang_writer_cpu_s": round(hang["writer"]["cpu_s"], 3),
        "check_writer_cpu_s": round(check["writer"]["cpu_s"], 3),
        "check_consolidate_s": _since(check["writer"], "consolidated"),
        "check_verdict_out_s": _since(check["writer"], "verdict"),
        "check_posting_s": round(check["posting_s"], 3),
        "check_ahead_behind_s": check["writer"]["ahead_behind_s"],
        "check_seen_s": round(check["writer"]["t0"] - check["posted_at"], 3),
        "check_probes_s": check["writer"]["probes"],
        "hang_max_value_bytes": hang["max_value"], "check_max_value_bytes": check["max_value"],
        "rank_value_max_bytes": max(hang["rank_max_value"], check["rank_max_value"]),
        "check_error": check["writer"].get("error"),
        "hang_error": hang["writer"].get("error"),
        "ranks_without_verdict": {"hang": hang["gave_up"], "check": check["gave_up"]},
        "max_store_value_bytes": max(hang["max_value"], check["max_value"]),
        "writer_peak_mb": max(hang["peak_mb"], check["peak_mb"]),
        "hang_writer_peak_mb": hang["peak_mb"], "check_writer_peak_mb": check["peak_mb"],
        "store_ops_per_s": round(ops / elapsed),
        "server_core_share": round((hang["server_cpu"] + check["server_cpu"]) / elapsed, 2),
        "hang_cores_busy": {"server": round(hang["server_cpu"] / hang["elapsed"], 2),
                            "clients": round(hang["clients_cpu"] / hang["elapsed"], 2),
                            "writer": round(hang["writer"]["cpu_s"] / hang["elapsed"], 2)},
        "hang_report_kb": hang["writer"].get("report_kb"),
        "poll_rate_shortfall": {"late_rounds": hang["late_rounds"] + check["late_rounds"]},
        "leader_aggregate_ms": hang["leaders_ms"],
        "clients": clients,
        "writer_core": "own" if os.environ.get(PIN_ENV) else "shared",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--clients", type=int, default=2, help="client processes playing the ranks (default 2)")
    parser.add_argument("--json", action="store_true", help="one JSON object per N instead of the table")
    parser.add_argument("--from-declaration", action="store_true",
                        help="the hang's clock starts at the declaration: each rank notices at its own tick, takes a "
                             "real-shaped snapshot (benchmarks/results/real_snapshot.json) in its measured time, node "
                             "leaders wait for their ranks; the writer shares every core (implies --shared-cores)")
    parser.add_argument("--grace", type=float, default=2.0,
                        help="--from-declaration: the writer's snapshot grace (default 2 s, the watchdog's); two client "
                             "processes playing 16k ranks on a loaded machine post late, and past the grace their ranks "
                             "are reported lost: a longer grace measures the report once every snapshot is in")
    parser.add_argument("--shared-cores", action="store_true",
                        help="let the writer share every core with the store server and the client processes (by "
                             "default it has core 0 to itself and they have the others, as on a real job)")
    parser.add_argument("--hang-only", action="store_true", help="the hang phase alone (with --json): no check phase")
    parser.add_argument("--post-only", action="store_true",
                        help="--from-declaration: the simulated ranks post on their schedule and leave, without "
                             "waiting for the verdict (16k ranks' polls are most of the two client processes' CPU: "
                             "on a loaded machine they fall seconds behind the schedule and their leaders post late)")
    args = parser.parse_args()
    os.environ[GRACE_ENV] = str(args.grace)
    if args.post_only:
        os.environ[POST_ONLY_ENV] = "1"
    if not args.shared_cores and not args.from_declaration and (os.cpu_count() or 1) >= 2:
        os.environ[PIN_ENV] = "0"
        _pin("main")  # the client processes start from here: off the writer's core
    if not args.json:
        print("| N | hang report s | check exchange s (writer s) | max store value | writer peak MB | store ops/s | "
              "server cores | notes |")
        print("|---|---|---|---|---|---|---|---|")
    for world in args.ranks:
        row = measure(world, args.clients, args.from_declaration, args.hang_only and args.json)
        if args.json:
            print(json.dumps(row), flush=True)
            continue
        notes = [f"hang writer raised: {row['hang_error']}"] if row["hang_error"] else []
        notes += [f"check raised: {row['check_error']}"] if row["check_error"] else []
        notes += [f"{n} {k} ranks got no verdict" for k, n in row["ranks_without_verdict"].items() if n]
        notes += [f"one node leader {row['leader_aggregate_ms']['median']} ms (max {row['leader_aggregate_ms']['max']})"]
        notes += [f"{row['poll_rate_shortfall']['late_rounds']} late poll rounds"] if row["poll_rate_shortfall"]["late_rounds"] else []
        notes += [f"the store refused {row['store_rejected_values']} value(s) over 8 MiB"] if row["store_rejected_values"] else []
        hang = "-" if row["hang_report_s"] is None else f"{row['hang_report_s']:.2f}"
        print(f"| {world} | {hang} | {row['check_exchange_s']:.2f} ({row['check_writer_s']:.2f}) | "
              f"{row['max_store_value_bytes'] / 1024:.0f} KB | {row['writer_peak_mb']:.0f} | {row['store_ops_per_s']} | "
              f"{row['server_core_share']:.2f} | {'; '.join(notes) or '-'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
