"""The check's end at scale (issue 21): the writer's collector pause, and what each rank reads
when it leaves (the rank table of the silent ranks only, never all N rows on every rank)."""

from __future__ import annotations

import threading


class _Recording:
    """A store that notes every key a multi_get asks for."""

    def __init__(self, store) -> None:
        self._store = store
        self.read: list[str] = []

    def multi_get(self, keys):
        self.read += keys
        return self._store.multi_get(keys)

    def __getattr__(self, name):
        return getattr(self._store, name)


def _run_end(rank: int, world: int):
    import socket
    import tempfile
    import time
    from types import SimpleNamespace

    from distdiag.check.config import CheckConfig
    from distdiag.check.finish import RunEnd
    from distdiag.check.plan import Plan
    from distdiag.report.render import ProgressLine
    from distdiag.runtime.context import LaunchInfo

    config = CheckConfig(probes=["collectives"], quiet=True, report=f"{tempfile.mkdtemp()}/report.json")
    info = LaunchInfo(rank=rank, world_size=world, local_rank=rank, local_world_size=world, node=0,
                      host=socket.gethostname(), pid=1000 + rank, restart_count=0, run_id="t", master_addr=None,
                      master_port=None, agent_store=True)
    end = RunEnd(config, Plan(config, []), info, time.monotonic(), ProgressLine(None))
    end.sentinel = SimpleNamespace(finishing_code=1)
    return end


def test_a_late_rank_reads_only_the_silent_ranks_rows():
    """After the verdict, rank 1 waits for the others to leave; rank 3 never does: rank 1 reads
    rank 3's row of the rank table, not all 4 (at 16k ranks every late rank read 16k rows)."""
    import socket

    from torch.distributed import HashStore

    from distdiag.runtime.exchange import Exchange
    from distdiag.runtime.keys import Keys

    world, store = 4, _Recording(HashStore())
    for r in range(world):
        info = {"rank": r, "host": socket.gethostname(), "node": 0, "local_rank": r, "device": "cpu", "pid": 2**22 + 77 + r}
        Exchange(store, r, world).post(Keys.INFO, info)
    for r in (0, 2):
        Exchange(store, r, world).post(Keys.LEFT, 1)
    store.read.clear()
    assert _run_end(1, world).after_verdict(Exchange(store, 1, world), wait_s=0.3) == 1
    assert [k for k in store.read if k.startswith(f"{Keys.INFO}/")] == [f"{Keys.INFO}/3"]


def test_leaving_waits_while_the_count_moves():
    """The others leave one by one over longer than the stall limit: the wait goes on, and ends
    once all have left (a fixed bound would have given up and looked for silent ranks)."""
    import time

    from torch.distributed import HashStore

    from distdiag.check.finish import _all_left
    from distdiag.runtime.exchange import Exchange
    from distdiag.runtime.keys import Keys

    world, store = 10, HashStore()

    def leave_one_by_one() -> None:
        for r in range(1, world):
            time.sleep(0.2)
            Exchange(store, r, world).post(Keys.LEFT, 1)

    Exchange(store, 0, world).post(Keys.LEFT, 1)
    thread = threading.Thread(target=leave_one_by_one)
    thread.start()
    try:
        assert _all_left(Exchange(store, 0, world), world, stall_s=1.5)
    finally:
        thread.join(10)
    assert not _all_left(Exchange(store, 0, world + 1), world + 1, stall_s=0.2)


def test_shared_fields_are_stored_once_and_read_back_as_posted():
    """Ranks post a probe's shared fields: equal values are stored once (a large one in parts),
    a differing one per rank; the writer gets every rank's entry exactly as it was made, ranks
    that posted a value alike holding one object parsed once."""
    import copy
    import json

    from torch.distributed import HashStore

    from distdiag.check.shared_values import SHARED, resolve_shared, share_fields
    from distdiag.runtime.exchange import Exchange
    from distdiag.runtime.keys import Keys

    world, store = 5, _Recording(HashStore())
    digests = {f"layer{i}.weight": {"bits": f"{i:016x}", "shape": [64, 64], "sum": i * 0.5} for i in range(40)}
    big = {f"t{i}": "x" * 200 for i in range(500)}  # ~110 KB: over one store value
    made = {}
    for r in range(world):
        payload = {"digests": copy.deepcopy(digests), "big": copy.deepcopy(big), "small": [r],
                   "mine": {"rank": r, "pad": "y" * 2000}}
        made[r] = {"status": "ok", "payload": payload}
        ex = Exchange(store, r, world)
        entry = share_fields(ex, 0, made[r], ("digests", "big", "small", "mine"))
        assert entry["payload"]["small"] == [r] and SHARED in entry["payload"]["digests"]
        ex.post(Keys.result(0), entry)
    made[world] = {"status": "skip", "reason": "no GPU"}
    Exchange(store, world, world + 1).post(Keys.result(0), made[world])
    stored = [k for k in store.read if "/shared/" in k]
    assert stored == []  # nothing read yet
    posted = Exchange(store, 0, world + 1).collect(Keys.result(0))
    sizes = [len(json.dumps(p)) for p in posted.values()]
    assert max(sizes) < 1000  # references, not the values
    resolved = resolve_shared(Exchange(store, 0, world + 1), 0, posted)
    assert resolved == made
    digests_of = [resolved[r]["payload"]["digests"] for r in range(world)]
    assert all(d is digests_of[0] for d in digests_of)
    assert resolved[0]["payload"]["mine"] is not resolved[1]["payload"]["mine"]
    shared_reads = [k for k in store.read if "/shared/" in k and "/part/" not in k]
    assert len(shared_reads) == len(set(shared_reads)) == 2 + world  # digests, big, each rank's "mine": once each
