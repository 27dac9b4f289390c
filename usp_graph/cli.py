"""The ``usp-graph`` command line (also ``python -m usp_graph``).

Exit codes: 0 success; 1 a check failed (verify found a problem, demo saw a mismatch);
2 bad usage or an unreadable file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

EXAMPLES = """examples:
  usp-graph demo                              the main job: trace, CP over 2 gloo ranks, save,
                                              load fresh, replay with new documents, compare
  usp-graph inspect rank0.uspg                tables: inputs, attention sites, collectives, ops
  usp-graph inspect rank0.uspg --json         the same as JSON
  usp-graph inspect rank0.uspg --html out.html    one self-contained page
  usp-graph inspect rank0.uspg --dot out.dot      data-flow graph for graphviz
  usp-graph inspect rank0.uspg --values T=65536   evaluate symbolic byte counts
  usp-graph inspect dumps/                    every graph file a torch.compile dump_dir holds
  usp-graph verify rank0.uspg                 exit 0 if every collective and parameter is paired
  usp-graph diff a.uspg b.uspg                what changed between two graphs
"""


class _Unreadable(Exception):
    """A path that is not a readable graph file or dump directory (exit code 2)."""


def _graph_files(path: str) -> list[str]:
    """The graph file itself, or every *.uspg under a directory (a compile dump_dir)."""
    if os.path.isdir(path):
        files = sorted(
            os.path.join(root, f) for root, _, names in os.walk(path) for f in names if f.endswith(".uspg")
        )
        if not files:
            raise _Unreadable(f"{path}: directory holds no graph files (*.uspg)")
        return files
    if not os.path.exists(path):
        raise _Unreadable(f"{path}: no such file")
    return [path]


def _load(path: str) -> Any:
    """Any graph file (train step or compile dump) as a `GraphFile`; nothing in it is executed."""
    from .graphfile import load_graph_module

    try:
        return load_graph_module(path)
    except (OSError, ValueError) as e:
        raise _Unreadable(f"{path}: {e}") from e


def _summary(path: str, values: dict[str, int] | None = None, graph: Any = None) -> dict[str, Any]:
    from .analysis import summarize

    g = graph if graph is not None else _load(path)
    return summarize(g.graph_module, symbols=g.symbols, values=values)


def inspect_text(path: str, values: dict[str, int] | None = None) -> str:
    from . import report

    return report.text(_summary(path, values), title=path)


def _parse_values(items: Sequence[str] | None) -> dict[str, int]:
    out = {}
    for item in items or ():
        name, _, value = item.partition("=")
        if not name or not value.isdigit():
            raise _Unreadable(f"--values expects NAME=INT (e.g. T=65536), got {item!r}")
        out[name] = int(value)
    return out


def _inspect(args: argparse.Namespace) -> int:
    from . import analysis, report

    values = _parse_values(args.values)
    files = _graph_files(args.path)
    summaries = {f: _summary(f, values) for f in files}
    if args.json:
        print(json.dumps(summaries if len(files) > 1 else summaries[files[0]], indent=1, default=str))
    else:
        for f, s in summaries.items():
            print(report.text(s, title=f))
    if args.html:
        page = "\n".join(report.to_html(s, title=f) for f, s in summaries.items())
        with open(args.html, "w") as fh:
            fh.write(page)
        print(f"wrote {args.html}", file=sys.stderr)
    if args.dot:
        with open(args.dot, "w") as fh:
            fh.write(analysis.to_dot(_load(files[0]).graph_module))
        print(f"wrote {args.dot}", file=sys.stderr)
    return 0


def _verify(args: argparse.Namespace) -> int:
    from .passes.verify import VerifyError, verify

    status = 0
    for f in _graph_files(args.path):
        g = _load(f)
        s = _summary(f, graph=g)
        problems = [f"{u['node']} ({u['op']}): {u['missing']}" for u in s["unpaired"]]
        if g.kind == "train_step":
            try:  # the package's own verify pass: SDPA left, rules, adjoints, a grad per parameter
                verify(g.graph_module)
            except VerifyError as e:
                problems.append(str(e))
        if problems:
            status = 1
            print(f"{f}: FAILED")
            for p in dict.fromkeys(problems):
                print(f"  {p}")
        else:
            print(
                f"{f}: ok ({len(s['pairing'])} forward ops paired with their backward, "
                f"{len(s['collectives'])} collectives)"
            )
    return status


def _diff(args: argparse.Namespace) -> int:
    from . import analysis, report

    a, b = (_summary(_graph_files(p)[0]) for p in (args.a, args.b))
    d = analysis.diff(a, b)
    print(
        json.dumps(d, indent=1, default=str) if args.json else report.diff_text(d),
        end="" if not args.json else "\n",
    )
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    out_dir = args.out or tempfile.mkdtemp(prefix="usp_demo_")
    return run_demo(out_dir=out_dir, strategy=args.strategy, seed=args.seed, layers=args.layers)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="usp-graph",
        description="usp_graph: SDPA -> varlen attention + context-parallel collectives, with registered "
        "backward rules. Inspect, verify and diff graph files; run the main job.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="summarize a graph file or a compile dump_dir")
    p.add_argument("path", help="a graph file (.uspg) or a directory of them")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--html", metavar="OUT", help="also write one self-contained HTML page")
    p.add_argument("--dot", metavar="OUT", help="also write the data-flow graph as graphviz DOT")
    p.add_argument("--values", nargs="*", metavar="NAME=INT", help="evaluate symbolic sizes, e.g. T=65536")
    p.set_defaults(func=_inspect)

    p = sub.add_parser(
        "verify", help="exit 0 if every forward collective has its adjoint and every parameter a grad"
    )
    p.add_argument("path")
    p.set_defaults(func=_verify)

    p = sub.add_parser("diff", help="what changed between two graphs")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_diff)

    p = sub.add_parser(
        "demo",
        help="the main job on the embedded default model",
        description="Trace a small Llama-style model on packed documents with context parallelism over 2 "
        "gloo ranks on CPU, save per-rank graph files, load them in fresh processes, replay with new "
        "document boundaries, check bitwise against eager, print the inspect summary.",
    )
    p.add_argument(
        "--strategy", default="ulysses", choices=["allgather_kv", "ulysses", "ring", "usp", "halo"]
    )
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="directory for the graph files (default: a new temp dir)")
    p.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except _Unreadable as e:
        print(f"usp-graph: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
