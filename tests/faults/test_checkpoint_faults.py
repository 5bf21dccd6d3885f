"""checkpoint on real gloo ranks: renamed models are named, round trips clean up, bad paths are findings."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from tests.harness import run_check

pytestmark = pytest.mark.timeout(150)

TARGETS = Path(__file__).parent / "targets"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A DCP checkpoint of ckpt_healthy's model and Adam state, written by one process (no group)."""
    import sys

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from distdiag.probes.checkpoint.probe import _manual_adam_state

    sys.path.insert(0, str(TARGETS))
    import ckpt_healthy

    model = ckpt_healthy.build_model()
    opt = torch.optim.AdamW(model.parameters())
    _manual_adam_state(opt)
    msd, osd = get_state_dict(model, opt)
    path = tmp_path_factory.mktemp("ckpt") / "step1"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))
    return str(path)


class _Mkdir:
    """Unpickling this runs os.mkdir(path): what a crafted checkpoint could do on every rank."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        import os

        return (os.mkdir, (self.path,))


def _save_healthy(path: Path, poison_step: str | None = None) -> None:
    """ckpt_healthy's model and Adam state saved by DCP in this process; `poison_step` replaces
    fc1.weight's Adam step (a tensor) by an object that makes that directory when unpickled."""
    import sys

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from distdiag.probes.checkpoint.probe import _manual_adam_state

    sys.path.insert(0, str(TARGETS))
    import ckpt_healthy

    model = ckpt_healthy.build_model()
    opt = torch.optim.AdamW(model.parameters())
    _manual_adam_state(opt)
    msd, osd = get_state_dict(model, opt)
    if poison_step:
        osd["state"]["fc1.weight"]["step"] = _Mkdir(poison_step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))


def _run(workdir: Path, target: str | None, *extra: str, inject: str | None = None):
    args = ["--probes", "checkpoint", *extra] + (["--target", str(TARGETS / f"{target}.py")] if target else [])
    result = run_check(2, args, workdir, timeout=120, inject=inject)
    assert not result.timed_out, result.stderr
    return result, result.report().probe("checkpoint")


def test_round_trip_of_target_passes_and_removes_its_dir(workdir):
    """FSDP2-sharded model + Adam state saved, perturbed, loaded: all equal; the temp dir is gone."""
    base = workdir / "ckptdir"
    base.mkdir()
    cfg = workdir / "c.toml"
    cfg.write_text(f'[probes.checkpoint]\ndir = "{base}"\n')
    result, probe = _run(workdir, "ckpt_healthy", "--config", str(cfg))
    assert result.codes == [0, 0], result.stderr
    assert [f.issue for f in probe.findings if f.severity != "info"] == []
    assert probe.metrics["tensors"] >= 12 and list(base.iterdir()) == []


def test_loading_into_the_same_model_passes(workdir, saved):
    """--checkpoint into the model that wrote it: every key read, every tensor equal."""
    result, probe = _run(workdir, "ckpt_healthy", "--checkpoint", saved)
    assert result.codes == [0, 0], result.stderr
    assert [f.issue for f in probe.findings if f.severity != "info"] == []
    assert probe.metrics["loaded"] >= 12


def test_wrapper_rename_gets_a_rename_map(workdir, saved):
    """The model gained `module.`: every key differs only by it; the map names old -> new."""
    result, probe = _run(workdir, "ckpt_wrapped", "--checkpoint", saved)
    assert result.codes == [1, 1]
    (f,) = [f for f in probe.findings if f.severity == "error"]
    assert "only by wrapper names" in f.issue and "'model.fc1.weight': 'model.module.fc1.weight'" in f.evidence


def test_renamed_layer_lists_missing_and_unread_keys_with_a_guess(workdir, saved):
    """fc1 -> proj_in: proj_in keys missing, fc1 keys unread, same-shape guess offered."""
    result, probe = _run(workdir, "ckpt_renamed", "--checkpoint", saved)
    assert result.codes == [1, 1]
    by_issue = {f.issue: f for f in probe.findings if f.severity == "error"}
    (missing,) = [f for i, f in by_issue.items() if "not in the checkpoint" in i]
    (unread,) = [f for i, f in by_issue.items() if "read by nothing" in i]
    assert "model.proj_in.weight (perhaps checkpoint key 'model.fc1.weight'" in missing.evidence
    assert "model.fc1.weight" in unread.evidence


def test_a_path_that_is_no_checkpoint_is_a_clear_finding(workdir):
    """--checkpoint on an empty directory: one error naming the path on every rank, no hang."""
    empty = workdir / "nothing"
    empty.mkdir()
    result, probe = _run(workdir, "ckpt_healthy", "--checkpoint", str(empty))
    assert result.codes == [1, 1]
    (f,) = [f for f in probe.findings if f.severity == "error"]
    assert "not a readable DCP checkpoint" in f.issue and f.ranks == [0, 1]


