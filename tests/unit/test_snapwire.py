"""Snapshots on the wire (distdiag/runtime/snapwire.py): labels by reference, compressed, the
long history under its own key; what the writer reads back is what the rank posted (issue 21
item 2). The store round trips run on a real TCPStore served in this process."""

from __future__ import annotations

import copy
import json
import random
import zlib
from datetime import timedelta

import pytest
import torch.distributed as dist

from distdiag.hang.records import RankSnapshot
from distdiag.runtime import snapwire
from distdiag.runtime.exchange import Exchange
from distdiag.runtime.incident import collect_histories, collect_snapshots, post_snapshot
from distdiag.runtime.keys import MAX_STORE_VALUE
from tests.unit.hang_incident import rank_snapshot


@pytest.mark.parametrize("members", [
    [], [7], [3, 9], list(range(8)), list(range(5, 16384, 32)), [0, 1, 2, 3, 8, 9, 10, 11, 40],
    [1, 2, 4, 8, 16, 32], sorted(random.Random(0).sample(range(100000), 300)),
])
def test_members_come_back_from_their_runs(members):
    spec = snapwire.encode_members(members)
    assert snapwire.decode_members(spec) == members


def test_a_mesh_slice_is_one_run():
    assert snapwire.encode_members(list(range(3, 16384, 32))) == "3+32x512"


def test_a_16k_rank_snapshot_packs_to_a_few_kb_and_unpacks_to_what_was_posted():
    """Rank 35 of a TP=8 x PP=4 x DP=512 job waits in the dp all_reduce: its dp group's label
    (512 members, ~3 KB) is in its records and positions; packed, the snapshot is a few KB."""
    snap = rank_snapshot(35, 16384, "dp")
    raw = len(json.dumps(snap))
    core, hist = snapwire.pack(snap)
    assert raw > 30_000 and len(core) < 3_000 and hist is not None
    back = snapwire.unpack(snapwire.decode(core), {})
    back["history"] = snapwire.unpack(snapwire.decode(hist), {})["history"]
    assert back == snap


def test_labels_are_one_string_per_group_across_a_gather():
    cache: dict[str, str] = {}
    a = snapwire.unpack(snapwire.decode(snapwire.pack(rank_snapshot(35, 16384, "dp"))[0]), cache)
    b = snapwire.unpack(snapwire.decode(snapwire.pack(rank_snapshot(67, 16384, "dp"))[0]), cache)
    assert a["in_collective"]["group"] is b["in_collective"]["group"]


def test_a_label_with_its_backend_keeps_it():
    """A group on two backends is labelled 'ranks[...] (gloo)' by the recorder's reader."""
    label = "ranks[" + ",".join(map(str, range(0, 4096, 8))) + "] (gloo)"
    snap = {"rank": 0, "engine": {"state": "ok", "groups": [{"group": label, "enqueued": 2, "completed": 1,
                                                             "pending": {"group": label, "seq": 2}}]}}
    core, _ = snapwire.pack(snap)
    assert b"ranks[" not in zlib.decompress(core[len(snapwire.MAGIC):])
    assert snapwire.unpack(snapwire.decode(core)) == snap


def test_packing_leaves_the_callers_snapshot_as_it_was():
    snap = rank_snapshot(35, 16384, "dp")
    before = copy.deepcopy(snap)
    snapwire.pack(snap)
    assert snap == before


def test_a_plain_json_value_still_reads():
    """A snapshot posted as JSON text (a rank of an older distdiag) reads as it always did."""
    assert snapwire.decode(b'{"rank": 3}') == {"rank": 3}


def test_a_value_that_inflates_without_end_is_refused():
    bomb = snapwire.MAGIC + zlib.compress(b"[" + b" " * (snapwire.MAX_UNPACKED + 10) + b"]", 9)
    with pytest.raises(ValueError, match="inflates past"):
        snapwire.decode(bomb)


@pytest.fixture()
def server():
    yield dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=timedelta(seconds=10))


