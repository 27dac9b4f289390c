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
import stat
import tempfile
from typing import Any, BinaryIO

from .errors import CorruptGraphFileError, FingerprintError, GraphFileVersionError

__all__ = ["FORMAT", "FORMAT_VERSION", "fingerprint", "dumps", "parse", "write_atomic"]

FORMAT = "usp_graph.graphfile"
# The one extension graph files carry: what `save` examples, compile dumps, the demo and the CLI's
# directory scan use (loading reads any name; the content decides what a file is).
SUFFIX = ".uspg"
# Bump on any change a version-1 reader would misread; readers refuse every other version.
FORMAT_VERSION = 1

_FINGERPRINT = re.compile(r"sha256:[0-9a-f]{64}")


def canonical_bytes(doc: dict[str, Any]) -> bytes:
    body = {k: v for k, v in doc.items() if k != "fingerprint"}
    return json.dumps(
        body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


def fingerprint(doc: dict[str, Any]) -> str:
    """sha256 over the canonical content (every field but ``fingerprint`` itself).

    Hashed piece by piece (the same bytes as `canonical_bytes`): encoding the whole document at
    once held about 7x the file size in memory on top of the parsed document."""
    h = hashlib.sha256()
    _hash_canonical(h, {k: v for k, v in doc.items() if k != "fingerprint"})
    return "sha256:" + h.hexdigest()


def _hash_canonical(h: Any, v: Any) -> None:
    # json.dumps(sort_keys=True, separators=(",", ":")) writes an object as {"k":v,...} in key order
    # and a list as [a,...]. A value whose encoding is small (`_encoded_size_at_most`) is encoded at
    # once; a larger container is walked, so no encoding holds more than one small piece.
    if not isinstance(v, (dict, list)) or _encoded_size_at_most(v, _PIECE) >= 0:
        h.update(_canonical_piece(v))
        return
    if isinstance(v, list):  # walked in place: a list of pairs would cost 64 bytes an item
        h.update(b"[")
        for i, x in enumerate(v):
            if i:
                h.update(b",")
            _hash_canonical(h, x)
        h.update(b"]")
        return
    h.update(b"{")
    for i, k in enumerate(sorted(v)):
        if not isinstance(k, str):  # json.dumps would write it as a string; no parsed key is one
            raise TypeError(f"keys must be str, got {type(k).__name__}")
        h.update((b"," if i else b"") + _canonical_piece(k) + b":")
        _hash_canonical(h, v[k])
    h.update(b"}")


_PIECE = 1 << 14  # bytes: the most one encoding of a piece of the document may take


def _encoded_size_at_most(v: Any, budget: int) -> int:
    """`budget` minus an upper bound of `v`'s canonical encoding size, or -1 once it is spent (the
    walk stops there, so a huge container costs no more than the budget to look at)."""
    if isinstance(v, str):
        return budget - 6 * len(v) - 2  # \uXXXX per character at worst, and the quotes
    if isinstance(v, (dict, list)):
        budget -= 2
        items = v.items() if isinstance(v, dict) else ((None, x) for x in v)
        for k, x in items:
            if budget < 0:
                return -1
            if k is not None:
                budget = _encoded_size_at_most(k, budget - 2)
                if budget < 0:
                    return -1
            budget = _encoded_size_at_most(x, budget - 1)
        return budget if budget >= 0 else -1
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 1 << 64:
        return budget - len(str(v)) if budget >= len(str(v)) // 2 else -1
    return budget - 32  # a float's repr, a small int, true / false / null


def _canonical_piece(v: Any) -> bytes:
    return json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


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
# graph and stops a wrong path (a checkpoint, a dataset) from being read into memory whole. With
# MAX_PARSE_MULTIPLE it bounds what parsing any file can allocate (issue 17: it was 512 MiB, and a
# file of small containers then took ~12 GiB).
MAX_FILE_BYTES = 128 * 2**20

# Parsing builds Python objects that are larger than their JSON: a list is 56+ bytes for "[]", an
# object 64-184 bytes for "{}", a string 49 bytes plus its text. Before json.loads, `parse_cost`
# bounds from above what the parse can allocate, from byte counts alone (C speed, no allocation),
# and a file whose bound is over MAX_PARSE_MULTIPLE times its size is refused. Real graph files
# bound at 11-13x and take 5-6x (measured: tests/test_graphfile_limits.py); a file of nothing but
# small containers took 24-34x before this check.
MAX_PARSE_MULTIPLE = 20
# Upper bounds (bytes, CPython 3.10-3.13, 64-bit) of what one such character can make the parse
# allocate, the slot in its container included: "[" a list; "{" a dict of up to 5 keys; ":" one
# more key (dict growth); "," one more value (a slot, a float or int); '"' half a string (a new
# string object, or a new key in the decoder's key memo). Measured worst cases per shape are in
# the test; string contents count once more through the bytes themselves.
_COST = {b"[": 88, b"{": 184, b":": 40, b",": 40, b'"': 30}


def check_size(nbytes: int, source: str) -> None:
    if nbytes > MAX_FILE_BYTES:
        raise CorruptGraphFileError(
            f"{source} is {nbytes / 2**20:.0f} MiB, over the {MAX_FILE_BYTES / 2**20:.0f} MiB a graph file may be "
            "(train-step graphs are a few MB): it is not a usp_graph graph file (raise "
            "usp_graph.graphfile.document.MAX_FILE_BYTES if it really is one)"
        )


_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}  # fmt: skip


