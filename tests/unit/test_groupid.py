"""A process group's identity and label in one place (distdiag/hang/groupid.py): every label form
reads back to itself, text that is no label reads as a group of unknown members, and each caller's
meaning of an unknown group. Labels of torch's own gloo dumps and live groups are read in
tests/dist/test_group_labels.py; the real NCCL dumps of the acceptance cases here, when present."""

from __future__ import annotations

from pathlib import Path

import pytest

from distdiag.hang import views, waitfor
from distdiag.hang.dumpgroups import group_label
from distdiag.hang.dumpreport import dump_files, rank_dumps, read_folder
from distdiag.hang.groupid import UNKNOWN, GroupId, group_members, parse_label
from distdiag.runtime import snapwire
from distdiag.watchdog import stall
from distdiag.watchdog.marks import MarkComparer

FORMS = [
    ("world", GroupId(world=True)),
    ("ranks[0,8,16]", GroupId((0, 8, 16))),
    ("ranks[2,0]", GroupId((2, 0))),
    ("ranks[0,2] (DP)", GroupId((0, 2), "DP")),
    ("ranks[0,2] (DP, group 5)", GroupId((0, 2), "DP", "5")),
    ("ranks[0,2] (group 5)", GroupId((0, 2), name="5")),
    ("world (INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP)", GroupId(desc="INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP", world=True)),
    ("world (gloo)", GroupId(world=True).qualified("gloo")),
    ("ranks[0,1] (mesh (dp))", GroupId((0, 1), "mesh (dp)")),
    ("group 5", GroupId(name="5")),
    ("group 5 (nccl)", GroupId(name="5").qualified("nccl")),
    ("group?", GroupId()),
]


@pytest.mark.parametrize(("label", "gid"), FORMS)
def test_every_label_form_is_built_and_read_back(label, gid):
    """Each form the module writes: the GroupId builds exactly that text and the parser reads it back to the same GroupId."""
    assert gid.label == label
    assert parse_label(label) == gid and parse_label(label).label == label


def test_members_and_every_rank_for_world():
    """'world' is every rank; a listed group its members in order; 'group NAME' unknown."""
    assert group_members("world", 3) == [0, 1, 2]
    assert group_members("ranks[1,3] (cuda)", 4) == [1, 3]
    assert group_members("ranks[0, 2]", 4) == [0, 2]
    assert group_members("group 7", 2) is None and group_members("group?", 2) is None


@pytest.mark.parametrize("text", [
    "p2p", "ranks[3-16355 step 32] (512 ranks)", "ranks[1,x]", "ranks[0,1", "ranks[0,1] (DP", "", "tp", "World",
])
def test_text_that_is_no_label_is_a_group_of_unknown_members(text):
    """One behaviour on text that is no label: UNKNOWN (members None, label 'group?'), never an exception."""
    gid = parse_label(text)
    assert gid == UNKNOWN and gid.members is None and gid.ranks(4) is None and gid.label == "group?"


def test_each_caller_says_what_an_unknown_group_means():
    """The rules' and the writer's parser gives None, the wait-for graph no members, the stall check
    every rank (any may have completed it), the step-mark comparison skips the group."""
    assert views.group_members("group 7", 4) is None
    assert waitfor._members("group 7", 4) == ()
    assert stall.group_members("group 7", 4) == [0, 1, 2, 3]
    assert MarkComparer(0, 4)._ranks_of("group 7") is None
    for label in ("ranks[0,2]", "world"):
        assert views.group_members(label, 4) == stall.group_members(label, 4) == MarkComparer(0, 4)._ranks_of(label)


def test_of_names_the_world_and_hides_torchs_placeholder_descs():
    """GroupId.of as the dump reader calls it: every rank in order is 'world'; 'undefined'/'default_pg' are not names."""
    assert GroupId.of((0, 1, 2, 3), 4, "default_pg").label == "world"
    assert GroupId.of((0, 1, 2, 3), 4, "mesh_tp").label == "world (mesh_tp)"
    assert GroupId.of((1, 0, 2, 3), 4).label == "ranks[1,0,2,3]"
    assert GroupId.of((1, 3), 4, "undefined").label == "ranks[1,3]"
    assert GroupId.of((1, 3), 4, "undefined", "7").label == "ranks[1,3] (group 7)"


@pytest.mark.parametrize("tail", ["", " (gloo)", " (DP, group 5)"])
def test_the_wire_carries_a_long_label_by_reference_and_restores_it_byte_for_byte(tail):
    """A 512-member label goes as `ranks@0` plus what follows its members, and comes back as it was."""
    label = GroupId(tuple(range(3, 16384, 32))).label + tail
    snap = {"in_collective": {"op": "all_reduce", "group": label, "seq": 3}}
    value, _ = snapwire.pack(snap)
    wire = snapwire.decode(value)
    assert wire["~labels"] == {"0": "3+32x512"} and wire["in_collective"]["group"] == "ranks@0" + tail
    assert snapwire.unpack(snapwire.decode(value))["in_collective"]["group"] == label


def _acceptance() -> Path | None:
    for up in Path(__file__).resolve().parents:
        found = up / "shared" / "acceptance" / "nccl_dumps"
        if found.is_dir():
            return found
    return None


@pytest.mark.skipif(_acceptance() is None, reason="the acceptance cases' NCCL dumps are not beside this checkout")
@pytest.mark.parametrize("case", ["nvrx_gpu_error_1st", "nvrx_lock_gil_1st"])
def test_labels_of_real_nccl_dumps_read_back_to_their_members(case):
    """A 16-rank Megatron MoE job's own NCCL dumps: every group's label (Megatron's descs, 'world (...)' for the
    whole-job optimizer group) reads back to the members and desc pg_config gives."""
    raw = read_folder(dump_files(_acceptance() / case))[0]
    dumps, world, _ = rank_dumps(raw)
    seen = 0
    for d in dumps.values():
        for g in d.groups.values():
            label = group_label(g, world)
            gid = parse_label(label)
            assert gid.label == label and gid.ranks(world) == list(g.members), label
            assert gid.desc == ("" if g.desc in ("", "undefined", "default_pg") else g.desc)
            seen += 1
    assert world == 16 and seen > 16 * 5
