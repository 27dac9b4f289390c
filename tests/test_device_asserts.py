"""Every message usp_graph hands ``torch._assert_async`` fits the device: CUDA refuses one of 255
bytes or more ("Message length must be smaller than 255", the call fails whether the assertion
holds or not), MPS one of 250; the CPU takes any, so only these tests can catch a long one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import usp_graph
from usp_graph.ops.boundaries import DEVICE_MESSAGE_BYTES, device_assert, device_message

# Each value formatted into a message, at its widest: a 64-bit integer has 20 characters.
_WIDEST_VALUE = "9" * 20
_ROOT = Path(usp_graph.__file__).parent


def _text(expr: ast.expr, scope: ast.AST) -> str | None:
    """A message expression at its longest: constants as written, each formatted value as the
    widest integer, a name as the longest string assigned to it in the enclosing function."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return expr.value
    if isinstance(expr, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else _WIDEST_VALUE for v in expr.values)
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
        left, right = _text(expr.left, scope), _text(expr.right, scope)
        return None if left is None or right is None else left + right
    if isinstance(expr, ast.Name):
        assigned = [
            _text(node.value, scope)
            for node in ast.walk(scope)
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == expr.id for t in node.targets)
        ]
        if assigned and None not in assigned:
            return max(assigned, key=lambda s: len(s.encode()))
    return None


def _messages() -> list[tuple[str, str | None]]:
    """(file:line, message at its longest) of every ``device_assert(ok, message)`` and
    ``_assert_async(ok, message)`` call in the package."""
    found = []
    for path in sorted(_ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text())
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or len(node.args) + len(node.keywords) < 2:
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name not in ("device_assert", "_assert_async"):
                continue
            message = node.args[1] if len(node.args) > 1 else node.keywords[0].value
            scope = min(
                (f for f in functions if f.lineno <= node.lineno <= f.end_lineno),
                key=lambda f: f.end_lineno - f.lineno,
                default=tree,
            )
            found.append((f"{path.relative_to(_ROOT)}:{node.lineno}", _text(message, scope)))
    return found


def test_every_assert_message_in_the_package_fits_the_device_at_its_longest():
    messages = _messages()
    # the one torch._assert_async call with a message is device_assert's own, which shortens
    raw = [where for where, _ in messages if where.startswith("ops/boundaries.py") and _ is None]
    assert len(raw) == 1, raw
    checked = {where: text for where, text in messages if where not in raw}
    unreadable = [where for where, text in checked.items() if text is None]
    assert not unreadable, f"messages this test cannot read; write them as (f-)string literals: {unreadable}"
    assert len(checked) >= 6, checked  # masks, hf (3), ring, boundaries
    for where, text in checked.items():
        size = len(device_message(text).encode())
        assert size <= DEVICE_MESSAGE_BYTES, f"{where}: {size} bytes: {text}"
        assert device_message(text) == text.replace('"', "'")  # fits without being cut


def test_messages_that_reach_assert_async_at_run_time_fit_the_device(monkeypatch):
    from usp_graph import masks
    from usp_graph.ops import boundaries, ring

    seen: list[str] = []
    real = torch._assert_async

    def record(ok, *message):
        seen.extend(message)
        return real(ok, *message)

    monkeypatch.setattr(torch, "_assert_async", record)
    cu = torch.tensor([0, 3, 8, 8], dtype=torch.int32)
    boundaries.assert_boundaries(cu, cu, 8, 8, 5, 5)
    masks.check_positions_match(cu, torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]))
    ring._check_ends(cu, 8)
    assert len(seen) == 3, seen
    for message in seen:
        assert 0 < len(message.encode()) <= DEVICE_MESSAGE_BYTES, message


def test_an_over_long_message_is_cut_to_the_device_limit_and_still_fails_the_assertion():
    long = 'attn_implementation="usp": ' + "é" * 300  # two bytes each: cut on a character boundary
    short = device_message(long)
    assert len(short.encode()) <= DEVICE_MESSAGE_BYTES and short.endswith("...")
    assert short.startswith("attn_implementation='usp': é")
    device_assert(torch.tensor(True), long)
    with pytest.raises(RuntimeError, match="attn_implementation='usp': é"):
        device_assert(torch.tensor(False), long)
