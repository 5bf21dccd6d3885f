"""The rank runtime: what every rank of a check runs on, and how ranks talk out of band.

    context.py   who this process is (LaunchInfo), the store, the process groups, RankContext
    exchange.py  post/collect/publish through the c10d store, with deadlines (works while
                 collectives are broken)
    keys.py      every key distdiag uses in the store, who writes and who reads it
    incident.py  ending a broken run together, shared by the check and the watchdog: snapshot,
                 claim the writer, the small verdict first, waiting on the writer's progress
    snapwire.py  a snapshot as the store carries it: labels by reference, compressed, the long
                 history under its own key
    nodes.py     snapshots gathered per node: local rank 0 posts its node's as one value
    gcpause.py   Python's cyclic collector held off while a writer builds a 16k-rank report
    sentinel.py  one daemon thread per rank that ends a broken run with a report
    early.py     before torch is imported: a stop signal noted, then handed to the sentinel
    lastword.py  torchrun's error file (TORCHELASTIC_ERROR_FILE) written with the verdict, so its
                 root cause names the blamed rank with distdiag's sentence
    tracker.py   where the main thread is: phase, probe, the collective it is inside
    comm.py      the tracked collectives probes issue (ctx.comm), open to injected faults
    faults.py    the fault-injection vocabulary (DISTDIAG_INJECT) that proves each diagnosis
    blind.py     what torch's flight recorder cannot see in this process's setup (NCCL blocking
                 wait), said in a hang report with lowered confidence

Used by the check (distdiag.check) and, for the exchange, by the watchdog. May import
distdiag.errors, distdiag.hang and distdiag.report; never the check, the probes or the CLI.
Importing this package imports nothing: each module is loaded where it is used (context.py
imports torch).
"""

__all__ = ["blind", "comm", "context", "early", "exchange", "faults", "gcpause", "incident", "keys", "nodes", "sentinel", "snapwire", "tracker"]
