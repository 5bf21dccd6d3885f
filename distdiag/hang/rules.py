"""Why a run stopped making progress: an ordered list of small rules over every rank's view.

Input: each live rank's last snapshot (distdiag.hang.views reads where it waits, from
torch's flight recorder and our wrappers), what is known of the ranks that could not answer
(gone, stopped, silent, never checked in), and the exceptions ranks raised or caught.
Output: findings that name the culprit ranks, where they are, and the fix.

The rules, tried in this order (`RULES`); each adds findings and marks the ranks it
explained, so a later rule does not blame a rank twice:
  1. raised      - a rank's exception (raised, or caught and carried on from) left others waiting;
  2a. aborted_in_collective (distdiag.hang.death_rules) - a rank the library aborted inside a
                   collective (SIGABRT: gloo's size check, NCCL's watchdog): the live ranks whose
                   steps changed course are blamed, the dead one is the consequence;
  2c. group_creation (distdiag.hang.creation_rules) - ranks that bound one process-group number
                   to different members (groups created in another order, or by their members
                   only): their backends met the wrong peers;
  2. lost        - a rank's process is gone, stopped or silent, or it never checked in (with the
                   signal and stack it died with, when a same-host peer read them);
  2b. uneven_data, skipped_send, deadlock (distdiag.hang.group_rules): a short rank out of its
                   loop inside a collective of its own; a receive whose peer issued fewer sends
                   than it posted receives; ranks waiting for each other across groups (a cycle);
  3. behind      - ranks wait in collective #N on a group that rank k never entered: k computes
                   elsewhere, waits on another group, finished with fewer collectives, or ran
                   fewer training steps (uneven data);
                   Ranks the wait-for graph (distdiag.hang.waitfor) finds stranded - waiting on
                   another group for a rank further along - are never named here;
  3a. chain_end  - a rank at the end of chains whose waiters are in a send/recv with it;
  3b. left_early - nobody waits any more (their collective failed once k's process left), but
                   k finished with fewer collectives or steps than the others;
  3c. broken_connections - connections broke, every rank answered, nothing above explains it;
  4-6. (distdiag.hang.desync_rules)
  4. desync_in_flight    - ranks inside different collectives at the same sequence number;
  5. desync_in_records   - torch's recorder entries differ at the same sequence number;
  6. desync_in_histories - the watchdog's fingerprint histories part (skip, extra, mismatch);
  7. stall       - every member inside the same collective: below the program (network,
                   fabric, GPU), split by NCCL's "started" where it is known;
  8. nobody_waiting - no rank inside a collective: the step is slower than the deadline;
  9. stranded    - (info) the ranks stranded through others, each with its chain of waits.
Adding a rule is adding a function to `RULES`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from distdiag.hang.creation_rules import group_creation
from distdiag.hang.death_rules import ABORTED_FIX, aborted_in_collective, death_fix
from distdiag.hang.desync import record_divergence
from distdiag.hang.desync_rules import a_snaps, desync_in_flight, desync_in_histories, desync_in_records
from distdiag.hang.fixes import GENERIC_FIX, fix_for
from distdiag.hang.frontcore import reached
from distdiag.hang.group_rules import (
    UNEVEN_FIX,
    chain_end,
    deadlock,
    loader_passes,
    pass_ended,
    ran_out_first,
    skipped_send,
    stranded,
    uneven_data,
)
from distdiag.hang.records import CAUSE_CAUGHT, CAUSE_RAISED, CAUSE_STALLED, CAUSE_UNEVEN, Cause, Silence, SilentReason
from distdiag.hang.shapes import SHAPE_LINES, shape_lines
from distdiag.hang.views import RankView, build_views, group_members, stack_text, wait_text, where
from distdiag.hang.waitfor import WaitGraph, build_graph, nodes_from_views
from distdiag.report.model import Finding
from distdiag.report.render import format_ranks

__all__ = ["Analysis", "RULES", "analyze_hang", "ensure_critical"]

_DIGITS = re.compile(r"\d+")


@dataclass
class Analysis:
    """What every rule reads, and what the rules found so far."""

    views: dict[int, RankView]
    lost: Mapping[int, str]
    errors: dict[int, dict[str, Any]]
    """rank -> exception summary (type, message, traceback, raised_at, through; `caught`: the
    rank caught it and went on; `comm`: a broken connection, a consequence of a lost peer)."""
    world: int
    what: str
    timeout_s: float
    findings: list[Finding] = field(default_factory=list)
    explained: set[int] = field(default_factory=set)
    causes: set[int] = field(default_factory=set)
    """Ranks whose exception stranded others: what they do next is a consequence."""
    desync_reported: bool = False
    graph: WaitGraph = field(init=False)
    """Who waits for whom across groups (distdiag.hang.waitfor): stranded ranks are never blamed."""

    _waiters: dict[str, dict[int, dict[str, Any]]] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.graph = build_graph(nodes_from_views(self.views, self.lost, self.errors, self.world), self.world)

    def waiters(self) -> dict[str, dict[int, dict[str, Any]]]:
        """group -> {rank: the collective it waits in on that group}. Built once (no rule
        changes the views; five rules ask): read it, do not change it."""
        if self._waiters is None:
            out: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
            for rank, v in sorted(self.views.items()):
                for w in v.waits:
                    out[w["group"]][rank] = w
            self._waiters = out
        return self._waiters

    def divergence(self) -> dict[str, Any] | None:
        """The first (group, seq) where ranks' recorder entries name different collectives
        (desync.record_divergence), computed once for the rules that read it."""
        if not hasattr(self, "_divergence"):
            self._divergence = record_divergence(a_snaps(self))
        return self._divergence

    def waiting_ranks(self) -> list[int]:
        return sorted(r for r, v in self.views.items() if v.waiting)

    def members(self, group: str) -> list[int]:
        known = group_members(group, self.world)
        if known is not None:
            return known
        return sorted(r for r, v in self.views.items() if group in v.positions or v.wait_on(group)) + sorted(self.lost)


def _they(ranks: list[int]) -> str:
    """'rank 0 waits' / 'ranks 0-2 wait'."""
    return f"{format_ranks(ranks)} {'waits' if len(ranks) == 1 else 'wait'}"


def _wait_text(w: dict[str, Any]) -> str:
    return wait_text(w)


# -- 1. a rank's exception ------------------------------------------------------------------


def raised(a: Analysis) -> None:
    causes = {r: e for r, e in a.errors.items() if not e.get("comm")}
    if not causes:
        return
    stranded = [r for r in a.waiting_ranks() if r not in causes]
    by_exc: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for rank, err in sorted(causes.items()):
        # one error raised on several ranks often names its rank or step ("... on rank 3"):
        # the same type, place and words with other numbers is one finding naming every rank
        words = _DIGITS.sub("#", str(err.get("message")))
        by_exc[(str(err.get("type")), words, str(err.get("raised_at")), bool(err.get("caught")))].append(rank)
    for (_type, _words, _at, caught), ranks in by_exc.items():
        err = causes[ranks[0]]
        etype = err.get("type")
        message = err.get("message")
        who = format_ranks(ranks)
        lib = f" in {err['through']}" if err.get("through") else ""
        at = f" at {err['raised_at']}" if err.get("raised_at") else ""
        left = ""
        if stranded:
            w = _direct_wait(a, stranded, ranks)
            them = "it never entered" if len(ranks) == 1 else "they never entered"
            then = " and went on" if caught else ""
            were = "was" if len(stranded) == 1 else "were"
            left = f"{then}; {format_ranks(stranded)} {were} left waiting in {_wait_text(w)} that {them}"
        gone = [r for r in ranks if r in a.lost]
        if gone:
            left += f"; then {format_ranks(gone)} was lost ({a.lost[gone[0]]})"
        verb = "raised" if not caught else "caught an exception"
        # nobody waits for it: the run ended on this error (on every rank, or before the others
        # reached a collective), an error to fix, not a hang
        ended = not stranded and not caught and not a.waiting_ranks()
        issue = f"{a.what} {verb} on {who}: {etype}: {message}{lib}{left}"
        evidence = "\n".join(x for x in (f"raised{at}" if at else "", err.get("traceback", "")) if x)
        a.findings.append(
            Finding(
                severity="critical" if stranded or ended else "error",
                issue=issue,
                evidence=evidence,
                ranks=ranks,
                fix=fix_for(str(etype), str(message)) or GENERIC_FIX,
                confidence=0.9,
                cause=CAUSE_CAUGHT if caught else CAUSE_RAISED,
            )
        )
        if stranded:
            a.causes.update(ranks)
        a.explained.update(ranks)


def _direct_wait(a: Analysis, waiting: list[int], culprits: list[int]) -> dict[str, Any]:
    """What a rank waiting on one of `culprits` itself waits in (not one stranded behind another)."""
    for r in waiting:
        for e in a.graph.direct(r):
            if e.dst in culprits:
                node_waits = a.graph.waits_of(r)
                return a.views[r].waits[node_waits.index(e.wait)]
    return a.views[waiting[0]].waits[0]


# -- 2. lost ranks --------------------------------------------------------------------------


def broken_connections(a: Analysis) -> None:
    """Connections broke, yet every rank answered and nothing above explains it."""
    comm_only = {r: e for r, e in a.errors.items() if e.get("comm") and r not in a.explained}
    if not comm_only or a.lost or any(f.severity == "critical" for f in a.findings):
        return
    ranks = sorted(comm_only)
    e = comm_only[ranks[0]]
    a.findings.append(
        Finding(
            severity="critical",
            issue=f"{format_ranks(ranks)} lost a connection to a peer during {a.what}: {e.get('type')}: {e.get('message')}",
            evidence=e.get("traceback", ""),
            ranks=ranks,
            fix="gloo names the peer by address, not by rank: find the rank on that host and port; look for a "
                "process that ended or a network fault (dmesg, the node's health)",
            confidence=0.7,
            cause=Cause.BROKEN_CONNECTION,
        )
    )


def left_early(a: Analysis) -> None:
    """A rank that finished while the others went on to collectives it never issued.

    With nobody left waiting (the others' collective failed once the finished rank's process
    left, or they raised), `behind` has nothing to compare: the finished rank's last counts
    per group (its final snapshot) against the others' say it left first.
    """
    going = {r: v for r, v in a.views.items() if v.state not in ("finished", "final")}
    if not going:
        return
    for rank, v in sorted(a.views.items()):
        if v.state not in ("finished", "final") or rank in a.explained or rank in a.causes:
            continue
        ahead = [(g, max(o.positions.get(g, 0) for o in going.values()), n) for g, n in v.positions.items()]
        ahead = [(g, top, n) for g, top, n in ahead if top > n]
        lag = _step_lag(a, rank, sorted(going))
        if not ahead and not (lag and v.steps is not None and any(o.steps and o.steps > v.steps for o in going.values())):
            continue
        where = "; ".join(f"on {g} it issued {n} collectives, the others {top}" for g, top, n in ahead) or lag
        consequence = sorted(r for r, e in a.errors.items() if e.get("comm"))
        tail = f"; {format_ranks(consequence)} then lost their connection to it" if consequence else ""
        out = [p for r, p, _, _ in ran_out_first(a) if r == rank]
        evidence = (f"rank {rank} left its watched loop after {v.steps} step(s)" if v.steps is not None else
                    f"rank {rank} posted its final state")
        if out:  # its DataLoader ended before a peer's: uneven data, seen
            evidence += f"; its DataLoader ({out[0].get('label')}, pass {out[0]['pass']}) ended after {out[0]['drawn']} batch(es), a peer's went on"
            fix, cause, confidence = UNEVEN_FIX.format(rank=rank), CAUSE_UNEVEN, 0.95
        elif loader_passes(v) and not any(pass_ended(p) for p in loader_passes(v).values()):
            # its data did not end: it returned or skipped on its own
            fix = (f"rank {rank}'s data did not run out before its peers': look for a rank-dependent early return, "
                   "break or skipped collective on that rank; every rank must issue the same collectives")
            cause, confidence = Cause.LEFT_EARLY, 0.8
        else:
            fix = (f"rank {rank} ran out of data (or returned early) while the others still train: make every rank "
                   "run the same number of steps - DistributedSampler(..., drop_last=True) or an equal number of "
                   "batches per rank - or wrap the loop in DDP's Join context manager "
                   "(torch.distributed.algorithms.Join) for uneven inputs; no DataLoader was seen on this rank, so "
                   "which of the two is not observed")
            cause, confidence = CAUSE_UNEVEN, 0.7
        a.findings.append(
            Finding(
                severity="critical",
                issue=f"rank {rank} finished {a.what} while {format_ranks(sorted(going))} went on: {where}{tail}",
                evidence=evidence, ranks=[rank], fix=fix, confidence=confidence, cause=cause,
            )
        )
        a.explained.add(rank)
        a.explained.update(consequence)


def lost(a: Analysis) -> None:
    by_reason: dict[str, list[int]] = defaultdict(list)
    for rank, reason in sorted(a.lost.items()):
        if rank not in a.explained:
            by_reason[reason].append(rank)
    comm = sorted(r for r, e in a.errors.items() if e.get("comm"))
    for reason, ranks in by_reason.items():
        kind = Silence.reason_of(a.lost[ranks[0]])
        death = Silence.death_of(a.lost[ranks[0]])
        never = kind is SilentReason.NEVER_CHECKED_IN
        evidence = f"no snapshot from {format_ranks(ranks)} through the store; the others kept answering"
        if comm:
            evidence += f"; {format_ranks(comm)} saw their connection to a peer close (a consequence)"
        if death is not None and death.stack:
            evidence += "\nits main thread when it died (faulthandler):\n" + "\n".join(death.stack[:12])
        a.findings.append(
            Finding(
                severity="critical",
                issue=f"{format_ranks(ranks)} lost during {a.what}: {reason}",
                evidence=evidence,
                ranks=ranks,
                fix=death_fix(death) or (
                    "look for the process's end: the kernel log (dmesg: OOM killer, segfault), "
                    "torchrun's per-worker exit code, the node's health; a stopped process "
                    "(SIGSTOP, debugger) must be continued or killed"
                ),
                confidence=0.6 if never else 0.95,
                cause=("aborted_in_collective" if death_fix(death) == ABORTED_FIX else
                       kind.cause if kind is not None else "lost"),
            )
        )
        a.explained.update(ranks)


# -- 3. ranks that never entered what the others wait in -----------------------------------


def _step_lag(a: Analysis, rank: int, waiters: list[int]) -> str | None:
    """How the rank's training steps compare with the waiting ranks', when that says it left.

    Fewer steps (marks or optimizer steps) is a lag; the same number while the rank is no
    longer inside its training loop's frame (the others are inside their next step) means it
    left the loop.
    """
    v = a.views[rank]
    mine = v.steps
    theirs = [s for r in waiters if (s := a.views[r].steps) is not None]
    if mine is None or not theirs:
        return None
    if mine < min(theirs):
        return f"rank {rank} has taken {mine} training step(s) and the waiting ranks {min(theirs)}"
    if loader_passes(v):
        return None  # its DataLoader did not end early (data_ran_out would have named it): not a lag
    if v.in_loop is False or v.state in ("finished", "final"):
        return (f"rank {rank} took {mine} training step(s) and left its training loop ({v.snap.get('loop') or '?'}) "
                f"while the others are in step {min(theirs) + 1}")
    return None


def _behind_text(a: Analysis, rank: int, group: str, seq: int) -> tuple[str, str]:
    """(where the rank is, the evidence) for a rank behind on `group`."""
    v = a.views[rank]
    snap = v.snap
    other = next((w for w in v.waits if w["group"] != group), None)
    same = v.wait_on(group)
    if same is not None and same["seq"] < seq:
        since = f" for {float(same['for_s']):.1f}s" if same.get("for_s") else ""
        text = f"it waits in {_wait_text(same)}{since}"
        if same.get("source") == "engine" and not v.record.in_collective and v.record.stack:
            # The recorder marks a collective completed on torch's own thread, after the caller
            # may have returned (gloo), and on NCCL the CPU leaves at once: where the main
            # thread is says whether the rank is still in the collective or stuck after it.
            text += f" by torch's recorder; its main thread is at {where(v.record.stack)}{_step_text(snap)}"
        return text, stack_text(snap)
    if other is not None:
        return (f"it waits in {_wait_text(other)} on another group (called at {other.get('call_site', '?')}): "
                "the groups wait on each other", stack_text(snap))
    if v.state in ("finished", "final"):
        done = v.positions.get(group)
        count = f"{done} collectives on {group}" if done is not None else f"{snap.get('collectives_in_probe', 0)} collectives"
        return f"it finished {a.what} after {count} and left", stack_text(snap)
    if snap.get("place") and not v.record.stack:
        return snap["place"], ""  # no live stack: where its source (a dump) places it
    return (f"it is at {where(v.record.stack)}{_step_text(snap)}",
            f"rank {rank} main-thread stack (innermost last):\n{stack_text(snap)}")


def _step_text(snap: dict[str, Any]) -> str:
    """' (in step 7)' for the user's marks, ' (after 6 optimizer steps)' without them."""
    if snap.get("step_source") == "marks" and snap.get("step") is not None:
        return f" (in step {snap['step']})"
    if snap.get("step_source") == "optimizer" and snap.get("steps"):
        return f" (after {snap['steps']} optimizer step(s))"
    return ""


