"""The package stays in pieces a reader can hold (issue 39): no function over 100 lines, no class
over 250, in every module of `usp_graph`.

A definition's length counts from its ``def``/``class`` line to the last line of its body
(``end_lineno - lineno + 1``): decorators are excluded, its docstring, comments and blank lines
inside the body are included. Nested functions and methods count on their own and inside their
parent. The check reads the source with `ast`; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import usp_graph

PACKAGE = Path(usp_graph.__file__).parent
MAX_FUNCTION_LINES = 100
MAX_CLASS_LINES = 250


def definition_lengths(source: str) -> list[tuple[str, str, int, int]]:
    """(kind, qualified name, first line, length) of every function and class in `source`."""
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                name = f"{prefix}{child.name}"
                out.append((kind, name, child.lineno, child.end_lineno - child.lineno + 1))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return out


def test_lengths_count_from_the_def_line_to_the_end_of_the_body_without_decorators():
    source = "@decorator\n@another(1)\ndef f(\n    x,\n):\n    '''doc'''\n\n    return x\n\n\nclass C:\n    def g(self):\n        pass\n"
    assert definition_lengths(source) == [
        ("function", "f", 3, 6),
        ("class", "C", 11, 3),
        ("function", "C.g", 12, 2),
    ]


def test_no_function_over_100_lines_and_no_class_over_250_in_the_package():
    over = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for kind, name, line, length in definition_lengths(path.read_text()):
            limit = MAX_CLASS_LINES if kind == "class" else MAX_FUNCTION_LINES
            if length > limit:
                over.append(
                    f"{path.relative_to(PACKAGE.parent)}:{line} {kind} {name}: {length} lines (max {limit})"
                )
    assert not over, f"{len(over)} definitions over the limit; split them along what they do:\n" + "\n".join(
        over
    )