def _client(server) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))


def test_snapshots_and_their_histories_through_a_real_store(server):
    """Four ranks of a 16k-rank job post; the writer reads the snapshots, then the histories of
    the ranks it asks for. No value over the limit; a history of 512 records goes in parts when
    it must, and comes back whole."""
    world = 16384
    posted = {r: rank_snapshot(r, world, "dp") for r in (32, 33, 34, 35)}
    posted[35]["history"] = [dict(posted[35]["history"][0], seq=i, call_site=f"f{i}.py:{i}") for i in range(512)]
    for r, snap in posted.items():
        post_snapshot(Exchange(_client(server), r, world), "snap/1", RankSnapshot.from_dict(copy.deepcopy(snap)))
    reader = Exchange(_client(server), 0, world)
    got = collect_snapshots(reader, "snap/1", [32, 33, 34, 35, 36])
    assert sorted(got) == [32, 33, 34, 35] and all("history" not in s for s in got.values())
    assert got[33]["engine"]["groups"][3]["group"] == posted[33]["engine"]["groups"][3]["group"]
    histories = collect_histories(reader, "snap/1", [33, 35])
    assert sorted(histories) == [33, 35] and histories[35] == posted[35]["history"]
    assert all(len(server.get(f"snap/1/{r}")) <= MAX_STORE_VALUE for r in posted)


# -- per node: the leaders' values (distdiag/runtime/nodes.py) ---------------------------------
def _post_all(server, world: int, ranks: list[int]) -> dict[int, dict]:
    from distdiag.runtime.incident import Incident
    from distdiag.runtime.keys import IncidentKeys

    posted = {}
    for r in ranks:
        snap = RankSnapshot.from_dict(rank_snapshot(r, world, "dp" if r >= 32 else "tp"))
        posted[r] = copy.deepcopy(snap.to_dict())
        Incident(Exchange(_client(server), r, world), IncidentKeys(1), world).post_snapshot(snap)
    return {r: {k: v for k, v in s.items() if k != "history"} for r, s in posted.items()}


def test_a_node_leader_brings_its_nodes_snapshots_and_the_writer_reads_the_rest(server):
    """Ranks 32-39 are one node: its leader posts their snapshots as one value. The writer
    (rank 0) gets them from it even once their own keys are gone, and reads rank 0-7 one by one."""
    from distdiag.runtime.incident import Incident
    from distdiag.runtime.keys import IncidentKeys
    from distdiag.runtime.nodes import aggregate_node, gather_snapshots

    world = 16384
    ranks = [*range(8), *range(32, 40)]
    posted = _post_all(server, world, ranks)
    leader = Incident(Exchange(_client(server), 32, world), IncidentKeys(1), world)
    assert aggregate_node(leader, list(range(32, 40)), wait_s=2.0) == 8
    for r in range(33, 40):
        server.delete_key(f"snap/1/{r}")  # the writer cannot have read them one by one
    writer = Incident(Exchange(_client(server), 0, world), IncidentKeys(1), world)
    got = gather_snapshots(writer, cache={}, leaders=[32], wait_s=2.0)
    assert got == {r: posted[r] for r in ranks}


def test_a_dead_leader_costs_its_nodes_snapshots_nothing(server):
    """The leader of ranks 32-39 never posts (dead): the writer waits for no value of it and
    reads the node's snapshots one by one."""
    from distdiag.runtime.incident import Incident
    from distdiag.runtime.keys import IncidentKeys
    from distdiag.runtime.nodes import gather_snapshots

    world = 16384
    posted = _post_all(server, world, list(range(33, 40)))
    writer = Incident(Exchange(_client(server), 0, world), IncidentKeys(1), world)
    got = gather_snapshots(writer, cache={}, leaders=[32], wait_s=30.0)
    assert got == posted


