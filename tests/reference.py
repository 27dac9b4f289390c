"""Shared numeric helpers for the tests (they live in `usp_graph.testing`, shared with the benchmarks)."""

from __future__ import annotations

from usp_graph.testing import rel_err

__all__ = ["rel_err"]
