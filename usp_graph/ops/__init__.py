"""usp custom ops. Importing this package defines every op and registers its backward rule."""

from __future__ import annotations

from .. import registry
from . import collectives, halo, ring, varlen

registry.check_complete()

__all__ = ["collectives", "halo", "ring", "varlen"]
