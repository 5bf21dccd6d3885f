"""Forked ranks share the launching process's Python hash seed (it is drawn at interpreter start
and cannot be changed after: every string caches its hash), where torchrun's ranks each draw
their own. A bug that depends on set order across ranks passes under the fork launch, so its
report says the fork cannot see such bugs and points to `--launch torchrun`, which shows the bug;
the sorted twin passes under torchrun. Real `distdiag check` runs (torchrun agents, gloo ranks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from distdiag.launcher import forkrun

TARGET = Path(__file__).resolve().parent / "targets" / "hash_order_build.py"


def _check(cli_env: dict[str, str], tmp_path: Path, launch: str, *, healthy: bool = False) -> tuple[int, dict, str]:
    env = dict(cli_env)
    env.pop("PYTHONHASHSEED", None)
    if healthy:
        env["DISTDIAG_TWIN"] = "healthy"
    report = tmp_path / f"{launch}-{healthy}.json"
    out = subprocess.run(
        [sys.executable, "-m", "distdiag", "check", "--nproc", "2", "--probes", "setup_sync", "--target", str(TARGET),
         "--launch", launch, "--report", str(report), "--timeout-s", "100"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=130, stdin=subprocess.DEVNULL,
    )
    return out.returncode, json.loads(report.read_text()), out.stderr


def test_note_only_where_the_seed_is_shared_and_not_fixed(monkeypatch) -> None:
    """The note needs both: this rank's hash of the probe string is the parent's (forked), and
    PYTHONHASHSEED is not one number (with it, torchrun's ranks share one seed too)."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.delenv(forkrun.PARENT_HASH_ENV, raising=False)
    assert forkrun.shared_hash_seed_note() is None  # not launched by forkrun
    monkeypatch.setenv(forkrun.PARENT_HASH_ENV, str(hash("distdiag.check.forkrun: hash seed")))
    assert "--launch torchrun" in (forkrun.shared_hash_seed_note() or "")
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert forkrun.shared_hash_seed_note() is None
    monkeypatch.setenv("PYTHONHASHSEED", "random")
    assert forkrun.shared_hash_seed_note() is not None
    monkeypatch.setenv(forkrun.PARENT_HASH_ENV, str(hash("distdiag.check.forkrun: hash seed") + 1))
    assert forkrun.shared_hash_seed_note() is None  # a spawned rank drew its own seed


@pytest.mark.torchrun
@pytest.mark.timeout(300)
def test_set_order_bug_hidden_by_fork_is_said_and_seen_under_torchrun(cli_env, tmp_path) -> None:
    """Branches built in set order: fork passes with the note; torchrun fails at setup_sync;
    the sorted twin passes under torchrun with no note."""
    code, report, err = _check(cli_env, tmp_path, "fork")
    assert code == 0 and any("--launch torchrun" in n and "hash seed" in n for n in report.get("notes", [])), report
    assert "distdiag: note:" not in err, err[-2000:]  # a healthy run stays one line per probe: in the JSON, and --verbose
    code, report, _ = _check(cli_env, tmp_path, "torchrun")
    errors = [f for p in report["probes"] for f in p["findings"] if f["severity"] == "error"]
    assert code == 1 and any("in branches" in f["issue"] for f in errors), errors  # the module, or its branches
    assert [f["cause"] for f in errors] == ["setup_divergence_init_order"], errors  # the values moved between names
    assert not report.get("notes")
    code, report, _ = _check(cli_env, tmp_path, "torchrun", healthy=True)
    assert code == 0 and not report.get("notes"), report
