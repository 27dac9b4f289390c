"""The pass pipeline: a printable list of named passes, each disable-able and dumpable.

A pass is one function ``(gm, ctx) -> PassResult``. Every node a pass creates is tagged with the
pass's name in ``node.meta["usp_pass"]`` (nodes of the initial trace carry ``"trace"``), so a dump
or the CLI can say where each op came from.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch.fx as fx

__all__ = [
    "PASS_META",
    "PassContext",
    "PassResult",
    "Pass",
    "Pipeline",
    "PipelineRun",
    "tag_nodes",
    "graph_text",
]

PASS_META = "usp_pass"


def tag_nodes(gm: fx.GraphModule | fx.Graph, name: str) -> int:
    """Tag every untagged node with pass `name`; returns how many were tagged."""
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    count = 0
    for node in graph.nodes:
        if PASS_META not in node.meta:
            node.meta[PASS_META] = name
            count += 1
    return count


def graph_text(gm: fx.GraphModule) -> str:
    """Readable code of `gm`, each node annotated with the pass that created it."""
    return gm.print_readable(print_output=False, additional_meta=[PASS_META])


@dataclass
class PassContext:
    """What passes share beyond the graph.

    cp: a `usp_graph.ContextParallel` (or None: single process), forwarded to `sdpa_to_usp`.
    metadata: example `AttentionMetadata` for a graph that has no metadata inputs yet (a Dynamo
        graph); the rewrite adds ``cu_seqlens``/``max_seqlen`` inputs shaped like it.
    """

    cp: Any = None
    metadata: Any = None


@dataclass
class PassResult:
    """What one pass did: the graph it returns and what it matched.

    matches: sites rewritten, gradients produced, checks passed (each pass documents its count).
    sites / skipped: attention sites acted on / left alone with a reason (`AttentionSite`).
    """

    name: str
    gm: fx.GraphModule
    matches: int
    sites: tuple[Any, ...] = ()
    skipped: tuple[Any, ...] = ()
    notes: tuple[str, ...] = ()
    seconds: float = 0.0

    def __str__(self) -> str:
        extra = f", {len(self.skipped)} left as SDPA" if self.skipped else ""
        return f"{self.name}: {self.matches} matches{extra} ({self.seconds * 1e3:.0f} ms)"


@dataclass(frozen=True)
class Pass:
    """A named pass. `required` passes cannot be disabled (the train-step graph needs them)."""

    name: str
    fn: Callable[[fx.GraphModule, PassContext], PassResult]
    doc: str
    required: bool = False


@dataclass
class PipelineRun:
    """The result of `Pipeline.run`: the final graph, each pass's result and any dumps."""

    gm: fx.GraphModule
    results: list[PassResult]
    dumps: dict[str, tuple[str, str]] = field(default_factory=dict)

    def result(self, name: str) -> PassResult:
        for r in self.results:
            if r.name == name:
                return r
        ran = ", ".join(r.name for r in self.results) or "none"
        raise KeyError(f"pass {name!r} did not run (ran: {ran})")

    @property
    def matches(self) -> dict[str, int]:
        return {r.name: r.matches for r in self.results}


