"""The store exchange at scale (issue 21): batched reads, presence without N round trips,
polls that cost the store a fixed budget whatever the world. A real TCPStore in this process
(server and client), with a counting wrapper around the client to see the requests sent."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from distdiag.runtime.exchange import BATCH, POLL_BUDGET_OPS_S, Exchange, poll_interval


class Counting:
    """The real client, counting each request by name and the keys it carried."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.calls: list[tuple[str, int]] = []

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.store, name)

        def call(*args: Any) -> Any:
            keys = args[0] if args and isinstance(args[0], list) else [args[0]] if args else []
            self.calls.append((name, len(keys)))
            return fn(*args)

        return call

    def count(self, name: str) -> int:
        return sum(1 for n, _k in self.calls if n == name)


@pytest.fixture(scope="module")
def server():
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)


@pytest.fixture
def store(server, request):
    client = dist.TCPStore("127.0.0.1", server.port, None, False, timeout=timedelta(seconds=30))
    return Counting(dist.PrefixStore(f"{request.node.name}/", client))


def _post(store: Any, world: int, ranks: list[int], key: str = "k") -> None:
    for r in ranks:
        Exchange(store.store, r, world).post(key, {"rank": r})


def test_collect_reads_in_batches(store):
    world = 2 * BATCH + 100
    _post(store, world, list(range(world)))
    got = Exchange(store, 0, world).collect("k")
    assert got == {r: {"rank": r} for r in range(world)}
    sizes = [k for n, k in store.calls if n == "multi_get"]
    assert sizes == [BATCH, BATCH, 100], sizes
    assert store.count("check") == 0  # everyone posted: the counter said so


def test_present_finds_a_few_missing_without_a_check_per_rank(store):
    world = 1000
    silent = {17, 500, 999}
    _post(store, world, [r for r in range(world) if r not in silent])
    have = Exchange(store, 0, world).present("k")
    assert set(range(world)) - set(have) == silent and have == sorted(have)
    # one check per batch, then halving down to each silent rank: ~2 log2(BATCH) each
    assert store.count("check") <= 4 + 2 * 8 * len(silent), store.count("check")
    assert store.count("check") < world / 10


def test_present_is_one_request_when_everyone_or_no_one_posted(store):
    world = 700
    ex = Exchange(store, 0, world)
    assert ex.present("k") == [] and len(store.calls) == 1
    _post(store, world, list(range(world)))
    store.calls.clear()
    assert ex.present("k") == list(range(world)) and store.calls == [("add", 1)]


def test_present_of_some_ranks_and_collect_of_them(store):
    world = 600
    _post(store, world, list(range(0, world, 2)))
    ex = Exchange(store, 0, world)
    asked = list(range(100, 400))
    assert ex.present("k", asked) == list(range(100, 400, 2))
    assert ex.collect("k", [3, 4, 5, 6]) == {4: {"rank": 4}, 6: {"rank": 6}}


def test_every_rank_missing_costs_at_most_two_checks_per_key(store):
    world = 300
    _post(store, 2 * world, [world + 1])  # the counter says one posted, but not among these
    have = Exchange(store, 0, 2 * world).present("k", list(range(world)))
    assert have == [] and store.count("check") < 2 * world


def test_polls_scale_with_the_world():
    assert poll_interval(0.01, 8) == 0.01
    assert poll_interval(0.05, 1000) == 0.05
    assert poll_interval(0.01, 16384) == pytest.approx(16384 / POLL_BUDGET_OPS_S)
    # what all ranks of a 16k job polling together ask of the store: the budget, not more
    assert 16384 / poll_interval(0.01, 16384) <= POLL_BUDGET_OPS_S


def test_waits_still_end_at_the_deadline_and_on_the_count(store):
    world = 50_000  # a scaled interval (2 s a poll): the deadline still ends the wait
    ex = Exchange(store, 0, world)
    started = time.monotonic()
    assert not ex.wait_count("w", world, started + 0.3)
    assert ex.wait_read("none", started + 0.3) is None
    ex.publish("v", {"exit_code": 0})
    assert ex.wait_read("v", time.monotonic() + 5) == {"exit_code": 0}
    small = Exchange(store, 0, 2)
    _post(store, 2, [0, 1], key="w2")
    assert small.wait_count("w2", 2, time.monotonic() + 5)


class Sized:
    """The real client, recording the size of every value set."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.sizes: list[int] = []

    def set(self, key: str, value: Any) -> None:
        self.sizes.append(len(value.encode() if isinstance(value, str) else value))
        self.store.set(key, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def test_a_large_value_goes_in_parts_and_comes_back_whole(server):
    """A probe's payload of a user's big model (digests of thousands of tensors) or a job-wide
    value: no set over 64 KB reaches the store, and collect/read give the value back."""
    store = Sized(dist.PrefixStore("parts", server))
    big = {"digests": [[i * 0.5] * 64 for i in range(2000)], "text": "\u00e9\u4e2d" * 30_000}
    small = {"ok": 1}
    Exchange(store, 0, 3).post("res/0", big)
    Exchange(store, 1, 3).post("res/0", small)
    Exchange(store, 0, 3).publish("verdict", big)
    assert max(store.sizes) <= 64 * 1024
    reader = Exchange(store, 2, 3)
    assert reader.collect("res/0") == {0: big, 1: small}
    assert reader.read("verdict") == big


def test_a_batch_of_plain_packed_and_split_values_reads_back_as_posted(server):
    """collect parses a batch's JSON values as one array; a packed snapshot (runtime/snapwire.py)
    and a value set in parts beside them are read one by one, each as it was posted."""
    from distdiag.runtime import snapwire

    store = dist.PrefixStore("mixed", server)
    big = {"digests": [[i * 0.5] * 64 for i in range(2000)]}
    snap = {"rank": 2, "engine": {"groups": [{"group": "ranks[" + ",".join(map(str, range(0, 4096, 8))) + "]"}]}}
    Exchange(store, 0, 5).post("k", {"a": 0})
    Exchange(store, 1, 5).post("k", big)
    Exchange(store, 2, 5).put("k/2", snapwire.pack(snap)[0])
    store.add("k/n", 1)
    Exchange(store, 3, 5).post("k", [3, "x"])
    got = Exchange(store, 4, 5).collect("k")
    assert got[0] == {"a": 0} and got[1] == big and got[3] == [3, "x"]
    assert snapwire.unpack(got[2]) == snap


def test_collect_reads_ahead_and_keeps_every_value_in_its_place(server):
    """Past PREFETCH_PARTS batches the next multi_get runs on a second thread while a batch is
    parsed: every value still lands under its own rank, silent ranks absent, in every batch."""
    from distdiag.runtime.exchange import PREFETCH_PARTS

    world = (PREFETCH_PARTS + 1) * BATCH + 7
    store = dist.PrefixStore("readahead/", server)
    silent = {3, BATCH + 1, 3 * BATCH + 5, world - 1}
    for r in range(world):
        if r not in silent:
            Exchange(store, r, world).post("v", {"rank": r, "pad": "x" * (r % 13)})
    counted = Counting(store)
    got = Exchange(counted, 0, world).collect("v")
    assert sorted(got) == [r for r in range(world) if r not in silent]
    assert all(v["rank"] == r and v["pad"] == "x" * (r % 13) for r, v in got.items())
    assert counted.count("multi_get") == -(-len(got) // BATCH)
