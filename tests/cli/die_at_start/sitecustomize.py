"""Test helper, put on PYTHONPATH: the rank named by DISTDIAG_TEST_DIE_AT_START SIGKILLs itself
(or sends itself DISTDIAG_TEST_DIE_AT_START_SIGNAL: SIGTERM, SIGINT, SIGSEGV, ...) when its interpreter starts importing torch.distributed (while it imports torch and the check),
before any rank could report: distdiag check must still name it (--launch torchrun: a fresh
interpreter per rank). Tied to the import, not to a clock: a timer of 1 s fired after the whole
check had passed on a quiet machine (imports from a warm cache), and during a probe on another."""

import os
import signal
import sys

if os.environ.get("DISTDIAG_TEST_DIE_AT_START") not in (None, "") and (
    os.environ.get("DISTDIAG_TEST_DIE_AT_START") == os.environ.get("RANK")
):

    class _DieOnImport:
        """A meta-path finder that finds nothing: it only ends the process at the import."""

        def find_spec(self, name, path=None, target=None):
            if name == "torch.distributed":
                sig = os.environ.get("DISTDIAG_TEST_DIE_AT_START_SIGNAL") or "SIGKILL"
                os.kill(os.getpid(), getattr(signal, sig))
            return None

    sys.meta_path.insert(0, _DieOnImport())
