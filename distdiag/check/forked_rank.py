"""One rank forked by distdiag.launcher.forkrun: torchrun's --run-path runs this file as `__main__`
in each worker it forks, with torch and the check already imported by the parent.

Before the check runs, the rank is made what torchrun's `python -u -m distdiag.check` would
be in the three ways a fork differs: stdout and stderr are flushed at every line (-u), the
elastic agent's signal handlers (they raise its SignalException) go back to Python's
defaults, and torch's intra-op threads follow this rank's OMP_NUM_THREADS (torchrun sets it
per rank after the parent imported torch, which read it then).
"""

from __future__ import annotations

import os
import signal
import sys

__all__ = ["as_a_fresh_rank"]


def as_a_fresh_rank() -> None:
    # torchrun runs a rank of its own as `python -u`: nothing a rank printed is lost when it
    # is killed. A forked rank has the parent's buffered streams; flush them at each line.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # a TextIOWrapper's; others: AttributeError
        except (AttributeError, ValueError):
            pass
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threads = os.environ.get("OMP_NUM_THREADS", "").strip()
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


if __name__ == "__main__":
    from distdiag.launcher.ranks import note_phase

    note_phase("starting (forked by torchrun's agent)")
    as_a_fresh_rank()
    from distdiag.check.run import main

    main(sys.argv[1:], forked=True)
