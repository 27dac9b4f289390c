"""Document boundaries of a packed token stream.

# T packed tokens, N document capacity (max_docs)

`cu_seqlens_N1` holds the start of each document and, last, the token count; unused tail slots
repeat the total, so a fixed capacity carries any number of documents up to `max_docs` and the
tensor's shape (hence a traced graph) stays the same when boundaries change between steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["AttentionMetadata"]

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)

# cu_seqlens is int32 (the varlen kernels' type): no document, total or bound may pass it.
INT32_MAX = 2**31 - 1
# Capacity is one int32 slot per document; 2**24 slots (64 MiB) is far above any batch (a 1M-token
# batch of 64-token documents has 16k) and stops max_docs=10**9 from allocating gigabytes (issue 17).
MAX_DOCS = 2**24


def _check_device(device: Any) -> torch.device | None:
    """`device` as a torch.device, or ValueError/TypeError naming it (before any tensor moves).

    Issue 17: 'cuda' on a CPU build raised AssertionError, 'bogus' RuntimeError, and 3.5 was taken
    as a dtype by Tensor.to with a misleading message."""
    if device is None:
        return None
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise TypeError(
            f"device must be a torch.device, a string such as 'cpu' or 'cuda:0', or a CUDA device index, "
            f"got {device!r} ({type(device).__name__})"
        )
    if isinstance(device, int) and device < 0:
        raise ValueError(f"device={device!r}: a CUDA device index is >= 0")
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"device={device!r} is not a device: use 'cpu', 'cuda' or 'cuda:<index>'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={device!r}, but this torch has no usable CUDA device (torch.cuda.is_available() is "
                "False); use device='cpu' or a CUDA build of torch"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"device={device!r}, but there are {torch.cuda.device_count()} CUDA device(s) "
                f"(indices 0..{torch.cuda.device_count() - 1})"
            )
    return dev


def _move(t: torch.Tensor, device: Any) -> torch.Tensor:
    dev = _check_device(device)
    if dev is None:
        return t
    try:
        return t.to(dev)
    except (RuntimeError, AssertionError, ValueError) as e:  # a backend this torch lacks (mps, xpu, ...)
        raise ValueError(f"device={device!r} cannot hold tensors in this process: {e}") from None


def _is_real(t: torch.Tensor) -> bool:
    """False for fake/meta/functional tensors, whose values cannot (and need not) be read."""
    from torch._subclasses.fake_tensor import is_fake

    if torch.compiler.is_compiling():  # Dynamo tracing: its tensors stand for values not yet there
        return False
    return not (t.is_meta or is_fake(t) or type(t) is not torch.Tensor)


def _as_int_list(name: str, values: Any, *, allow_2d: bool = False) -> tuple[list[int], list[int]]:
    """Host ints of `values` (flattened row-major) and the indices where its rows start."""
    if isinstance(values, torch.Tensor):
        if values.dtype not in _INT_DTYPES:
            raise ValueError(f"{name} must be an integer tensor, got dtype {values.dtype}")
        if values.dim() == 2 and allow_2d:
            rows, cols = values.shape
            return values.reshape(-1).tolist(), [r * cols for r in range(rows)]
        if values.dim() != 1:
            allowed = "1-D or 2-D" if allow_2d else "1-D"
            raise ValueError(f"{name} must be {allowed}, got a tensor of shape {tuple(values.shape)}")
        return values.tolist(), [0]
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(
            f"{name} must be a sequence of ints or an integer tensor, got {type(values).__name__}"
        )
    out = []
    for i, x in enumerate(values):
        if isinstance(x, bool) or not isinstance(x, int):
            raise ValueError(f"{name}[{i}] must be an int, got {x!r}")
        out.append(x)
    return out, [0]


@dataclass(frozen=True, eq=False)
class AttentionMetadata:
    """Global document boundaries of a packed token stream.

    cu_seqlens: int32 `(max_docs + 1,)`: document starts, then the token count; unused tail slots
        repeat the total.
    max_seqlen: a static upper bound on any document's length (kernels size work by it).
    total_tokens: the token count, equal to ``cu_seqlens[-1]``.

    Construct it with `from_lengths`, `from_position_ids`, `from_document_ids` or `per_sample`.
    Direct construction validates too. Boundaries may change between steps without retracing as
    long as `max_docs` (capacity) and `max_seqlen` stay the same.
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    total_tokens: int

    def __post_init__(self) -> None:
        cu = self.cu_seqlens
        if not isinstance(cu, torch.Tensor):
            raise ValueError(f"cu_seqlens must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise ValueError(f"cu_seqlens must be int32, got {cu.dtype}; convert with .to(torch.int32)")
        if cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(
                f"cu_seqlens must be 1-D with at least 2 entries (max_docs + 1), got shape {tuple(cu.shape)}"
            )
        for name in ("max_seqlen", "total_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if isinstance(self.max_seqlen, int) and not 0 <= self.max_seqlen <= INT32_MAX:
            raise ValueError(
                f"max_seqlen must be in [0, 2**31 - 1] (kernels take int32 sizes), got {self.max_seqlen}"
            )
        if isinstance(self.total_tokens, int) and not 0 <= self.total_tokens <= INT32_MAX:
            raise ValueError(
                f"total_tokens must be in [0, 2**31 - 1] (cu_seqlens is int32), got {self.total_tokens}"
            )
        if _is_real(cu):
            _check_cu_seqlens(cu, self.max_seqlen, self.total_tokens)

    @classmethod
    def _read_on_host(cls, cu_seqlens: torch.Tensor, max_seqlen: int, total_tokens: int) -> AttentionMetadata:
        """Metadata whose boundaries the caller has just read and checked on the host (usp's own
        readings of position ids or flash-attention's kwargs, once per forward): validation would
        copy them to the host a second time (a second sync on an accelerator)."""
        self = object.__new__(cls)
        object.__setattr__(self, "cu_seqlens", cu_seqlens)
        object.__setattr__(self, "max_seqlen", max_seqlen)
        object.__setattr__(self, "total_tokens", total_tokens)
        return self

    # ---- constructors -------------------------------------------------------------------------

    @classmethod
    def from_lengths(
        cls,
        lengths: Sequence[int] | torch.Tensor,
        *,
        max_docs: int | None = None,
        max_seqlen: int | None = None,
        device: torch.device | str | None = None,
    ) -> AttentionMetadata:
        """Documents of the given lengths, in order. Zero lengths are allowed (empty documents)."""
        lens, _ = _as_int_list("lengths", lengths)
        if not lens:
            raise ValueError("lengths is empty: give at least one document length")
        for i, n in enumerate(lens):
            if n < 0:
                raise ValueError(f"lengths[{i}] = {n} is negative")
        return cls._build(lens, max_docs=max_docs, max_seqlen=max_seqlen, device=device)

    @classmethod
    def from_position_ids(
        cls,
        position_ids: torch.Tensor,
        *,
        max_docs: int | None = None,
        max_seqlen: int | None = None,
        device: torch.device | str | None = None,
    ) -> AttentionMetadata:
        """A document starts at every row start and wherever a position is not its predecessor's
        + 1: a restart at 0 (the padding-free convention) or at any other value (RoBERTa-style
        positions from 2, a document cut off at the start of a pack). That is how transformers
        reads packed position ids (`masking_utils.find_packed_sequence_indices`), so usp and the
        model's own masks agree. Rows of a 2-D tensor are flattened row-major, as the tokens are
        packed."""
        pos, row_starts = _as_int_list("position_ids", position_ids, allow_2d=True)
        if not pos:
            raise ValueError("position_ids is empty")
        for i, p in enumerate(pos):
            if p < 0:
                raise ValueError(f"position_ids has a negative position {p} at flat index {i}")
        starts = sorted(set(row_starts) | {i for i in range(1, len(pos)) if pos[i] != pos[i - 1] + 1})
        return cls._from_starts(starts, len(pos), max_docs, max_seqlen, device)

    @classmethod
    def from_document_ids(
        cls,
        document_ids: torch.Tensor,
        *,
        max_docs: int | None = None,
        max_seqlen: int | None = None,
        device: torch.device | str | None = None,
    ) -> AttentionMetadata:
        """A document starts wherever the id differs from the previous token's and at every row
        start. Ids need not be sorted; two runs of the same id are two documents."""
        ids, row_starts = _as_int_list("document_ids", document_ids, allow_2d=True)
        if not ids:
            raise ValueError("document_ids is empty")
        starts = sorted(set(row_starts) | {i for i in range(1, len(ids)) if ids[i] != ids[i - 1]})
        return cls._from_starts(starts, len(ids), max_docs, max_seqlen, device)

    @classmethod
    def per_sample(
        cls, batch_size: int, seq_len: int, *, device: torch.device | str | None = None
    ) -> AttentionMetadata:
        """One document per batch row: exactly SDPA's own semantics on a `(batch_size, seq_len)` batch."""
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        _check_capacity(batch_size, "batch_size")
        if batch_size * seq_len > INT32_MAX:
            raise ValueError(
                f"batch_size * seq_len = {batch_size} * {seq_len} = {batch_size * seq_len} tokens, over the "
                f"{INT32_MAX} (2**31 - 1) that int32 cu_seqlens can count"
            )
        return cls._build([seq_len] * batch_size, max_docs=None, max_seqlen=None, device=device)

    @classmethod
    def _from_starts(
        cls,
        starts: list[int],
        total: int,
        max_docs: int | None,
        max_seqlen: int | None,
        device: torch.device | str | None,
    ) -> AttentionMetadata:
        bounds = [*starts, total]
        lens = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        return cls._build(lens, max_docs=max_docs, max_seqlen=max_seqlen, device=device)

    @classmethod
    def _build(
        cls,
        lens: list[int],
        *,
        max_docs: int | None,
        max_seqlen: int | None,
        device: torch.device | str | None,
    ) -> AttentionMetadata:
        _check_device(device)  # before any work: a bad device is the caller's first thing to fix
        n = len(lens)
        if max_docs is None:
            max_docs = n
        if isinstance(max_docs, bool) or not isinstance(max_docs, int) or max_docs < 1:
            raise ValueError(f"max_docs must be a positive int, got {max_docs!r}")
        _check_capacity(max_docs, "max_docs")
        if n > max_docs:
            raise ValueError(f"{n} documents exceed the capacity max_docs={max_docs}; raise max_docs")
        longest = max(lens)
        if longest > INT32_MAX:
            doc = lens.index(longest)
            raise ValueError(
                f"document {doc} has {longest} tokens, over {INT32_MAX} (2**31 - 1): cu_seqlens is int32"
            )
        if max_seqlen is None:
            max_seqlen = longest
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
            raise ValueError(f"max_seqlen must be a non-negative int, got {max_seqlen!r}")
        if max_seqlen > INT32_MAX:
            raise ValueError(
                f"max_seqlen={max_seqlen} is over {INT32_MAX} (2**31 - 1): kernels take int32 sizes"
            )
        if longest > max_seqlen:
            doc = lens.index(longest)
            raise ValueError(
                f"document {doc} has {longest} tokens, more than max_seqlen={max_seqlen}; raise max_seqlen"
            )
        cu = [0]
        for length in lens:
            cu.append(cu[-1] + length)
        if cu[-1] > INT32_MAX:
            raise ValueError(
                f"the documents hold {cu[-1]} tokens in total, over the {INT32_MAX} (2**31 - 1) that int32 "
                "cu_seqlens can count"
            )
        # The unused tail repeats the total: filled as a tensor, never as a Python list.
        cu_t = torch.full((max_docs + 1,), cu[-1], dtype=torch.int32)
        cu_t[: n + 1] = torch.tensor(cu, dtype=torch.int32)
        return cls(_move(cu_t, device), max_seqlen, cu[-1])

    # ---- views ---------------------------------------------------------------------------------

    @property
    def max_docs(self) -> int:
        """Capacity: how many documents this metadata's shape can describe."""
        return self.cu_seqlens.numel() - 1

    def lengths(self) -> list[int]:
        """Document lengths, padding slots included as zeros (reads the tensor: a host sync on GPU)."""
        cu = self.cu_seqlens.tolist()
        return [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]

    def to(self, device: torch.device | str) -> AttentionMetadata:
        if device is None:
            raise TypeError("to() needs a device, got None")
        return AttentionMetadata(_move(self.cu_seqlens, device), self.max_seqlen, self.total_tokens)

    def __repr__(self) -> str:
        return (
            f"AttentionMetadata(total_tokens={self.total_tokens}, max_docs={self.max_docs}, "
            f"max_seqlen={self.max_seqlen}, device={self.cu_seqlens.device})"
        )


def check_has_values(metadata: AttentionMetadata | None, door: str) -> None:
    """ValueError naming `door` when `metadata` lives on the meta device: it holds no values, so no
    door can read its documents (each failed on it with a raw "Cannot copy out of meta tensor").
    Building one there stays allowed (its shape and static fields, for planning)."""
    if metadata is None:
        return
    cu = metadata.cu_seqlens
    if cu.is_meta and type(cu) is torch.Tensor and not torch.compiler.is_compiling():
        raise ValueError(
            f"{door}: the metadata's cu_seqlens is on the meta device, which holds no values, so its documents "
            "cannot be read; build it on the device of the tokens (device='cpu' or 'cuda', or "
            "AttentionMetadata.to(device))"
        )


def _check_capacity(max_docs: int, name: str) -> None:
    if max_docs > MAX_DOCS:
        raise ValueError(
            f"{name}={max_docs} document slots is over the {MAX_DOCS} (2**24) a metadata may hold (cu_seqlens "
            f"would take {4 * (max_docs + 1) / 2**20:.0f} MiB); capacity needs one slot per document a batch can "
            "hold, at most one per token"
        )


def _check_cu_seqlens(cu_t: torch.Tensor, max_seqlen: Any, total: Any) -> None:
    # On tensors, not a Python list: a capacity of millions of slots stays cheap (reads the values:
    # a host sync on GPU, as before).
    cu = cu_t.detach().to("cpu", torch.int64)
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0] = {int(cu[0])}")
    lens = cu[1:] - cu[:-1]
    bad = (lens < 0).nonzero()
    if bad.numel():
        i = int(bad[0]) + 1
        raise ValueError(
            f"cu_seqlens must be non-decreasing: cu_seqlens[{i}] = {int(cu[i])} < cu_seqlens[{i - 1}] = {int(cu[i - 1])}"
        )
    if isinstance(total, int) and int(cu[-1]) != total:
        raise ValueError(
            f"cu_seqlens must end at the token count {total}, got cu_seqlens[-1] = {int(cu[-1])}"
        )
    if isinstance(max_seqlen, int):
        bad = (lens > max_seqlen).nonzero()
        if bad.numel():
            i = int(bad[0])
            raise ValueError(f"document {i} has {int(lens[i])} tokens, more than max_seqlen={max_seqlen}")


def capacity_bucket(n: int) -> int:
    """The smallest of 1, 2, 3, 4, 6, 8, 12, 16, ... (powers of two and 1.5 times them) >= n: a
    capacity at most 1.5 x what is needed, from a handful of distinct values."""
    n, p = max(int(n), 1), 1
    while True:
        for b in (p, p + p // 2):
            if b >= n:
                return b
        p *= 2


def fit_to_documents(cu_seqlens: torch.Tensor, bound: int) -> tuple[torch.Tensor, int]:
    """`cu_seqlens` cut after its last non-empty slot, to a capacity of `capacity_bucket` of that
    many slots, and the bound lowered to its longest document: one host read. Every document is
    kept (empty slots may sit anywhere; those past the last document go), and the bound never
    rises above `bound`, so a boundary check on the result fails wherever one on the input would.

    On CUDA every slot and every token of max_seqlen is kernel work (flash varlen and cuDNN launch
    blocks for slots x max_seqlen), so one slot per token with bound L (what documents derived from
    position ids on the device need to be always enough) made a 32K-token step 1.9x slower than
    tight metadata; the read costs one synchronization."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    slots = lens.numel()
    if slots == 0:
        return cu_seqlens, bound
    where = torch.arange(slots, device=lens.device)
    last, longest = (
        int(x) for x in torch.stack((torch.where(lens != 0, where, -1).max(), lens.max().long())).tolist()
    )
    capacity = min(capacity_bucket(last + 1), slots)
    return cu_seqlens[: capacity + 1], min(max(longest, 1), bound)
