"""The watchdog's log of the process groups a rank makes, on torch's own group creation.

Each case runs in a fresh process: torch's flight recorder and group counter are per process,
and a group made here would change what later tests in the same worker read."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

_PRELUDE = """
import json, socket
import torch.distributed as dist
from distdiag.watchdog.groupnames import GroupLog
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
name = dist.distributed_c10d._get_process_group_name
"""


def _run(body: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PRELUDE + textwrap.dedent(body)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(90)
def test_numbered_groups_are_logged_hashed_ones_not_and_torch_gets_its_own_names():
    got = _run("""
        log = GroupLog()
        assert log.install()
        try:
            g1 = dist.new_group([0])
            dist.new_group([0], use_local_synchronization=True)  # a hashed name: the same on every rank
            g3 = dist.new_group([0])
        finally:
            log.remove()
        print(json.dumps({"snap": log.snapshot(), "names": [name(g1), name(g3)],
                          "restored": not hasattr(dist.distributed_c10d._process_group_name, "__distdiag_group_log__")}))
    """)
    snap = got["snap"]
    assert snap["from"] == "calls"
    assert [n for n, _ in snap["names"]] == got["names"], snap
    assert all(m == "0" for _, m in snap["names"])
    assert snap["count"] == int(got["names"][-1]) + 1
    assert got["restored"]  # removed: torch's own function is back


@pytest.mark.timeout(90)
def test_without_calls_seen_the_registry_of_own_groups_stands_in():
    got = _run("""
        g = dist.new_group([0])
        print(json.dumps({"snap": GroupLog().snapshot(), "name": name(g)}))
    """)
    assert got["snap"]["from"] == "registry"
    assert got["snap"]["names"] == [[got["name"], "0"]]
