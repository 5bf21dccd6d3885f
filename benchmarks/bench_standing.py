"""The store traffic distdiag keeps up while a job runs, measured on one real TCPStore.

    python benchmarks/bench_standing.py --ranks 1024 4096 16384 [--seconds 10] [--clients 2]
        [--mode check|watch|both] [--old] [--json]

Every rank of `distdiag check` has a sentinel thread (distdiag/runtime/sentinel.py) that,
while the check runs, looks at the job's abort flag (`Exchange.count(Keys.ABORT_REASON)`) and
beats its heartbeat (`Exchange.bump(Keys.heartbeat(rank))`); every rank of a watched training
job has a watchdog thread (distdiag/watchdog/watcher.py) that each tick looks for the next
event (`store.check([Keys.event(n)])`) and, at most every timeout/4, publishes its recorder's
counts (`store.set(Keys.engine(rank), ...)`, distdiag/watchdog/stall.py). Nothing here is
copied: the intervals come from `distdiag.runtime.sentinel.standing_intervals` and
`distdiag.runtime.exchange.poll_interval`, the defaults from `WatchdogConfig`, the requests
go through distdiag's own `Exchange` and `Keys`.

One torch TCPStore server runs in its own process, as torchrun's agent hosts it
(benchmarks/bench_scale.py's SERVER); `--clients` processes each hold ONE client (bench_scale's
`_client`, counting every request) and play N/clients ranks: each simulated rank issues its
requests at the real code's intervals, from a random phase (real ranks start apart). The
sentinel decides on its own 0.1 s ticks (TICK_S), so an interval of 0.655 s is a look every 7th
tick (0.7 s): the schedule is the real loop's, `offered_per_s` says what it issues,
`formula_per_s` what N / interval gives. The watchdog checks the engine key on each tick too.

`--mode`: check (sentinel), watch (watchdog) or both (one job running both: the check's
sentinel and an armed watchdog are not on one job at once, but both on one store is the
worst case). `--old`: also run each N with the intervals before they scaled with the world
(0.1 s look, 0.5 s heartbeat, the watchdog's poll_s), in the same run, old then new.
`--marks STEP_S`: the watchdog also compares step marks (`compare_steps`, on by default, where
the wrappers give the marks digests): a step mark every STEP_S on every rank; at its next tick
the group's lowest rank sets its window (`marks/0`) and each other rank reads it
(`Exchange.read`: a check and a get), as distdiag/watchdog/marks.py does when every rank keeps
pace (a rank ahead of rank 0 reads on every tick until rank 0 posts).

Per N and configuration (`--json`: one object per line): offered_per_s, achieved_per_s (the
requests the clients counted / the measured wall), server_cores (the server process's CPU time
/ wall, psutil: 1.0 is one core), server_us_per_request (its CPU / the requests), projected_cores
(offered_per_s x that cost: the share the real intervals would take were the clients able to
offer them), clients_cores, late_rounds (requests a whole interval late: the client was busy
with its other ranks) and shortfall (1 - achieved / offered). A client has one request in
flight at a time, so a client process offers at most 1 / round trip: `--conns K` gives each
process K clients on threads of their own (the requests are the same; more are in flight). Two client processes on a
2-core machine shared with the server cannot offer much more than ~40-60k requests a second:
beyond that the achieved rate is what they managed, and projected_cores is the figure to read.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import multiprocessing as mp
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from bench_scale import SERVER, _client, _cpu  # noqa: E402 - the same server, client and CPU clock

OLD_LOOK_S = 0.1
"""The sentinel's look at the abort flag before it scaled: every tick."""
OLD_BEAT_S = 0.5
"""Its heartbeat before: HEARTBEAT_EVERY_S whatever the world."""
START_LEAD_S = 0.5
"""How far ahead of now the clients are told to start (they are all waiting by then)."""


# -- what the real code issues ------------------------------------------------------------------
def _on_ticks(interval: float, tick: float) -> float:
    """The interval a loop that decides on `tick`-second ticks ends up with for `interval`."""
    return max(1, math.ceil(interval / tick - 1e-9)) * tick


