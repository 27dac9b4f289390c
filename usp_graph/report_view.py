"""The train step as a picture: attention sites and collectives in lanes, for ``inspect --html``.

`step(gm, summary)` reads a graph and its `usp_graph.analysis.summarize` result into plain data:
one lane per attention site (a layer's attention and the collectives its rewrite added, in
forward then backward order), each event with its phase, bytes, shapes and source line, the
forward/backward pairs (the summary's pairing, which is `usp_graph.passes.pairing`'s: nothing is
paired a second time here), the collectives on the critical path, and the alarms (an SDPA left
unrewritten, a forward op whose backward is missing) with their reasons.

`render(view, key=...)` draws that data as inline SVG inside one HTML fragment: an overview with
one row per lane on a shared time axis (the step's staircase: sites forward left to right, then
backward in reverse), then one collapsible detail lane per site with a box per event and an arc
per pair. `PAGE_HEAD` holds the page's CSS and its one small script (click for details, hover to
show the pair, expand or collapse the lanes); the script records any error it hits in the ``html``
element's ``data-script-errors`` attribute, so a browser test can read it back. No network, no
external files.
"""

from __future__ import annotations

import bisect
import html
from dataclasses import dataclass
from typing import Any

from torch import fx

from .analysis import (
    _COMM_OPS_SET,
    _SDPA_NAMES,
    _collective_bytes,
    _fmt,
    _shape,
    _target_name,
    _usp_name,
    human_bytes,
)
from .sites import source_location

__all__ = ["step", "render", "PAGE_HEAD", "page_script"]

_ATTENTION_OPS = frozenset({"varlen_fwd", "varlen_bwd", "ring_attn_fwd", "ring_attn_bwd"})
_NO_SITE = "(no attention site)"
# Lanes open on the page when the whole step is this small; bigger steps start collapsed.
_OPEN_LANES, _OPEN_EVENTS = 4, 160


def _kind(node: fx.Node) -> str | None:
    u = _usp_name(node)
    if u in _ATTENTION_OPS:  # ring attention communicates too: it carries bytes (`_sends`)
        return "attention"
    if u in _COMM_OPS_SET:
        return "collective"
    if node.op == "call_function" and any(x in _target_name(node) for x in _SDPA_NAMES):
        return "sdpa"
    return None


def _short_op(node: fx.Node) -> str:
    u = _usp_name(node)
    return u if u is not None else _target_name(node).rsplit(".", 2)[0].split(".")[-1]


def _shapes(nodes: list[Any], names: dict[str, str]) -> list[str]:
    out = []
    for x in nodes:
        s = _shape(x)
        if s is not None:
            out.append("(" + ", ".join(str(_fmt(d, names)) for d in s) + ")")
    return out


def _out_shapes(node: fx.Node, names: dict[str, str]) -> list[str]:
    v = node.meta.get("val")
    return _shapes(list(v) if isinstance(v, (tuple, list)) else [v], names)


