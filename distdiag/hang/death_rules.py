"""A rank that died of a fatal signal, told apart by the signal and where its program was.

Its peers learn only that the process is gone; the note faulthandler left
(distdiag.runtime.deathnote) says how. SIGABRT while the program was inside a
torch.distributed call is the communication library ending the process itself: gloo when a
peer's message has another size than this rank's collective expects (the ranks are in
different collectives: gloo pairs collectives by their order, never by name), NCCL's
watchdog on a collective's timeout or a communicator error. The dead rank then only received
the mismatch; the rank that caused it is, first, one whose DataLoader pass ended after fewer
batches than a peer still in the same pass drew (it left the pass and issued the pass's end
collectives while its peers issued one per batch: uneven data); else one whose own steps
changed course: the same lines each step, then a step that issued collectives from lines its
other steps never did (an extra evaluation, a rank-dependent branch). Such a rank is blamed,
the dead rank named as the consequence. Without one, the dead rank is named with what its
death says, and the observation that would decide.
"""

from __future__ import annotations

from typing import Any

from distdiag.hang.desync import departure
from distdiag.hang.group_rules import UNEVEN_FIX, loader_passes, pass_when, ran_out_finding, ran_out_first
from distdiag.hang.records import CAUSE_DESYNC, CAUSE_UNEVEN, Cause, Silence
from distdiag.report.model import Finding
from distdiag.report.render import format_ranks

__all__ = ["ABORTED_FIX", "aborted_in_collective", "death_fix"]

ABORTED_FIX = (
    "the ranks called different collectives (or sizes) at the same point: gloo aborts the rank that receives a "
    "message of the wrong size (its stderr says 'Is there a distributed collective mismatch'); NCCL's watchdog "
    "aborts on a collective's timeout. Run once with TORCH_DISTRIBUTED_DEBUG=DETAIL to have torch compare every "
    "collective across ranks, and look for a collective inside a branch only some ranks take"
)


def death_fix(death: Any) -> str | None:
    """The fix a death's signal points to, or None for the generic one."""
    if death is None:
        return None
    if death.signal == "SIGABRT" and death.in_collective:
        return ABORTED_FIX
    if death.signal in ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE"):
        return ("a crash in native code (an extension, a kernel, a corrupted tensor): the stack of its main thread "
                "is in the finding's evidence; rerun that rank's inputs under gdb (or compute-sanitizer on a GPU)")
    return None


def _dead_rank_departed(a: Any, dead: dict[int, Any], alive: list[int]) -> None:
    """No live rank changed course: the dead rank may have. It died inside a collective called
    from a line none of the live ranks' recorded collectives came from (their histories cover
    their steps): it issued a collective they did not, and gloo aborted it when their next
    message, of another size, arrived."""
    seen = _live_sites(a, alive)
    if not seen:
        return
    odd = {r: d for r, d in dead.items() if d.call_site and d.call_site not in seen}
    if not odd:
        return
    for r, d in odd.items():
        a.findings.append(
            Finding(
                severity="critical",
                issue=(f"rank {r} issued a collective the other ranks did not: it died inside {d.collective} called at "
                       f"{d.call_site}, a line none of their recorded collectives came from ({d.signal}: gloo aborts "
                       "the rank that receives a message of another size than its collective expects)"),
                evidence=f"{a.lost[r]}\nits main thread when it died (faulthandler):\n" + "\n".join(d.stack[:12]),
                ranks=[r],
                fix=("make every rank issue the same collectives in the same order: this line runs on this rank "
                     "only (a rank-dependent branch), or must run on all of them"),
                confidence=0.7,
                cause=CAUSE_DESYNC,
            )
        )
        a.explained.add(r)


def _live_sites(a: Any, alive: list[int]) -> set[str]:
    """Every line the live ranks' recorded collectives came from (their histories cover their steps)."""
    from distdiag.hang.desync import _records

    return {str(c["call_site"]) for r in alive for c in _records(a.views[r].snap) if c.get("call_site")}