def test_a_snapshot_read_again_comes_with_its_history(server):
    """The writer's re-read of a snapshot that contradicted itself (writer.py `_reread`) keeps
    the rank's long history: without it, a desync is located from the 8 recent records only
    (a loaded run of test_watchdog_faults named the wrong call site that way)."""
    from distdiag.runtime.incident import Incident
    from distdiag.runtime.keys import IncidentKeys

    world = 64
    rank = Incident(Exchange(_client(server), 5, world), IncidentKeys(1), world)
    snap = RankSnapshot.from_dict(rank_snapshot(5, world, "tp"))
    rank.post_snapshot(snap)
    rank.repost_snapshot(RankSnapshot.from_dict(rank_snapshot(5, world, "tp")))
    again = Incident(Exchange(_client(server), 0, world), IncidentKeys(1), world).snapshots([5])[5]
    assert again.reread and again.extra["history"] == rank_snapshot(5, world, "tp")["history"]


def test_only_nodes_of_two_ranks_or_more_have_a_leader_the_writer_waits_for():
    """One rank per node (or the writer's own node): no value to wait for, no second lost."""
    from distdiag.report.model import RankInfo
    from distdiag.runtime.nodes import node_leaders

    infos = {r: RankInfo(r, f"h{r // 2}", r // 2, r % 2, "cpu", 100 + r) for r in range(6)}
    infos[6] = RankInfo(6, "h3", 3, 0, "cpu", 106)  # a node of one rank
    assert node_leaders(infos, writer=0) == [2, 4]
    single = {r: RankInfo(r, f"h{r}", r, 0, "cpu", 100 + r) for r in range(4)}
    assert node_leaders(single, writer=1) == []


def test_a_leader_posts_what_came_so_the_writer_need_not_wait_for_it(server):
    """Rank 33 never posts (dead): rank 32, its node's leader, posts its own snapshot alone after
    its wait, and the writer reads rank 33's absence from that, not after a second of its own."""
    from distdiag.runtime.incident import Incident
    from distdiag.runtime.keys import IncidentKeys
    from distdiag.runtime.nodes import aggregate_node

    world = 64
    posted = _post_all(server, world, [32])
    leader = Incident(Exchange(_client(server), 32, world), IncidentKeys(1), world)
    assert aggregate_node(leader, [32, 33], wait_s=0.2) == 1
    assert int(server.add("node/1/n", 0)) == 1
    writer = Incident(Exchange(_client(server), 0, world), IncidentKeys(1), world)
    from distdiag.runtime.nodes import gather_snapshots

    stats: dict[str, int] = {}
    assert gather_snapshots(writer, cache={}, leaders=[32], wait_s=30.0, stats=stats) == posted
    assert stats == {"node_values": 1, "from_node_leaders": 1, "one_by_one": 0}


# -- a node's recent collectives, their shared fields once (pack_many) -------------------------
def _node(world: int, first: int) -> dict[int, dict]:
    snaps = {r: {k: v for k, v in rank_snapshot(r, world, "dp").items() if k != "history"} for r in range(first, first + 8)}
    snaps[first + 1]["recent"][0].pop("step")  # a column missing (the check's tracker writes no step)
    snaps[first + 2]["recent"][-1] = {**snaps[first + 2]["recent"][-1], "for_s": 3.5}  # a field of its own
    snaps[first + 3]["recent"].append("not a record")  # left as it is, not split
    return snaps


def test_a_node_value_writes_its_records_shared_fields_once_and_unpacks_to_what_was_posted():
    """8 ranks x 8 recent records of a 16k-rank job: each record's op, shape, dtype, call site
    and fingerprint are written once for the node, its group, seq, step and duration in a
    row; unpacked, every record is the posted one, in order, with its full group label."""
    from distdiag.hang.views import SplitRecords

    snaps = _node(16384, 800)
    value = snapwire.decode(snapwire.pack_many(snaps))
    rows = [row for s in value["~snaps"].values() for row in s.get("~recent", [])]  # rank 803: not split
    assert len(value["~recent"]) <= 5 and len(rows) == 56 and all(type(row) is list and len(row) == 5 for row in rows)
    back = snapwire.unpack_many(value, {})
    assert back == snaps
    assert type(back[800]["recent"]) is SplitRecords and type(back[803]["recent"]) is list
    assert back[801]["recent"][0] == snaps[801]["recent"][0] and "step" not in back[801]["recent"][0]


def test_a_node_value_with_malformed_rows_leaves_them_out():
    """A corrupt or hostile value: rows that point nowhere or have the wrong width are dropped,
    the rest of the rank's records and the other ranks come back."""
    snaps = _node(64, 8)
    value = snapwire.decode(snapwire.pack_many(snaps))
    rows = value["~snaps"]["9"]["~recent"]
    rows[0][0], rows[1] = 999, [0, 1]
    value["~snaps"]["10"]["~recent"] = "rows"
    back = snapwire.unpack_many(value, {})
    assert back[9]["recent"] == snaps[9]["recent"][2:]
    assert "recent" not in back[10] and back[11] == snaps[11]


def test_the_recent_table_reads_the_nodes_split_as_it_reads_plain_records():
    """The report's table of recent collectives (hang/views.py `recent_table`) is the same from
    snapshots a node leader split as from the plain records; a rank whose snapshot was
    replaced (re-read: a plain list) or whose list changed is read from its records."""
    from distdiag.hang.views import _namer, recent_table

    world = 2048
    plain = {}
    for first in range(0, 128, 8):
        plain.update(_node(world, first))
    split: dict[int, dict] = {}
    cache: dict[str, str] = {}
    for first in range(0, 128, 8):
        split.update(snapwire.unpack_many(snapwire.decode(snapwire.pack_many({r: plain[r] for r in range(first, first + 8)})), cache))
    from distdiag.hang.views import SplitRecords

    assert type(split[16]["recent"]) is SplitRecords  # the node's split is what the table reads
    split[17] = copy.deepcopy(plain[17])
    split[18]["recent"].append(dict(plain[18]["recent"][0]))
    plain[18]["recent"].append(dict(plain[18]["recent"][0]))
    assert recent_table(split, _namer({})) == recent_table(plain, _namer({}))


@pytest.mark.parametrize("value", [
    {"~snaps": {"\u00b2": {}}},  # a digit that is no ASCII digit
    {"~snaps": {"1": {}}, "~labels": {"0": "abc"}},
    {"~snaps": {"1": {}}, "~labels": {"0": "0+0x5"}},
    {"~snaps": {"1": {}}, "~labels": {"0": "0+1x10000000000"}},
])
def test_a_corrupt_node_value_never_raises(value):
    assert all(isinstance(s, dict) for s in snapwire.unpack_many(value, {}).values())


def test_a_values_shared_entries_are_read_once_for_all_its_snapshots(monkeypatch):
    """50k shared entries and 1,000 snapshots (a 4 KB value): what the rows need of the shared
    entries is worked out once for the value; once a snapshot, it took 16 s."""
    made = []
    original = snapwire._Split.__init__

    def counted(self, *args):
        made.append(1)
        original(self, *args)

    monkeypatch.setattr(snapwire._Split, "__init__", counted)
    value = {"~snaps": {str(r): {"~recent": []} for r in range(1000)}, "~recent": [{}] * 50_000}
    assert len(snapwire.unpack_many(value, {})) == 1000 and len(made) == 1


def test_records_with_keys_json_cannot_sort_go_as_they_are():
    snaps = {0: {"recent": [{"op": "x", 1: "y", "seq": 1}]}}
    value = snapwire.decode(snapwire.pack_many(snaps))
    assert "~recent" not in value["~snaps"]["0"] and value["~snaps"]["0"]["recent"][0]["op"] == "x"


# -- the writer reads node values while the snapshots still come in (nodes.py NodeReader) ------
def test_the_writer_reads_each_node_value_as_it_comes_and_not_again(server):
    """Two nodes' leaders post one after the other: each read finds only what is new (by the
    number the leader wrote), the gather reads neither again, and what it returns is what the
    ranks posted, whole."""
    from distdiag.runtime.incident import Incident
    from distdiag.runtime.keys import IncidentKeys
    from distdiag.runtime.nodes import NodeReader, aggregate_node, gather_snapshots

    world = 16384
    posted = _post_all(server, world, [*range(32, 40), *range(40, 48)])
    writer = Incident(Exchange(_client(server), 0, world), IncidentKeys(1), world)
    ahead = NodeReader(writer, {})
    assert ahead.read_new() == []
    assert aggregate_node(Incident(Exchange(_client(server), 32, world), IncidentKeys(1), world), list(range(32, 40))) == 8
    assert sorted(ahead.read_new()) == list(range(32, 40)) and ahead.read_new() == []
    assert aggregate_node(Incident(Exchange(_client(server), 40, world), IncidentKeys(1), world), list(range(40, 48))) == 8
    assert sorted(ahead.read_new()) == list(range(40, 48)) and ahead.leaders == {32, 40}
    for r in range(32, 48):
        server.delete_key(f"node/1/{r}" if r in (32, 40) else f"snap/1/{r}")  # not read again from anywhere
    stats: dict[str, int] = {}
    got = gather_snapshots(writer, cache={}, leaders=[32, 40], wait_s=2.0, stats=stats, ahead=ahead)
    assert got == posted and stats == {"node_values": 2, "from_node_leaders": 16, "one_by_one": 0}


def test_the_writers_wait_reads_the_node_values_that_came(server):
    """The wait for snapshots ends once every rank posted; the node value that came by then is
    read and typed in it (the gather then finds it read)."""
    from distdiag.runtime.incident import Incident
    from distdiag.runtime.keys import IncidentKeys
    from distdiag.runtime.nodes import NodeReader, aggregate_node
    from distdiag.watchdog import writer as writer_module

    world = 16
    posted = _post_all(server, world, list(range(world)))
    assert aggregate_node(Incident(Exchange(_client(server), 8, world), IncidentKeys(1), world), list(range(8, 16))) == 8
    writer = Incident(Exchange(_client(server), 0, world), IncidentKeys(1), world)
    ahead, typed = NodeReader(writer, {}), {}
    writer_module._wait_for_snapshots(writer, {}, host="here", grace_s=5.0, ahead=ahead, typed=typed)
    assert sorted(ahead.snaps) == list(range(8, 16)) and sorted(typed) == list(range(8, 16))
    assert all(ahead.snaps[r] == posted[r] and typed[r][1].rank == r for r in range(8, 16))
    merged = {r: posted[r] for r in range(8)} | ahead.snaps
    records = writer_module.typed_snapshots(merged, typed)
    assert all(records[r] is typed[r][1] for r in range(8, 16))
    assert {r: s.to_dict() for r, s in records.items()} == {r: RankSnapshot.from_dict(s).to_dict() for r, s in merged.items()}


def test_entries_sharing_their_sizes_are_compared_as_before():
    """The gather keeps one sizes / dtypes object per distinct text: a rank whose recorder
    entry differs is still the odd one, whether its lists are shared objects or its own."""
    from distdiag.hang.desync import record_divergence

    def entry(sizes, dtypes=None):
        return {"group": "ranks[0,1,2]", "seq": 4, "op": "all_reduce", "sizes": sizes, "dtypes": dtypes or ["Float"]}

    shared = [[1024]]
    snaps = {0: {"engine": {"entries": [entry(shared)]}}, 1: {"engine": {"entries": [entry(shared)]}},
             2: {"engine": {"entries": [entry([[1024.0]])]}}}  # equal as lists, not as the recorder wrote them
    found = record_divergence(snaps)
    assert found is not None and found["classes"] == [[0, 1], [2]]
    snaps[2]["engine"]["entries"][0]["sizes"] = [[1024]]
    assert record_divergence(snaps) is None
