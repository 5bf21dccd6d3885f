"""`torchrun --nproc-per-node N -m distdiag.check`: the probe suite on every rank."""

import threading

from distdiag.launcher.ranks import note_phase

if threading.current_thread() is threading.main_thread():
    # Before torch: a rank lost while importing is named so, by the launcher (launcher/exit_code.py) or
    # by the survivor that writes the report (distdiag/check/starting.py). A SIGTERM from
    # torchrun (another rank died) or a Ctrl-C is noted until the sentinel can act on it
    # (distdiag/runtime/early.py), and a fatal signal leaves its note (runtime/deathnote.py).
    from distdiag.runtime import deathnote
    from distdiag.runtime.early import defer_stop_signals

    note_phase("importing torch and the check")
    defer_stop_signals(lambda name: note_phase(signal=name))
    deathnote.arm()
    from distdiag.check.run import main

    main()
