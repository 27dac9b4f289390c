"""The ``usp-graph`` command line (also ``python -m usp_graph``).

Exit codes: 0 success; 1 a check failed (verify found a problem, demo saw a mismatch, a
compile dump's manifest records a file it could not write); 2 bad usage or an unreadable file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from .graphfile.document import SUFFIX
from .terminal import escape as _safe

EXAMPLES = """examples:
  usp-graph demo                              the main job: trace, CP over 2 gloo ranks, save,
                                              load fresh, replay with new documents, compare
  usp-graph inspect rank0.uspg                tables: inputs, attention sites, collectives, ops
  usp-graph inspect rank0.uspg --json         the same as JSON
  usp-graph inspect rank0.uspg --html out.html    one self-contained page: the step as a picture
  usp-graph inspect rank0.uspg --dot out.dot      data-flow graph for graphviz
  usp-graph inspect rank0.uspg --values T=65536   evaluate symbolic byte counts
  usp-graph inspect dumps/                    every graph file a torch.compile dump_dir holds
  usp-graph verify rank0.uspg                 exit 0 if every collective and parameter is paired
  usp-graph diff a.uspg b.uspg                what changed between two graphs
"""


class _Unreadable(Exception):
    """A path that is not a readable graph file or dump directory (exit code 2)."""


_DUMP_FORMAT = "usp_graph.compile_dump"  # backend.dump.FORMAT, without importing torch for --help


class _Usage(_Unreadable):
    """A bad command-line value (exit code 2, one line saying what to fix)."""


def _regular(path: str) -> str:
    """`path`, or _Unreadable when it is a FIFO, a device or a socket: opening a FIFO waits for a
    writer forever (issue 17). `_load` re-checks on the opened descriptor, so a swap after this
    check is refused too."""
    from .graphfile.document import not_regular

    try:
        what = not_regular(os.stat(path).st_mode)
    except OSError as e:
        raise _Unreadable(f"{path}: {e.strerror or e}") from None
    if what is not None:
        raise _Unreadable(f"{path} is {what}, not a regular file: graph files are regular files")
    return path


def _graph_files(path: str) -> tuple[list[str], list[tuple[str, str]]]:
    """(graph files, files a compile dump failed to write): the graph file itself, or every *.uspg
    under a directory (a compile dump_dir), with each (path, error) its manifests record. A
    non-regular file where a graph file is expected is refused (exit 2), never opened."""
    if os.path.isdir(path):
        files, failed = [], []
        for root, _, names in sorted(os.walk(path)):
            files += sorted(_regular(os.path.join(root, f)) for f in names if f.endswith(SUFFIX))
            if "summary.json" in names:
                failed += _failed_files(root)
        if not files and not failed:
            raise _Unreadable(f"{path}: directory holds no graph files (*{SUFFIX})")
        return files, failed
    if not os.path.exists(path):
        raise _Unreadable(f"{path}: no such file")
    return [_regular(path)], []


def _manifest(folder: str) -> Any:
    """The `backend.dump.Manifest` of one compiled graph's dump in `folder` (its summary.json,
    decoded against the manifest's schema), or None where there is none."""
    from .backend.dump import ManifestError, read_manifest

    try:
        return read_manifest(folder)
    except ManifestError as e:
        raise _Unreadable(str(e)) from None


def _failed_files(folder: str) -> list[tuple[str, str]]:
    """What the manifest (summary.json) of one compiled graph's dump says was not written."""
    manifest = _manifest(folder)
    if manifest is None:
        return []
    out = dict(manifest.failed)
    for name, (file, error) in manifest.graph_files.items():
        if error:
            out.setdefault(name + SUFFIX, error)
        elif file is not None and not os.path.exists(os.path.join(folder, file)):
            out.setdefault(file, "summary.json lists it as written, but it is not in the directory")
    return [(os.path.join(folder, what), error) for what, error in out.items()]


