"""Pure checks of sequence_parallel, moe_routing and checkpoint (no processes)."""

from __future__ import annotations

import pytest
import torch

from distdiag.probes.checkpoint.keys import compare_keys, normalize_key
from distdiag.probes.moe.checks import load_findings
from distdiag.probes.moe.dispatch import pair_mismatches
from distdiag.probes.sequence_parallel.checks import analyze_split, loss_problem, output_shape_problem
from distdiag.workloads import sequence as seqw
from distdiag.workloads.moe import DenseMoE, ExpertParallelMoE, keep_mask


def _payload(batch, split, world):
    full = {k: (v.tolist() if v is not None else None) for k, v in
            {k: batch.get(k) for k in ("input_ids", "labels", "position_ids", "attention_mask")}.items()}
    local = {}
    for r in range(world):
        out = split(batch, r, world)
        local[r] = {k: (out[k].tolist() if k in out else None) for k in ("input_ids", "shift_labels", "labels", "position_ids", "attention_mask")}
    return full, local


@pytest.mark.parametrize("name", ["contiguous", "zigzag"])
@pytest.mark.parametrize("seq,world", [(32, 2), (33, 4), (7, 4)])
def test_builtin_splitters_cover_every_triple_once(name, seq, world):
    """Even and uneven lengths: no finding for either built-in split."""
    batch = seqw.make_lm_batch(2, seq, 50, pad=3)
    assert analyze_split(name, *_payload(batch, seqw.SPLITTERS[name], world), world) == []


def test_labels_shifted_after_split_are_named_at_each_boundary():
    """Per-shard shifting: the last local target of ranks 0..W-2 is lost, positions named."""
    batch = seqw.make_lm_batch(1, 16, 50)
    del batch["attention_mask"]

    def bad(b, rank, world):
        idx = seqw.contiguous_indices(16, rank, world)
        return {"input_ids": b["input_ids"][:, idx], "shift_labels": seqw.shift_labels(b["labels"][:, idx]),
                "position_ids": idx[None]}

    (f,) = analyze_split("x", *_payload(batch, bad, 4), 4)
    assert "shifted after the split" in f.issue and f.ranks == [0, 1, 2]
    assert "rank 1: positions 7 " in f.evidence


def test_output_shape_problem_names_the_dim_that_grew():
    assert output_shape_problem([1, 8, 5], [1, 8, 5], [1, 16, 5], 2) is None
    assert output_shape_problem([1, 16, 5], [1, 8, 5], [1, 16, 5], 2) is None
    assert "along dim 0" in output_shape_problem([2, 8, 5], [1, 8, 5], [1, 16, 5], 2)


def test_loss_problem_tells_per_rank_means_from_other_errors():
    assert loss_problem(2.0, {0: 2.0, 1: 2.0}, {0: 3, 1: 1}, None, 1e-4) is None
    issue, _ = loss_problem(2.5, {0: 2.0, 1: 4.0}, {0: 3, 1: 1}, {0: 6.0, 1: 4.0}, 1e-4)
    assert "average of per-rank mean losses" in issue
    issue, _ = loss_problem(2.5, {0: 2.0, 1: float("nan")}, {0: 4, 1: 0}, None, 1e-4)
    assert "not finite" in issue and "rank 1" in issue


def test_sp_loss_is_finite_and_zero_without_valid_targets():
    model = seqw.TinyCausalLM(vocab=50)
    batch = seqw.make_lm_batch(1, 8, 50)
    batch["labels"][:] = -100
    assert seqw.sp_loss(model, batch).item() == 0.0


def test_keys_normalise_wrappers_and_guess_renames_by_shape():
    assert normalize_key("module._orig_mod.fc._checkpoint_wrapped_module.weight") == "fc.weight"
    d = compare_keys({"model.fc.w": (2, 3), "model.new.b": (4,)}, {"model._orig_mod.fc.w": (2, 3), "model.old.b": (4,)})
    assert d.rename == {"model._orig_mod.fc.w": "model.fc.w"}
    assert d.missing == ["model.new.b"] and d.unread == ["model.old.b"] and d.by_shape == {"model.old.b": "model.new.b"}


def test_pair_mismatches_and_load_findings():
    assert pair_mismatches([[2, 2], [2, 2]], [[2, 2], [2, 2]], [0, 1]) == []
    assert pair_mismatches([[2, 2], [3, 2]], [[2, 2], [2, 2]], [0, 1]) == ["rank 1 sends 3 rows to rank 0, which expects 2"]
    (idle,) = [f for f in load_findings("r", [[0, 1]] * 10, 4, 3.0) if f.severity == "warning" and "no tokens" in f.issue]
    assert "experts [2, 3]" in idle.issue
    collapse = load_findings("r", [[0]] * 30 + [[1]], 4, 3.0)
    assert any("collapses" in f.issue for f in collapse)


def test_expert_parallel_layer_equals_dense_in_a_world_of_one_with_drops():
    """One rank holds every expert; with a capacity of 3 some assignments drop, the same in both."""
    torch.manual_seed(0)
    dense = DenseMoE(8, 16, num_experts=4, k=2, capacity_factor=0.5)
    x = torch.randn(20, 8)

    def a2a(out, inp, out_splits, in_splits, group=None):
        out.copy_(inp)

    ep = ExpertParallelMoE.from_dense(dense, 0, 1, a2a=a2a)
    with torch.no_grad():
        assert torch.allclose(ep(x), dense(x), atol=1e-6)
    assert ep.stats["dropped"] == int((~keep_mask(dense.router(x)[0], 4, ep.stats["capacity"])).sum()) > 0


def _floor_split(b, rank, world):
    per = b["input_ids"].shape[1] // world  # relies on divisible lengths
    idx = torch.arange(rank * per, (rank + 1) * per)
    return seqw.take_positions(b, idx)


