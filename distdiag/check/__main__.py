"""`torchrun --nproc-per-node N -m distdiag.check`: the probe suite on every rank."""

import threading

from distdiag.check.run import main

if threading.current_thread() is threading.main_thread():
    main()