def streams(world: int, mode: str, old: bool, timeout_s: float | None = None, marks_s: float = 0.0) -> dict[str, float]:
    """{request stream: its interval per rank, as the real loop issues it}, for one rank of
    `world`: the sentinel's look and heartbeat ("look", "beat"), the watchdog's tick ("tick",
    one check of the next event key) and its engine counts ("engine"); "marks": the step
    marks' comparison rides on the tick (a mark every marks_s: at most once a tick)."""
    from distdiag.runtime.exchange import poll_interval
    from distdiag.runtime.sentinel import TICK_S, standing_intervals
    from distdiag.watchdog.config import WatchdogConfig

    out: dict[str, float] = {}
    if mode in ("check", "both"):
        look, beat = (OLD_LOOK_S, OLD_BEAT_S) if old else standing_intervals(world)
        out["look"], out["beat"] = _on_ticks(look, TICK_S), _on_ticks(beat, TICK_S)
    if mode in ("watch", "both"):
        cfg = WatchdogConfig() if timeout_s is None else WatchdogConfig(timeout=_delta(timeout_s))
        tick = cfg.poll_s if old else poll_interval(cfg.poll_s, world)
        out["tick"] = tick
        out["engine"] = _on_ticks(cfg.timeout_s / 4, tick)
        if marks_s > 0:
            out["marks"] = _on_ticks(marks_s, tick)
    return out


def _delta(seconds: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=seconds)


REQUESTS = {"look": 1, "beat": 1, "tick": 1, "engine": 1, "marks": 2}
"""Store requests one round of each stream costs (the marks: Exchange.read is a check and a get;
rank 0 sets its window instead, one request)."""


def offered(world: int, plan: dict[str, float]) -> float:
    """Requests a second all `world` ranks issue together at the intervals of `plan`."""
    return sum(world * REQUESTS[kind] / interval for kind, interval in plan.items())


def formula(world: int, mode: str, old: bool, timeout_s: float | None = None) -> float:
    """The same as N / interval from the functions, before the sentinel's tick grid (and
    without the engine counts and marks)."""
    from distdiag.runtime.exchange import poll_interval
    from distdiag.runtime.sentinel import standing_intervals
    from distdiag.watchdog.config import WatchdogConfig

    total = 0.0
    if mode in ("check", "both"):
        look, beat = (OLD_LOOK_S, OLD_BEAT_S) if old else standing_intervals(world)
        total += world / look + world / beat
    if mode in ("watch", "both"):
        poll = (WatchdogConfig() if timeout_s is None else WatchdogConfig(timeout=_delta(timeout_s))).poll_s
        total += world / (poll if old else poll_interval(poll, world))
    return total


