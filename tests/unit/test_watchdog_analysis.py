"""Desync location from fingerprint histories, config validation, the digest (pure, no torch group)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from distdiag.errors import ConfigError
from distdiag.hang import desync_finding, find_desync
from distdiag.watchdog.config import WatchdogConfig
from distdiag.watchdog.progress import Progress


def rec(seq, site, op="all_reduce", shape=(16,), step=0, group="world"):
    return {"op": op, "seq": seq, "group": group, "shape": list(shape), "dtype": "float32", "call_site": site, "step": step}


def program(sites, start=1, step_of=lambda i: i // 3):
    return [rec(start + i, s, step=step_of(i)) for i, s in enumerate(sites)]


def snaps_of(histories):
    return {r: {"history": h, "in_collective": None, "phase": "training", "stack": []} for r, h in histories.items()}


GOOD = ["t.py:A", "t.py:B", "t.py:C"] * 4


def test_skip_is_located_with_both_sites_and_step():
    skipped = GOOD[:7] + GOOD[8:]  # rank 1 leaves out B of step 2
    d = find_desync(snaps_of({0: program(GOOD), 1: program(skipped), 2: program(GOOD)}))
    assert d["kind"] == "skipped" and d["odd"] == [1] and d["seq"] == 8
    f = desync_finding(d)
    assert f.ranks == [1] and "t.py:B" in f.issue and "t.py:C" in f.issue and "step 2" in f.issue


def test_extra_same_shape_is_located():
    extra = GOOD[:8] + ["t.py:X"] + GOOD[8:]
    d = find_desync(snaps_of({0: program(GOOD), 1: program(GOOD), 2: program(extra)}))
    assert d["kind"] == "extra" and d["odd"] == [2] and d["seq"] == 9
    assert "t.py:X" in desync_finding(d).issue


def test_different_op_is_a_mismatch():
    other = program(GOOD)
    other[4] = rec(5, "t.py:B", op="all_gather", step=1)
    d = find_desync(snaps_of({0: program(GOOD), 1: other, 2: program(GOOD)}))
    assert d["kind"] == "mismatch" and d["odd"] == [1] and "all_gather" in desync_finding(d).issue


def test_rank_dependent_call_site_alone_is_not_a_desync():
    """`if rank == 0: broadcast(...) else: broadcast(...)` on two lines pairs fine: no finding."""
    other = program(GOOD)
    other[3] = rec(4, "t.py:A_else", step=1)
    assert find_desync(snaps_of({0: program(GOOD), 1: other, 2: program(GOOD)})) is None


def test_a_rank_that_is_only_behind_is_not_a_desync():
    assert find_desync(snaps_of({0: program(GOOD), 1: program(GOOD[:5])})) is None


def test_digest_ignores_call_sites_but_counts_collectives():
    a, b = Progress(64), Progress(64)
    for p, site in ((a, "x.py:1"), (b, "y.py:9")):
        r = p.begin("all_reduce", "world", (4,), "float32", site, False)
        p.end(r)
        p.mark_step(0)
    assert a.marks[-1][2] == b.marks[-1][2]
    r = b.begin("all_reduce", "world", (4,), "float32", "y.py:9", False)
    b.end(r)
    a.mark_step(1)
    b.mark_step(1)
    assert a.marks[-1][2] != b.marks[-1][2]


@pytest.mark.parametrize(
    "kwargs,key",
    [({"timeout": timedelta(0)}, "watchdog.timeout"), ({"action": "explode"}, "watchdog.action"), ({"history": 3}, "watchdog.history")],
)
def test_config_errors_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        WatchdogConfig(**kwargs)


def test_env_fills_what_arguments_leave_out(monkeypatch):
    monkeypatch.setenv("DISTDIAG_WATCHDOG_TIMEOUT_S", "7")
    monkeypatch.setenv("DISTDIAG_WATCHDOG_ACTION", "report")
    cfg = WatchdogConfig.from_env(action="raise")
    assert cfg.timeout_s == 7 and cfg.action == "raise"
    monkeypatch.setenv("DISTDIAG_WATCHDOG_TIMEOUT_S", "soon")
    with pytest.raises(ConfigError, match="DISTDIAG_WATCHDOG_TIMEOUT_S"):
        WatchdogConfig.from_env()


def test_importing_the_package_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, distdiag, distdiag.watchdog; distdiag.HangWatchdog; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
