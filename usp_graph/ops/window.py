"""Sliding-window attention: the `(left, right)` window shared by the varlen op and the CP strategies.

# lq / lk query / key count of one document, r query row, c key column

The flash-attention convention (``window_size=(left, right)``): within a document whose query view
has lq rows and key view lk keys, query r sits at key position ``d = r + lk - lq`` (bottom-right
alignment, as for causal) and attends key c iff ``d - left <= c <= d + right``; -1 leaves a side
unbounded. ``is_causal`` is ``right = 0``: the two combine (`bounds`). ``(-1, -1)`` is no window,
and every caller runs exactly its windowless code for it.

Bottom-right alignment anchors the window at the END of each document's views. A strategy whose
query and key views of a document end at different global positions (a query chunk against keys
that reach past it) cannot shift the window per document; it makes the view ends meet instead
(dummy query rows, `usp_graph.cp.strategies`; static chunk views, `usp_graph.ops.ring`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["NO_WINDOW", "check_window", "bounds", "doc_plan", "keep_mask", "flash_window"]

NO_WINDOW = (-1, -1)


def check_window(window: object, where: str = "window") -> tuple[int, int]:
    """`window` as a `(left, right)` tuple of ints >= -1 (None: no window); ValueError otherwise."""
    if window is None:
        return NO_WINDOW
    if type(window) is tuple and len(window) == 2:  # the ops' own call: no ABC check (host time)
        left, right = window
        if type(left) is int and type(right) is int and left >= -1 and right >= -1:
            return window
    ok = (
        isinstance(window, Sequence)
        and not isinstance(window, str)
        and len(window) == 2
        and all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window)
    )
    if not ok:
        raise ValueError(
            f"{where} must be None or (left, right): two ints >= 0, or -1 for an unbounded side "
            f"(flash-attention's window_size); got {window!r}"
        )
    return int(window[0]), int(window[1])


def bounds(window: tuple[int, int], is_causal: bool) -> tuple[int, int]:
    """The effective `(left, right)`: causal is right = 0 (a wider right bound changes nothing)."""
    left, right = window
    return left, (0 if is_causal else right)


def doc_plan(lq: int, lk: int, is_causal: bool, left: int, right: int) -> tuple[str, int, int]:
    """How one document with a window runs: ``("plain" | "causal", -1, -1)`` when the window cuts
    no key beyond what `is_causal` cuts (the windowless kernel call, bit for bit), otherwise
    ``("window", left, right)`` with causality folded into `right` and a side that cuts nothing
    set to -1."""
    right = 0 if is_causal else right
    cuts_left = 0 <= left < lk - 1  # the last row (d = lk - 1) would see keys below d - left
    cuts_right = 0 <= right < lq - 1  # the first row (d = lk - lq) would miss keys above d + right
    if not cuts_left:
        if is_causal or (cuts_right and right == 0):
            return "causal", -1, -1
        if not cuts_right:
            return "plain", -1, -1
    return "window", (left if cuts_left else -1), (right if cuts_right else -1)


def keep_mask(
    rows: range, lq: int, lk: int, keys: range, left: int, right: int, device: torch.device | None = None
) -> Tensor:
    """Boolean `(len(rows), len(keys))`: which keys (columns `keys` of the document's key view)
    the query rows `rows` of a document with lq queries and lk keys attend."""
    d = torch.arange(rows.start, rows.stop, device=device).unsqueeze(1) + (lk - lq)
    c = torch.arange(keys.start, keys.stop, device=device).unsqueeze(0)
    keep = torch.ones(len(rows), len(keys), dtype=torch.bool, device=device)
    if left >= 0:
        keep &= c >= d - left
    if right >= 0:
        keep &= c <= d + right
    return keep


def flash_window(
    max_q: int, max_k: int, is_causal: bool, left: int, right: int
) -> tuple[int, dict[str, int]]:
    """`(max_seqlen_k, keyword arguments)` for ``aten._flash_attention_forward/backward``.

    Flash reads a bound >= max_seqlen_k as none, then gives an unbounded side facing a bounded one
    the bound max_seqlen_k (flash_api.cpp, ``mha_varlen_fwd`` / ``set_params_fprop``). Both are
    exact only while max_seqlen_k >= every document's query count - 1: a view with more queries
    than keys (a CP query chunk against a key chunk) would lose keys. max_seqlen_k is only an
    upper bound, so it is raised to max(max_q, max_k) for windowed calls."""
    if (left, right) == NO_WINDOW:
        return max_k, {}
    left, right = bounds((left, right), is_causal)
    return max(max_q, max_k), {"window_size_left": left, "window_size_right": right}
