"""`torchrun --nproc-per-node N -m distdiag.check`: the probe suite on every rank."""

import threading

from distdiag.check.launched import note_phase

if threading.current_thread() is threading.main_thread():
    # Before torch: a rank lost while importing is named so by distdiag check (launch_end.py).
    note_phase("importing torch and the check")
    from distdiag.check.run import main

    main()
