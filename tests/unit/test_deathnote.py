"""The note faulthandler leaves when a rank dies of a fatal signal, read as a peer reads it.

Each case is a real process that arms the note and dies (or ends cleanly); the file read is
the one CPython's faulthandler wrote, never text built here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from distdiag.runtime import deathnote

pytestmark = pytest.mark.timeout(60)

_BODY = {
    "abort": "import os\ndef inner():\n    os.abort()\ninner()\n",
    "segv": "import ctypes\ndef inner():\n    ctypes.string_at(0)\ninner()\n",
    "kill": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
    "clean": "deathnote.disarm()\n",
    "theirs": "",
    # a forked child (a DataLoader worker) that crashes must not write this rank's note
    # a DataLoader pass ends (the tap writes its copy beside the note), then the rank aborts
    "loaders": ("import os, torch\nfrom distdiag.watchdog.dataload import LoaderTap\n"
                "tap = LoaderTap(lambda: 7, ended=deathnote.note_loaders)\ntap.install()\n"
                "for _ in torch.utils.data.DataLoader(list(range(5)), batch_size=1):\n    pass\n"
                "it = iter(torch.utils.data.DataLoader(list(range(9)), batch_size=1))\nnext(it)\n"
                "if len(sys.argv) > 1:\n    deathnote.disarm()\n    sys.exit(0)\nos.abort()\n"),
    "link": ("import os, torch\nfrom distdiag.watchdog.dataload import LoaderTap\n"
             "os.symlink(sys.argv[1], deathnote.loaders_path(os.getpid()))\n"
             "LoaderTap(ended=deathnote.note_loaders).install()\n"
             "for _ in torch.utils.data.DataLoader(list(range(3)), batch_size=1):\n    pass\n"
             "assert not os.path.islink(deathnote.loaders_path(os.getpid()))\ndeathnote.disarm()\n"),
    "child": "import os, ctypes\npid = os.fork()\nif pid == 0:\n    ctypes.string_at(0)\nos.waitpid(pid, 0)\nimport time\nos.kill(os.getpid(), 9)\n",
}


def _die(tmp_path, how: str, *, theirs: bool = False, args: tuple[str, ...] = ()) -> tuple[int, int]:
    """Run a process that arms the note (after enabling faulthandler itself, with `theirs`) and
    then does `how`; returns (pid, returncode)."""
    code = "import faulthandler, sys\n" + ("faulthandler.enable()\n" if theirs else "")
    code += "from distdiag.runtime import deathnote\nprint(deathnote.arm(), flush=True)\n" + _BODY[how]
    env = dict(os.environ, TMPDIR=str(tmp_path))
    p = subprocess.Popen([sys.executable, "-c", code, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    p.communicate(timeout=30)
    return p.pid, p.returncode


@pytest.fixture
def tmpdir_env(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    return tmp_path


def test_abort_names_sigabrt_and_the_main_threads_frames(tmpdir_env):
    pid, rc = _die(tmpdir_env, "abort")
    assert rc == -6
    death = deathnote.read(pid)
    assert death is not None and death.signal == "SIGABRT" and death.line == "Fatal Python error: Aborted"
    assert death.stack[0].endswith("in inner") and death.stack[-1].endswith("in <module>")
    assert not death.in_collective and "SIGABRT" in death.text()


def test_segfault_names_sigsegv(tmpdir_env):
    pid, rc = _die(tmpdir_env, "segv")
    assert rc == -11
    death = deathnote.read(pid)
    assert death is not None and death.signal == "SIGSEGV" and any("string_at" in f for f in death.stack)


def test_sigkill_and_a_clean_end_leave_nothing_to_read(tmpdir_env):
    pid, rc = _die(tmpdir_env, "kill")
    assert rc == -9 and deathnote.read(pid) is None  # faulthandler cannot catch SIGKILL: an empty note
    pid, rc = _die(tmpdir_env, "clean")
    assert rc == 0 and deathnote.read(pid) is None and not os.path.exists(deathnote.note_path(pid))


def test_a_program_that_enabled_faulthandler_keeps_it(tmpdir_env):
    pid, rc = _die(tmpdir_env, "theirs", theirs=True)
    assert rc == 0 and not os.path.exists(deathnote.note_path(pid))


def test_a_note_reached_through_a_link_is_not_read(tmpdir_env):
    pid, rc = _die(tmpdir_env, "abort")
    path = deathnote.note_path(pid)
    os.rename(path, path + ".real")
    os.symlink(path + ".real", path)
    assert deathnote.read(pid) is None


def test_a_collective_is_named_from_torch_distributed_frames():
    """faulthandler's own format (as CPython 3.11 writes it) around a gloo abort in all_gather."""
    text = textwrap.dedent('''\
        Fatal Python error: Aborted

        Thread 0x00007f75f2ffd6c0 (most recent call first):
          File "/x/distdiag/watchdog/sigterm.py", line 82 in _listen
          File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

        Thread 0x00007f761e249b80 (most recent call first):
          File "/v/site-packages/torch/distributed/distributed_c10d.py", line 4287 in all_gather
          File "/v/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
          File "/v/site-packages/transformers/trainer_pt_utils.py", line 207 in distributed_concat
          File "/job/train.py", line 152 in <module>
        ''')
    death = deathnote.parse(text)
    assert death is not None and death.collective == "all_gather"
    assert death.call_site == "/v/site-packages/transformers/trainer_pt_utils.py:207 in distributed_concat"