def _split_payloads(seq: int, world: int, split=_floor_split) -> dict:
    from distdiag.probes.sequence_parallel.probe import _local_lists, _one_longer

    batch = seqw.make_lm_batch(2, seq, 50, pad=2)
    payloads = {r: {"splits": []} for r in range(world)}
    for variant, b in (("batch", batch), ("seq+1", _one_longer(batch))):
        for r in range(world):
            local, problem = _local_lists(split(b, r, world), 2)
            entry = {"splitter": "split_sequence", "variant": variant, "seq_len": b["input_ids"].shape[1],
                     "origin": "make_batch(1)", "local": local, "problem": problem}
            if r == 0:
                entry["full"] = {k: (b[k].tolist() if k in b else None) for k in ("input_ids", "labels", "position_ids", "attention_mask")}
            payloads[r]["splits"].append(entry)
    return payloads


def test_tokens_lost_only_on_the_made_up_length_are_a_warning_naming_the_invariant():
    """A floor split is right on 32 at world 4 and loses position 32 of the probe's 33: a warning, not an error."""
    from distdiag.probes.sequence_parallel.probe import _split_findings

    (f,) = _split_findings(_split_payloads(32, 4), 4)
    assert f.severity == "warning" and "a length distdiag made up" in f.issue and "2 of 66 tokens are on no rank" in f.issue
    assert "(0, 32), (1, 32)" in f.evidence and "dividing by 4" in f.fix


def test_tokens_lost_on_the_targets_own_length_stay_an_error():
    """The same split on make_batch's own length 34 (world 4): an error, and the made-up length is not looked at."""
    from distdiag.probes.sequence_parallel.probe import _split_findings

    findings = _split_findings(_split_payloads(34, 4), 4)
    assert [(f.severity, f.issue) for f in findings] == [("error", "split split_sequence: 4 of 68 tokens are on no rank")]
    assert "make_batch(1) has sequences of length 34, which 4 ranks do not divide" in findings[0].evidence


@pytest.mark.parametrize("seq_len,world,expected", [(32, 2, 32), (32, 3, 36), (32, 32, 64), (5, 2, 8)])
def test_the_built_in_batch_length_divides_by_twice_the_world(seq_len, world, expected):
    from distdiag.probes.sequence_parallel.probe import nominal_length

    assert nominal_length(seq_len, world) == expected


class _Mkdir:
    """Unpickling this runs os.mkdir(path): what a crafted checkpoint could do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        import os

        return (os.mkdir, (self.path,))


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory):
    """A real DCP checkpoint (model + Adam state + plain values) written by one process."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from distdiag.probes.checkpoint.probe import _adamw

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    msd, osd = get_state_dict(model, _adamw(model))
    path = tmp_path_factory.mktemp("dcp") / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd, "extra": {"epoch": 3, "tag": "x"}}, checkpoint_id=str(path))
    return path


def test_restricted_unpickler_reads_what_dcp_writes_like_pickle_does(dcp_dir):
    """A real checkpoint's .metadata: every class it references is admitted; same keys and shapes as plain pickle."""
    import pickle

    from distdiag.probes.checkpoint.safe_load import load_metadata

    with open(dcp_dir / ".metadata", "rb") as f:
        safe = load_metadata(f, ".metadata")
    with open(dcp_dir / ".metadata", "rb") as f:
        plain = pickle.load(f)
    assert safe.state_dict_metadata == plain.state_dict_metadata and "model.1.num_batches_tracked" in safe.state_dict_metadata
    assert safe.storage_data == plain.storage_data


def test_a_crafted_metadata_is_refused_before_it_runs(tmp_path):
    """A .metadata whose object reduces to os.mkdir: refused by name, and the directory is never made."""
    import pickle

    from distdiag.probes.checkpoint.safe_load import RefusedPickle, SafeFileSystemReader

    marker = tmp_path / "pwned"
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(_Mkdir(str(marker))))
    with pytest.raises(RefusedPickle) as info:
        SafeFileSystemReader(str(tmp_path / "ckpt")).read_metadata()
    assert info.value.what in ("posix.mkdir", "os.mkdir") and "trust_pickle = true" in str(info.value)
    assert not marker.exists()


def test_something_that_is_not_dcp_metadata_is_refused(tmp_path):
    """Only admitted classes, but not a Metadata: refused as such (a dict of sizes is not a checkpoint)."""
    import io
    import pickle

    from distdiag.probes.checkpoint.safe_load import RefusedPickle, load_metadata

    with pytest.raises(RefusedPickle, match="a dict where DCP's Metadata belongs"):
        load_metadata(io.BytesIO(pickle.dumps({"a": torch.Size([2])})), "x")


def test_byte_entries_must_pass_torch_weights_only_first(tmp_path):
    """A non-tensor entry that reduces to os.mkdir is refused by the planner; a plain number still loads."""
    import io

    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from distdiag.probes.checkpoint.safe_load import RefusedPickle, SafeLoadPlanner

    marker = tmp_path / "pwned"
    state = {"epoch": 0, "evil": 0}
    planner = SafeLoadPlanner()
    planner.set_up_planner(state, None, False)

    def item(fqn: str) -> ReadItem:
        index = MetadataIndex(fqn)
        return ReadItem(LoadItemType.BYTE_IO, index, torch.Size([0]), index, torch.Size([0]), torch.Size([0]))

    def saved(obj) -> io.BytesIO:
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        return buf

    planner.load_bytes(item("epoch"), saved(7))
    assert state["epoch"] == 7
    with pytest.raises(RefusedPickle, match="checkpoint entry evil"):
        planner.load_bytes(item("evil"), saved(_Mkdir(str(marker))))
    assert not marker.exists() and state["evil"] == 0
