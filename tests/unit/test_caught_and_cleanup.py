"""Out-of-band publishing of caught exceptions, and cleanups that run when the sentinel ends a rank."""

from __future__ import annotations

import subprocess
import sys

import pytest

from distdiag.errors import error_summary, library_path, publish_caught, set_caught_publisher


def _raise_in_json() -> None:
    import json

    json.loads("{not json")


def test_library_path_names_the_library_frames_not_distdiags():
    """The chain starts at the first frame outside distdiag and ends where the library raised."""
    try:
        _raise_in_json()
    except ValueError as exc:
        where = library_path(exc)
        summary = error_summary(exc)
    assert "json" in where["raised_at"] and "decode" in where["through"]
    assert where["through"].startswith("test_library_path") and summary["through"] == where["through"]


def test_publish_caught_is_a_no_op_without_a_publisher_and_never_raises():
    set_caught_publisher(None)
    publish_caught(RuntimeError("x"))  # nothing installed: nothing happens
    seen = []

    def broken(exc: BaseException, where: str) -> None:
        seen.append((type(exc).__name__, where))
        raise OSError("store gone")

    set_caught_publisher(broken)
    try:
        publish_caught(RuntimeError("y"), "hook build_model")
    finally:
        set_caught_publisher(None)
    assert seen == [("RuntimeError", "hook build_model")]


@pytest.mark.timeout(60)
def test_at_abort_cleanups_run_when_the_process_is_ended(tmp_path):
    """flush_and_exit runs the registered cleanups (a probe's temp dir), not the cancelled ones."""
    code = f"""
import os
from distdiag.runtime.sentinel import at_abort, cancel_at_abort, flush_and_exit
os.makedirs({str(tmp_path / 'kept')!r}); os.makedirs({str(tmp_path / 'removed')!r})
at_abort(lambda: os.rmdir({str(tmp_path / 'removed')!r}))
token = at_abort(lambda: os.rmdir({str(tmp_path / 'kept')!r}))
cancel_at_abort(token)
at_abort(lambda: 1 / 0)
flush_and_exit(3)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert (tmp_path / "kept").is_dir() and not (tmp_path / "removed").exists()
    assert "cleanup at exit failed: ZeroDivisionError" in proc.stderr