def behind(a: Analysis) -> None:
    if a.lost:
        return  # a lost rank explains why the others wait
    div = a.divergence()
    for group, waits in a.waiters().items():
        seq = max(int(w["seq"]) for w in waits.values())
        if div is not None and div["group"] == group and div["seq"] <= seq:
            # ranks recorded different collectives at #div on this group (gloo paired them by
            # order): whoever sits below #seq there is in another collective, not behind
            continue
        at_top = sorted(r for r, w in waits.items() if int(w["seq"]) == seq)
        first = waits[at_top[0]]
        engine = first.get("source") == "engine"
        for rank in a.members(group):
            if rank in a.explained or rank in a.causes or rank in at_top or rank not in a.views:
                continue
            if rank in a.graph.stranded:
                continue  # it waits on another group for a rank further along: that one is named
            v = a.views[rank]
            if engine and v.engine_ok:
                if reached(v.positions.get(group, 0), seq):  # the frontier's rule (hang/frontcore.py)
                    continue  # it reached #seq (a different op there is a desync) or passed it
            elif v.wait_on(group) is not None or v.state not in ("computing", "setup", "finished", "final"):
                continue
            elif v.state in ("finished", "final") and a.errors:
                continue  # without engine counts, a finished rank next to a raise says nothing
            a.findings.append(_behind_finding(a, rank, group, seq, at_top, first))
            a.explained.add(rank)


