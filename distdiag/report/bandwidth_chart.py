"""The gate's bandwidth chart (`distdiag gate --chart FILE.png`), drawn from a report.

Reads what the `bandwidth` probe put in the report (docs/gate.md): the straggler score of
every rank (`table:straggler scores`), the time of every ring link (`table:ring links`), the
busbw per op and size against its expected floor (`table:bandwidth`), and the limits the
findings were judged by (`limits`). Draws one panel each, the ranks and links the probe
named in red and each limit as a dashed line, so the picture and the findings agree.
A report from before `limits` was written gets the probe's findings' ranks marked and no lines.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distdiag.report.figure import SEVERITY_COLOURS, pyplot, save_figure

if TYPE_CHECKING:
    from distdiag.report.model import ProbeResult, Report

__all__ = ["bandwidth_of", "draw_bandwidth_chart", "judged"]

_RED, _GREY, _BLUE = SEVERITY_COLOURS["error"], "#9e9e9e", "#4c72b0"
_BARS = 64
"""Ranks or links drawn as bars; past this, as points (a 16k-rank job is still one picture)."""
_NAMED = 12
"""Flagged ranks or links named beside their mark; the rest are counted in the title."""


def bandwidth_of(report: Report) -> ProbeResult | None:
    """The report's bandwidth probe result, or None when it did not run."""
    return next((p for p in report.probes if p.name == "bandwidth" and p.details.get("table:straggler scores")
                 is not None), None)


def judged(details: dict[str, Any], findings: list[Any]) -> tuple[set[int], set[str]]:
    """(straggler ranks, slow links as "a<->b") by the probe's own limits; without them (an
    older report) the ranks its straggler findings name, and the links its slow-link findings
    name (both links of a rank named alone, the pair named together)."""
    limits = details.get("limits")
    scores = details.get("table:straggler scores") or []
    links = details.get("table:ring links") or []
    if not isinstance(limits, dict):
        named = {r for f in findings for r in f.ranks if "straggler" in f.issue}
        # a slow rank's finding names the rank (both its links), a slow pair's names the two
        about_links = [set(f.ranks) for f in findings
                       if "ring links are slow" in f.issue or f.issue.startswith("slow link between")]
        return named, {row["link"] for row in links
                       if any(len(r) == 1 and r <= _pair(row["link"]) or len(r) == 2 and r == _pair(row["link"])
                              for r in about_links)}
    stragglers = {row["rank"] for row in scores if row["score"] > limits["straggler_score"]
                  and row["late_ms"] > limits["straggler_min_late_ms"]}
    slow = set()
    reference = _reference_us(links)
    for row in links:
        t = row["time_us"]
        too_slow = len(links) >= 3 and t > limits["slow_link_factor"] * reference and t - reference > limits["slow_link_min_us"]
        below = limits.get("expected_p2p_gbps") and row["GBps"] < limits["expected_p2p_gbps"]
        if too_slow or below:
            slow.add(row["link"])
    return stragglers, slow


def _pair(link: str) -> set[int]:
    a, _, b = link.partition("<->")
    return {int(a), int(b)} if a.isdigit() and b.isdigit() else set()


