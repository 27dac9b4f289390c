"""The overlap pass: collectives become issue + wait, and the graph is reordered so independent
compute runs while the data travels.

# N nodes of the graph

Runs after autograd (on a traced train step after verify; in the compile backend on each graph
AOTAutograd hands its inner compiler), so the backward rules and their pairing are untouched:

1. Lower. Each collective whose registry row names an ``issue`` op (`usp_graph.registry.Rule`)
   becomes ``recv = <issue>(same args)`` and ``out = usp::wait(recv, dim, reduce)``
   (`usp_graph.ops.collectives`). The two nodes keep the collective's node metadata (phase,
   forward origin, source, pass), so pairing and inspect read the issue node as the collective.
2. Schedule. A list schedule (a topological order, N log N) that, among the nodes ready to run,
   takes first an issue node; then the nodes the next issue (in the original order) needs; then
   any other compute, in the original order; and a wait last, only when nothing else can run. So
   a collective starts as soon as its input exists, its transfer overlaps whatever does not
   depend on it (Ulysses: the k and v projections while q travels), and the graph waits only
   where the result is needed.

Order that must not change does not: nodes that consume the RNG state or have side effects keep
their order among themselves, placeholders stay first and the output last. Every rank runs the
same graph, so every rank issues its collectives in the same order. Reordering independent
nodes changes no value: replay stays bitwise equal to eager.

Disable with ``Pipeline.disable("overlap")`` (tracer) or the backend option ``disable=["overlap"]``:
the graph then keeps the blocking collectives.
"""

from __future__ import annotations

import heapq
from typing import Any

import torch
import torch.fx as fx

from .. import registry
from ..ops.collectives import wait_args
from .base import PassContext, PassResult

__all__ = ["ASYNC_META", "lower_collectives", "overlap", "overlap_pass", "schedule"]

# "issue" / "wait" on the two nodes a collective is lowered to.
ASYNC_META = "usp_async"


def _fake_value(op: Any, args: tuple, kwargs: dict) -> Any:
    """The issue op's output value from its arguments' ``val`` metadata (None without them)."""
    from torch._guards import detect_fake_mode

    missing = []

    def val(n: fx.Node) -> Any:
        if "val" not in n.meta:
            missing.append(n)
        return n.meta.get("val")

    a, kw = fx.node.map_arg((args, kwargs), val)
    if missing:
        return None
    fake_mode = detect_fake_mode(
        [v for v in fx.node.map_aggregate((a, kw), lambda x: x) if isinstance(v, torch.Tensor)]
    )
    if fake_mode is None:
        return None
    with fake_mode:
        return op(*a, **kw)


def lower_collectives(gm: fx.GraphModule) -> int:
    """Replace each collective that has an issue op by issue + ``usp::wait``; returns how many."""
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        issue = registry.issue_of(node.target)
        if issue is None:
            continue
        dim, reduce = wait_args(node.target, node.args, node.kwargs)
        with graph.inserting_before(node):  # named after the collective: all_to_all_3 -> _start, _wait
            start = graph.create_node(
                "call_function", issue, node.args, node.kwargs, name=f"{node.name}_start"
            )
            done = graph.create_node(
                "call_function", torch.ops.usp.wait.default, (start, dim, reduce), name=f"{node.name}_wait"
            )
        start.meta.update(node.meta)  # the same schema and arguments as the collective
        done.meta.update((k, v) for k, v in node.meta.items() if k != "eager_input_vals")
        start.meta[ASYNC_META], done.meta[ASYNC_META] = "issue", "wait"
        value = _fake_value(issue, node.args, node.kwargs) if "val" in node.meta else None
        if value is None:
            start.meta.pop("val", None)
        else:
            start.meta["val"] = value
        start.meta.pop("tensor_meta", None)
        node.replace_all_uses_with(done)
        graph.erase_node(node)
        count += 1
    if count:
        gm.recompile()
    return count


def _keeps_order(node: fx.Node) -> bool:
    """A node whose order among its kind must stay: it consumes the RNG state or has side effects."""
    if node.op != "call_function":
        return False
    t = node.target
    if isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags:
        return True
    return node.is_impure()


def schedule(gm: fx.GraphModule) -> int:
    """Reorder `gm`'s nodes (issues early, waits late; see the module docstring); returns how many
    nodes changed position."""
    graph = gm.graph
    nodes = list(graph.nodes)
    is_issue = {n for n in nodes if n.meta.get(ASYNC_META) == "issue" and n.op == "call_function"}
    if not is_issue:
        return 0
    is_wait = {n for n in nodes if n.op == "call_function" and registry.is_wait_op(n.target)}
    head = [n for n in nodes if n.op in ("placeholder", "get_attr")]
    output = [n for n in nodes if n.op == "output"]
    body = [n for n in nodes if n.op not in ("placeholder", "get_attr", "output")]
    order = _Scheduler(nodes, body, is_issue, is_wait).run()
    moved = sum(1 for a, b in zip(order, body, strict=True) if a is not b)
    if moved:
        new = head + order + output
        for prev, n in zip(new, new[1:], strict=False):
            prev.append(n)
        graph.lint()
        gm.recompile()
    return moved