def _load(path: str, cache: dict[str, Any] | None = None) -> Any:
    """Any graph file (train step or compile dump) as a `GraphFile`; nothing in it is executed."""
    from .graphfile import load_graph_module

    if cache is not None and path in cache:
        return cache[path]
    try:
        g = load_graph_module(path)
    except (OSError, ValueError) as e:
        raise _Unreadable(f"{path}: {e}") from e
    if cache is not None:
        cache[path] = g
    return g


def _backward_file(path: str, g: Any, cache: dict[str, Any] | None) -> tuple[bool, Any, str | None]:
    """(is a compile dump's forward graph, its backward `GraphFile` or None, that file's path).

    A dump writes one compiled graph's forward and backward as forward.uspg and backward.uspg in
    one directory; the backward's nodes name the forward nodes they differentiate."""
    if g.kind != "graph_module" or g.meta.get("graph") != "forward" or "compile_dump" not in g.meta:
        return False, None, None
    other = os.path.join(os.path.dirname(path), "backward" + SUFFIX)
    if not os.path.exists(other):
        return True, None, None
    b = _load(other, cache)
    if b.meta.get("graph") != "backward" or b.meta.get("compile_dump") != g.meta["compile_dump"]:
        return True, None, None
    return True, b, other


def _summary(
    path: str, values: dict[str, int] | None = None, graph: Any = None, cache: dict[str, Any] | None = None
) -> dict[str, Any]:
    from .analysis import MalformedGraphError, summarize

    g = graph if graph is not None else _load(path, cache)
    forward, b, b_path = _backward_file(path, g, cache)
    try:
        s = summarize(
            g.graph_module,
            sites=_dump_sites(path, g),
            symbols=g.symbols,
            values=values,
            inputs=g.inputs,
            backward=b.graph_module if b is not None else None,
            forward_only=forward,
        )
    except MalformedGraphError as e:
        raise _Unreadable(f"{path}: not a readable graph file: {e}") from None
    if g.meta.get("cp_decision") is not None:  # what ContextParallel("auto") chose, and why
        from .cp.auto import decode_decision

        try:
            s["cp_decision"] = decode_decision(g.meta["cp_decision"], "meta.cp_decision")
        except ValueError as e:
            raise _Unreadable(f"{path}: not a readable graph file: {e}") from None
    if "compile_dump" in g.meta:
        s["compile_dump"] = {
            "graph": g.meta["compile_dump"],
            "file": g.meta.get("graph"),
            "backward_file": b_path,
        }
        forward_file = os.path.join(os.path.dirname(path), "forward" + SUFFIX)
        if g.meta.get("graph") == "backward" and os.path.exists(forward_file):
            s["compile_dump"]["forward_file"] = forward_file
    return s


def _dump_sites(path: str, g: Any) -> list[Any] | None:
    """The attention sites a compile dump's manifest records (rewritten or kept, with the reason),
    for the graphs that run the forward: an SDPA kept as SDPA may leave no SDPA op in AOTAutograd's
    graphs (with dropout it decomposes), so only the manifest still says it was there and why."""
    if g.meta.get("graph") not in ("joint", "forward", "inference") or "compile_dump" not in g.meta:
        return None
    manifest = _manifest(os.path.dirname(path))
    if manifest is None or manifest.graph != g.meta["compile_dump"]:
        return None
    return [
        SimpleNamespace(
            name=r.name,
            source=r.source,
            reason=r.reason,
            rewritable=r.rewritten,
            q_shape=r.q_shape,
            is_causal=r.is_causal,
        )
        for r in manifest.sites
    ]


def inspect_text(path: str, values: dict[str, int] | None = None) -> str:
    from . import report

    return report.text(_summary(path, values), title=path)


def _report_failed(failed: list[tuple[str, str]]) -> None:
    for path, error in failed:
        print(f"usp-graph: the compile dump could not write {_safe(path)}: {_safe(error)}", file=sys.stderr)


# Sizes are int64 and a graph file's symbol ranges stay below 2**62; 19 digits covers every size
# and stops a 5000-digit value before int() refuses it with a traceback (issue 17).
_MAX_VALUE_DIGITS = 19
_VALUE = re.compile(rf"[0-9]{{1,{_MAX_VALUE_DIGITS}}}", re.ASCII)
_NAME = re.compile(r"\$?[A-Za-z_][A-Za-z0-9_]{0,99}", re.ASCII)