def _reference_us(links: list[dict[str, Any]]) -> float:
    """The 25th-percentile link's time, as the probe takes it (one slow rank slows two links)."""
    times = sorted(row["time_us"] for row in links)
    return times[len(times) // 4] if times else 0.0


def _bars(ax: Any, labels: list[str], values: list[float], flagged: list[bool], notes: list[str]) -> None:
    """Bars (or points past _BARS), red where flagged, the first _NAMED flagged ones annotated."""
    xs = list(range(len(values)))
    colours = [_RED if f else _BLUE for f in flagged]
    if len(values) <= _BARS:
        ax.bar(xs, values, color=colours, width=0.7)
        step = max(1, len(xs) // 32)
        ax.set_xticks(xs[::step], labels[::step], rotation=90 if len(xs) > 16 else 0, fontsize=7)
    else:
        ax.scatter(xs, values, c=colours, s=[18 if f else 4 for f in flagged], linewidths=0)
        ax.set_xlim(-1, len(xs))
    ax.margins(y=0.18)  # room above the highest mark for its name
    shown = 0
    for x, v, f, note in zip(xs, values, flagged, notes, strict=True):
        if f and shown < _NAMED:
            ax.annotate(note, (x, v), xytext=(4, 4 + 9 * (shown % 3)), textcoords="offset points", fontsize=7,
                        color=_RED, annotation_clip=False)
            shown += 1


def _log_axis(ax: Any) -> None:
    """A log scale whose ticks read as plain numbers (0.004, not 4 x 10^-3)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    lo, hi = ax.get_ylim()
    # 1, 2, 5 per decade over a narrow range (a single decade would show one tick), else 1
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if hi < 100 * lo else (1.0,)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def draw_bandwidth_chart(report: Report, path: str | Path) -> Path:
    """Draw the report's bandwidth results to `path` (.png, .svg, .pdf); ValueError when the
    report holds none (the profile left the probe out, or it was skipped)."""
    probe = bandwidth_of(report)
    if probe is None:
        raise ValueError("no bandwidth results in the report (the profile or --probes left the bandwidth probe out)")
    plt = pyplot("--chart")
    details = probe.details
    limits = details.get("limits") if isinstance(details.get("limits"), dict) else None
    links = details.get("table:ring links") or []
    floors = [row for row in details.get("table:bandwidth") or [] if row.get("expected_GBps")]
    stragglers, slow = judged(details, probe.findings)
    panels = 1 + bool(links) + bool(floors)
    fig, axes = plt.subplots(panels, 1, figsize=(11, 3.4 * panels + 0.6), squeeze=False)
    _scores_panel(axes[0][0], details, stragglers, limits)
    if links:
        _links_panel(axes[1][0], links, slow, limits)
    if floors:
        _floors_panel(axes[-1][0], floors)
    fig.suptitle(textwrap.fill(f"distdiag bandwidth, {report.world_size} ranks: {report.summary}", 140), fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path, "--chart")


def _limit_line(ax: Any, y: float, text: str, colour: str = _RED, style: str = "--") -> None:
    ax.axhline(y, color=colour, linestyle=style, linewidth=1)
    ax.annotate(text, (0, y), xycoords=("axes fraction", "data"), xytext=(2, 3), textcoords="offset points",
                fontsize=7, color=colour, zorder=5, bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1})


def _scores_panel(ax: Any, details: dict[str, Any], stragglers: set[int], limits: dict[str, Any] | None) -> None:
    scores = sorted(details.get("table:straggler scores") or [], key=lambda row: row["rank"])
    _bars(ax, [str(row["rank"]) for row in scores], [row["score"] for row in scores],
          [row["rank"] in stragglers for row in scores],
          [f"rank {row['rank']} ({row['host']}): {row['late_ms']:.2f} ms late" for row in scores])
    if limits:
        _limit_line(ax, limits["straggler_score"],
                    f"straggler above {limits['straggler_score']:g} (and {limits['straggler_min_late_ms']:g} ms late)")
    ax.set_ylabel("straggler score")
    ax.set_xlabel("rank")
    named = (f"straggler{'s' if len(stragglers) > 1 else ''}: rank {', '.join(map(str, sorted(stragglers)[:_NAMED]))}"
             + (" ..." if len(stragglers) > _NAMED else ""))
    ax.set_title(f"Per rank: how long the others waited for it, / the median iteration "
                 f"({len(scores)} ranks; {named if stragglers else 'no straggler'})", fontsize=9)


def _links_panel(ax: Any, links: list[dict[str, Any]], slow: set[str], limits: dict[str, Any] | None) -> None:
    _bars(ax, [r["link"] for r in links], [r["GBps"] for r in links], [r["link"] in slow for r in links],
          [f"{r['link']} ({r['hosts']}): {r['GBps']:g} GB/s" for r in links])
    reference = _reference_us(links)
    if limits and reference > 0:
        # GB/s x time is the bytes moved: the rate at `factor` times the reference link's time
        line = links[0]["time_us"] * links[0]["GBps"] / (limits["slow_link_factor"] * reference)
        _limit_line(ax, line, f"slow below {line:.3g} GB/s ({limits['slow_link_factor']:g}x the reference link's time)")
        if limits.get("expected_p2p_gbps"):
            _limit_line(ax, limits["expected_p2p_gbps"], f"expected_p2p_gbps {limits['expected_p2p_gbps']:g}",
                        SEVERITY_COLOURS["warning"], ":")
    _log_axis(ax)
    ax.set_ylabel("GB/s, one direction")
    ax.set_xlabel("ring link (rank <-> rank)")
    ax.set_title(f"Per ring link: {links[0]['size']} exchanged, one pair at a time "
                 f"({len(slow)} slow of {len(links)})", fontsize=9)


def _floors_panel(ax: Any, floors: list[dict[str, Any]]) -> None:
    xs = list(range(len(floors)))
    below = [r["busbw_GBps"] < r["expected_GBps"] for r in floors]
    ax.bar(xs, [r["busbw_GBps"] for r in floors], color=[_RED if b else _BLUE for b in below], width=0.6)
    ax.scatter(xs, [r["expected_GBps"] for r in floors], marker="_", s=600, color=_RED, linewidths=2,
               label="expected busbw (the floor)")
    ax.set_xticks(xs, [f"{r['op']}\n{r['size']}" for r in floors], fontsize=7)
    ax.set_xlim(-0.8, max(len(xs), 6) - 0.2)
    _log_axis(ax)
    ax.set_ylabel("busbw GB/s")
    ax.legend(loc="upper right", fontsize=7)
    ax.set_title(f"Bus bandwidth against the expected floors ({sum(below)} below)", fontsize=9)
