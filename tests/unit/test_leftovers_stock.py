"""What a rank's user code leaves behind at the end (distdiag/check/leftovers.py): found, told,
ended; nothing found where nothing was left."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import psutil

from distdiag.check import leftovers


def test_nothing_left_is_nothing_said(tmp_path):
    """Healthy twin: no thread, child or change of directory: stock is empty and says nothing.
    In a fresh process: a pytest worker holds other tests' children and threads (under xdist
    in CI it once held two child processes), which are not this rank's leftovers."""
    code = ("from distdiag.check import leftovers\n"
            "leftovers.note_start()\n"
            "stock = leftovers.take_stock()\n"
            "print(bool(stock), stock.sentences())\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False []", out.stdout


def test_a_thread_a_child_and_a_chdir_are_found_told_and_the_child_ended(tmp_path, monkeypatch):
    """A non-daemon thread, a child process and a new working directory: each told; the child ended."""
    monkeypatch.chdir(tmp_path)
    leftovers.note_start()
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="user-thread")
    thread.start()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (tmp_path / "away").mkdir()
    try:
        os.chdir(tmp_path / "away")
        stock = leftovers.take_stock()
        said = stock.sentences()
        assert "a non-daemon thread 'user-thread' still running at the end; ended" in said
        assert any(s.startswith(f"a child process (pid {child.pid}, ") for s in said), said
        assert any(s.startswith(f"the working directory was changed to {tmp_path / 'away'}") for s in said), said
        leftovers.end_children(stock.children)
        assert child.wait(timeout=10) is not None
        assert not psutil.pid_exists(child.pid) or psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE
    finally:
        stop.set()
        thread.join(10)
        if child.poll() is None:
            child.kill()


CHILD = """
import os, signal, time
from distdiag.runtime.sentinel import install_sigterm_wakeup

install_sigterm_wakeup()
ready_r, ready_w = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(ready_w, b"x")  # past the fork's own steps: its signal handling is set
    time.sleep(30)
    os._exit(0)
os.read(ready_r, 1)
os.kill(pid, signal.SIGTERM)
_, status = os.waitpid(pid, 0)
print(os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM)
"""


def test_a_process_forked_from_a_rank_dies_of_sigterm():
    """A child the user's code forks from a rank gets the default SIGTERM (not the rank's no-op
    handler and wakeup pipe, which made it unkillable by SIGTERM and woke the rank's sentinel)."""
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "True", out.stderr
