"""usp custom ops. Importing this package defines every op and implements its row of
`usp_graph.registry.TABLE` (its backward rule); a row or an op left out fails here."""

from __future__ import annotations

from .. import registry
from . import collectives, halo, ring, varlen

registry.check_complete()

__all__ = ["collectives", "halo", "ring", "varlen"]