def test_a_forked_child_that_crashes_leaves_the_rank_s_note_empty(tmpdir_env):
    pid, rc = _die(tmpdir_env, "child")
    assert rc == -9 and deathnote.read(pid) is None


def test_the_call_site_is_the_one_the_recorder_gives_even_inside_ddp_forward():
    """Lightning's per-step metric sync runs inside DDP's forward (torch/nn/parallel frames further
    out): the call site is the innermost frame outside torch, as the flight recorder's entries
    name theirs, not torch's module call outside DDP's frames (the rules compare the two)."""
    text = textwrap.dedent('''\
        Fatal Python error: Aborted

        Current thread 0x00007f761e249b80 (most recent call first):
          File "/v/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
          File "/v/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
          File "/v/site-packages/lightning/fabric/utilities/distributed.py", line 214 in _sync_ddp
          File "/v/site-packages/lightning/pytorch/core/module.py", line 520 in log
          File "/job/train.py", line 40 in validation_step
          File "/v/site-packages/torch/nn/parallel/distributed.py", line 1695 in _run_ddp_forward
          File "/v/site-packages/torch/nn/parallel/distributed.py", line 1859 in forward
          File "/v/site-packages/torch/nn/modules/module.py", line 1789 in _call_impl
          File "/job/train.py", line 90 in <module>
        ''')
    death = deathnote.parse(text)
    assert death is not None and death.collective == "all_reduce"
    assert death.call_site == "/v/site-packages/lightning/fabric/utilities/distributed.py:214 in _sync_ddp"


def test_a_rank_that_dies_after_a_pass_ended_leaves_its_loaders_beside_the_note(tmpdir_env):
    """The tap writes its passes when one ends; a peer reads them with the death (the ended pass
    with its count and step, the pass begun after it as of that moment: not yet in the copy)."""
    pid, rc = _die(tmpdir_env, "loaders")
    assert rc == -6
    death = deathnote.read(pid)
    assert death is not None and death.signal == "SIGABRT"
    assert [(p["loader"], p["pass"], p["drawn"], p["exhausted"], p.get("at_steps")) for p in death.loaders] == [
        (0, 1, 5, True, 7)], death.loaders
    assert isinstance(death.loaders[0]["at_wall_ns"], int) and death.to_dict()["loaders"] == death.loaders


def test_a_clean_end_removes_the_loaders_copy_and_a_link_is_replaced_not_written_through(tmpdir_env):
    pid, rc = _die(tmpdir_env, "loaders", args=("clean",))
    assert rc == 0 and not os.path.exists(deathnote.loaders_path(pid)) and not os.path.exists(deathnote.note_path(pid))
    # a link planted at the process's own path before its pass ends: the copy replaces the
    # link, the file it pointed to is untouched
    target = tmpdir_env / "target.txt"
    target.write_text("keep")
    pid, rc = _die(tmpdir_env, "link", args=(str(target),))
    assert rc == 0 and target.read_text() == "keep"
    assert not os.path.lexists(deathnote.loaders_path(pid))
