"""Test helper, put on PYTHONPATH: the rank named by DISTDIAG_TEST_DIE_AT_START SIGKILLs itself
one second after its interpreter started (while it imports torch and the check), before any
rank could report: distdiag check must still name it (--launch torchrun: a fresh interpreter
per rank)."""

import os
import signal
import threading

if os.environ.get("DISTDIAG_TEST_DIE_AT_START") not in (None, "") and (
    os.environ.get("DISTDIAG_TEST_DIE_AT_START") == os.environ.get("RANK")
):
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
