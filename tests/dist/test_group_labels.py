"""Group labels of a real gloo job (tests/dist/group_label_workers.py): the live side's and the
dump reader's, read back by the one parser (distdiag/hang/groupid.py) to the members torch has.

The job has the default group, a 2x2 device mesh (torch's descs mesh_dp / mesh_tp), two groups of
the same members and desc (twins) and a group with no desc; the dumps are the ones torch wrote.
"""

from __future__ import annotations

import json

import pytest

from distdiag.hang.dumpgroups import group_label
from distdiag.hang.dumpreport import dump_files, rank_dumps, read_dumps
from distdiag.hang.groupid import GroupId, parse_label
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(180)
WORLD = 4


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    path = tmp_path_factory.mktemp("labels")
    result = run_ranks(WORLD, [], path, entry="tests.dist.group_label_workers:job",
                       env={"TORCH_FR_BUFFER_SIZE": "2000"}, timeout=90)
    assert not result.timed_out and result.codes == [0] * WORLD, [o.stderr[-2000:] for o in result.outcomes]
    return path


def _truth(job, rank):
    return json.loads((job / f"labels_{rank}.json").read_text())


@pytest.mark.parametrize("rank", range(WORLD))
def test_live_labels_read_back_to_the_members_torch_has(job, rank):
    """The recorder's, the tracked collectives' and the live reader's labels of every group name its ranks."""
    truth = _truth(job, rank)
    assert truth["state"] == "ok"
    for name, g in truth["groups"].items():
        for label in (g["recorder"], g["comm"]):
            assert parse_label(label).label == label, label
            assert parse_label(label).ranks(WORLD) == g["ranks"], (name, label)
        assert g["recorder"] == ("world" if name == "0" else GroupId(tuple(g["ranks"])).label)
    members = sorted(g["ranks"] for g in truth["groups"].values())
    assert sorted(parse_label(label).ranks(WORLD) for label in truth["live"]) == members


@pytest.mark.parametrize("form", ["json", "pickle"])
def test_dump_labels_carry_desc_and_twins_and_read_back(job, form):
    """Each group of torch's own dumps: 'world', 'ranks[0,2] (mesh_dp)', the twins 'ranks[0,2] (DP, group N)'
    with torch's name, 'ranks[1,3]' for no desc; parsed back to its members, desc and name."""
    dumps, world, _ = rank_dumps(read_dumps(dump_files(job / form)))
    assert world == WORLD
    for rank, d in dumps.items():
        truth = _truth(job, rank)["groups"]
        assert {g.name for g in d.groups.values()} == set(truth)
        for g in d.groups.values():
            label, want = group_label(g, world), truth[g.name]
            gid = parse_label(label)
            assert gid.label == label and gid.ranks(world) == want["ranks"], label
            if g.name == "0":
                assert label == "world"
            elif want["desc"] == "DP":  # the twins: only torch's group name tells them apart
                assert label == f"ranks[0,2] (DP, group {g.name})" and (gid.desc, gid.name) == ("DP", g.name)
            elif want["desc"] == "undefined":
                assert label == "ranks[1,3]" and gid.desc == ""
            else:
                assert label == f"{GroupId(tuple(want['ranks'])).label} ({want['desc']})" and gid.desc == want["desc"]
