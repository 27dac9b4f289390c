"""The package's modules import each other without cycles.

The import graph is built from the source (AST), not by importing anything:
- a node per module of `usp_graph`; a package is its ``__init__``;
- ``import a.b`` is an edge to ``a.b``; ``from a import n`` is an edge to the module ``a.n`` when
  there is one (a submodule), else to ``a`` (a name its ``__init__`` defines);
- parent packages are no edge: importing ``usp_graph.ops.varlen`` runs ``usp_graph/__init__``
  first, but that is Python's package machinery, not a dependency the module chose, and counting
  it would make every ``__init__`` that imports its own submodules a false cycle;
- imports under ``if TYPE_CHECKING:`` are left out (they never run);
- imports inside functions COUNT. Deferring an import hides a cycle from Python, not from a
  reader: the ``cli`` <-> ``demo`` cycle (issue 18) was made of function-local imports only.
  A second test checks the stricter module-level graph with no exception at all.

What a fresh process imports (issue 39): ``import usp_graph`` and eager `attention_mode` (forward and
backward) import neither ``torch._dynamo`` nor ``torch._inductor``; the usp ops are defined with
`usp_graph.ops.define`, whose kernels need no Dynamo (``torch.library.custom_op`` wraps its kernels in
``torch._disable_dynamo``, which imports ``torch._dynamo`` at an op's first call: torch/_compile.py).
A graph file read with ``values=False`` imports neither. Replaying one, or reading it with its fake
values (the default), imports ``torch._dynamo`` because torch itself does, in two places, checked
below so that a torch that stops doing so tightens the checks:
- ``FakeTensorMode()`` (the replay's check runs every node on fake tensors first):
  torch/_subclasses/fake_tensor.py imports ``torch._dynamo.config``;
- ``ShapeEnv()`` (the symbolic sizes of the rebuilt fake values): torch/fx/experimental/symbolic_shapes.py
  imports torch/fx/experimental/validator.py, which imports ``torch._dynamo.exc``.
``torch._dynamo`` brings the ``torch._inductor`` package (its config and utility modules), never
inductor's compiler; usp_graph's compiler and tracer are never imported on these paths.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import usp_graph

PACKAGE = Path(usp_graph.__file__).parent

# Cycles in the full graph that are known and owned elsewhere, as the edges that close them (each
# a function-local import). Remove an entry once its import is gone; `test_known_exceptions_still_exist`
# says when.
KNOWN_CYCLE_EDGES: dict[tuple[str, str], str] = {}

Edges = dict[str, dict[str, str]]  # module -> imported module -> where ("path:line")


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Imports(ast.NodeVisitor):
    """Every import statement of a module, with whether it runs inside a function."""

    def __init__(self, *, type_checking: bool = False) -> None:
        self.found: list[tuple[ast.Import | ast.ImportFrom, bool]] = []
        self.depth = 0
        self.type_checking = type_checking

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test) and not self.type_checking:
            for stmt in node.orelse:
                self.visit(stmt)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import | ast.ImportFrom) -> None:
        self.found.append((node, self.depth > 0))

    visit_ImportFrom = visit_Import


def import_graph(*, function_local: bool, type_checking: bool = False) -> Edges:
    modules = _modules()
    graph: Edges = {m: {} for m in modules}
    for mod, (path, is_pkg) in modules.items():
        finder = _Imports(type_checking=type_checking)
        finder.visit(ast.parse(path.read_text(), str(path)))
        for node, local in finder.found:
            if local and not function_local:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [
                    f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names
                ]
            for target in targets:
                if target in modules and target != mod:
                    where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
                    graph[mod].setdefault(target, where)
    return graph


def find_cycle(graph: Edges) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, in sorted order)."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _describe(cycle: list[str], graph: Edges) -> str:
    return "import cycle:\n" + "\n".join(
        f"  {a} -> {b}  ({graph[a][b]})" for a, b in zip(cycle, cycle[1:], strict=False)
    )


def test_find_cycle_finds_a_cycle_and_only_a_cycle():
    assert find_cycle({"a": {"b": ""}, "b": {"c": ""}, "c": {}}) is None
    assert find_cycle({"a": {"b": ""}, "b": {"c": ""}, "c": {"b": ""}}) == ["b", "c", "b"]


def test_the_graph_sees_module_level_function_local_and_package_imports():
    full, top = import_graph(function_local=True), import_graph(function_local=False)
    assert "usp_graph.registry" in top["usp_graph.ops.varlen"]  # from .. import registry
    assert "usp_graph.ops.varlen" in top["usp_graph.ops"]  # from . import ..., varlen (an __init__)
    assert "usp_graph.cp.table" in top["usp_graph.cp.context"]  # from .table import ...
    assert "usp_graph.demo" in full["usp_graph.cli"] and "usp_graph.demo" not in top["usp_graph.cli"]
    assert "usp_graph.cp.context" not in full["usp_graph.cp.strategies"]  # under TYPE_CHECKING
    assert "usp_graph" not in top["usp_graph.ops.varlen"]  # parent packages are no edge


def test_module_level_imports_are_acyclic():
    graph = import_graph(function_local=False)
    cycle = find_cycle(graph)
    assert cycle is None, _describe(cycle, graph)


def test_imports_including_function_local_ones_are_acyclic():
    graph = import_graph(function_local=True)
    for a, b in KNOWN_CYCLE_EDGES:
        graph[a].pop(b, None)
    cycle = find_cycle(graph)
    assert cycle is None, _describe(cycle, graph)


def _subgraph(graph: Edges, package: str) -> Edges:
    inside = {m for m in graph if m == package or m.startswith(package + ".")}
    return {m: {t: w for t, w in graph[m].items() if t in inside} for m in inside}


def test_cp_imports_are_acyclic_counting_every_import():
    """usp_graph.cp with no exception at all: module-level, function-local and type-only imports
    (issue 30: context -> strategies -> context under TYPE_CHECKING, table -> strategies, cost ->
    strategies' private helpers, context -> auto -> cost; the shared pieces now live in cp.common)."""
    graph = _subgraph(import_graph(function_local=True, type_checking=True), "usp_graph.cp")
    assert "usp_graph.cp.common" in graph["usp_graph.cp.cost"]  # the graph sees the package
    cycle = find_cycle(graph)
    assert cycle is None, _describe(cycle, graph)
    leaf = graph["usp_graph.cp.common"]  # every other cp module may import it: it imports none
    assert set(leaf) <= {"usp_graph.cp.layout"}, leaf


def test_type_only_imports_are_seen_when_asked():
    with_types = import_graph(function_local=True, type_checking=True)
    assert "usp_graph.cp.context" in with_types["usp_graph.cp.cross"]  # under TYPE_CHECKING


def test_known_exceptions_still_exist():
    graph = import_graph(function_local=True)
    gone = [edge for edge in KNOWN_CYCLE_EDGES if edge[1] not in graph.get(edge[0], {})]
    assert not gone, f"remove these from KNOWN_CYCLE_EDGES, their imports are gone: {gone}"


def _reach(graph: Edges, start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


# usp_graph's compile path (the passes package is not: a graph file's load runs its verify pass).
COMPILE_PATH = (
    "usp_graph.trace",
    "usp_graph.backend.compiler",
    "usp_graph.backend.pipeline",
    "usp_graph.analysis",
)


def test_graph_files_import_nothing_above_them_at_module_level():
    """graphfile/ never imports the package root (the version comes from the leaf `usp_graph.version`)
    nor, at module level, the tracer or the compiler: reading a file is not tracing one."""
    full, top = import_graph(function_local=True), import_graph(function_local=False)
    graphfile = [m for m in full if m.startswith("usp_graph.graphfile")]
    assert not [m for m in graphfile if "usp_graph" in full[m]], "a graphfile module imports usp_graph itself"
    for m in graphfile:
        reached = _reach(top, m)
        assert not reached & {"usp_graph", *COMPILE_PATH}, (m, sorted(reached & {"usp_graph", *COMPILE_PATH}))


# ---- what a fresh process imports ----------------------------------------------------------------

ROOT = PACKAGE.parent
# Inductor's compiler: never on the light paths (its package and config come with torch._dynamo).
INDUCTOR_COMPILER = ("torch._inductor.compile_fx", "torch._inductor.graph", "torch._inductor.lowering",
                     "torch._inductor.scheduler")  # fmt: skip
# Where torch itself imports torch._dynamo on a graph file's replay (the module docstring says why).
TORCH_DYNAMO_IMPORTERS = ("torch/_subclasses/fake_tensor.py", "torch/fx/experimental/validator.py")
NO_COMPILER_AT_ALL = ("torch._dynamo", "torch._inductor")

_PRELUDE = """
import importlib.abc, json, sys, traceback

class _FirstDynamoImport(importlib.abc.MetaPathFinder):
    where = None

    def find_spec(self, name, path, target=None):
        if name == "torch._dynamo" and _FirstDynamoImport.where is None:
            frames = [f for f in traceback.extract_stack()[:-1] if "importlib" not in f.filename]
            _FirstDynamoImport.where = f"{frames[-1].filename}:{frames[-1].lineno}"
        return None

sys.meta_path.insert(0, _FirstDynamoImport())

def report(**extra):
    print(json.dumps({"modules": sorted(sys.modules), "dynamo_from": _FirstDynamoImport.where, **extra}))
"""


def _fresh(code: str, *args: str) -> dict:
    """Run `code` (after `_PRELUDE`; it ends with ``report()``) in a fresh interpreter on this tree."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-c", _PRELUDE + textwrap.dedent(code), *args],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["modules"] = set(out["modules"])
    return out


def _assert_no_compiler(out: dict, *, dynamo_from: str | None = None) -> None:
    """No compiler module in `out` (usp_graph's or inductor's); ``torch._dynamo`` not imported at all,
    or (`dynamo_from`) first imported by that file of torch's."""
    assert not out["modules"] & {*COMPILE_PATH, *INDUCTOR_COMPILER}, sorted(
        out["modules"] & {*COMPILE_PATH, *INDUCTOR_COMPILER}
    )
    where = out["dynamo_from"]
    if dynamo_from is None:
        assert where is None and not out["modules"] & set(NO_COMPILER_AT_ALL), (
            f"torch._dynamo was imported (first from {where})"
        )
    else:
        assert where is not None and where.split(":")[0].endswith(dynamo_from), (
            f"torch._dynamo was first imported from {where}, not by {dynamo_from}"
        )


@pytest.mark.slow
def test_import_usp_graph_imports_no_dynamo_and_keeps_its_backend_guard_and_names():
    out = _fresh(
        """
        import torch
        import torch.nn.functional as F
        import usp_graph
        guarded = F.scaled_dot_product_attention is sys.modules["usp_graph.backend.documents"]._checked_sdpa
        modules, where = sorted(sys.modules), _FirstDynamoImport.where
        from torch._dynamo.backends.registry import lookup_backend  # after the snapshot: imports Dynamo
        found = lookup_backend("usp") is usp_graph.usp_backend
        missing = [n for n in usp_graph.__all__ if getattr(usp_graph, n, None) is None]
        print(json.dumps({"modules": modules, "dynamo_from": where, "guarded": guarded, "found": found,
                          "missing": missing}))
        """
    )
    _assert_no_compiler(out)
    heavy = {"torch._dynamo", "torch._inductor", "networkx", "usp_graph.graphfile", "usp_graph.cp"}
    assert not out["modules"] & heavy, sorted(out["modules"] & heavy)
    assert out["guarded"], "import usp_graph no longer installs the eager-SDPA guard of documents()"
    assert out["found"], 'torch.compile(backend="usp") does not find usp_graph.usp_backend'
    assert out["missing"] == [], out["missing"]


@pytest.mark.slow
def test_import_usp_graph_imports_no_sympy():
    """sympy is ~0.3 s of import on these machines; only tracing and graph files need it."""
    out = _fresh("import torch, usp_graph\nreport()")
    assert "sympy" not in out["modules"], (
        "import usp_graph imported sympy (usp_graph/graph_inputs.py imports it at module level for annotations "
        "only: import it under TYPE_CHECKING)"
    )


def test_every_public_name_and_submodule_resolves_and_a_missing_one_is_an_attribute_error():
    for name in usp_graph.__all__:
        assert getattr(usp_graph, name) is not None, name
    assert set(usp_graph.__all__) <= set(dir(usp_graph))
    assert usp_graph.analysis.__name__ == "usp_graph.analysis"  # a submodule, imported on first use
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        usp_graph.no_such_name  # noqa: B018


_PROBES = {
    "a custom_op kernel's first call": ("torch/_compile.py", """
        @torch.library.custom_op("usp_import_probe::ident", mutates_args=())
        def ident(x: torch.Tensor) -> torch.Tensor:
            return x.clone()
        before = "torch._dynamo" in sys.modules
        ident(torch.zeros(1))
        """),
    "FakeTensorMode()": ("torch/_subclasses/fake_tensor.py", """
        from torch._subclasses.fake_tensor import FakeTensorMode
        before = "torch._dynamo" in sys.modules
        FakeTensorMode()
        """),
    "ShapeEnv()": ("torch/fx/experimental/validator.py", """
        from torch.fx.experimental.symbolic_shapes import ShapeEnv
        before = "torch._dynamo" in sys.modules
        ShapeEnv(duck_shape=False)
        """),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("probe", sorted(_PROBES))
def test_torch_itself_imports_dynamo_where_the_module_docstring_says(probe):
    """Where torch imports torch._dynamo (module docstring). If torch stops importing it at a
    custom_op's first call, `usp_graph.ops.define` may go back to ``custom_op``; if it stops in
    FakeTensorMode() or ShapeEnv(), forbid torch._dynamo on the graph-file paths below."""
    importer, code = _PROBES[probe]
    out = _fresh("import torch\n" + textwrap.dedent(code) + "report(before=before)")
    assert not out["before"] and out["dynamo_from"].split(":")[0].endswith(importer), out["dynamo_from"]


@pytest.mark.slow
def test_eager_attention_mode_imports_no_dynamo_forward_and_backward():
    out = _fresh(
        """
        import torch
        import torch.nn.functional as F
        import usp_graph
        meta = usp_graph.AttentionMetadata.from_lengths([3, 5], max_docs=4)
        q = torch.randn(1, 2, 8, 4, dtype=torch.float64, requires_grad=True)
        with usp_graph.attention_mode(meta):
            F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
        report(grad=bool(q.grad.abs().sum() > 0))
        """
    )
    _assert_no_compiler(out)
    assert "usp_graph.varlen" not in out["modules"] and "usp_graph.ops.varlen" in out["modules"]
    assert out["grad"]


def _step_file(tmp_path) -> None:
    from tests.graphfile_corpus import STEP, build_bases, example_inputs

    (tmp_path / "step.uspg").write_bytes(build_bases()[STEP])
    params, batch, meta = example_inputs(STEP)
    torch.save({"params": params, "batch": batch, "meta": (meta.cu_seqlens, meta.max_seqlen, meta.total_tokens)},
               tmp_path / "inputs.pt")  # fmt: skip


_REPLAY = """
        d = torch.load(sys.argv[1] + "/inputs.pt")
        loss, grads = step.replay(d["params"], d["batch"], usp_graph.AttentionMetadata(*d["meta"]))
        report(loss=float(loss), loaded=loaded)
        """


@pytest.mark.slow
def test_a_graph_file_read_without_values_imports_no_dynamo_and_its_replay_only_torchs_fake_tensors(tmp_path):
    _step_file(tmp_path)
    out = _fresh(
        """
        import torch
        import usp_graph
        step = usp_graph.load(sys.argv[1] + "/step.uspg", values=False)
        loaded = {"modules": sorted(sys.modules), "dynamo_from": _FirstDynamoImport.where}
        """
        + _REPLAY,
        str(tmp_path),
    )
    _assert_no_compiler({**out["loaded"], "modules": set(out["loaded"]["modules"])})
    _assert_no_compiler(out, dynamo_from="torch/_subclasses/fake_tensor.py")
    assert out["loss"] > 0


@pytest.mark.slow
def test_a_graph_file_load_and_replay_imports_dynamo_only_through_torchs_shape_env(tmp_path):
    _step_file(tmp_path)
    out = _fresh(
        """
        import torch
        import usp_graph
        step = usp_graph.load(sys.argv[1] + "/step.uspg")
        loaded = None
        """
        + _REPLAY,
        str(tmp_path),
    )
    _assert_no_compiler(out, dynamo_from="torch/fx/experimental/validator.py")
    assert out["loss"] > 0


def test_the_constant_mark_on_group_lookups_is_the_one_torch_sets():
    """`dynamo_marks.assume_constant_result` marks a function as Dynamo's `assume_constant_result`
    does, without importing Dynamo (`ops.collectives`' group lookup carries it); if torch changes its
    mark, this fails (and fullgraph compiles of the collectives would graph-break)."""
    from usp_graph.dynamo_marks import assume_constant_result
    from usp_graph.ops.collectives import _group_info

    def torch_marked() -> None: ...

    def ours() -> None: ...

    torch.compiler.assume_constant_result(torch_marked)
    assume_constant_result(ours)
    assert vars(torch_marked) and vars(ours) == vars(torch_marked)
    assert {k: v for k, v in vars(_group_info).items() if k in vars(torch_marked)} == vars(torch_marked)


def test_the_disable_mark_breaks_the_graph_and_runs_eagerly_as_torch_disable_does():
    """`dynamo_marks.disable` sets torch's mark without importing Dynamo: a compiled caller breaks its
    graph at the call and runs it in eager, and frames it calls are not compiled."""
    from usp_graph.dynamo_marks import disable

    ran: list[bool] = []

    def inner(x):
        ran.append(torch.compiler.is_compiling())
        return x + 1

    @disable
    def eager(x):
        ran.append(torch.compiler.is_compiling())
        return inner(x) * 2

    assert getattr(eager, "_torchdynamo_disable", False) is getattr(
        torch.compiler.disable(inner), "_torchdynamo_disable", None
    )
    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    before = sum(counts["graph_break"].values())
    out = torch.compile(lambda x: eager(x + 1) - 1, backend="eager")(torch.zeros(3))
    assert torch.equal(out, torch.full((3,), 3.0))
    assert ran == [False, False]  # the function and what it calls ran in eager
    assert sum(counts["graph_break"].values()) > before


@pytest.mark.slow
def test_without_the_installed_entry_point_import_usp_graph_registers_the_backend():
    """A source checkout (no entry point installed): ``import usp_graph`` registers ``"usp"`` itself,
    importing Dynamo for it."""
    out = _fresh(
        """
        import importlib.metadata, torch
        importlib.metadata.entry_points = lambda **kw: importlib.metadata.EntryPoints(())  # none installed
        import usp_graph
        from torch._dynamo.backends.registry import lookup_backend
        report(found=lookup_backend("usp") is usp_graph.usp_backend)
        """
    )
    assert out["found"]
