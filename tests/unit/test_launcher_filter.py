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


def test_watch_and_check_leave_out_the_same_lines():
    """One filter: what `distdiag watch` passes on as it comes is what `distdiag check` keeps at the end."""
    import io

    from distdiag.launcher.stderr import WatchOutput

    lines = [
        "I1121 21:20:51.800000 3073 site-packages/torch/distributed/run.py:874] starting\n",
        "distdiag[rank 1]: watchdog ending the process\n",
        "Traceback (most recent call last):\n",
        '  File "/job/train.py", line 3, in <module>\n',
        "ValueError: user bug\n",
        "Traceback (most recent call last):\n",
        '  File "/venv/bin/torchrun", line 8, in <module>\n',
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n",
    ]
    out = io.StringIO()
    watch = WatchOutput(out)
    for line in lines:
        watch.line(line)
    watch.close()
    assert out.getvalue().splitlines(keepends=True) == filter_torchrun_stderr(lines) == lines[2:5]


def test_the_verdict_is_said_again_when_a_rank_printed_after_it():
    """A rank's own traceback may reach the terminal after the report (it raised, the writer was
    faster): the verdict's lines come again at the end, once; our own one-liners do not count."""
    import io

    from distdiag.launcher.stderr import WatchOutput

    out = io.StringIO()
    w = WatchOutput(out)
    for line in ["verdict: FAIL (exit 3) - step 6 raised on rank 1: AttributeError\n", "hang report: /r/hang-report.json\n",
                 "distdiag[rank 0]: ended by SIGTERM after the report (exit 3)\n"]:
        w.line(line)
    w.verdict_again()
    assert "again" not in out.getvalue()  # nothing of the ranks' followed
    for line in ["Traceback (most recent call last):\n", '  File "/job/train.py", line 9, in <module>\n',
                 "AttributeError: Can't pickle local object\n"]:
        w.line(line)
    w.close()
    w.verdict_again()
    w.verdict_again()
    text = out.getvalue()
    assert text.count("the verdict again (the ranks printed 3 line(s) after it)") == 1, text
    assert text.endswith("verdict: FAIL (exit 3) - step 6 raised on rank 1: AttributeError\nhang report: /r/hang-report.json\n")