def _behind_finding(a: Analysis, rank: int, group: str, seq: int, at_top: list[int], first: dict[str, Any]) -> Finding:
    v = a.views[rank]
    place, evidence = _behind_text(a, rank, group, seq)
    lag = _step_lag(a, rank, at_top)
    confidence = 0.9
    if lag and v.state in ("computing", "finished", "final"):
        issue = (
            f"rank {rank} stopped taking training steps while {_they(at_top)} in {_wait_text(first)}: "
            f"{lag}; {place}"
        )
        fix, cause = UNEVEN_FIX.format(rank=rank), CAUSE_UNEVEN
        if not _fewer_steps(a, rank, at_top):
            # the same step count, out of the loop, and no DataLoader seen: its data's end is not
            # observed, so a branch out of the loop stays open beside uneven data
            confidence = 0.7
            fix += (f"; no DataLoader was seen on rank {rank}, so its data's end was not observed: if it did not "
                    "run out, a branch taken on this rank alone led it out of the loop")
    elif v.state in ("finished", "final"):
        issue = (
            f"rank {rank} finished while {_they(at_top)} in {_wait_text(first)}: it issued fewer "
            f"collectives (one was skipped, or it ran fewer steps); {place}"
        )
        fix = "look for a rank-dependent branch or an early exit around this collective; every rank must issue it"
        cause = Cause.SKIPPED
    else:
        issue = f"rank {rank} never entered {first['op']} #{seq} on {group} that {_they(at_top)} in; {place}"
        fix = (
            f"find why rank {rank} is stuck or slow there (a rank-dependent branch, I/O, a lock, data loading); "
            "every rank must reach the same collectives in the same order"
        )
        cause = Cause.BEHIND
    behind_it = sorted(r for r, e in a.graph.end_of.items() if rank in e.ranks and r in a.graph.stranded)
    if len(behind_it) > SHAPE_LINES:  # the stranded finding has them, one line per chain shape
        evidence += f"\n{format_ranks(behind_it)} ({len(behind_it)}) wait on it through others: see the stranded ranks below"
    elif behind_it:
        evidence += "\nstranded behind it (waiting on it through others):\n" + "\n".join(
            "  " + c for c in shape_lines(a, behind_it))
    return Finding(severity="critical", issue=issue, evidence=evidence, ranks=[rank], fix=fix, confidence=confidence,
                   cause=cause)


