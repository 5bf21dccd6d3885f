"""Rank 0 consolidates each probe while the ranks run the next one (distdiag/check/ahead.py,
issue 21): the report is the same as the one consolidated at the end, on a real TCPStore with
the default suite's payloads (healthy and faulty); what the thread could not make, the writer
makes; nothing it does can hold the writer."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from distdiag.check.ahead import Ahead
from distdiag.check.config import CheckConfig
from distdiag.check.finish import RunEnd
from distdiag.check.plan import Plan, PlannedProbe
from distdiag.check.shared_values import share_fields
from distdiag.probes import PROBES
from distdiag.report.model import ProbeResult
from distdiag.report.render import ProgressLine
from distdiag.runtime.context import LaunchInfo
from distdiag.runtime.exchange import Exchange
from distdiag.runtime.keys import Keys
from tests.unit.check_payloads import DATA_SCENARIOS, SCENARIOS, SUITE_SCENARIOS, payloads, rank_infos

WORLD = 8
SUITE = [name for name, cls in PROBES.items() if cls.default_enabled]


def _server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)


def _client(server: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, None, False, timeout=timedelta(seconds=30))


def _scenario(probe: str, faulty: bool) -> str:
    cases = SUITE_SCENARIOS.get(probe) or (DATA_SCENARIOS if probe == "data_shards" else SCENARIOS)
    return cases[1] if faulty else cases[0]


def _post_suite(store: dist.TCPStore, faulty: bool) -> None:
    """Every rank's row and its entry of each default probe, as distdiag/check/run.py posts them."""
    infos = rank_infos(WORLD)
    for index, name in enumerate(SUITE):
        made = payloads(name, WORLD, _scenario(name, faulty))
        for r in range(WORLD):
            ex = Exchange(store, r, WORLD)
            if index == 0:
                ex.post(Keys.INFO, infos[r].to_dict())
            ex.post(Keys.result(index), share_fields(ex, index, {"status": "ok", "payload": made[r]}, PROBES[name].shared_fields))


def _end() -> RunEnd:
    config = CheckConfig(probes=SUITE, quiet=True, report=os.path.join(tempfile.mkdtemp(), "report.json"))
    plan = Plan(config, [PlannedProbe(PROBES[n](), PROBES[n].Config() if PROBES[n].Config else None) for n in SUITE])
    info = LaunchInfo(rank=0, world_size=WORLD, local_rank=0, local_world_size=WORLD, node=0, host="h0", pid=os.getpid(),
                      restart_count=0, run_id="t", master_addr=None, master_port=None, agent_store=True)
    return RunEnd(config, plan, info, time.monotonic(), ProgressLine(None))


def _probes(report) -> list[dict]:
    return [{k: v for k, v in p.to_dict().items() if k != "duration_s"} for p in report.probes]


def test_the_report_made_ahead_is_the_report_made_at_the_end():
    """Healthy and faulty payloads of every default probe: the same probes, findings and
    details whether consolidated one by one on the thread (its own store client) or at the end."""
    for faulty in (False, True):
        server = _server()
        _post_suite(server, faulty)
        at_end = _end().consolidate(Exchange(_client(server), 0, WORLD))
        end = _end()
        ex = Exchange(_client(server), 0, WORLD)
        end.consolidate_ahead(ex, lambda server=server: _client(server))
        for index in range(len(SUITE)):
            end.ahead.ready(index)
        ahead = end.consolidate(ex)
        assert all(end.ahead.result(i) is not None for i in range(len(SUITE)))
        assert _probes(ahead) == _probes(at_end)
        assert ahead.verdict == at_end.verdict and ahead.summary == at_end.summary
        assert (ahead.verdict == "pass") is (not faulty)


def _result(index: int) -> ProbeResult:
    return ProbeResult(f"p{index}", status="pass")


def test_each_probe_is_made_on_the_thread_as_it_is_handed_over():
    made_on: dict[int, str] = {}

    def consolidate(ex, index):
        made_on[index] = threading.current_thread().name
        return _result(index)

    ahead = Ahead(consolidate, ex=None)
    for index in range(3):
        ahead.ready(index)
    ahead.finish()
    assert made_on == {i: "distdiag-consolidate" for i in range(3)}
    assert [ahead.result(i).name for i in range(3)] == ["p0", "p1", "p2"]
    ahead.ready(3)  # after finish: taken by nobody, waited for by nobody
    assert ahead.result(3) is None


def test_a_probe_the_thread_could_not_make_is_left_to_the_writer():
    def consolidate(ex, index):
        if index == 1:
            raise ConnectionError("store went away")
        return _result(index)

    ahead = Ahead(consolidate, ex=None)
    for index in range(3):
        ahead.ready(index)
    ahead.finish()
    assert ahead.result(0) is not None and ahead.result(1) is None and ahead.result(2) is not None


def test_nothing_is_made_ahead_when_preparing_fails_and_the_writer_is_not_held():
    def prepare(ex):
        raise ConnectionError("no rank table")

    ahead = Ahead(lambda ex, i: _result(i), ex=None, prepare=prepare)
    ahead.ready(0)
    started = time.monotonic()
    ahead.finish()
    assert time.monotonic() - started < 5
    assert ahead.result(0) is None


def test_a_failed_own_client_falls_back_to_the_callers():
    used = []

    def connect():
        raise OSError("connection refused")

    ahead = Ahead(lambda ex, i: used.append(ex) or _result(i), ex="callers", connect=connect)
    ahead.ready(0)
    ahead.finish()
    assert used == ["callers"] and ahead.result(0) is not None


def test_a_stopped_thread_does_not_hold_the_writer():
    """The aborted run stops it; a probe handed over after that is not waited for."""
    gate = threading.Event()

    def consolidate(ex, index):
        gate.wait(5)
        return _result(index)

    ahead = Ahead(consolidate, ex=None)
    ahead.ready(0)
    ahead.ready(1)
    ahead.stop()
    gate.set()
    started = time.monotonic()
    ahead.finish()
    assert time.monotonic() - started < 5
    assert ahead.result(1) is None


def test_drain_waits_for_what_was_handed_over_and_keeps_the_thread():
    """Before a probe that times the ranks (bandwidth: `Probe.times_ranks`) rank 0 drains the
    thread: nothing of it holds the GIL while rank 0 is timed; the probes after it still go ahead."""
    from distdiag.probes import PROBES

    assert PROBES["bandwidth"].times_ranks and not any(
        cls.times_ranks for name, cls in PROBES.items() if name != "bandwidth")

    def consolidate(ex, index):
        time.sleep(0.2)
        return _result(index)

    ahead = Ahead(consolidate, ex=None)
    ahead.ready(0)
    ahead.drain()
    assert ahead.result(0) is not None
    ahead.ready(1)
    ahead.finish()
    assert ahead.result(1) is not None
