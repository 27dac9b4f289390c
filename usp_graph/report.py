"""Render an `analysis.summarize` result as text tables or one self-contained HTML page
(the picture of the step in it is drawn by `usp_graph.report_view`)."""

from __future__ import annotations

import html
from typing import Any

from .analysis import human_bytes
from .terminal import escape

__all__ = ["text", "to_html", "to_html_page", "diff_text", "escape"]


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[escape(h) for h in headers]] + [["" if c is None else escape(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _shape(s: Any) -> str:
    return "(" + ", ".join(str(d) for d in s) + ")" if s else "-"


def _sections(summary: dict[str, Any]) -> list[tuple[str, list[str], list[list[Any]]]]:
    inputs = summary["inputs"]
    by_role: dict[str, list[dict[str, Any]]] = {}
    for i in inputs:
        by_role.setdefault(i["role"], []).append(i)
    input_rows = []
    for role, items in by_role.items():
        shown = (
            items
            if len(items) <= 6
            else items[:3] + [{"name": f"... {len(items) - 5} more", "shape": None, "dtype": ""}] + items[-2:]
        )
        for i in shown:
            input_rows.append([role, i["name"], _shape(i["shape"]), i["dtype"]])
    attn = [
        [
            a["node"],
            a.get("source", ""),
            _shape(a.get("q_shape")),
            _shape(a.get("k_shape")),
            a.get("causal") if not a.get("window") else f"{a.get('causal')} window={tuple(a['window'])}",
            a.get("gqa", ""),
            a.get("strategy", "") if a["rewritten"] else f"NOT REWRITTEN: {a.get('reason')}",
        ]
        for a in summary["attention"]
    ]
    coll = [
        [
            c["node"],
            c["op"],
            c["phase"],
            c["group"],
            c["group_size"],
            human_bytes(c["bytes_per_rank"]),
            c.get("forward_node") or "",
            f"{c['overlap_ops']} ops" if "overlap_ops" in c else "blocking",
        ]
        for c in summary["collectives"]
    ]
    pairs = [[p["forward"], p["op"], ", ".join(p["backward"]), "ok"] for p in summary["pairing"]]
    pairs += [[u["node"], u["op"], "-", "MISSING: " + u["missing"]] for u in summary["unpaired"]]
    counts = sorted(summary["op_counts"].items(), key=lambda kv: (-kv[1], kv[0]))
    if len(counts) > 20:  # the JSON output has all of them
        counts = counts[:20] + [(f"... {len(counts) - 20} more ops", sum(v for _, v in counts[20:]))]
    meta = summary["metadata"]
    meta_rows = [[m["name"], _shape(m["shape"]), m["dtype"]] for m in meta["inputs"]]
    decision = _decision_section(summary.get("cp_decision"))
    return decision + [
        ("Inputs by role", ["role", "name", "shape", "dtype"], input_rows),
        (f"Metadata inputs{_capacity(meta)}", ["name", "shape", "dtype"], meta_rows),
        (_attention_title(summary), ["node", "source", "q", "k", "causal", "gqa", "strategy"], attn),
        (
            "Collectives (bytes sent per rank per step)",
            ["node", "op", "phase", "group", "ranks", "bytes", "forward node", "in flight over"],
            coll,
        ),
        (_pairing_title(summary), ["forward", "op", "backward", "status"], pairs),
        ("Op counts", ["op", "count"], [[k, v] for k, v in counts]),
        (
            "Nodes by creating pass",
            ["pass", "nodes"],
            [[k, v] for k, v in summary["created_by_pass"].items()],
        ),
    ]


def _attention_title(summary: dict[str, Any]) -> str:
    inside = sum(1 for a in summary["attention"] if a.get("checkpointed"))
    return f"Attention sites ({inside} inside checkpointed regions)" if inside else "Attention sites"


def _decision_section(d: Any) -> list[tuple[str, list[str], list[list[Any]]]]:
    """What ContextParallel("auto") chose for the traced step, every candidate's estimate per
    attention call and why the others could not run (`usp_graph.cp.auto.Decision.as_dict`)."""
    if not isinstance(d, dict) or not isinstance(d.get("candidates"), list):
        return []

    # The CLI decodes a file's record first (`usp_graph.cp.auto.decode_decision`: a malformed one is
    # an error there); a record handed in otherwise is still shown without a traceback: what is
    # well-formed, "-" / "?" for the rest.
    def seconds(x: Any) -> float | None:
        small = isinstance(x, float) or (isinstance(x, int) and not isinstance(x, bool) and abs(x) < 2**63)
        return float(x) if small else None

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.3g}"

    def sent(n: Any) -> str:
        return human_bytes(n) if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else "?"

    chosen = d.get("chosen") or {}
    rows = []
    for c in d["candidates"]:
        if not isinstance(c, dict):
            continue
        opts = c.get("options") if isinstance(c.get("options"), dict) else {}
        label = str(c.get("strategy")) + (
            f"({', '.join(f'{k}={v!r}' for k, v in opts.items())})" if opts else ""
        )
        compute, comm = seconds(c.get("compute_s")), seconds(c.get("comm_s"))
        total = (
            compute + comm if c.get("refused") is None and compute is not None and comm is not None else None
        )
        status = "CHOSEN" if c == chosen else (f"cannot run: {c['refused']}" if c.get("refused") else "")
        rows.append([label, ms(total), ms(compute), ms(comm), sent(c.get("bytes_per_rank")), status])
    title = (
        f"CP strategy chosen by ContextParallel('auto') over {d.get('world')} ranks "
        f"({d.get('steps')} sampled step(s) of {d.get('tokens')} tokens; ms per attention call)"
    )
    return [(title, ["candidate", "total", "compute", "comm", "sent/rank", "status"], rows)]


def _capacity(meta: dict[str, Any]) -> str:
    cap, hint = meta["capacity"], meta.get("capacity_hint")
    if cap is None:
        return ""
    if isinstance(cap, int):
        return f" (capacity {cap} documents)"
    # a compiled graph takes any capacity (cu_seqlens' length is a symbol): say what it was made with
    example = f"; {hint} in the example it was compiled with" if hint is not None else ""
    return f" (capacity {cap} documents: any, without recompiling{example})"


def _pairing_title(summary: dict[str, Any]) -> str:
    if not summary.get("pairing_checked", True):
        return "Forward/backward pairing (not checked: this forward graph's backward is in no file given)"
    dump = summary.get("compile_dump") or {}
    if dump.get("backward_file"):
        return f"Forward/backward pairing (backward in {dump['backward_file']})"
    if dump.get("forward_file"):  # a backward graph: its forward's ops are paired in the forward's file
        return f"Forward/backward pairing (the forward's ops: see {dump['forward_file']})"
    return "Forward/backward pairing"


def text(summary: dict[str, Any], *, title: str = "") -> str:
    """The summary as text tables; every field escaped (`escape`), so the text is safe to print."""
    out = [escape(title)] if title else []
    for name, headers, rows in _sections(summary):
        out.append(f"\n{escape(name)}")
        out.append(_table(headers, rows) if rows else "  (none)")
    crit = [escape(c) for c in summary.get("critical_path_comm") or []]
    out.append(f"\nCollectives on the critical path: {', '.join(crit) if crit else 'none'}")
    out.append(f"{summary['nodes']} nodes")
    return "\n".join(out) + "\n"


def _tables_html(summary: dict[str, Any]) -> list[str]:
    parts = []
    for name, headers, rows in _sections(summary):
        parts.append(f"<h3>{html.escape(name)}</h3>")
        if not rows:
            parts.append("<p>(none)</p>")
            continue
        parts.append("<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in headers) + "</tr>")
        for r in rows:
            cells = []
            for c in r:
                s = "" if c is None else str(c)
                cls = " class='bad'" if s.startswith(("MISSING", "NOT REWRITTEN")) else ""
                cells.append(f"<td{cls}>{html.escape(s)}</td>")
            parts.append("<tr>" + "".join(cells) + "</tr>")
        parts.append("</table>")
    crit = summary.get("critical_path_comm") or []
    parts.append(f"<p>Collectives on the critical path: {html.escape(', '.join(crit) or 'none')}</p>")
    parts.append(f"<p>{summary['nodes']} nodes</p>")
    return parts


def to_html_page(sections: list[dict[str, Any]], *, title: str = "usp_graph") -> str:
    """One self-contained page (inline SVG, CSS and script; no network, no external files) with a
    section per graph: the step as a picture (`usp_graph.report_view`) when the section has its
    ``graph``, then the tables. Each section: ``{"title", "summary"}`` and optionally ``"graph"``
    (the `fx.GraphModule` summarized) and ``"symbols"`` (as given to summarize)."""
    from . import report_view

    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title>",
        report_view.PAGE_HEAD,
        "</head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    if len(sections) > 1:
        parts.append("<ul class='toc'>")
        parts += [f"<li><a href='#s{i}'>{html.escape(s['title'])}</a></li>" for i, s in enumerate(sections)]
        parts.append("</ul>")
    for i, sec in enumerate(sections):
        parts.append(f"<section id='s{i}' data-file='{html.escape(sec['title'], quote=True)}'>")
        if len(sections) > 1:
            parts.append(f"<h2>{html.escape(sec['title'])}</h2>")
        if sec.get("graph") is not None:
            view = report_view.step(sec["graph"], sec["summary"], symbols=sec.get("symbols"))
            parts.append("<h3>The step</h3>")
            parts.append(report_view.render(view, key=f"g{i}"))
        parts += _tables_html(sec["summary"])
        parts.append("</section>")
    parts.append(report_view.page_script())
    parts.append("</body></html>\n")
    return "\n".join(parts)


def to_html(
    summary: dict[str, Any],
    *,
    title: str = "usp_graph",
    graph: Any = None,
    symbols: dict[str, Any] | None = None,
) -> str:
    """One self-contained page for one graph: the picture (when `graph`, the summarized
    `fx.GraphModule`, is given) and the tables; see `to_html_page`."""
    return to_html_page(
        [{"title": title, "summary": summary, "graph": graph, "symbols": symbols}], title=title
    )


def diff_text(d: dict[str, Any]) -> str:
    """`analysis.diff`'s result as text, every field escaped (`escape`)."""
    if d["same"]:
        return "no differences in ops, attention sites, collectives or inputs\n"
    out = []
    if d["op_counts"]:
        out.append("Op counts (a -> b)")
        out.append(_table(["op", "a", "b"], [[k, v["a"], v["b"]] for k, v in d["op_counts"].items()]))
    for key in ("added", "removed", "changed"):
        if d["inputs"][key]:
            out.append(f"Inputs {key}: {', '.join(escape(n) for n in d['inputs'][key])}")
    for side in ("only_a", "only_b"):
        for s in d["attention"][side]:
            out.append(f"Attention site {side.replace('_', ' in ')}: {escape(s)}")
    if d["collectives"]["a"] != d["collectives"]["b"]:
        out.append(f"Collectives a: {escape(d['collectives']['a'])}")
        out.append(f"Collectives b: {escape(d['collectives']['b'])}")
    return "\n".join(out) + "\n"