def _fewer_steps(a: Analysis, rank: int, waiters: list[int]) -> bool:
    mine = a.views[rank].steps
    theirs = [s for r in waiters if (s := a.views[r].steps) is not None]
    return mine is not None and bool(theirs) and mine < min(theirs)


# -- 7-8. nobody to blame in the program ------------------------------------------------------


def stall(a: Analysis) -> None:
    if a.lost or a.errors or any(f.severity == "critical" for f in a.findings):
        return
    for group, waits in a.waiters().items():
        members = a.members(group)
        if sorted(waits) != sorted(members) or len({(tuple(w.get("key") or ()), w["seq"]) for w in waits.values()}) != 1:
            continue
        w = next(iter(waits.values()))
        seq = int(w["seq"])
        started = {r: x.get("started") for r, x in waits.items()}
        known = {r: s for r, s in started.items() if s is not None}
        not_started = sorted(r for r, s in known.items() if s < seq)
        for_s = min(float(x.get("for_s") or 0) for x in waits.values())
        if known and len(known) == len(waits) and not not_started:
            issue = (f"every rank started {_wait_text(w)} and none completed it in {for_s:.1f}s: "
                     "the collective is stuck in the network or the GPUs, below the program")
            fix = ("check the fabric and the GPUs: NCCL_DEBUG=INFO, link errors (ibstat, nvidia-smi nvlink -e), Xid "
                   "errors in dmesg; `distdiag check --profile gate` on the same nodes names a slow link or GPU")
            ranks: list[int] = []
        elif not_started:
            issue = (f"{format_ranks(not_started)} enqueued {_wait_text(w)} but never started it, while the others did: "
                     "their GPU stream is still busy with earlier work")
            fix = ("look at what those ranks queued before this collective: a long or hung kernel, or a collective on "
                   "another group that waits on its own peers (py-spy dump --native, or the ranks' stacks below)")
            ranks = not_started
        else:
            issue = (f"every rank has been inside {_wait_text(w)} for {for_s:.1f}s: the collective does not complete")
            fix = ("a stall below the program: check the network/fabric (NCCL_DEBUG=INFO, link errors), GPU health, "
                   "and the process group's transport"
                   + ("; on NCCL set TORCH_NCCL_ENABLE_TIMING=1 so a rank whose GPU never started it is told apart"
                      if not known else ""))
            ranks = []
        a.findings.append(
            Finding(severity="critical", issue=issue, ranks=ranks, fix=fix, confidence=0.6, cause=Cause.COLLECTIVE_STALL,
                    evidence=f"all {len(waits)} member rank(s) of {group} are inside the same collective (same op, sequence number and shape)")
        )


