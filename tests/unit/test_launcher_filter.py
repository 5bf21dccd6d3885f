"""`distdiag check` keeps torchrun's own noise away from the user."""

from __future__ import annotations

from distdiag.launcher.stderr import filter_torchrun_stderr


def test_drops_torchrun_logs_and_child_failed_traceback():
    lines = [
        "W1121 21:20:51.800000 3073 site-packages/torch/distributed/run.py:874] \n",
        "*****************************************\n",
        "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default\n",
        "distdiag: error: unknown probe 'x'\n",
        "E1121 21:21:08.057000 3241 site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed\n",
        "Traceback (most recent call last):\n",
        '  File "/usr/bin/torchrun", line 8, in <module>\n',
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n",
        "distdiag.check FAILED\n",
    ]
    assert filter_torchrun_stderr(lines) == ["distdiag: error: unknown probe 'x'\n"]


def test_keeps_other_tracebacks():
    lines = ["Traceback (most recent call last):\n", "ValueError: user bug\n"]
    assert filter_torchrun_stderr(lines) == lines