def test_temp_dir_is_removed_when_the_round_trip_fails(workdir):
    """Both ranks raise at the collective after the save: the probe errors and the dir is still removed."""
    base = workdir / "ckptdir"
    base.mkdir()
    cfg = workdir / "c.toml"
    cfg.write_text(f'[probes.checkpoint]\ndir = "{base}"\n')
    result, probe = _run(workdir, None, "--config", str(cfg), inject="raise:checkpoint:0:after=3;raise:checkpoint:1:after=3")
    assert result.codes == [1, 1], result.stderr
    assert probe.status == "error" and "injected fault" in probe.findings[0].issue
    assert "_round_trip" in probe.findings[0].evidence  # raised after the save, inside the cleanup's agreement
    assert list(base.iterdir()) == []


def test_missing_build_model_skips_with_the_hook_named(workdir):
    """A target without build_model: checkpoint skips and says which hook it needs."""
    result = run_check(2, ["--probes", "checkpoint,sequence_parallel", "--target", str(TARGETS / "sp_bad_split.py")], workdir, timeout=90)
    probe = result.report().probe("checkpoint")
    assert probe.status == "skip" and "build_model()" in probe.reason


def test_round_trip_of_integer_buffers_and_frozen_params_passes(workdir):
    """BatchNorm's int64 counter and a frozen layer: the probe's own perturbation and made-up Adam state do not fail it."""
    result, probe = _run(workdir, "ckpt_int_buffer_frozen")
    assert result.codes == [0, 0], result.stderr
    assert [f.issue for f in probe.findings if f.severity != "info"] == []
    assert probe.metrics["mode"] == "round_trip" and probe.metrics["tensors"] >= 8


@pytest.mark.parametrize("spec", ["hang:checkpoint:1:after=2", "hang:checkpoint:1:after=3", "hang:checkpoint:0:after=3"])
def test_a_hang_inside_the_round_trip_leaves_no_directory_behind(workdir, spec):
    """A rank hangs before the path broadcast (dir just made) or after the save: the run ends 3, and the
    distdiag-ckpt-* directory is removed by the sentinel's exit cleanup (no `finally` runs then)."""
    base = workdir / "ckptdir"
    base.mkdir()
    cfg = workdir / "c.toml"
    cfg.write_text(f'[probes.checkpoint]\ndir = "{base}"\n')
    result, _ = _run(workdir, None, "--config", str(cfg), "--timeout-s", "3", inject=spec)
    assert result.codes == [3, 3], result.stderr
    assert list(base.iterdir()) == []


def test_a_crafted_metadata_is_refused_and_does_not_run(workdir, saved):
    """--checkpoint on a directory whose .metadata reduces to os.mkdir: an error naming it on every rank, no directory
    made; with trust_pickle = true it is read with plain pickle (the directory appears: the option is wired)."""
    import pickle
    import shutil

    crafted = workdir / "crafted"
    shutil.copytree(saved, crafted)
    marker = workdir / "pwned"
    (crafted / ".metadata").write_bytes(pickle.dumps(_Mkdir(str(marker))))
    result, probe = _run(workdir, "ckpt_healthy", "--checkpoint", str(crafted))
    assert result.codes == [1, 1], result.stderr
    (f,) = [f for f in probe.findings if f.severity == "error"]
    assert "distdiag refuses to unpickle posix.mkdir from" in f.issue and f.ranks == [0, 1]
    assert "trust_pickle = true" in f.fix and not marker.exists()
    cfg = workdir / "trust.toml"
    cfg.write_text("[probes.checkpoint]\ntrust_pickle = true\n")
    result, probe = _run(workdir, "ckpt_healthy", "--checkpoint", str(crafted), "--config", str(cfg))
    assert result.codes == [1, 1] and marker.is_dir()
    assert any("not a readable DCP checkpoint" in f.issue for f in probe.findings)


def test_a_crafted_byte_entry_in_the_data_files_is_refused_and_does_not_run(workdir):
    """A tensor entry (Adam step) stored as a pickled object that reduces to os.mkdir: dcp.load would torch.load it
    with weights_only=False; the probe refuses it by name on every rank and the directory is never made."""
    ckpt, marker = workdir / "ckpt", workdir / "pwned"
    _save_healthy(ckpt, poison_step=str(marker))
    assert not marker.exists()
    result, probe = _run(workdir, "ckpt_healthy", "--checkpoint", str(ckpt))
    assert result.codes == [1, 1], result.stderr
    (f,) = [f for f in probe.findings if f.severity == "error"]
    assert "refuses to unpickle posix.mkdir from the checkpoint entry optim.state.fc1.weight.step" in f.issue
    assert f.ranks == [0, 1] and not marker.exists()
