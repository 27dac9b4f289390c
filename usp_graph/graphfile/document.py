"""The file as a JSON document: strict parsing, canonical bytes, fingerprint, format version.

Canonical content = ``json.dumps(doc minus "fingerprint", sort_keys=True, separators=(",", ":"),
ensure_ascii=True, allow_nan=False)``; the fingerprint is ``"sha256:" + sha256(canonical).hexdigest()``.
The file on disk is the same document pretty-printed (one node per line); whitespace and key order
do not change the fingerprint, content does.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from typing import Any

from .errors import CorruptGraphFileError, FingerprintError, GraphFileVersionError

__all__ = ["FORMAT", "FORMAT_VERSION", "fingerprint", "dumps", "parse", "write_atomic"]

FORMAT = "usp_graph.graphfile"
# Bump on any change a version-1 reader would misread; readers refuse every other version.
FORMAT_VERSION = 1

_FINGERPRINT = re.compile(r"sha256:[0-9a-f]{64}")


def canonical_bytes(doc: dict[str, Any]) -> bytes:
    body = {k: v for k, v in doc.items() if k != "fingerprint"}
    return json.dumps(
        body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


def fingerprint(doc: dict[str, Any]) -> str:
    """sha256 over the canonical content (every field but ``fingerprint`` itself)."""
    return "sha256:" + hashlib.sha256(canonical_bytes(doc)).hexdigest()


def _compact(v: Any) -> str:
    return json.dumps(v, separators=(", ", ": "), ensure_ascii=False, allow_nan=False)


def _pretty(v: Any, indent: int, depth: int) -> str:
    # Top-level sections open up; lists two levels down (nodes, inputs) get one item per line.
    expand = (isinstance(v, dict) and depth < 2) or (isinstance(v, list) and depth < 3)
    if not expand or not v:
        return _compact(v)
    pad, end = " " * (indent + 1), " " * indent
    if isinstance(v, dict):
        items = [f"{pad}{json.dumps(k)}: {_pretty(x, indent + 1, depth + 1)}" for k, x in v.items()]
        return "{\n" + ",\n".join(items) + "\n" + end + "}"
    return "[\n" + ",\n".join(pad + _compact(x) for x in v) + "\n" + end + "]"


def dumps(doc: dict[str, Any]) -> str:
    """The document as written to disk (fingerprint included by the caller)."""
    return _pretty(doc, 0, 0) + "\n"


def write_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` to `path` via a temporary file and a rename: a reader never sees half a file."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".graphfile.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise CorruptGraphFileError(f"not a valid graph file: key {k!r} appears twice in one object")
        out[k] = v
    return out


def _no_constants(name: str) -> Any:
    raise CorruptGraphFileError(
        f"not a valid graph file: bare {name} is not JSON (graph files spell non-finite floats as "
        '{"float": "inf"})'
    )


# The largest file `load` reads: a 32-layer train step is a few MB; this is far above any real
# graph and stops a wrong path (a checkpoint, a dataset) from being read into memory whole.
MAX_FILE_BYTES = 512 * 2**20


def check_size(nbytes: int, source: str) -> None:
    if nbytes > MAX_FILE_BYTES:
        raise CorruptGraphFileError(
            f"{source} is {nbytes / 2**20:.0f} MiB, over the {MAX_FILE_BYTES / 2**20:.0f} MiB a graph file may be "
            "(train-step graphs are a few MB): it is not a usp_graph graph file (raise "
            "usp_graph.graphfile.document.MAX_FILE_BYTES if it really is one)"
        )


def read_file(path: Any) -> bytes:
    """The bytes of the file at `path`, refused before reading when over `MAX_FILE_BYTES`."""
    with open(path, "rb") as fh:
        check_size(os.fstat(fh.fileno()).st_size, os.fspath(path))
        return fh.read(MAX_FILE_BYTES + 1)


def parse(data: bytes, *, source: str = "graph file") -> dict[str, Any]:
    """Bytes -> the checked document: JSON, our format, this format version, fingerprint intact.

    Raises CorruptGraphFileError, GraphFileVersionError or FingerprintError (all GraphFileError)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"expected the file's bytes, got {type(data).__name__}")
    check_size(len(data), source)
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptGraphFileError(
            f"{source} is not a usp_graph graph file: not UTF-8 text (byte {e.start}); the file is damaged "
            "or is something else"
        ) from None
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    except json.JSONDecodeError as e:
        # Every graph file ends with its closing brace; without it the likeliest story is a cut.
        ends_early = e.pos >= len(text.rstrip()) or not text.rstrip().endswith("}")
        hint = (
            "the file ends early (truncated: an interrupted write or copy?)"
            if ends_early
            else f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}"
        )
        raise CorruptGraphFileError(f"{source} is not a readable graph file: {hint}; re-save it") from None
    except (ValueError, RecursionError) as e:  # int too long for str->int, nesting too deep
        if isinstance(e, CorruptGraphFileError):
            raise
        raise CorruptGraphFileError(
            f"{source} is not a readable graph file: {type(e).__name__}: {e}"
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptGraphFileError(
            f'{source} is JSON but not a usp_graph graph file (no "format": "{FORMAT}" field)'
        )
    version = doc.get("format_version")
    if version != FORMAT_VERSION:
        if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
            what = "a newer usp_graph wrote it; upgrade usp_graph to read it"
        else:
            what = "re-save the graph with this usp_graph (trace it again, then usp_graph.save)"
        raise GraphFileVersionError(
            f"{source} has graph file format version {version!r}; this usp_graph reads version "
            f"{FORMAT_VERSION} only: {what}"
        )
    stored = doc.get("fingerprint")
    if not isinstance(stored, str) or not _FINGERPRINT.fullmatch(stored):
        raise FingerprintError(
            f'{source} has no valid fingerprint (expected "sha256:<64 hex digits>", got {stored!r:.80}); '
            "the file is damaged: re-save it"
        )
    try:
        actual = fingerprint(doc)
    except (ValueError, TypeError, RecursionError) as e:  # cannot happen for parsed JSON; stay in the family
        raise CorruptGraphFileError(f"{source}: content cannot be hashed: {e}") from None
    if actual != stored:
        raise FingerprintError(
            f"{source}: content does not match its fingerprint (stored {stored[:19]}..., content "
            f"hashes to {actual[:19]}...): the file was modified or damaged after it was written; "
            "re-save it from the traced graph"
        )
    return doc
