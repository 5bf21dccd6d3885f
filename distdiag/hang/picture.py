"""A picture of the hang: the wait-for graph the verdict was drawn from, as DOT or Mermaid text.

The graph is the one the rules read (distdiag.hang.waitfor for live snapshots, the dump
frontier for flight-recorder dumps), turned into plain data a report can carry
(`details["wait_for_graph"]`) and `distdiag hang-report --graph FILE.dot|.mmd` writes (and
distdiag.hang.drawing draws as an image, for `--graph FILE.png|.svg`):

    {"nodes": [{"id": "r3", "label": "rank 3\\nis at data.py:58 in next_batch", "kind": "culprit"}, ...],
     "edges": [{"src": "r0", "dst": "r3", "label": "all_reduce #11 on ranks[0-3]"}, ...],
     "note": ""}

Node kinds: `culprit` (a rank at an end the program caused: the ranks the verdict blames),
`end` (a stall or desync below the program, or a rank at an end not blamed), `stranded` (a
rank waiting on others), `hub` (a collective many members never entered: its waiters point at
it, it points at those members), `ranks` (stranded ranks drawn as one node past
MAX_RANK_NODES ranks). Past MAX_RANK_NODES ranks the stranded ranks are drawn one node per
end they wait on (their chains are in the report's findings): a 16k-rank picture is still a
picture. Pure and torch-free.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from distdiag.report.render import format_ranks

__all__ = ["MAX_RANK_NODES", "picture_of_graph", "picture_of_dumps", "to_dot", "to_mermaid", "graph_text", "hang_extras"]

MAX_RANK_NODES = 128
"""Ranks drawn one node each; past this, stranded ranks are drawn as one node per end."""
LABEL_MAX = 120
"""Characters of a node's or an edge's label kept (the report has the rest)."""


def _cut(text: str) -> str:
    text = "\n".join(" ".join(line.split()) for line in str(text).splitlines())
    return text if len(text) <= LABEL_MAX else text[: LABEL_MAX - 3] + "..."


class _Drawing:
    """The nodes and edges drawn so far (a node once, by id)."""

    def __init__(self) -> None:
        self.nodes: dict[str, dict[str, Any]] = {}
        self.edges: list[dict[str, str]] = []

    def node(self, nid: str, label: str, kind: str) -> str:
        if nid not in self.nodes:
            self.nodes[nid] = {"id": nid, "label": _cut(label), "kind": kind}
        return nid

    def edge(self, src: str, dst: str, label: str = "") -> None:
        self.edges.append({"src": src, "dst": dst, "label": _cut(label)})


End_ = tuple[str, list[int], str, list[tuple[int, int, str]]]
"""An end read into plain parts: (kind, ranks, text, the cycle's edges as (src, dst, label))."""


def _draw_ends(d: _Drawing, ends: list[End_], culprits: set[int]) -> list[list[str]]:
    """Each end's nodes: a stall or a desync (or many ranks) one node; a deadlock its ranks and
    their cycle; else each rank at it, red when blamed."""
    out = []
    for i, (kind, ranks, text, cycle) in enumerate(ends):
        if kind in ("stall", "mismatch", "fresh") or (kind != "deadlock" and len(ranks) > 8):
            out.append([d.node(f"e{i}", f"{format_ranks(ranks)}: {text}", "end")])
            continue
        ids = []
        for r in ranks:
            kind_of = "culprit" if r in culprits else "end"
            if kind == "deadlock":
                ids.append(d.node(f"r{r}", f"rank {r} (in a deadlock)", kind_of))
            else:
                own = text[len(f"rank {r} "):] if text.startswith(f"rank {r} ") else text
                ids.append(d.node(f"r{r}", f"rank {r}\n{own}" if len(ranks) == 1 else f"rank {r}: {text}", kind_of))
        for src, dst, label in cycle:
            d.edge(f"r{src}", f"r{dst}", label)
        out.append(ids)
    return out


def _draw_waits(d: _Drawing, edges: dict[int, list[tuple[int, str]]], hub_label: dict[int, str]) -> None:
    """Every waiting rank with an arrow to each rank it waits for (or to its collective's hub)."""
    waiting = sorted(r for r in edges if r >= 0)
    for r in waiting:
        d.node(f"r{r}", f"rank {r} (waiting)", "stranded")
    hubs = set()
    for src in waiting:
        for dst, label in edges[src]:
            if dst < 0:
                hubs.add(dst)
                d.edge(f"r{src}", f"h{-dst}")
            else:
                d.edge(f"r{src}", d.node(f"r{dst}", f"rank {dst}", "end"), label)
    for hub in sorted(hubs, reverse=True):
        members = [dst for dst, _l in edges.get(hub, [])]
        d.node(f"h{-hub}", f"{hub_label.get(hub, '')}: {len(members)} never entered", "hub")
        for m in members:
            d.edge(f"h{-hub}", d.node(f"r{m}", f"rank {m}", "end"))


def _picture(ends: list[End_], culprits: set[int], edges: dict[int, list[tuple[int, str]]],
             stranded_end: dict[int, int], hub_label: dict[int, str]) -> dict[str, Any]:
    """The picture from a graph read into plain parts: `edges` src -> [(dst, label)] (negative
    ids: hubs), `stranded_end` stranded rank -> its end's index in `ends`."""
    d = _Drawing()
    end_nodes = _draw_ends(d, ends, culprits)
    everyone = {r for _k, ranks, _t, _c in ends for r in ranks} | {r for r in edges if r >= 0}
    note = ""
    if len(everyone) <= MAX_RANK_NODES:
        _draw_waits(d, edges, hub_label)
    else:
        by_end: dict[int, list[int]] = {}
        for r, i in sorted(stranded_end.items()):
            by_end.setdefault(i, []).append(r)
        for i, ranks in sorted(by_end.items()):
            nid = d.node(f"s{i}", f"{format_ranks(ranks)} ({len(ranks)} stranded)", "ranks")
            for dst in end_nodes[i]:
                d.edge(nid, dst, "wait, through chains of waits")
        note = (f"{len(everyone)} ranks: the stranded ones are drawn as one node per end they wait on "
                "(each one's chain is in the report)")
    unique = list({(e["src"], e["dst"], e["label"]): e for e in d.edges}.values())
    return {"nodes": list(d.nodes.values()), "edges": unique, "note": note}


def picture_of_graph(graph: Any) -> dict[str, Any]:
    """The picture of a live wait-for graph (distdiag.hang.waitfor.WaitGraph)."""
    ends = [(e.kind, list(e.ranks), e.text, [(c.src, c.dst, c.wait.label) for c in e.cycle]) for e in graph.ends]
    index = {id(e): i for i, e in enumerate(graph.ends)}
    stranded_end = {r: index[id(graph.end_of[r])] for r in graph.stranded if id(graph.end_of.get(r)) in index}
    edges = {src: [(e.dst, e.wait.label) for e in es] for src, es in graph.edges.items()}
    hub_label = {src: es[0].wait.label for src, es in graph.edges.items() if src < 0 and es}
    return _picture(ends, set(graph.culprits()), edges, stranded_end, hub_label)


_DUMP_END = {"no_dump": "left no dump", "stale": "its completions were not discovered (stale)", "idle": "is not inside any collective",
             "not_started": "never started the collective", "fresh": "was still in flight", "stall": "every member entered, none completed",
             "mismatch": "members recorded different collectives", "deadlock": "in a deadlock"}


def picture_of_dumps(attribution: Any) -> dict[str, Any]:
    """The picture of a dumped job's wait-for graph (distdiag.hang.frontier.Attribution)."""
    ends = []
    for e in attribution.ends:
        text = _DUMP_END.get(e.kind, e.kind)
        if e.step is not None and e.kind in ("stall", "mismatch", "fresh", "not_started"):
            text = f"{text} ({e.step.text})"
        ends.append((e.kind, list(e.ranks), text, [(c.src, c.dst, c.step.text) for c in e.cycle]))
    index = {id(e): i for i, e in enumerate(attribution.ends)}
    stranded_end = {r: index[id(attribution.end_of[r])] for r in attribution.chains
                    if id(attribution.end_of.get(r)) in index}
    edges = {src: [(e.dst, f"{e.step.text}" + (" (queued behind older work)" if e.kind == "queued" else ""))
                   for e in es] for src, es in attribution.edges.items()}
    return _picture(ends, set(attribution.culprits()), edges, stranded_end, {})


_STYLE = {"culprit": 'shape=box, style="filled,bold", fillcolor="#f4cccc", color="#cc0000"',
          "end": 'shape=box, style=filled, fillcolor="#fff2cc"',
          "stranded": "shape=ellipse",
          "ranks": 'shape=folder, style=filled, fillcolor="#eeeeee"',
          "hub": 'shape=diamond, style=filled, fillcolor="#dddddd"'}


def _dot_text(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def to_dot(picture: dict[str, Any]) -> str:
    """Graphviz DOT: `dot -Tsvg hang.dot > hang.svg`. Edges point from a waiting rank to the
    ranks it waits for; the blamed ranks are red boxes."""
    lines = ["digraph wait_for {", "  rankdir=LR;", '  node [fontname="Helvetica", fontsize=10];',
             '  edge [fontname="Helvetica", fontsize=9];']
    if picture.get("note"):
        lines.append(f'  label="{_dot_text(picture["note"])}"; labelloc=t;')
    for n in picture["nodes"]:
        lines.append(f'  {n["id"]} [label="{_dot_text(n["label"])}", {_STYLE.get(n["kind"], "")}];')
    for e in picture["edges"]:
        label = f' [label="{_dot_text(e["label"])}"]' if e["label"] else ""
        lines.append(f'  {e["src"]} -> {e["dst"]}{label};')
    lines.append("}")
    return "\n".join(lines) + "\n"


_MERMAID_UNSAFE = re.compile(r'["<>{}\[\]|#;`]')


def _mermaid_text(text: str) -> str:
    return _MERMAID_UNSAFE.sub(lambda m: f"#{ord(m.group(0))};", text).replace("\n", "<br/>")


def to_mermaid(picture: dict[str, Any]) -> str:
    """Mermaid flowchart text (GitHub and GitLab render it in a ```mermaid block)."""
    lines = ["flowchart LR"]
    if picture.get("note"):
        lines.append(f"  %% {' '.join(picture['note'].split())}")
    shapes = {"culprit": ('["', '"]'), "end": ('["', '"]'), "stranded": ('("', '")'), "ranks": ('[["', '"]]'),
              "hub": ('{"', '"}')}
    for n in picture["nodes"]:
        left, right = shapes.get(n["kind"], ('["', '"]'))
        lines.append(f"  {n['id']}{left}{_mermaid_text(n['label'])}{right}")
    for e in picture["edges"]:
        label = f'|"{_mermaid_text(e["label"])}"|' if e["label"] else ""
        lines.append(f"  {e['src']} -->{label} {e['dst']}")
    lines.append("  classDef culprit fill:#f4cccc,stroke:#cc0000,stroke-width:2px")
    lines.append("  classDef atend fill:#fff2cc")
    culprits = [n["id"] for n in picture["nodes"] if n["kind"] == "culprit"]
    ends = [n["id"] for n in picture["nodes"] if n["kind"] == "end"]
    if culprits:
        lines.append(f"  class {','.join(culprits)} culprit")
    if ends:
        lines.append(f"  class {','.join(ends)} atend")
    return "\n".join(lines) + "\n"


def graph_text(picture: dict[str, Any], path: str) -> str:
    """DOT for a path ending .dot or .gv, Mermaid for .mmd or .mermaid; ValueError otherwise."""
    lower = path.lower()
    if lower.endswith((".dot", ".gv")):
        return to_dot(picture)
    if lower.endswith((".mmd", ".mermaid")):
        return to_mermaid(picture)
    raise ValueError(f"--graph: {path} must end in .dot or .gv (Graphviz), .mmd (Mermaid), "
                     "or .png, .svg, .pdf (an image; needs matplotlib)")


def hang_extras(findings: list[Any], views: dict[int, Any], lost: Mapping[int, str], errors: dict[int, dict[str, Any]],
                world: int, graph: Any = None) -> dict[str, Any]:
    """What a live hang report's details carry for programs: `wait_for_graph` (the graph the
    rules read, built again from the same views: rules.Analysis keeps it to itself) and
    `culprit_locations` (the places the findings name, as fields; distdiag.hang.views).
    `graph`: the one the rules read (analyze_hang's `keep`), not built a second time."""
    from distdiag.hang.views import culprit_locations
    from distdiag.hang.waitfor import build_graph, nodes_from_views

    if graph is None:
        graph = build_graph(nodes_from_views(views, lost, errors, world), world)
    return {"wait_for_graph": picture_of_graph(graph), "culprit_locations": culprit_locations(findings, views)}
