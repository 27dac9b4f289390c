"""Every way loading a graph file can be refused, as one exception family.

All are `GraphFileError`, a `ValueError`: a caller that wants "any bad file" catches that one class.
Nothing else escapes `load` / `load_graph_module` for a bad file (the fuzz test holds us to it).
"""

from __future__ import annotations

__all__ = [
    "GraphFileError",
    "CorruptGraphFileError",
    "GraphFileVersionError",
    "FingerprintError",
    "GraphFileSchemaError",
    "DisallowedTargetError",
    "ProcessGroupMismatchError",
    "GraphReplayError",
    "GraphFileVersionWarning",
]


class GraphFileError(ValueError):
    """A graph file cannot be loaded or bound; the message says what is wrong and what to do."""


class CorruptGraphFileError(GraphFileError):
    """The bytes are not a graph file: not UTF-8, not JSON (e.g. truncated), or not our format."""


class GraphFileVersionError(GraphFileError):
    """The file's format version is not the one this usp_graph reads (or, with
    ``strict_versions=True``, it was written by another torch / usp_graph version)."""


class FingerprintError(GraphFileError):
    """The content does not hash to the fingerprint stored with it: modified or damaged after saving."""


class GraphFileSchemaError(GraphFileError):
    """The JSON is intact but breaks the format: a missing or mistyped field, a dangling node
    reference, arguments that do not fit the op's schema, an unknown op, an inconsistent signature."""


class DisallowedTargetError(GraphFileError):
    """A node calls something outside the allowlist (aten/prims/usp/_c10d_functional ops and a
    few `operator` / `torch.sym_*` functions). Such a file is refused before anything runs."""


class ProcessGroupMismatchError(GraphFileError):
    """The process groups a context-parallel graph was saved with cannot be found in this
    process (torch.distributed not initialized, another world size or rank, a group missing)."""


class GraphReplayError(GraphFileError):
    """A loaded graph cannot run on these inputs: the check that runs before any op (every node's
    shapes, dtypes and argument bounds propagated from the actual input sizes) refused a node, or
    an op failed during the run. Nothing the caller passed in was modified."""


class GraphFileVersionWarning(UserWarning):
    """The file was written by another torch or usp_graph version (see the version policy)."""