def _dependencies(body: list[fx.Node]) -> dict[fx.Node, list[fx.Node]]:
    """Each node's data inputs in `body`, plus a chain through the order-keeping nodes."""
    deps: dict[fx.Node, list[fx.Node]] = {}
    previous = None
    for n in body:
        d = [i for i in n.all_input_nodes if i.op not in ("placeholder", "get_attr")]
        if _keeps_order(n):
            if previous is not None:
                d.append(previous)
            previous = n
        deps[n] = d
    return deps


class _Scheduler:
    """List scheduling of a graph's body: of the ready nodes, issues first, then the cone of the
    next issue (its unemitted ancestors), then other compute, then waits (the cone's first)."""

    def __init__(
        self, nodes: list[fx.Node], body: list[fx.Node], is_issue: set[fx.Node], is_wait: set[fx.Node]
    ) -> None:
        self.body, self.is_issue, self.is_wait = body, is_issue, is_wait
        self.pos = {n: i for i, n in enumerate(nodes)}
        self.deps = _dependencies(body)
        self.issues = sorted(is_issue, key=self.pos.__getitem__)
        self.next_issue = 0
        self.cone: set[fx.Node] = set()
        self.emitted: set[fx.Node] = set()
        self.ready: set[fx.Node] = set()
        self.ready_issue: list[tuple[int, fx.Node]] = []
        self.ready_cone: list[tuple[int, fx.Node]] = []
        self.ready_other: list[tuple[int, fx.Node]] = []
        self.ready_wait: list[tuple[int, fx.Node]] = []

    def push(self, n: fx.Node) -> None:
        self.ready.add(n)
        item = (self.pos[n], n)
        if n in self.is_issue:
            heapq.heappush(self.ready_issue, item)
        elif n in self.is_wait:
            heapq.heappush(self.ready_wait, item)
        elif n in self.cone:
            heapq.heappush(self.ready_cone, item)
        else:
            heapq.heappush(self.ready_other, item)

    def new_cone(self) -> None:
        """The unemitted ancestors of the next issue not yet emitted (the issue included)."""
        self.cone.clear()
        while self.next_issue < len(self.issues) and self.issues[self.next_issue] in self.emitted:
            self.next_issue += 1
        if self.next_issue == len(self.issues):
            return
        stack = [self.issues[self.next_issue]]
        while stack:
            n = stack.pop()
            if n in self.emitted or n in self.cone:
                continue
            self.cone.add(n)
            stack.extend(self.deps[n])
        for n in self.cone:
            if n in self.ready and n not in self.is_issue and n not in self.is_wait:
                heapq.heappush(self.ready_cone, (self.pos[n], n))

    def pop(self, heap: list[tuple[int, fx.Node]], where: set[fx.Node] | None = None) -> fx.Node | None:
        """The earliest node of `heap` not yet emitted (and in `where`, when given)."""
        skipped = []
        found = None
        while heap:
            item = heapq.heappop(heap)
            if item[1] in self.emitted:
                continue
            if where is not None and item[1] not in where:
                skipped.append(item)
                continue
            found = item[1]
            break
        for item in skipped:
            heapq.heappush(heap, item)
        return found

    def run(self) -> list[fx.Node]:
        """The body in its new order."""
        users: dict[fx.Node, list[fx.Node]] = {n: [] for n in self.body}
        waiting = {n: len(set(d)) for n, d in self.deps.items()}
        for n, d in self.deps.items():
            for i in set(d):
                users[i].append(n)
        for n in self.body:
            if waiting[n] == 0:
                self.push(n)
        self.new_cone()
        order: list[fx.Node] = []
        while len(order) < len(self.body):
            n = (
                self.pop(self.ready_issue)
                or self.pop(self.ready_cone)
                or self.pop(self.ready_other)
                or self.pop(self.ready_wait, self.cone)
                or self.pop(self.ready_wait)
            )
            assert n is not None, "the graph has a cycle"
            order.append(n)
            self.emitted.add(n)
            self.ready.discard(n)
            for u in users[n]:
                waiting[u] -= 1
                if waiting[u] == 0:
                    self.push(u)
            if n in self.cone and n in self.is_issue:
                self.new_cone()
        return order


def overlap(gm: fx.GraphModule) -> PassResult:
    """Lower the collectives to issue + wait and schedule them. matches: collectives lowered."""
    lowered = lower_collectives(gm)
    moved = schedule(gm) if lowered else 0
    return PassResult("overlap", gm, lowered, notes=(f"{moved} nodes moved",) if lowered else ())


def overlap_pass(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    return overlap(gm)
