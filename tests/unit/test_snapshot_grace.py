"""The hang writer's snapshot grace counts from the last snapshot that came in (capped by
GRACE_PER_RANK_S a rank): a large job whose ranks are still posting is waited for, a silent
rank costs the grace after the others, and a small job waits as before. A real TCPStore; the
ranks' posts come from a thread as a job's would, late and spread out."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from distdiag.hang.records import RankSnapshot
from distdiag.runtime.exchange import Exchange
from distdiag.runtime.incident import Incident
from distdiag.runtime.keys import IncidentKeys
from distdiag.watchdog import writer


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


def _post(store: dist.TCPStore, world: int, ranks: range, keys: IncidentKeys) -> None:
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30))
    for r in ranks:
        Incident(Exchange(client, r, world), keys, world).post_snapshot(RankSnapshot.from_dict({"rank": r}))


def _gather_while_posting(world: int, waves: list[range], every_s: float, grace_s: float) -> tuple[float, int]:
    store, keys = _store(), IncidentKeys(1)
    _post(store, world, waves[0], keys)

    def later() -> None:
        for wave in waves[1:]:
            time.sleep(every_s)
            _post(store, world, wave, keys)

    t = threading.Thread(target=later, daemon=True)
    t.start()
    incident = Incident(Exchange(store, 0, world), keys, world)
    start = time.monotonic()
    writer._wait_for_snapshots(incident, {}, host="here", grace_s=grace_s)
    took = time.monotonic() - start
    t.join(10)
    return took, len(incident.ex.present(keys.snap))


def test_snapshots_still_coming_in_past_the_grace_are_waited_for():
    world = 1500  # cap: grace + 3 s (room for slow posts on a loaded box); 900 of them post, 0.35 s apart
    waves = [range(0, 300), range(300, 600), range(600, 900)]
    took, have = _gather_while_posting(world, waves, every_s=0.35, grace_s=0.5)
    assert have == 900 and took < 0.5 + writer.GRACE_PER_RANK_S * world + 1.0, (took, have)


def test_a_silent_rank_costs_the_grace_after_the_last_snapshot_not_the_cap():
    world = 2000  # cap: grace + 4 s
    took, have = _gather_while_posting(world, [range(0, world - 1)], every_s=0.0, grace_s=0.4)
    assert have == world - 1 and took < 0.4 + 2.0, took  # nowhere near the 4.4 s cap


def test_a_small_job_waits_no_longer_than_its_grace():
    took, have = _gather_while_posting(4, [range(0, 2), range(2, 3)], every_s=0.3, grace_s=0.5)
    assert have == 3 and 0.45 < took < 0.5 + 4 * writer.GRACE_PER_RANK_S + 1.0, took