def not_regular(mode: int) -> str | None:
    """What a file of this `st_mode` is when it is not a regular file (None for a regular file)."""
    if stat.S_ISREG(mode):
        return None
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def open_regular(path: Any) -> BinaryIO:
    """`path` opened for reading in binary mode, or CorruptGraphFileError when it is not a regular
    file. Opened non-blocking first, so a FIFO (which would wait for a writer forever) or a device
    is refused instead of hanging or streaming; the check is on the opened descriptor, so swapping
    the file between a check and the open changes nothing (issue 17)."""
    fd = os.open(os.fspath(path), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        what = not_regular(os.fstat(fd).st_mode)
        if what is not None:
            raise CorruptGraphFileError(
                f"{os.fspath(path)} is {what}, not a regular file: graph files are regular files"
            )
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_file(path: Any) -> bytes:
    """The bytes of the regular file at `path`, refused before reading when over `MAX_FILE_BYTES`
    (and when it is a FIFO, a device or a directory)."""
    with open_regular(path) as fh:
        check_size(os.fstat(fh.fileno()).st_size, os.fspath(path))
        return fh.read(MAX_FILE_BYTES + 1)


def parse_cost(data: bytes) -> int:
    """An upper bound on the bytes `json.loads` allocates for `data` (the decoded text included)."""
    width = 1 if data.isascii() else (4 if max(data) >= 0xF0 else 2)  # str: 1, 2 or 4 bytes a char
    return width * len(data) + sum(w * data.count(c) for c, w in _COST.items())


def check_parse_cost(data: bytes, source: str) -> None:
    cost = parse_cost(data)
    if cost > MAX_PARSE_MULTIPLE * len(data) + 2**16:
        raise CorruptGraphFileError(
            f"{source} is not a usp_graph graph file: parsing its {len(data)} bytes could take up to "
            f"{cost / 2**20:.1f} MiB ({cost / max(len(data), 1):.0f}x its size; graph files stay under "
            f"{MAX_PARSE_MULTIPLE}x): it is packed with more brackets, separators and strings than a graph "
            "file holds"
        )


def parse(data: bytes, *, source: str = "graph file") -> dict[str, Any]:
    """Bytes -> the checked document: JSON, our format, this format version, fingerprint intact.

    Raises CorruptGraphFileError, GraphFileVersionError or FingerprintError (all GraphFileError)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"expected the file's bytes, got {type(data).__name__}")
    check_size(len(data), source)
    data = bytes(data)
    check_parse_cost(data, source)
    try:
        text = data.decode("utf-8")
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