def nobody_waiting(a: Analysis) -> None:
    if a.waiters() or a.lost or a.errors or any(f.severity == "critical" for f in a.findings):
        return
    slow = sorted(a.views)
    place = "; ".join(f"rank {r} at {where(a.views[r].record.stack)}" for r in slow[:4])
    # The table says 'collective' for a rank inside a wrapped call whose collectives torch's
    # recorder has all completed (it moves from one to the next): never contradict it.
    inside = [r for r in slow if a.views[r].state == "collective"]
    how = ("no rank is inside a collective" if not inside else
           f"no collective is pending: torch's recorder completed every one, though {format_ranks(inside)} "
           f"{'is' if len(inside) == 1 else 'are'} inside a call that issues them (it keeps moving)")
    a.findings.append(
        Finding(
            severity="critical",
            issue=f"{a.what} did not finish within {a.timeout_s:g}s and {how}: {place}",
            evidence="\n".join(f"rank {r}:\n{stack_text(a.views[r].snap, 4)}" for r in slow[:4]),
            ranks=slow if len(slow) < a.world else [],
            fix="if the work is just slow, raise the deadline (--timeout-s); otherwise the stacks show where it loops",
            confidence=0.6,
            cause=CAUSE_STALLED,
        )
    )


RULES: tuple[Callable[[Analysis], None], ...] = (
    raised, aborted_in_collective, group_creation, lost, uneven_data, skipped_send, deadlock, desync_in_histories, behind, chain_end, left_early, broken_connections,
    desync_in_flight, desync_in_records, stall, nobody_waiting, stranded,
)