# -- one client process, ranks lo..hi-1 ------------------------------------------------------
def _ranks(port: int, prefix: str, world: int, lo: int, hi: int, plan: dict[str, float], seconds: float,
           conns: int, out: Any) -> None:
    """Ranks lo..hi-1 on one client (`conns` > 1: that many clients, each on a thread of its own
    with its share of the ranks; a client has one request in flight at a time)."""
    import threading

    cuts = [lo + (hi - lo) * i // conns for i in range(conns + 1)]
    got: list[dict[str, Any]] = []
    threads = [threading.Thread(target=lambda a, b: got.append(_play(port, prefix, world, a, b, plan, seconds)),
                                args=(cuts[i], cuts[i + 1]), daemon=True) for i in range(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 150)
    if len(got) < conns:
        return  # the main process is gone, or the store: nothing to report
    out.put({"ops": sum(g["ops"] for g in got), "wall": max(g["wall"] for g in got),
             "late_rounds": sum(g["late_rounds"] for g in got),
             "issued": {k: sum(g["issued"][k] for g in got) for k in plan}, "cpu_s": _cpu() - min(g["cpu0"] for g in got)})


def _play(port: int, prefix: str, world: int, lo: int, hi: int, plan: dict[str, float], seconds: float) -> dict[str, Any]:
    from distdiag.runtime.exchange import Exchange
    from distdiag.runtime.keys import Keys

    store = _client(port, prefix)
    exs = {r: Exchange(store, r, world) for r in range(lo, hi)}
    engine = json.dumps({"world": 12345, "ranks[0,1,2,3,4,5,6,7]": 6789})
    window = json.dumps({str(i): {"world": [100 * i, 2**31 + i]} for i in range(32)})  # MARK_WINDOW marks

    def look(r: int) -> None:  # sentinel.py _check
        exs[r].count(Keys.ABORT_REASON)

    def beat(r: int) -> None:  # sentinel.py run
        exs[r].bump(Keys.heartbeat(r))

    def tick(r: int) -> None:  # watcher.py _tick
        exs[r].store.check([Keys.event(1)])

    def eng(r: int) -> None:  # stall.py read_engine
        exs[r].store.set(Keys.engine(r), engine)

    def marks(r: int) -> None:  # marks.py compare: the lead posts, the others read its window
        if r == 0:
            exs[r].store.set(Keys.marks(0), window)
        else:
            exs[r].read(Keys.marks(0))

    act = {"look": look, "beat": beat, "tick": tick, "engine": eng, "marks": marks}
    store.add("ready", 1)
    given_up = time.monotonic() + 120  # the main process is gone: do not wait on
    while not store.check(["go"]):
        if time.monotonic() > given_up:
            raise TimeoutError("no go")
        time.sleep(0.02)
    t0 = float(bytes(store.get("go")).decode())
    end = t0 + seconds
    heap = [(t0 + random.uniform(0, interval), r, kind) for kind, interval in plan.items() for r in exs]
    heapq.heapify(heap)
    while time.time() < t0:
        time.sleep(0.001)
    store.ops = 0
    cpu0 = _cpu()
    late = 0
    issued = dict.fromkeys(plan, 0)
    while heap:
        due, r, kind = heap[0]
        if due >= end:
            break
        now = time.time()
        if due > now:
            time.sleep(due - now)
            continue
        heapq.heapreplace(heap, (due + plan[kind] if now - due < plan[kind] else now + plan[kind], r, kind))
        if now - due >= plan[kind]:
            late += 1  # a whole interval behind: this rank's next round starts from now, no catch-up
        act[kind](r)
        issued[kind] += 1
    return {"ops": store.ops, "wall": time.time() - t0, "late_rounds": late, "issued": issued, "cpu0": cpu0}


# -- one configuration, one N ------------------------------------------------------------------
def run_once(port: int, server: Any, world: int, clients: int, seconds: float, plan: dict[str, float],
             prefix: str, conns: int = 1) -> dict[str, Any]:
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    cuts = [world * i // clients for i in range(clients + 1)]
    procs = [ctx.Process(target=_ranks, args=(port, prefix, world, cuts[i], cuts[i + 1], plan, seconds, conns, out),
                         daemon=True) for i in range(clients)]
    for p in procs:
        p.start()
    try:
        main = dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", port, None, False, timeout=_delta(120)))
        ready_by = time.monotonic() + 120
        while int(main.add("ready", 0)) < clients * conns:
            if time.monotonic() > ready_by or not all(p.is_alive() for p in procs):
                raise RuntimeError("the client processes did not start")
            time.sleep(0.1)
        t0 = time.time() + START_LEAD_S
        main.set("go", repr(t0))
        time.sleep(max(0.0, t0 - time.time()))
        cpu0 = sum(server.cpu_times()[:2])
        time.sleep(max(0.0, t0 + seconds - time.time()))
        cpu1 = sum(server.cpu_times()[:2])
        results = [out.get(timeout=seconds + 60) for _ in procs]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    ops = sum(r["ops"] for r in results)
    wall = max(max(r["wall"] for r in results), seconds)
    issued = {k: sum(r["issued"][k] for r in results) for k in plan}
    return {"ops": ops, "wall": wall, "server_cpu": cpu1 - cpu0, "late_rounds": sum(r["late_rounds"] for r in results),
            "issued": issued, "clients_cpu": sum(r["cpu_s"] for r in results)}


def measure(world: int, *, clients: int = 2, seconds: float = 10.0, mode: str = "both", old: bool = False,
            timeout_s: float | None = None, marks_s: float = 0.0, conns: int = 1,
            server: tuple[int, Any] | None = None) -> dict[str, Any]:
    """One configuration at `world` ranks; `server`: (port, psutil.Process) of a running store
    server, else one is started (and stopped) for this measurement."""
    import psutil

    own = None
    if server is None:
        own = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
        server = (int(own.stdout.readline()), psutil.Process(own.pid))
    plan = streams(world, mode, old, timeout_s, marks_s)
    try:
        got = run_once(server[0], server[1], world, clients, seconds, plan,
                       f"{'old' if old else 'new'}{mode}{world}-{time.monotonic_ns()}/", conns)
    finally:
        if own is not None:
            own.stdin.close()
            try:
                own.wait(10)
            except subprocess.TimeoutExpired:
                own.kill()
    offer = offered(world, plan)
    achieved = got["ops"] / got["wall"]
    cost = got["server_cpu"] / got["ops"] if got["ops"] else None
    return {
        "ranks": world, "mode": mode, "intervals": "old" if old else "new",
        "interval_s": {k: round(v, 4) for k, v in plan.items()},
        "offered_per_s": round(offer), "formula_per_s": round(formula(world, mode, old, timeout_s)),
        "achieved_per_s": round(achieved), "requests": got["ops"], "issued": got["issued"],
        "server_cores": round(got["server_cpu"] / got["wall"], 3),
        "server_us_per_request": None if cost is None else round(cost * 1e6, 2),
        "projected_cores": None if cost is None else round(offer * cost, 2),
        "clients_cores": round(got["clients_cpu"] / got["wall"], 2),
        "late_rounds": got["late_rounds"], "shortfall": round(max(0.0, 1 - achieved / offer), 3) if offer else 0.0,
        "clients": clients, "conns": conns, "seconds": round(got["wall"], 2), "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> int:
    import psutil

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--seconds", type=float, default=10.0, help="measured stretch per configuration (default 10)")
    parser.add_argument("--clients", type=int, default=2, help="client processes playing the ranks (default 2)")
    parser.add_argument("--conns", type=int, default=1,
                        help="store clients per client process, one thread each (default 1: one client a process)")
    parser.add_argument("--mode", choices=("check", "watch", "both"), default="both")
    parser.add_argument("--old", action="store_true", help="also the intervals before they scaled with the world, old first")
    parser.add_argument("--timeout-s", type=float, default=None, help="the watchdog's timeout (default WatchdogConfig's)")
    parser.add_argument("--marks", type=float, default=0.0, metavar="STEP_S",
                        help="the watchdog also compares step marks, one every STEP_S (default off)")
    parser.add_argument("--json", action="store_true", help="one JSON object per row instead of the table")
    args = parser.parse_args()
    srv = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
    try:
        server = (int(srv.stdout.readline()), psutil.Process(srv.pid))
        if not args.json:
            print("| N | intervals | mode | offered req/s | achieved req/s | server cores | server us/request | "
                  "projected cores at offered | clients cores | late rounds | shortfall |")
            print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
        for world in args.ranks:
            for old in ([True, False] if args.old else [False]):
                row = measure(world, clients=args.clients, seconds=args.seconds, mode=args.mode, old=old,
                              timeout_s=args.timeout_s, marks_s=args.marks, conns=args.conns, server=server)
                if args.json:
                    print(json.dumps(row), flush=True)
                    continue
                print(f"| {world} | {row['intervals']} | {row['mode']} | {row['offered_per_s']:,} | {row['achieved_per_s']:,} | "
                      f"{row['server_cores']:.2f} | {row['server_us_per_request']} | {row['projected_cores']} | "
                      f"{row['clients_cores']:.2f} | {row['late_rounds']} | {row['shortfall']:.0%} |", flush=True)
    finally:
        srv.stdin.close()
        try:
            srv.wait(10)
        except subprocess.TimeoutExpired:
            srv.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