def _aborted(a: Any) -> dict[int, Any]:
    out = {}
    for rank, why in sorted(a.lost.items()):
        death = Silence.death_of(why)
        if death is not None and death.signal == "SIGABRT" and death.in_collective and rank not in a.explained:
            out[rank] = death
    return out


def _consequences(a: Any, dead: dict[int, Any], above: str) -> None:
    for r, d in dead.items():
        a.findings.append(
            Finding(
                severity="warning",
                issue=f"rank {r} lost during {a.what}: {a.lost[r]} (a consequence of the {above} above)",
                evidence="\n".join(d.stack[:12]),
                ranks=[r],
                fix=ABORTED_FIX,
                confidence=0.7,
                cause=Cause.ABORTED,
            )
        )
    a.explained.update(dead)


def _died(r: int, d: Any) -> str:
    """'rank 3 died of SIGABRT (...) while ...' (Death.text() speaks of 'it')."""
    text = d.text()
    return f"rank {r} {text[3:] if text.startswith('it ') else text}"


def _pass_site(a: Any, rank: int, p: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The line of the collective `rank` issued last inside its ended pass `p`, and the first
    collective it issued after the pass ended, from its flight-recorder entries (wall-clock
    stamps, as the pass's end is); None when they do not tell."""
    end = p.get("at_wall_ns")
    entries = [e for e in (a.views[rank].snap.get("engine") or {}).get("entries") or []
               if isinstance(e, dict) and e.get("call_site") and not e.get("p2p") and isinstance(e.get("created_ns"), int)]
    if not isinstance(end, int) or not entries:
        return None
    entries.sort(key=lambda e: e["created_ns"])
    inside = [e for e in entries if e["created_ns"] < end]
    after = [e for e in entries if e["created_ns"] >= end and e["call_site"] != (inside[-1]["call_site"] if inside else None)]
    if not inside or not after:
        return None
    return inside[-1]["call_site"], after[0]


def _ran_out_beside_dead(a: Any, dead: dict[int, Any]) -> bool:
    """No live peer left to compare loaders with (two ranks, say): a live rank whose DataLoader
    pass ended (StopIteration) and that went on to another collective, while the dead rank died
    inside a collective from the very line the live rank issued for each batch of that pass:
    the dead rank still had batches where the live rank had none (its own loader is lost)."""
    for rank in sorted(a.views):
        if rank in a.explained or rank in a.lost:
            continue
        passes = loader_passes(a.views[rank])
        for key, p in sorted(passes.items()):
            if not p.get("exhausted") or any(k[0] == key[0] and k[1] > key[1] for k in passes):
                continue  # not ended, or a later pass of the same loader began (a step-driven loop)
            found = _pass_site(a, rank, p)
            if found is None:
                continue
            site, nxt = found
            still = {r: d for r, d in dead.items() if d.call_site == site}
            if not still:
                continue
            steps = pass_when(p)
            deaths = "; ".join(_died(r, d) for r, d in still.items())
            a.findings.append(
                Finding(
                    severity="critical",
                    issue=(f"rank {rank} ran out of data: its DataLoader ({p.get('label', '?')}, pass {p['pass']}) ended "
                           f"after {p['drawn']} batch(es){steps} and it went on to {nxt.get('op', '?')} at "
                           f"{nxt['call_site']}, while {format_ranks(sorted(still))} still issued the collective of "
                           f"each batch of that pass ({site}) when gloo aborted {'it' if len(still) == 1 else 'them'}"),
                    evidence=(f"batches drawn from that pass: rank {rank} {p['drawn']} (then StopIteration); {deaths}. "
                              f"Rank {rank}'s last collective inside the pass came from {site}, the line the dead "
                              "rank died in: it was still drawing batches. gloo pairs collectives by order, so the "
                              "two collectives met, and a message of the wrong size made gloo abort the receiver "
                              "(the dead rank's own loader is lost with it)"),
                    ranks=[rank],
                    fix=UNEVEN_FIX.format(rank=rank),
                    confidence=0.8,
                    cause=CAUSE_UNEVEN,
                )
            )
            a.explained.add(rank)
            a.causes.add(rank)
            _consequences(a, still, "uneven data")
            return True
    return False


def _ran_out_and_died(a: Any, dead: dict[int, Any], rank: int, p: dict[str, Any], more: list[int], most: int) -> None:
    """The short rank is the one gloo aborted: its pass ended (its note's copy of its loaders
    says so) and it died in the collective that followed, the pass's end, which met a peer's
    per-batch collective of another size."""
    d = dead[rank]
    steps = pass_when(p)
    drawn = ", ".join(f"rank {o} {n}" for o in more if (n := _drawn(a, o, p)) is not None)
    where = f"{d.collective} called at {d.call_site}" if d.call_site else str(d.collective)
    a.findings.append(
        Finding(
            severity="critical",
            issue=(f"rank {rank} ran out of data: its DataLoader ({p.get('label', '?')}, pass {p['pass']}) ended after "
                   f"{p['drawn']} batch(es){steps} while {format_ranks(more)} "
                   f"{'has' if len(more) == 1 else 'have'} up to {most} in the same pass; it went on to {where} and "
                   f"died there of {d.signal}: the collective met a peer's per-batch one"),
            evidence=(f"batches drawn from that pass: rank {rank} {p['drawn']} (then StopIteration; from the copy of "
                      f"its loaders it wrote when the pass ended, beside its death note); {drawn}. {_died(rank, d)}. "
                      "gloo pairs collectives by order, so the pass's end collective met the next batch's on its "
                      "peers, and a message of the wrong size made gloo abort the receiver\n"
                      "its main thread when it died (faulthandler):\n" + "\n".join(d.stack[:12])),
            ranks=[rank],
            fix=UNEVEN_FIX.format(rank=rank),
            confidence=0.9,
            cause=CAUSE_UNEVEN,
        )
    )
    a.explained.add(rank)
    a.causes.add(rank)
    a.explained.update(more)


def _drawn(a: Any, rank: int, p: dict[str, Any]) -> int | None:
    mine = loader_passes(a.views[rank]) if rank in a.views else {}
    q = mine.get((p["loader"], p["pass"]))
    return q["drawn"] if q else None


def _ran_out_before(a: Any, dead: dict[int, Any]) -> bool:
    """A live rank's DataLoader pass ended while a peer, still in that pass, drew more: the
    short rank went on to the pass's end collectives while its peers issued one per batch, so
    gloo met different collectives until a size mismatch aborted a receiver. The abort ended
    the peers' waits: they need not be waiting now."""
    rows = [row for row in ran_out_first(a, waiting=False) if row[0] not in a.explained]
    if not rows:
        return _ran_out_beside_dead(a, dead)
    short_dead = [row for row in rows if row[0] in dead]
    for row in short_dead:
        _ran_out_and_died(a, dead, *row)
    rows = [row for row in rows if row[0] not in dead]
    dead = {r: d for r, d in dead.items() if r not in {row[0] for row in short_dead}}
    if not rows:
        _consequences(a, dead, "uneven data")
        return True
    deaths = "; ".join(_died(r, d) for r, d in dead.items())
    for rank, p, more, most in rows:
        then = (f"then {deaths}: gloo pairs collectives by order, so after rank {rank} left the pass every later "
                "collective of its met a different one on its peers, until a message of the wrong size made gloo abort "
                "the receiver (the dead rank's own loader is lost with it)")
        a.findings.append(ran_out_finding(a, rank, p, more, most, [], then=then))
        a.explained.add(rank)
        a.causes.add(rank)
        a.explained.update(more)
    _consequences(a, dead, "uneven data")
    return True


def _both_departed(a: Any, dead: dict[int, Any], alive: list[int], changed: dict[int, str]) -> bool:
    """Live ranks left their course, and so did the dead ones: each dead rank died in a collective
    from a line none of the live ranks' recorded collectives came from. Both sides were in code
    new to them (an evaluation pass every rank begins, whose data ended first on one side, or a
    branch): the live side's departure does not make it the cause. Said as such, with both lines."""
    seen = _live_sites(a, alive)
    if not seen or not all(d.call_site and d.call_site not in seen for d in dead.values()):
        return False
    ranks = sorted({*changed, *dead})
    lines = "; ".join([f"rank {r}: {text}" for r, text in sorted(changed.items())]
                      + [f"{_died(r, d)}, a line none of the live ranks' recorded collectives came from"
                         for r, d in sorted(dead.items())])
    a.findings.append(
        Finding(
            severity="critical",
            issue=(f"{format_ranks(ranks)} were in different collectives, each side at a line new to it ({lines}); "
                   "which side left the common course is not identified"),
            evidence=("gloo pairs collectives by order, and aborts the rank that receives a message of another size "
                      "than its collective expects. The live ranks' recorders show their departure; the dead rank's "
                      "line is none the live ranks issued, so it departed too. Its own history (and its loaders, "
                      "unless it was watched and a DataLoader pass of it ended) are lost with it\n"
                      + "\n".join(next(iter(dead.values())).stack[:12])),
            ranks=ranks,
            fix=("both lines run in code every rank should enter the same way: where it loops over data (an "
                 "evaluation pass, a metric per batch), one side's data ended first - give every rank the same number "
                 "of batches (DistributedSampler(drop_last=True)); else a collective inside a branch only some ranks "
                 "take. To tell, run once with TORCH_DISTRIBUTED_DEBUG=DETAIL"),
            confidence=0.5,
            cause=CAUSE_DESYNC,
        )
    )
    a.explained.update(ranks)
    return True


def aborted_in_collective(a: Any) -> None:
    """Ranks aborted inside a collective: blame the live rank that ran out of data, else the live
    ranks whose steps changed course."""
    dead = _aborted(a)
    if not dead or _ran_out_before(a, dead):
        return
    alive = [r for r in sorted(a.views) if r not in a.lost]
    # where the program is now does not matter (the survivors were ended after the abort):
    # only the steps their recorders kept
    changed = {r: text for r in alive if (text := departure(a.views[r].snap, loop=False))}
    if not changed:
        _dead_rank_departed(a, dead, alive)
        return
    if len(changed) == len(alive) > 1:
        return  # everybody (no course to depart from): `lost` names the dead rank
    if _both_departed(a, dead, alive, changed):
        return
    culprits = sorted(changed)
    deaths = "; ".join(_died(r, d) for r, d in dead.items())
    a.findings.append(
        Finding(
            severity="critical",
            issue=(f"{format_ranks(culprits)} issued collectives its own training steps do not "
                   f"({changed[culprits[0]]}); {format_ranks(sorted(dead))} then died inside a collective (SIGABRT): "
                   "the ranks were in different collectives"),
            evidence=(f"{deaths}. gloo pairs collectives by order: after an extra collective on one rank every "
                      "later one meets a different one on its peer, until a message of the wrong size makes gloo "
                      "abort the receiver. The survivors' recorders show the departure; the dead rank's own "
                      "collectives are lost with it, so its matching steps are assumed"),
            ranks=culprits,
            fix=("make every rank issue the same collectives in the same order: a collective (an evaluation, a "
                 "metric gather, a save) inside a branch only some ranks take must run on all of them, or move "
                 "out of the branch. To confirm, run once with TORCH_DISTRIBUTED_DEBUG=DETAIL"),
            confidence=0.7,
            cause=CAUSE_DESYNC,
        )
    )
    a.explained.update(culprits)
    _consequences(a, dead, "mismatch")
