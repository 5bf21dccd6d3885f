"""The picture of a hang as an image: `distdiag hang-report --graph FILE.png|.svg|.pdf`.

Draws the graph model of distdiag.hang.picture (the one DOT and Mermaid are written from)
with matplotlib, laid out by hand, no graph-layout dependency: columns from left to right,
the ends the hang stops at first (the blamed ranks red, other ends yellow), then the ranks
waiting on them, then the ranks waiting on those (grey). Arrows point from a waiting rank
to what it waits for; the collectives they wait in are written once per target, beside
it, with how many ranks wait there, instead of one label per arrow (64 arrows with the same
label would be unreadable).
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

from distdiag.report.figure import pyplot, save_figure

__all__ = ["draw_picture", "layers"]

_FILL = {"culprit": "#f4cccc", "end": "#fff2cc", "stranded": "#eeeeee", "ranks": "#e0e0e0", "hub": "#d9d9d9"}
_EDGE = {"culprit": "#cc0000", "end": "#b59b00", "stranded": "#9e9e9e", "ranks": "#808080", "hub": "#606060"}
_TEXT = {"stranded": "#555555", "ranks": "#444444"}
_ROWS = 18
"""Nodes per column before a layer wraps into another column."""
_WRAP = 44
"""Characters per line of a node's label."""
_FONT = 8
_GAP_Y = 0.18
_MARGIN = 0.4
_MAX_IN = 60.0
"""Largest side of the figure in inches: past it the drawing is scaled down as a whole."""


def layers(picture: dict[str, Any]) -> dict[str, int]:
    """Each node's column: 0 for the ends (culprits, other ends; what nothing else is waited
    for past), else one more than the farthest thing it waits for. A cycle among waiting
    nodes (never drawn by picture.py, but a report is input) is cut where it closes."""
    out_edges: dict[str, list[str]] = {}
    for e in picture["edges"]:
        out_edges.setdefault(e["src"], []).append(e["dst"])
    kinds = {n["id"]: n["kind"] for n in picture["nodes"]}
    layer: dict[str, int] = {}

    def depth(nid: str, seen: frozenset[str]) -> int:
        if nid in layer:
            return layer[nid]
        targets = [d for d in out_edges.get(nid, []) if d in kinds and d not in seen]
        if kinds.get(nid) in ("culprit", "end") or not targets:
            value = 0
        else:
            value = 1 + max(depth(d, seen | {nid}) for d in targets)
        layer[nid] = value
        return value

    for nid in kinds:
        depth(nid, frozenset())
    return layer


def _wrap(line: str, width: int = _WRAP) -> list[str]:
    """`line` in lines of at most `width` characters, broken after a space or a `/` (a path
    breaks between its folders, not inside a name), a longer piece cut where it must."""
    pieces = [p for p in re.split(r"(?<=[ /])", line) if p]
    out, current = [], ""
    for piece in pieces:
        while len(piece) > width:
            if current:
                out.append(current.rstrip())
                current = ""
            out.append(piece[:width])
            piece = piece[width:]
        if len(current) + len(piece.rstrip()) > width and current:
            out.append(current.rstrip())
            current = ""
        current += piece
    if current.strip() or not out:
        out.append(current.rstrip())
    return out


def _label(node: dict[str, Any]) -> str:
    return "\n".join(row for line in str(node["label"]).split("\n") for row in _wrap(line))


def _incoming_labels(picture: dict[str, Any]) -> dict[str, str]:
    """Per target node, the labels of the arrows into it: each once, with how many wait there."""
    by_dst: dict[str, dict[str, int]] = {}
    for e in picture["edges"]:
        if e["label"]:
            counts = by_dst.setdefault(e["dst"], {})
            counts[e["label"]] = counts.get(e["label"], 0) + 1
    out = {}
    for dst, counts in by_dst.items():
        shown = [textwrap.shorten(label, 60) + (f" ({n} waiting)" if n > 1 else "")
                 for label, n in list(counts.items())[:4]]
        if len(counts) > 4:
            shown.append(f"... {len(counts) - 4} more")
        out[dst] = "\n".join(shown)
    return out


def _columns(picture: dict[str, Any], layer: dict[str, int]) -> list[list[str]]:
    """The nodes of each layer in order (ends: blamed first; waiters: by the row of what they
    wait for, so arrows cross less), a layer past _ROWS nodes wrapped into several columns."""
    kinds = {n["id"]: n["kind"] for n in picture["nodes"]}
    out_edges: dict[str, list[str]] = {}
    for e in picture["edges"]:
        out_edges.setdefault(e["src"], []).append(e["dst"])
    order: dict[str, float] = {}
    columns: list[list[str]] = []
    for depth in range(max(layer.values(), default=-1) + 1):
        ids = [n["id"] for n in picture["nodes"] if layer[n["id"]] == depth]

        def key(nid: str) -> tuple[float, int, str]:
            rows = [order[d] for d in out_edges.get(nid, []) if d in order]
            first = {"culprit": 0, "end": 1, "hub": 2}.get(kinds[nid], 3)
            return (sum(rows) / len(rows) if rows else -1.0, first, nid)

        ids.sort(key=key if depth else (lambda nid: ({"culprit": 0, "end": 1}.get(kinds[nid], 2), nid)))
        for i, nid in enumerate(ids):
            order[nid] = float(i)
        columns += [ids[i: i + _ROWS] for i in range(0, len(ids), _ROWS)] or [[]]
    return [c for c in columns if c]


