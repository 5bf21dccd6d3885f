"""Test helper, put on PYTHONPATH: the rank named by DISTDIAG_TEST_DIE_AFTER_VERDICT dies by
SIGKILL where it would have exited 0 after the verdict (a worker lost after the report); with
DISTDIAG_TEST_AFTER_VERDICT_SIGNAL=SIGSTOP it stops there instead (a worker frozen after it).

The rank is looked up when the process leaves, not when this file loads: ranks forked by
`distdiag check` (distdiag.launcher.forkrun) load it once, in the parent, before any RANK is set;
a forked rank leaves through multiprocessing's os._exit once the agent has its result."""

import os
import signal

if os.environ.get("DISTDIAG_TEST_DIE_AFTER_VERDICT"):
    _exit = os._exit

    def _die(code: int) -> None:
        if code == 0 and os.environ.get("DISTDIAG_TEST_DIE_AFTER_VERDICT") == os.environ.get("RANK", "-"):
            sig = os.environ.get("DISTDIAG_TEST_AFTER_VERDICT_SIGNAL", "SIGKILL")
            os.kill(os.getpid(), getattr(signal, sig))
        _exit(code)

    os._exit = _die