class Pipeline:
    """An ordered list of passes.

    ``print(pipeline)`` lists them; ``pipeline.disable("verify")`` returns a copy without one;
    ``pipeline.with_dump(dir)`` returns a copy that keeps (and, given a folder, writes) each pass's
    before/after graph.
    """

    def __init__(
        self,
        passes: Sequence[Pass],
        *,
        disabled: Iterable[str] = (),
        dump: bool | Iterable[str] = False,
        dump_dir: str | Path | None = None,
    ) -> None:
        names = [p.name for p in passes]
        if len(set(names)) != len(names):
            raise ValueError(f"pass names must be unique, got {names}")
        self.passes = tuple(passes)
        self.disabled = frozenset(self._check_names(disabled, "disable"))
        for p in self.passes:
            if p.required and p.name in self.disabled:
                raise ValueError(
                    f"pass {p.name!r} is required and cannot be disabled: {p.doc.splitlines()[0]}"
                )
        if dump is True:
            self.dump = frozenset(names)
        elif dump is False:
            self.dump = frozenset()
        else:
            self.dump = frozenset(self._check_names(dump, "dump"))
        self.dump_dir = None if dump_dir is None else Path(dump_dir)
        if self.dump_dir is not None and not self.dump:
            self.dump = frozenset(names)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.passes]

    def _check_names(self, names: Iterable[str], what: str) -> list[str]:
        if isinstance(names, str):
            names = [names]
        try:
            names = list(names)
        except TypeError:
            raise TypeError(
                f"cannot {what} {names!r}: give pass names (a str or an iterable of str); the passes are {self.names}"
            ) from None
        bad = [n for n in names if not isinstance(n, str)]
        if bad:
            raise TypeError(f"cannot {what} {bad!r}: pass names are str; the passes are {self.names}")
        unknown = [n for n in names if n not in self.names]
        if unknown:
            raise ValueError(f"cannot {what} unknown pass(es) {unknown}; the passes are {self.names}")
        return names

    def _copy(self, **changes: Any) -> Pipeline:
        kwargs = {"disabled": self.disabled, "dump": self.dump, "dump_dir": self.dump_dir, **changes}
        return Pipeline(self.passes, **kwargs)

    def disable(self, *names: str) -> Pipeline:
        """A copy with the named passes disabled (unknown or required names raise ValueError)."""
        return self._copy(disabled=self.disabled | set(self._check_names(names, "disable")))

    def enable(self, *names: str) -> Pipeline:
        return self._copy(disabled=self.disabled - set(self._check_names(names, "enable")))

    def with_dump(self, dump_dir: str | Path | None = None, *, only: Iterable[str] | None = None) -> Pipeline:
        """A copy that records each (or each `only`) pass's graph before and after it runs, in
        `PipelineRun.dumps` and, given `dump_dir`, as ``NN_<pass>.before.txt`` / ``.after.txt`` files."""
        dump = self.names if only is None else self._check_names(only, "dump")
        return self._copy(dump=dump, dump_dir=dump_dir)

    def replace(self, name: str, fn: Callable[[fx.GraphModule, PassContext], PassResult]) -> Pipeline:
        """A copy with pass `name` running `fn` instead (same name, doc and position)."""
        self._check_names([name], "replace")
        passes = [replace(p, fn=fn) if p.name == name else p for p in self.passes]
        return Pipeline(passes, disabled=self.disabled, dump=self.dump, dump_dir=self.dump_dir)

    def __str__(self) -> str:
        width = max((len(n) for n in self.names), default=0)
        lines = [f"Pipeline ({len(self.passes)} passes):"]
        for i, p in enumerate(self.passes, 1):
            state = "off" if p.name in self.disabled else "on "
            req = " (required)" if p.required else ""
            dump = " [dump]" if p.name in self.dump else ""
            lines.append(f"  {i}. {p.name:<{width}}  {state}  {p.doc.splitlines()[0]}{req}{dump}")
        return "\n".join(lines)

    __repr__ = __str__

    def run(
        self,
        gm: fx.GraphModule,
        ctx: PassContext | None = None,
        *,
        only: Iterable[str] | None = None,
        into: PipelineRun | None = None,
        tag: bool = True,
    ) -> PipelineRun:
        """Run the enabled passes in order; tag every new node with the pass that created it.

        only: run just these passes, a stage of a pipeline whose graphs arrive at different times
        (the compile backend's: AOTAutograd makes the joint graph between its stages). into: the
        `PipelineRun` of the earlier stages, which this stage continues on graph `gm`. tag: False
        leaves ``usp_pass`` tags as they are (a graph another tracer made, such as AOTAutograd's).
        """
        ctx = ctx or PassContext()
        selected = set(self.names if only is None else self._check_names(only, "run"))
        if tag and into is None:
            tag_nodes(gm, "trace")
        run = into if into is not None else PipelineRun(gm=gm, results=[])
        run.gm = gm
        if self.dump_dir is not None:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
        for i, p in enumerate(self.passes, 1):
            if p.name in self.disabled or p.name not in selected:
                continue
            before = graph_text(run.gm) if p.name in self.dump else None
            t0 = time.perf_counter()
            result = p.fn(run.gm, ctx)
            result.seconds = time.perf_counter() - t0
            if result.name != p.name:
                result = replace(result, name=p.name)
            if tag:
                tag_nodes(result.gm, p.name)
            run.gm = result.gm
            run.results.append(result)
            if before is not None:
                after = graph_text(run.gm)
                run.dumps[p.name] = (before, after)
                if self.dump_dir is not None:
                    (self.dump_dir / f"{i:02d}_{p.name}.before.txt").write_text(before)
                    (self.dump_dir / f"{i:02d}_{p.name}.after.txt").write_text(after)
        return run

    def enabled(self, name: str) -> bool:
        """Whether pass `name` runs (ValueError for a name that is not a pass of this pipeline)."""
        self._check_names([name], "look up")
        return name not in self.disabled