def analyze_hang(
    snaps: dict[int, dict[str, Any]],
    lost_ranks: Mapping[int, str],
    errors: dict[int, dict[str, Any]],
    world: int,
    *,
    what: str,
    timeout_s: float,
    raise_ends_run: bool = False,
    views: dict[int, RankView] | None = None,
    keep: dict[str, Any] | None = None,
) -> list[Finding]:
    """Findings for a run that stopped. `what` names the step (e.g. "probe 'collectives'").

    `raise_ends_run`: the run ended because of this step, so when nothing else is critical a
    rank's exception is the cause (e.g. a failed setup) and leads as critical. `views`:
    build_views(snaps, lost_ranks) when the caller built them already (no rule changes them).
    `keep` gets the wait-for graph the rules read (`graph`: the report draws the same one; no
    rule changes it).
    """
    views = build_views(snaps, lost_ranks) if views is None else views
    a = Analysis(views, dict(lost_ranks), dict(errors), world, what, timeout_s)
    for rule in RULES:
        rule(a)
    _settle(a, raise_ends_run)
    if keep is not None:
        keep["graph"] = a.graph
    return a.findings


def _settle(a: Analysis, raise_ends_run: bool) -> None:
    """Severities that depend on what else was found."""
    never = SilentReason.NEVER_CHECKED_IN.cause
    others = [f for f in a.findings if f.severity == "critical" and f.cause != never]
    if others:
        for f in a.findings:
            if f.cause == never:
                f.severity = "warning"  # still starting when another rank's trouble ended the run
    if raise_ends_run and not any(f.severity == "critical" for f in a.findings):
        for f in a.findings:
            if f.ranks and set(f.ranks) <= set(a.errors) and f.cause in (CAUSE_RAISED, CAUSE_CAUGHT):
                f.severity = "critical"


def ensure_critical(findings: list[Finding], issue: str, evidence: str, fix: str) -> None:
    """A run that ended early always leads with a critical finding: this one when no analysis named one."""
    if not any(f.severity == "critical" for f in findings):
        findings.append(Finding(severity="critical", issue=issue, evidence=evidence, fix=fix, confidence=0.5))
