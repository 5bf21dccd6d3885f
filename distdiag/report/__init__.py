"""The report: its model, its JSON schema, and the ways it is shown.

    model.py   Finding, ProbeResult, Report, exit codes, atomic JSON write and safe read-back
    schema.py  type checks of a report's JSON before it is read back
    render.py  the text table rank 0 prints and `distdiag report show` repeats
    junit.py   the verdict as JUnit XML for CI systems
    hostlist.py  host names in Slurm's hostlist syntax (`node[0005-0007,0127]`)
    figure.py  images through matplotlib (optional): pyplot or a one-line error, one atomic save
    bandwidth_chart.py  the gate's chart of the bandwidth probe (`distdiag gate --chart`)
    safefile.py  outputs never written through a link, inputs read as bounded regular files,
               strings printed without terminal escapes

A leaf package every use shares (check, watchdog, gate, analyze, CLI): it may import only
distdiag.errors, and never torch, so `distdiag report show` stays fast. The model's public
names are re-exported here (`from distdiag.report import Finding` keeps working).
"""

from distdiag.report.model import *  # noqa: F403 - the model's public names, as before the move
from distdiag.report.model import __all__ as _model_names

__all__ = list(_model_names)