def _place(columns: list[list[str]], boxes: dict[str, tuple[float, float]],
           sides: dict[str, tuple[float, float]]) -> tuple[dict[str, tuple[float, float]], float, float]:
    """Each node's centre (inches), the drawing's width and the columns' height: a column as
    wide as its widest box plus the labels written right of its boxes, columns centred."""
    x, centres = _MARGIN, {}
    col_x = []
    heights = []
    for col in columns:
        width = max(boxes[n][0] for n in col)
        label_w = max((sides[n][0] for n in col if n in sides), default=0.0)
        col_x.append((x, width))
        rows = [max(boxes[n][1], sides.get(n, (0.0, 0.0))[1]) for n in col]
        heights.append(sum(rows) + _GAP_Y * (len(rows) - 1))
        x += width + label_w + 0.25 + 0.7
    tallest = max(heights, default=1.0)
    for (x0, width), col, height in zip(col_x, columns, heights, strict=True):
        y = _MARGIN + (tallest + height) / 2
        for nid in col:
            row = max(boxes[nid][1], sides.get(nid, (0.0, 0.0))[1])
            centres[nid] = (x0 + width / 2, y - row / 2)
            y -= row + _GAP_Y
    return centres, max(x - 0.7 + _MARGIN, 7.0), tallest


def _draw_graph(ax: Any, picture: dict[str, Any], nodes: dict[str, Any], centres: dict[str, tuple[float, float]],
                boxes: dict[str, tuple[float, float]], texts: dict[str, Any], side: dict[str, Any]) -> None:
    """The boxes at their centres (coloured by kind), their texts in them, the arrows between."""
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    patches = {}
    for nid, (cx, cy) in centres.items():
        w, h = boxes[nid]
        kind = nodes[nid]["kind"]
        style = "round,pad=0.02,rounding_size=0.12" if kind in ("stranded", "ranks") else "square,pad=0.02"
        patch = FancyBboxPatch((cx - w / 2, cy - h / 2), w, h, boxstyle=style, facecolor=_FILL.get(kind, "white"),
                               edgecolor=_EDGE.get(kind, "black"), linewidth=2.0 if kind == "culprit" else 1.0, zorder=2)
        ax.add_patch(patch)
        patches[nid] = patch
        texts[nid].set_position((cx, cy))
        if nid in side:
            side[nid].set_position((cx + w / 2 + 0.12, cy))
    for e in picture["edges"]:
        if e["src"] in patches and e["dst"] in patches:
            colour = "#cc0000" if nodes[e["dst"]]["kind"] == "culprit" else "#7f7f7f"
            ax.add_patch(FancyArrowPatch(centres[e["src"]], centres[e["dst"]], patchA=patches[e["src"]],
                                         patchB=patches[e["dst"]], arrowstyle="-|>", mutation_scale=9,
                                         color=colour, linewidth=0.8, alpha=0.7, zorder=1,
                                         connectionstyle="arc3,rad=0.25" if e["src"] == e["dst"] else "arc3,rad=0.0"))


def draw_picture(picture: dict[str, Any], path: str | Path, title: str = "") -> Path:
    """Draw `picture` (distdiag.hang.picture's model) to `path` (.png, .svg, .pdf)."""
    plt = pyplot("--graph FILE.png")

    nodes = {n["id"]: n for n in picture["nodes"]}
    layer = layers(picture)
    columns = _columns(picture, layer)
    incoming = _incoming_labels(picture)
    fig = plt.figure(figsize=(8, 6))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_axis_off()
    renderer = fig.canvas.get_renderer()

    def size(text: Any) -> tuple[float, float]:
        box = text.get_window_extent(renderer)
        return box.width / fig.dpi, box.height / fig.dpi

    texts, side = {}, {}
    for nid, node in nodes.items():
        texts[nid] = ax.text(0, 0, _label(node), fontsize=_FONT, ha="center", va="center", zorder=3,
                             color=_TEXT.get(node["kind"], "black"),
                             fontweight="bold" if node["kind"] == "culprit" else "normal")
        if nid in incoming:
            side[nid] = ax.text(0, 0, incoming[nid], fontsize=_FONT - 1, ha="left", va="center", zorder=3,
                                color="#333333", bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85,
                                                       "pad": 1.0})
    boxes = {nid: (w + 0.16, h + 0.12) for nid, (w, h) in ((nid, size(t)) for nid, t in texts.items())}
    sides = {nid: size(t) for nid, t in side.items()}
    legend = "red: the ranks blamed   yellow: other places ranks stopped   grey: ranks waiting on others"
    if picture.get("note"):
        legend += "\n" + textwrap.fill(str(picture["note"]), 110)
    heads = [ax.text(0, 0, textwrap.fill(title, 120), fontsize=_FONT + 2, fontweight="bold", va="top")] if title else []
    heads.append(ax.text(0, 0, "Wait-for graph: each arrow points from a waiting rank to what it waits for",
                         fontsize=_FONT + 1, va="top"))
    heads.append(ax.text(0, 0, legend, fontsize=_FONT, va="top", color="#444444"))
    head_sizes = [size(t) for t in heads]
    centres, total_w, body_h = _place(columns, boxes, sides)
    total_w = max(total_w, max(w for w, _h in head_sizes) + 2 * _MARGIN)
    total_h = body_h + sum(h + 0.1 for _w, h in head_sizes) + 0.3 + 2 * _MARGIN
    _draw_graph(ax, picture, nodes, centres, boxes, texts, side)
    top = total_h - _MARGIN
    for text, (_w, h) in zip(heads, head_sizes, strict=True):
        text.set_position((_MARGIN, top))
        top -= h + 0.1
    scale = min(1.0, _MAX_IN / max(total_w, total_h))
    fig.set_size_inches(total_w * scale, total_h * scale)
    ax.set_xlim(0, total_w)
    ax.set_ylim(0, total_h)
    if scale < 1.0:
        for t in ax.texts:
            t.set_fontsize(t.get_fontsize() * scale)
    return save_figure(fig, path, "--graph")
