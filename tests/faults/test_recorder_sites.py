"""Call sites from torch's flight recorder (distdiag/hang/recorder.py), on dumps torch itself makes.

Without wrappers (the watchdog's default) the line that issued each collective comes from the
Python frames torch records with it, read from the recorder's pickle dump with stacks. One
gloo process group of 2 ranks issues collectives from known lines; the reader must name them,
and the entries must read as a desync history (distdiag/hang/desync.py: engine_history).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.harness import run_ranks


def issue_one(t) -> None:
    import torch.distributed as dist

    dist.all_reduce(t)  # SITE:issue_one


def worker(argv: list[str]) -> int:
    import torch
    import torch.distributed as dist

    from distdiag.hang.desync import engine_history
    from distdiag.hang.recorder import EngineReader, load_symbolizer, loaded

    dist.init_process_group("gloo")
    reader = EngineReader()
    cold = reader.read(details=True, tail=4, sites=True)  # before the warm-up: no sites, no wait
    t = torch.ones(4)
    for _ in range(3):
        issue_one(t)
        dist.broadcast(t, src=0)  # SITE:broadcast
    reader.read(details=False)
    if loaded("torch._inductor.codecache") is None:
        reader.warm_sites()  # the symbolizer is not imported: no warm-up thread, it would import it
        assert reader.sites_state == "cold", reader.sites_state
    load_symbolizer()  # as the watchdog does on the training thread before its threads start
    reader.warm_sites()
    end = time.monotonic() + 60
    while reader.sites_state == "warming" and time.monotonic() < end:
        time.sleep(0.05)
    view = reader.read(details=True, tail=6, sites=True)
    out = {"state": reader.sites_state, "cold": cold.get("entries"), "entries": view.get("entries"),
           "history": engine_history({"engine": view, "step_walls": []})}
    Path(f"sites_{dist.get_rank()}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _line(marker: str) -> str:
    text = Path(__file__).read_text().splitlines()
    return f"{Path(__file__).name}:{next(i for i, line in enumerate(text, 1) if marker in line and 'def ' not in line)}"


@pytest.mark.timeout(120)
def test_recorder_entries_name_the_line_that_issued_each_collective(tmp_path):
    result = run_ranks(2, [], tmp_path, entry="tests.faults.test_recorder_sites:worker", timeout=100)
    assert result.codes == [0, 0], result.stderr[-3000:]
    for rank in (0, 1):
        out = json.loads((tmp_path / f"sites_{rank}.json").read_text())
        assert out["state"] == "ready", out
        assert all(not e.get("call_site") for e in out["cold"] or []), out["cold"]
        sites = [(e["op"], e.get("call_site") or "") for e in out["entries"]]
        assert len(sites) == 6, sites
        for op, site in sites:
            marker = "SITE:issue_one" if op == "all_reduce" else "SITE:broadcast"
            assert _line(marker) in site, (op, site)
        assert "in issue_one" in sites[0][1] or "in issue_one" in sites[1][1], sites
        history = out["history"]
        assert [h["op"] for h in history] == [op for op, _ in sites] and history[0]["dtype"] == "float32", history