def step(
    gm: fx.GraphModule, summary: dict[str, Any], *, symbols: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The picture's data: lanes of events, pairs, alarms (JSON-able; see the module docstring).

    summary: `analysis.summarize(gm, ...)` (its bytes carry ``--values`` when it was given them).
    symbols: {readable name: SymInt}, as given to summarize, to show sizes as ``T`` not ``s27``.
    """
    ix = _Index.of(gm, summary, symbols)
    drawn_sources: set[str] = set()
    events = [
        ev for order, node in enumerate(gm.graph.nodes) if (ev := _node_event(order, node, ix, drawn_sources))
    ]
    _assign_sites(events, ix.by_name)
    lanes: dict[str, dict[str, Any]] = {}
    for ev in events:
        site = ev.pop("site") or _NO_SITE
        lanes.setdefault(site, {"site": site, "events": []})["events"].append(ev)
    for ev in _kept_site_events(summary, ix.by_name, drawn_sources):
        lanes.setdefault(ev["node"], {"site": ev["node"], "events": []})["events"].append(ev)
        events.append(ev)
    ranked = sorted((e for e in events if e["order"] >= 0), key=lambda e: e["order"])
    for rank, e in enumerate(ranked):
        e["rank"] = rank
    for e in events:
        e.setdefault("rank", None)
    first_bwd = next((e["rank"] for e in ranked if e["phase"] == "backward"), None)
    return {
        "lanes": _lane_records(lanes, summary),
        "events": len(events),
        "timeline": len(ranked),
        "first_backward": first_bwd,
        "pairs": [(p["forward"], b) for p in summary["pairing"] for b in p["backward"]],
        "alarms": [{"node": e["node"], "reason": e["alarm"]} for e in events if e["alarm"]],
        "critical": sorted(ix.critical),
        "nodes": summary["nodes"],
    }


@dataclass
class _Index:
    """The summary's records by node name, for drawing the graph's nodes."""

    names: dict[str, str]  # a SymInt's text -> its readable name
    by_name: dict[str, fx.Node]
    coll: dict[str, dict[str, Any]]
    critical: set[str]
    unpaired: dict[str, dict[str, Any]]
    pair_of: dict[str, list[str]]
    not_rewritten: dict[str, dict[str, Any]]
    kept_reason: dict[str, Any]

    @classmethod
    def of(cls, gm: fx.GraphModule, summary: dict[str, Any], symbols: dict[str, Any] | None) -> _Index:
        pair_of: dict[str, list[str]] = {}
        for p in summary["pairing"]:
            pair_of[p["forward"]] = list(p["backward"])
            for b in p["backward"]:
                pair_of.setdefault(b, []).append(p["forward"])
        by_name = {n.name: n for n in gm.graph.nodes}
        # a kept site's record (the tracer's, or a compile dump manifest's) names the node before the
        # joint graph was made; the graph's SDPA nodes (forward and backward) share its source line
        kept_reason = {a.get("source"): a.get("reason") for a in summary["attention"]
                       if not a["rewritten"] and a["node"] not in by_name and a.get("source")}  # fmt: skip
        return cls(
            names={str(v): k for k, v in (symbols or {}).items()},
            by_name=by_name,
            coll={c["node"]: c for c in summary["collectives"]},
            critical=set(summary.get("critical_path_comm") or ()),
            unpaired={u["node"]: u for u in summary["unpaired"]},
            pair_of=pair_of,
            not_rewritten={a["node"]: a for a in summary["attention"] if not a["rewritten"]},
            kept_reason=kept_reason,
        )


def _node_event(order: int, node: fx.Node, ix: _Index, drawn_sources: set[str]) -> dict[str, Any] | None:
    """The event of one graph node (None: not drawn), with its site, shapes, pair and alarm."""
    kind = _kind(node)
    if kind is None and node.name not in ix.pair_of and node.name not in ix.unpaired:
        return None
    kind = kind or "op"
    site = node.meta.get("usp_site")
    if not site:
        owner = ix.by_name.get(node.meta.get("usp_fwd_node") or "")
        site = owner.meta.get("usp_site") if owner is not None else None
    src = source_location(node) or str(node.meta.get("source") or "")
    if not site and kind == "sdpa":
        site = f"sdpa at {src.rsplit('/', 1)[-1]}" if src else node.name
        drawn_sources.add(src)
    ev: dict[str, Any] = {
        "node": node.name,
        "op": _short_op(node),
        "target": _target_name(node),
        "kind": kind,
        "phase": node.meta.get("usp_phase") or "",
        "order": order,
        "source": src,
        "in_shapes": _shapes(list(node.all_input_nodes), ix.names),
        "out_shapes": _out_shapes(node, ix.names),
        "critical": node.name in ix.critical,
        "pair": [p for p in ix.pair_of.get(node.name, []) if p in ix.by_name],
        "pair_elsewhere": [p for p in ix.pair_of.get(node.name, []) if p not in ix.by_name],
        "alarm": None,
        "site": site,
    }
    if node.name in ix.coll:
        c = ix.coll[node.name]
        symbolic = _fmt(_collective_bytes(node)[0], ix.names)
        ev.update(bytes=c.get("bytes_per_rank"), bytes_symbolic=symbolic, group=c.get("group"),
                  group_size=c.get("group_size"))  # fmt: skip
    if node.name in ix.unpaired:
        ev["alarm"] = f"unpaired: {ix.unpaired[node.name]['missing']}"
    if kind == "sdpa":
        reason = (
            ix.kept_reason.get(src)
            or ix.not_rewritten.get(node.name, {}).get("reason")
            or "SDPA left in the graph"
        )
        ev["alarm"] = f"not rewritten: {reason}"
    return ev


def _kept_site_events(
    summary: dict[str, Any], by_name: dict[str, fx.Node], drawn_sources: set[str]
) -> list[dict[str, Any]]:
    """Events for the sites kept as SDPA that left no node in the graph (the tracer's records)."""
    out = []
    for a in summary["attention"]:
        if a["rewritten"] or a["node"] in by_name or (a.get("source") and a["source"] in drawn_sources):
            continue
        name = a["node"] or "sdpa"
        ev = {"node": name, "op": "sdpa", "target": a.get("op", "sdpa"), "kind": "sdpa", "phase": "forward",
              "order": -1, "source": a.get("source") or "", "in_shapes": [], "out_shapes": [],
              "critical": False, "pair": [], "pair_elsewhere": [],
              "alarm": f"not rewritten: {a.get('reason') or 'kept as SDPA'}"}  # fmt: skip
        if a.get("q_shape"):
            ev["in_shapes"] = ["q (" + ", ".join(str(d) for d in a["q_shape"]) + ")"]
        out.append(ev)
    return out


def _lane_records(lanes: dict[str, dict[str, Any]], summary: dict[str, Any]) -> list[dict[str, Any]]:
    """One record per lane (an attention site): its events, forward then backward, each in graph order."""
    attention_of = {a.get("site") or a["node"]: a for a in summary["attention"] if a["rewritten"]}
    out_lanes = []
    for i, lane in enumerate(lanes.values()):
        evs = lane["events"]
        fwd = [e for e in evs if e["phase"] != "backward"]
        bwd = [e for e in evs if e["phase"] == "backward"]
        lane_events = fwd + bwd  # graph order within each phase
        a = attention_of.get(lane["site"], {})
        src = next((e["source"] for e in lane_events if e["source"]), "") or a.get("source") or ""
        out_lanes.append(
            {
                "index": i,
                "site": lane["site"],
                "source": src,
                "strategy": a.get("strategy", ""),
                "events": lane_events,
                "alarms": sum(1 for e in lane_events if e["alarm"]),
            }
        )
    return out_lanes


def _assign_sites(events: list[dict[str, Any]], by_name: dict[str, fx.Node]) -> None:
    """A site for the events whose nodes carry no ``usp_site`` (a torch.compile dump's graphs):
    an attention op's site is its forward op's name, and any other op goes with the attention op
    nearest to it in graph order within its phase (a site's collectives surround its attention).
    A binary search over the attention ops' order: O(n log n), not a scan per event."""
    attn = [e for e in events if e["kind"] == "attention" and not e["site"]]
    for e in attn:
        e["site"] = by_name[e["node"]].meta.get("usp_fwd_node") or e["node"]
    by_phase: dict[str, list[dict[str, Any]]] = {}
    for a in sorted(attn, key=lambda a: a["order"]):
        by_phase.setdefault(a["phase"], []).append(a)
    every = sorted(attn, key=lambda a: a["order"])
    orders = {phase: [a["order"] for a in group] for phase, group in by_phase.items()}
    every_orders = [a["order"] for a in every]
    for e in events:
        if e["site"]:
            continue
        near, at = (
            (by_phase[e["phase"]], orders[e["phase"]]) if e["phase"] in by_phase else (every, every_orders)
        )
        if not near:
            continue
        i = bisect.bisect_left(at, e["order"])
        # the nearest is at i or i - 1; on a tie the earlier one, as min() over graph order chose
        best = min(
            (j for j in (i - 1, i) if 0 <= j < len(near)), key=lambda j: (abs(at[j] - e["order"]), at[j])
        )
        e["site"] = near[best]["site"]


# ---- drawing ------------------------------------------------------------------------------------

_COLORS = {
    "all_to_all": "#4c8bd6",
    "all_gather": "#2aa198",
    "reduce_scatter": "#8a6bd1",
    "halo_exchange": "#3fa34d",
    "halo_reduce": "#6bbf59",
    "ring_attn_fwd": "#e0a800",
    "ring_attn_bwd": "#d07a00",
    "varlen_fwd": "#e8b923",
    "varlen_bwd": "#e08a1e",
}
_ALARM = "#d62728"
_LABEL_W = 230  # overview row labels
_BOX_W, _BOX_H, _GAP = 112, 58, 10


def _color(ev: dict[str, Any]) -> str:
    if ev["alarm"]:
        return _ALARM
    return _COLORS.get(ev["op"], "#9e9e9e")


def _e(s: Any) -> str:
    return html.escape("" if s is None else str(s), quote=True)


def _sends(ev: dict[str, Any]) -> bool:
    """Whether the event communicates (a collective, or ring attention): it has a bytes count."""
    return "bytes_symbolic" in ev


def _bytes_text(ev: dict[str, Any]) -> str:
    """Numeric bytes when known (``--values``), else the symbolic count."""
    b = ev.get("bytes")
    if isinstance(b, int):
        return human_bytes(b)
    sym = ev.get("bytes_symbolic")
    return human_bytes(sym if sym is not None else b)


def _data_attrs(ev: dict[str, Any], key: str) -> str:
    attrs = {
        "data-node": ev["node"],
        "data-kind": ev["kind"],
        "data-op": ev["op"],
        "data-target": ev["target"],
        "data-phase": ev["phase"],
        "data-source": ev["source"],
        "data-in-shapes": " ".join(ev["in_shapes"]),
        "data-out-shapes": " ".join(ev["out_shapes"]),
        "data-pair": " ".join(ev["pair"]),
        "data-section": key,
    }
    if ev["pair_elsewhere"]:
        attrs["data-pair-elsewhere"] = " ".join(ev["pair_elsewhere"])
    if _sends(ev):
        attrs["data-bytes"] = "" if ev.get("bytes") is None else str(ev["bytes"])
        attrs["data-bytes-symbolic"] = "" if ev.get("bytes_symbolic") is None else str(ev["bytes_symbolic"])
        attrs["data-group"] = "" if ev.get("group") is None else str(ev["group"])
    if ev["critical"]:
        attrs["data-critical"] = "1"
    if ev["alarm"]:
        attrs["data-alarm"] = ev["alarm"]
    return " ".join(f'{k}="{_e(v)}"' for k, v in attrs.items())


def _tooltip(ev: dict[str, Any]) -> str:
    lines = [f"{ev['node']} ({ev['target']}), {ev['phase'] or 'no phase'}"]
    if _sends(ev):
        lines.append(f"bytes sent per rank: {_bytes_text(ev)} (symbolic: {ev.get('bytes_symbolic')})")
    if ev["alarm"]:
        lines.append("ALARM: " + ev["alarm"])
    if ev["critical"]:
        lines.append("on the critical path")
    if ev["pair"] or ev["pair_elsewhere"]:
        lines.append("paired with " + ", ".join(ev["pair"] + ev["pair_elsewhere"]))
    if ev["source"]:
        lines.append(ev["source"])
    if ev["in_shapes"]:
        lines.append("in " + " ".join(ev["in_shapes"]))
    if ev["out_shapes"]:
        lines.append("out " + " ".join(ev["out_shapes"]))
    return "\n".join(lines)


def _short_source(src: str) -> str:
    return src.rsplit("/", 1)[-1]


def _lane_title(lane: dict[str, Any]) -> str:
    bits = [f"site {lane['index']}: {lane['site']}"]
    if lane["strategy"]:
        bits.append(lane["strategy"])
    if lane["source"]:
        bits.append(_short_source(lane["source"]))
    return " · ".join(bits)


def _overview(view: dict[str, Any], key: str) -> str:
    """One row per lane on the step's shared time axis: every event a tick at its place in graph order."""
    n = max(view["timeline"], 1)
    row_h, top = 18, 22
    plot_w = max(480, min(1100, n * 14))
    width = _LABEL_W + plot_w + 10
    height = top + row_h * len(view["lanes"]) + 8
    tick = max(2.0, min(12.0, plot_w / n - 1))

    def x(rank: int) -> float:
        return _LABEL_W + rank * plot_w / n

    out = [f'<svg class="overview" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="step overview">']  # fmt: skip
    fb = view["first_backward"]
    if fb is not None:
        out.append(f'<rect x="{x(fb):.1f}" y="{top - 4}" width="{_LABEL_W + plot_w - x(fb):.1f}" '
                   f'height="{height - top}" class="bwd-bg"/>')  # fmt: skip
        out.append(f'<text x="{x(fb) + 4:.1f}" y="14" class="axis">backward →</text>')
    if fb != 0:
        out.append(f'<text x="{_LABEL_W + 4}" y="14" class="axis">forward →</text>')
    for i, lane in enumerate(view["lanes"]):
        y = top + i * row_h
        label = _lane_title(lane)
        short = f"{lane['index']}: {lane['site']}".replace("scaled_dot_product_attention", "sdpa")
        short = short if len(short) <= 30 else short[:29] + "…"
        cls = "lane-row alarm-row" if lane["alarms"] else "lane-row"
        out.append(f'<g class="{cls}" data-lane="{key}-lane{lane["index"]}">')
        out.append(f'<text x="4" y="{y + 12}" class="row-label">{_e(short)}<title>{_e(label)}</title></text>')
        out.append(
            f'<line x1="{_LABEL_W}" x2="{_LABEL_W + plot_w}" y1="{y + 8}" y2="{y + 8}" class="row-line"/>'
        )
        for ev in lane["events"]:
            if ev["rank"] is None:  # a site kept as SDPA without a node: a mark at the row's start
                xx = _LABEL_W
            else:
                xx = x(ev["rank"])
            stroke = ' stroke="#222" stroke-width="1.5"' if ev["critical"] else ""
            out.append(f'<rect class="tick" x="{xx:.1f}" y="{y + 2}" width="{tick:.1f}" height="12" '
                       f'fill="{_color(ev)}"{stroke} data-ref="{_e(key)}:{_e(ev["node"])}">'
                       f'<title>{_e(_tooltip(ev))}</title></rect>')  # fmt: skip
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


def _lane_svg(lane: dict[str, Any], key: str) -> str:
    """A site's events as boxes, forward then backward, with an arc from each forward op to its backward."""
    evs = lane["events"]
    n_fwd = sum(1 for e in evs if e["phase"] != "backward")
    split = 40 if 0 < n_fwd < len(evs) else 0
    pos: dict[str, float] = {}
    for i, ev in enumerate(evs):
        pos[ev["node"]] = 10 + i * (_BOX_W + _GAP) + (split if i >= n_fwd else 0)
    width = int(20 + len(evs) * (_BOX_W + _GAP) + split)

    def lift(x1: float, x2: float) -> float:
        return 16 + abs(x2 - x1) * 0.08

    arc_h = 8 + max((lift(pos[e["node"]], pos[b]) for e in evs for b in e["pair"] if b in pos), default=0)
    box_y = arc_h + 8
    height = box_y + _BOX_H + 42
    out = [f'<svg class="lane" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" data-lane="{key}-lane{lane["index"]}" data-site="{_e(lane["site"])}">']  # fmt: skip
    if split:
        bx = pos[evs[n_fwd]["node"]] - split / 2 - _GAP / 2
        out.append(f'<rect x="{bx:.1f}" y="0" width="{width - bx:.1f}" height="{height}" class="bwd-bg"/>')
        out.append(f'<text x="{bx + 6:.1f}" y="{height - 6}" class="axis">backward</text>')
    if n_fwd:
        out.append(f'<text x="10" y="{height - 6}" class="axis">forward</text>')
    else:
        out.append(f'<text x="10" y="{height - 6}" class="axis">backward</text>')
    for ev in evs:  # arcs first, under the boxes
        for b in ev["pair"]:
            if ev["phase"] == "backward" or b not in pos:
                continue
            x1, x2 = pos[ev["node"]] + _BOX_W / 2, pos[b] + _BOX_W / 2
            h = lift(x1, x2)
            out.append(f'<path class="pair" d="M{x1:.1f},{box_y} C{x1:.1f},{box_y - h:.1f} {x2:.1f},{box_y - h:.1f} '
                       f'{x2:.1f},{box_y}" data-forward="{_e(ev["node"])}" data-backward="{_e(b)}" '
                       f'data-section="{_e(key)}"/>')  # fmt: skip
    for ev in evs:
        x0 = pos[ev["node"]]
        cls = "ev" + (" alarm" if ev["alarm"] else "") + (" critical" if ev["critical"] else "")
        line2, line3 = ev["phase"] or "", ""
        if _sends(ev):  # bytes sent per rank: the symbolic count, and its value when known
            sym, num = ev.get("bytes_symbolic"), ev.get("bytes")
            line2 = human_bytes(sym if sym is not None else num)
            line3 = f"= {human_bytes(num)}" if isinstance(num, int) and not isinstance(sym, int) else ""
        if ev["alarm"]:
            line2 = "UNPAIRED" if ev["alarm"].startswith("unpaired") else "NOT REWRITTEN"
        out.append(f'<g class="{cls}" tabindex="0" {_data_attrs(ev, key)}>')
        out.append(f"<title>{_e(_tooltip(ev))}</title>")
        out.append(
            f'<rect x="{x0:.1f}" y="{box_y}" width="{_BOX_W}" height="{_BOX_H}" rx="5" fill="{_color(ev)}"/>'
        )
        out.append(f'<text x="{x0 + 6:.1f}" y="{box_y + 17}" class="ev-op">{_e(ev["op"][:17])}</text>')
        out.append(f'<text x="{x0 + 6:.1f}" y="{box_y + 34}" class="ev-sub">{_e(line2[:17])}</text>')
        if line3:
            out.append(f'<text x="{x0 + 6:.1f}" y="{box_y + 50}" class="ev-sub">{_e(line3[:17])}</text>')
        if ev["critical"]:
            out.append(f'<text x="{x0 + _BOX_W - 14:.1f}" y="{box_y + _BOX_H - 6}" class="ev-crit">★</text>')
        if ev["pair_elsewhere"]:
            out.append(f'<text x="{x0 + 4:.1f}" y="{box_y + _BOX_H + 14}" class="ev-note">'
                       f'↔ {_e(ev["pair_elsewhere"][0][:16])} (other file)</text>')  # fmt: skip
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


def render(view: dict[str, Any], *, key: str = "g0", open_lanes: int = _OPEN_LANES) -> str:
    """The picture of `step`'s data as an HTML fragment; `key` keeps ids unique across sections.
    The detail lanes start open when there are at most `open_lanes` of them (and few events)."""
    lanes = view["lanes"]
    n_coll = sum(1 for ln in lanes for e in ln["events"] if _sends(e))
    n_sites = sum(1 for ln in lanes if any(e["kind"] in ("attention", "sdpa") for e in ln["events"]))
    is_open = len(lanes) <= open_lanes and view["events"] <= _OPEN_EVENTS
    out = [f'<div class="step" id="{_e(key)}" data-sites="{n_sites}" data-collectives="{n_coll}" '
           f'data-pairs="{len(view["pairs"])}" data-alarms="{len(view["alarms"])}">']  # fmt: skip
    out.append(
        f'<p class="stats">{n_sites} attention site(s), {n_coll} collective(s), {len(view["pairs"])} '
        f"forward/backward link(s), {len(view['critical'])} collective(s) on the critical path (★), "
        f"{view['nodes']} graph nodes. Click a box for its node, source line and shapes; hover to see its pair.</p>"
    )
    if view["alarms"]:
        out.append('<div class="alarms"><b>Alarms</b><ul>')
        for a in view["alarms"]:
            out.append(
                f'<li data-alarm-node="{_e(a["node"])}"><code>{_e(a["node"])}</code>: {_e(a["reason"])}</li>'
            )
        out.append("</ul></div>")
    out.append(_legend())
    out.append('<div class="scroll">' + _overview(view, key) + "</div>")
    out.append('<p class="controls"><button type="button" data-action="expand">expand all lanes</button> '
               '<button type="button" data-action="collapse">collapse all lanes</button></p>')  # fmt: skip
    for lane in lanes:
        alarm = f' <span class="bad">{lane["alarms"]} alarm(s)</span>' if lane["alarms"] else ""
        n_c = sum(1 for e in lane["events"] if _sends(e))
        out.append(
            f'<details class="lane-details" id="{_e(key)}-lane{lane["index"]}"{" open" if is_open else ""}>'
            f"<summary>{_e(_lane_title(lane))} — {len(lane['events'])} ops, {n_c} collectives{alarm}</summary>"
            f'<div class="scroll">{_lane_svg(lane, key)}</div></details>'
        )
    out.append('<div class="info" hidden></div>')
    out.append("</div>")
    return "\n".join(out)


def _legend() -> str:
    items = [("all_to_all", _COLORS["all_to_all"]), ("all_gather", _COLORS["all_gather"]),
             ("reduce_scatter", _COLORS["reduce_scatter"]), ("halo", _COLORS["halo_exchange"]),
             ("varlen / ring attention", _COLORS["varlen_fwd"]), ("alarm", _ALARM)]  # fmt: skip
    sw = "".join(f'<span class="sw" style="background:{c}"></span>{_e(t)} ' for t, c in items)
    return f'<p class="legend">{sw}<span class="sw crit-sw"></span>critical path ★</p>'


PAGE_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin-bottom:1.5em}
td,th{border:1px solid #ccc;padding:2px 8px;font-size:13px;text-align:left}
th{background:#eee}.bad{color:#b00;font-weight:bold}
.scroll{overflow-x:auto;max-width:100%}
.stats{color:#444}.legend{font-size:12px}
.sw{display:inline-block;width:12px;height:12px;margin:0 4px 0 10px;vertical-align:middle;border-radius:2px}
.crit-sw{border:2px solid #222;background:#fff}
.alarms{border:2px solid #d62728;background:#fdecea;padding:6px 12px;margin:8px 0}
.alarms ul{margin:4px 0}
.bwd-bg{fill:#f3f0ff}.axis{font-size:11px;fill:#666}
.row-label{font-size:11px;fill:#333;font-family:monospace}.row-line{stroke:#ddd}
.lane-row{cursor:pointer}.alarm-row .row-label{fill:#d62728;font-weight:bold}
.lane-details{margin:6px 0;border-left:3px solid #ccc;padding-left:8px}
.lane-details summary{cursor:pointer;font-family:monospace;font-size:13px}
.ev{cursor:pointer}.ev rect{stroke:#555;stroke-width:1}
.ev.critical rect{stroke:#111;stroke-width:3}
.ev.alarm rect{stroke:#7a0000;stroke-width:3;stroke-dasharray:5 3}
.ev.hl rect,.ev.sel rect{stroke:#000;stroke-width:4}
.ev-op{font-size:12px;font-family:monospace;fill:#111}
.ev-sub{font-size:11px;font-family:monospace;fill:#111}
.ev.alarm .ev-op,.ev.alarm .ev-sub{fill:#fff;font-weight:bold}
.ev-crit{font-size:12px;fill:#111}.ev-note{font-size:10px;fill:#555}
.pair{fill:none;stroke:#888;stroke-width:1.5}.pair.hl{stroke:#000;stroke-width:3}
.info{position:fixed;right:12px;bottom:12px;max-width:46em;background:#fffbe6;border:1px solid #caa;
padding:8px 12px;font-size:12px;font-family:monospace;white-space:pre-wrap;box-shadow:0 2px 8px #0003}
"""

# Plain DOM code, no library. Errors land in <html data-script-errors> (read by tests/test_report_browser.py).
# A page opened as report.html#show=g0:all_to_all_3_start shows that node's details, as a click would.
PAGE_SCRIPT = """
(function(){
var root=document.documentElement;
function fail(msg){var e=root.getAttribute('data-script-errors')||'';root.setAttribute('data-script-errors',e+msg+'; ');}
window.addEventListener('error',function(ev){fail(String(ev.message||ev));});
function box(sec,name){return document.querySelector('.ev[data-section="'+sec+'"][data-node="'+CSS.escape(name)+'"]');}
function partners(g){var s=g.getAttribute('data-pair');return s?s.split(' '):[];}
function arcs(g){var sec=g.getAttribute('data-section'),n=g.getAttribute('data-node');
 return document.querySelectorAll('.pair[data-section="'+sec+'"][data-forward="'+CSS.escape(n)+'"],'+
  '.pair[data-section="'+sec+'"][data-backward="'+CSS.escape(n)+'"]');}
function mark(g,on){var sec=g.getAttribute('data-section');g.classList.toggle('hl',on);
 partners(g).forEach(function(p){var b=box(sec,p);if(b)b.classList.toggle('hl',on);});
 arcs(g).forEach(function(a){a.classList.toggle('hl',on);});}
function show(g){var step=g.closest('.step'),info=step.querySelector('.info');
 document.querySelectorAll('.ev.sel').forEach(function(x){x.classList.remove('sel');});g.classList.add('sel');
 var f=[['node','data-node'],['op','data-target'],['phase','data-phase'],['source','data-source'],
  ['inputs','data-in-shapes'],['outputs','data-out-shapes'],['bytes/rank','data-bytes'],
  ['bytes (symbolic)','data-bytes-symbolic'],['group','data-group'],['paired with','data-pair'],
  ['paired in the other file','data-pair-elsewhere'],['ALARM','data-alarm']];
 var lines=[];f.forEach(function(k){var v=g.getAttribute(k[1]);if(v)lines.push(k[0]+': '+v);});
 if(g.hasAttribute('data-critical'))lines.push('on the critical path');
 document.querySelectorAll('.info').forEach(function(x){if(x!==info)x.hidden=true;});
 info.textContent=lines.join('\\n');info.hidden=false;info.setAttribute('data-shown',g.getAttribute('data-node'));}
try{
 document.querySelectorAll('.ev').forEach(function(g){
  g.addEventListener('mouseenter',function(){mark(g,true);});
  g.addEventListener('mouseleave',function(){mark(g,false);});
  g.addEventListener('click',function(){show(g);});
  g.addEventListener('keydown',function(e){if(e.key==='Enter')show(g);});});
 document.querySelectorAll('.info').forEach(function(i){i.title='click to close';
  i.addEventListener('click',function(){i.hidden=true;});});
 document.querySelectorAll('.lane-row').forEach(function(r){r.addEventListener('click',function(){
  var d=document.getElementById(r.getAttribute('data-lane'));if(d){d.open=true;d.scrollIntoView();}});});
 document.querySelectorAll('.tick').forEach(function(t){t.addEventListener('click',function(e){
  var ref=t.getAttribute('data-ref').split(':'),g=box(ref[0],ref.slice(1).join(':'));
  if(g){var d=g.closest('details');if(d)d.open=true;show(g);e.stopPropagation();}});});
 document.querySelectorAll('button[data-action]').forEach(function(b){b.addEventListener('click',function(){
  var open=b.getAttribute('data-action')==='expand';
  b.closest('.step').querySelectorAll('details.lane-details').forEach(function(d){d.open=open;});});});
 var n=0;document.querySelectorAll('.pair').forEach(function(a){
  var sec=a.getAttribute('data-section');
  if(!box(sec,a.getAttribute('data-forward'))||!box(sec,a.getAttribute('data-backward')))fail('pair without its boxes');n++;});
 root.setAttribute('data-pairs-linked',String(n));
 var m=/^#show=([^:]+):(.+)$/.exec(decodeURIComponent(location.hash||''));
 if(m){var g=box(m[1],m[2]);if(!g)fail('no node '+m[2]+' to show');else{var d=g.closest('details');if(d)d.open=true;show(g);}}
 root.setAttribute('data-script-ready','1');
}catch(err){fail(String(err));}
})();
"""

PAGE_HEAD = "<style>" + PAGE_CSS + "</style>"


def page_script() -> str:
    """The page's one script element (placed at the end of the body)."""
    return "<script>" + PAGE_SCRIPT + "</script>"