def _parse_values(items: Sequence[str] | None) -> dict[str, int]:
    """``["T=65536", ...]`` -> ``{"T": 65536}``; anything else is a usage error naming the item."""
    out: dict[str, int] = {}
    for item in items or ():
        name, eq, value = item.partition("=")
        shown = repr(item) if len(item) <= 60 else repr(item[:40]) + f"... ({len(item)} characters)"
        if not eq or not _NAME.fullmatch(name):
            raise _Usage(
                f"--values expects NAME=INT with NAME a symbol such as T (e.g. T=65536), got {shown}"
            )
        if not _VALUE.fullmatch(value) or int(value) >= 2**63:
            raise _Usage(
                "--values expects NAME=INT with INT a non-negative integer in ASCII digits below 2**63 "
                f"(e.g. {name}=65536), got {shown}"
            )
        if name in out:
            raise _Usage(f"--values gives {name} twice; give each symbol once")
        out[name] = int(value)
    return out


def _same_file(a: str, b: str) -> bool:
    """`a` and `b` name one file (by its device and inode: through links, `..` or another spelling)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist (yet): an output that does not exist overwrites nothing
        return False


def _refuse_overwriting(inputs: Sequence[str], outputs: dict[str, str | None]) -> None:
    """Every output path flag names a file other than each file the command reads and each other
    output, else `_Usage` (exit 2) before anything is read or written: ``inspect F --html F`` would
    replace the graph file F with its own report."""
    given = [(flag, path) for flag, path in outputs.items() if path is not None]
    for i, (flag, path) in enumerate(given):
        for f in inputs:
            if _same_file(path, f):
                raise _Usage(f"{flag} {path} is {f}, which this command reads; give another output path")
        for other, other_path in given[i + 1 :]:
            if os.path.abspath(path) == os.path.abspath(other_path) or _same_file(path, other_path):
                raise _Usage(f"{flag} and {other} name the same file {path}; give each its own path")


def _inspect(args: argparse.Namespace) -> int:
    from . import analysis, report

    values = _parse_values(args.values)
    files, failed = _graph_files(args.path)
    manifests = {os.path.join(os.path.dirname(f), "summary.json") for f in files}  # a compile dump's
    _refuse_overwriting([*files, *sorted(manifests)], {"--html": args.html, "--dot": args.dot})
    cache: dict[str, Any] = {}
    summaries = {f: _summary(f, values, cache=cache) for f in files}
    if args.json:
        if summaries:
            print(json.dumps(summaries if len(files) > 1 else summaries[files[0]], indent=1, default=str))
    else:
        for f, s in summaries.items():
            print(report.text(s, title=f))
        if failed:
            print("FAILED: files the compile dump could not write (summary.json):")
            for path, error in failed:
                print(f"  {_safe(path)}: {_safe(error)}")
    if args.html:
        write_html(args.html, summaries, cache, title=args.path)
    if args.dot and files:
        dot = analysis.to_dot(_load(files[0], cache).graph_module)
        try:
            with open(args.dot, "w") as fh:
                fh.write(dot)
        except OSError as e:
            raise _Usage(
                f"--dot {args.dot}: cannot write it ({e.strerror or e}); give a path in a writable folder"
            ) from None
        print(f"wrote {_safe(args.dot)}", file=sys.stderr)
    _report_failed(failed)
    return 1 if failed else 0


def write_html(out: str, summaries: dict[str, dict[str, Any]], cache: dict[str, Any], *, title: str) -> None:
    """One page for every graph file summarized (a section each: the step as a picture, then the
    tables); `cache` holds the loaded files (`_load`)."""
    from . import report

    sections = []
    for f, s in summaries.items():
        g = _load(f, cache)
        sections.append({"title": f, "summary": s, "graph": g.graph_module, "symbols": g.symbols})
    page = report.to_html_page(sections, title=title)
    try:
        with open(out, "w", encoding="utf-8") as fh:
            fh.write(page)
    except OSError as e:
        raise _Usage(
            f"--html {out}: cannot write it ({e.strerror or e}); give a path in a writable folder"
        ) from None
    print(f"wrote {_safe(out)}", file=sys.stderr)


def inspect_html(paths: Sequence[str], out: str) -> None:
    """Write `write_html`'s page for these graph files (the demo's report of its per-rank files)."""
    cache: dict[str, Any] = {}
    write_html(out, {p: _summary(p, cache=cache) for p in paths}, cache, title=", ".join(paths))


def _verify(args: argparse.Namespace) -> int:
    from .passes.verify import VerifyError, verify

    files, failed = _graph_files(args.path)
    status = 1 if failed else 0
    cache: dict[str, Any] = {}
    for f in files:
        g = _load(f, cache)
        s = _summary(f, graph=g, cache=cache)
        problems = [f"{u['node']} ({u['op']}): {u['missing']}" for u in s["unpaired"]]
        if g.kind == "train_step":
            try:  # the package's own verify pass: SDPA left, rules, adjoints, a grad per parameter
                verify(g.graph_module)
            except VerifyError as e:
                problems.append(str(e))
        if problems:
            status = 1
            print(f"{_safe(f)}: FAILED")
            for p in dict.fromkeys(problems):
                print(f"  {_safe(p)}")
        else:
            print(
                f"{_safe(f)}: ok ({len(s['pairing'])} forward ops paired with their backward, "
                f"{len(s['collectives'])} collectives)"
            )
    for path, error in failed:
        print(f"{_safe(path)}: FAILED (the compile dump could not write it: {_safe(error)})")
    return status


def _diff(args: argparse.Namespace) -> int:
    from . import analysis, report

    a, b = (_summary(_first_file(p)) for p in (args.a, args.b))
    d = analysis.diff(a, b)
    print(
        json.dumps(d, indent=1, default=str) if args.json else report.diff_text(d),
        end="" if not args.json else "\n",
    )
    return 0


def _first_file(path: str) -> str:
    files, failed = _graph_files(path)
    if not files:
        raise _Unreadable(f"{path}: no graph file was written ({'; '.join(f'{p}: {e}' for p, e in failed)})")
    return files[0]


def _train(args: argparse.Namespace) -> int:
    from .train import UsageError, run

    try:
        return run(args)
    except UsageError as e:
        raise _Usage(str(e)) from None


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    out_dir = args.out or tempfile.mkdtemp(prefix="usp_demo_")
    return run_demo(
        out_dir=out_dir,
        summary=inspect_text,
        html_report=inspect_html,
        strategy=args.strategy,
        seed=args.seed,
        layers=args.layers,
    )


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
    from .cp.table import STRATEGIES

    p.add_argument("--strategy", default="ulysses", choices=STRATEGIES)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="directory for the graph files (default: a new temp dir)")
    p.set_defaults(func=_demo)

    p = sub.add_parser(
        "train",
        help="the training recipe: a transformers LM on packed documents, CP x FSDP2, checkpointing (torchrun)",
        description="Train a transformers causal LM (tiny Llama by default) on packed documents with context "
        "parallelism, data parallelism or FSDP2, activation checkpointing and torch.compile(backend='usp'); "
        "save and resume (the recipe's own checkpoint format: raw tensor bytes and a JSON index, "
        "no pickle). One process as is; several with "
        "torchrun --nproc-per-node N -m usp_graph train ...",
    )
    from .train import add_arguments

    add_arguments(p)
    p.set_defaults(func=_train)
    return parser


def _show_warning(message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
                  line: str | None = None) -> None:  # fmt: skip
    # A warning about a file quotes it (a version string, a name): escaped like everything printed.
    print(f"usp-graph: {category.__name__}: {_safe(message)}", file=sys.stderr if file is None else file)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with warnings.catch_warnings():
        if args.command in ("inspect", "verify", "diff"):  # they read files anyone may have written
            warnings.showwarning = _show_warning
        try:
            return args.func(args)
        except _Unreadable as e:
            print(f"usp-graph: {_safe(e)}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())
