"""Under `python -m distdiag.watch` the wrapper runs as `__main__`, so the script's own
`import distdiag.watch` is a second copy whose armed() is None: mark_step and the callbacks still
find the wrapper's watchdog (through its init_process_group hook), and never arm a second one."""

from __future__ import annotations

import importlib.util

import torch.distributed as dist

import distdiag.watch
from distdiag.integrations import mark_step, wrapper_watchdog


class _Watchdog:
    def __init__(self) -> None:
        self.steps: list[int] = []

    def step(self, n: int) -> None:
        self.steps.append(n)


def test_the_wrappers_copy_is_found_through_its_hook(monkeypatch):
    spec = importlib.util.spec_from_file_location("__main_copy_of_distdiag_watch__", distdiag.watch.__file__)
    wrapper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wrapper)  # what `-m distdiag.watch` runs as __main__
    wd = _Watchdog()
    wrapper._STATE["wd"] = wd
    assert distdiag.watch.armed() is None and wrapper_watchdog() is None
    monkeypatch.setattr(dist, "init_process_group", wrapper._arm_after(dist.init_process_group))
    assert wrapper_watchdog() is wd
    mark_step(7)
    assert wd.steps == [7]
