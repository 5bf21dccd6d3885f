"""Test helper, put on PYTHONPATH: the rank named by DISTDIAG_TEST_DIE_AFTER_VERDICT dies by
SIGKILL where it would have exited 0 after the verdict (a worker lost after the report)."""

import os
import signal

if os.environ.get("DISTDIAG_TEST_DIE_AFTER_VERDICT") == os.environ.get("RANK", "-"):
    _exit = os._exit

    def _die(code: int) -> None:
        if code == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        _exit(code)

    os._exit = _die
