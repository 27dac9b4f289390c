"""`ContextParallel("auto")`: which strategy a run should use, from what is known up front.

# T tokens of a row, P CP ranks, H query heads, G key/value heads, K head dim, U Ulysses degree

Inputs: a sample of the packer's document lengths (a few steps, or the first one: each a list of
lengths filling a row of T tokens), the head counts, P, and two rates measured once on the group at
start-up (`measure_rates`): the link (a fitted latency and bandwidth of an all-to-all) and the
attention kernel (seconds per query-key pair, forward and backward, all heads). For every strategy
and option that can run these steps (Ulysses degrees dividing P, halo when the longest document
fits a shard, zigzag ring for causal attention), `choose` estimates one attention call of a step:

    compute = the busiest rank's query-key pairs x seconds per pair (shard balance included)
    comm    = bytes one rank sends (`cost.bytes_sent`) / bandwidth + messages x latency

and picks the smallest ``compute + comm`` (an upper bound: what `usp_graph.passes.overlap` hides
behind independent compute is not modelled), averaged over the sampled steps. Ties go to the first candidate in a fixed order, so every
rank decides the same; `resolve` also takes rank 0's decision for every rank. The `Decision`
keeps every candidate's estimate and why the others lost or could not run: `Decision.line()` is
the log line, `ContextParallel.decision` the record.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .balance import shard_work
from .cost import bytes_sent

__all__ = ["Candidate", "Decision", "Rates", "choose", "decode_decision", "measure_rates", "resolve"]

log = logging.getLogger("usp_graph.cp")


@dataclass(frozen=True)
class Rates:
    """What one attention call costs on this group: the link's fitted `latency_s` per message and
    `bandwidth` (bytes/s one rank sends), and the kernel's `pair_s`: seconds per causal query-key
    pair of forward + backward over all H heads."""

    latency_s: float
    bandwidth: float
    pair_s: float

    def __post_init__(self) -> None:
        for name in ("latency_s", "bandwidth", "pair_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"Rates.{name} must be a finite number >= 0, got {v!r}")
        if self.bandwidth <= 0 or self.pair_s <= 0:
            raise ValueError(f"Rates needs bandwidth > 0 and pair_s > 0, got {self}")


@dataclass(frozen=True)
class Candidate:
    """One way to run the steps: `strategy` with `options` (ContextParallel keyword arguments), its
    estimated seconds per attention call (mean over the sampled steps), or why it cannot run."""

    strategy: str
    options: dict[str, Any] = field(default_factory=dict)
    compute_s: float = math.inf
    comm_s: float = math.inf
    bytes_per_rank: int = 0
    refused: str | None = None

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def label(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{self.strategy}({opts})" if opts else self.strategy


@dataclass(frozen=True)
class Decision:
    """The chosen candidate and every other one, with the inputs the estimates came from."""

    chosen: Candidate
    candidates: tuple[Candidate, ...]
    rates: Rates
    world: int
    steps: int
    tokens: int

    @property
    def strategy(self) -> str:
        return self.chosen.strategy

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.chosen.options)

    def line(self) -> str:
        """One log line: the choice, its estimate, and the runners-up and refusals."""
        others = sorted((c for c in self.candidates if c is not self.chosen and c.refused is None),
                        key=lambda c: c.total_s)  # fmt: skip
        ran = "; ".join(f"{c.label} {_ms(c.total_s)}" for c in others[:3])
        refused = "; ".join(f"{c.label}: {c.refused}" for c in self.candidates if c.refused)
        c = self.chosen
        return (
            f"ContextParallel('auto') chose {c.label} over {self.world} ranks: {_ms(c.total_s)} per attention "
            f"call (compute {_ms(c.compute_s)}, communication {_ms(c.comm_s)}, {c.bytes_per_rank:,} B sent "
            f"per rank; {self.steps} sampled step(s) of {self.tokens} tokens)"
            + (f"; next: {ran}" if ran else "")
            + (f"; cannot run: {refused}" if refused else "")
        )

    def as_dict(self) -> dict[str, Any]:
        """Plain data (JSON): for graph metadata and reports."""

        def one(c: Candidate) -> dict[str, Any]:
            return {"strategy": c.strategy, "options": dict(c.options), "compute_s": _num(c.compute_s),
                    "comm_s": _num(c.comm_s), "bytes_per_rank": c.bytes_per_rank, "refused": c.refused}  # fmt: skip

        return {
            "chosen": one(self.chosen),
            "candidates": [one(c) for c in self.candidates],
            "rates": {
                "latency_s": self.rates.latency_s,
                "bandwidth": self.rates.bandwidth,
                "pair_s": self.rates.pair_s,
            },
            "world": self.world,
            "steps": self.steps,
            "tokens": self.tokens,
        }


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms"


def _num(x: float) -> float | None:
    return x if math.isfinite(x) else None


# ---- a saved decision read back (a graph file's meta: anyone may have written it) ---------------

# Sizes in a record stay int64 (bytes, tokens); counts are far smaller in any real run.
_MAX_INT = 2**63 - 1
_MAX_CANDIDATES = 1024


def _bad(where: str, what: str, got: Any) -> ValueError:
    shown = type(got).__name__ if isinstance(got, (dict, list)) else repr(got)[:40]
    return ValueError(f"{where} must be {what}, got {shown}")


def _record(d: Any, keys: tuple[str, ...], where: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise _bad(where, "an object", d)
    extra = sorted(set(d) - set(keys))
    if extra:
        raise ValueError(f"{where} has unknown field(s) {[k[:40] for k in extra[:5]]}; it holds {list(keys)}")
    return d


def _int_field(d: dict[str, Any], key: str, where: str, lo: int) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= _MAX_INT:
        raise _bad(f"{where}.{key}", f"an int in [{lo}, 2**63)", v)
    return v


def _seconds(d: dict[str, Any], key: str, where: str, *, optional: bool) -> float | None:
    v = d.get(key)
    if v is None and optional:
        return None
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) <= _MAX_INT
    if not ok or not math.isfinite(v) or v < 0:
        raise _bad(f"{where}.{key}", "a finite number >= 0" + (" or null" if optional else ""), v)
    return float(v)


def _candidate(c: Any, where: str) -> dict[str, Any]:
    c = _record(c, ("strategy", "options", "compute_s", "comm_s", "bytes_per_rank", "refused"), where)
    if not isinstance(c.get("strategy"), str):
        raise _bad(f"{where}.strategy", "a strategy name", c.get("strategy"))
    options = c.get("options", {})
    if not isinstance(options, dict):
        raise _bad(f"{where}.options", "an object of ContextParallel keyword arguments", options)
    for k, v in options.items():
        scalar = v is None or isinstance(v, (bool, str, float)) or (isinstance(v, int) and abs(v) <= _MAX_INT)
        if not scalar or (isinstance(v, float) and not math.isfinite(v)):
            raise _bad(f"{where}.options[{k[:40]!r}]", "a number, text, true/false or null", v)
    refused = c.get("refused")
    if refused is not None and not isinstance(refused, str):
        raise _bad(f"{where}.refused", "a reason (text) or null", refused)
    return {
        "strategy": c["strategy"],
        "options": dict(options),
        "compute_s": _seconds(c, "compute_s", where, optional=True),
        "comm_s": _seconds(c, "comm_s", where, optional=True),
        "bytes_per_rank": _int_field(c, "bytes_per_rank", where, 0),
        "refused": refused,
    }


def decode_decision(data: Any, where: str = "cp_decision") -> dict[str, Any]:
    """A saved `Decision.as_dict` record, checked field by field against its schema, as plain data
    of the same shape (ints bounded to int64, seconds finite and >= 0). ValueError naming the field
    and what it must hold: a record from a file (``meta.cp_decision``) is read by this only."""
    d = _record(data, ("chosen", "candidates", "rates", "world", "steps", "tokens"), where)
    candidates = d.get("candidates")
    if not isinstance(candidates, list) or len(candidates) > _MAX_CANDIDATES:
        raise _bad(f"{where}.candidates", f"a list of at most {_MAX_CANDIDATES} candidates", candidates)
    rates = _record(d.get("rates"), ("latency_s", "bandwidth", "pair_s"), f"{where}.rates")
    return {
        "chosen": _candidate(d.get("chosen"), f"{where}.chosen"),
        "candidates": [_candidate(c, f"{where}.candidates[{i}]") for i, c in enumerate(candidates)],
        "rates": {
            k: _seconds(rates, k, f"{where}.rates", optional=False)
            for k in ("latency_s", "bandwidth", "pair_s")
        },
        "world": _int_field(d, "world", where, 1),
        "steps": _int_field(d, "steps", where, 1),
        "tokens": _int_field(d, "tokens", where, 0),
    }


# ---- the choice (host arithmetic, the same on every rank) ----------------------------------------


def _check_steps(documents: Sequence[Sequence[int]] | Sequence[int]) -> list[list[int]]:
    if isinstance(documents, (str, bytes)) or not isinstance(documents, Sequence) or not documents:
        raise ValueError(
            "documents must be the document lengths of one step (a list of ints) or of several sampled "
            f"steps (a list of such lists), not empty; got {documents!r:.80}"
        )
    steps = [list(documents)] if all(isinstance(n, int) for n in documents) else [list(s) for s in documents]
    tokens = None
    for i, step in enumerate(steps):
        for n in step:
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"documents: step {i} has length {n!r}; lengths are non-negative ints")
        t = sum(step)
        if tokens is None:
            tokens = t
        elif t != tokens:
            raise ValueError(
                f"documents: sampled steps must fill rows of the same length; step 0 holds {tokens} tokens, "
                f"step {i} {t} (pad the last document, as the packer does)"
            )
    if not tokens:
        raise ValueError("documents: the sampled steps hold no tokens")
    return steps


def _check_dims(**dims: int) -> None:
    """Positive ints, and heads a multiple of kv_heads (GQA)."""
    for name, v in dims.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if "heads" in dims and "kv_heads" in dims and dims["heads"] % dims["kv_heads"]:
        raise ValueError(f"heads ({dims['heads']}) must be a multiple of kv_heads ({dims['kv_heads']})")


def _zigzag_work(lengths: Sequence[int], world: int, is_causal: bool) -> list[int]:
    """Pairs per rank when rank p holds chunks p and 2P-1-p of 2P (documents may cross)."""
    chunk = shard_work(lengths, 2 * world, is_causal=is_causal)
    return [chunk[p] + chunk[2 * world - 1 - p] for p in range(world)]


def _messages(strategy: str, world: int, u: int) -> int:
    """Collective calls one rank makes per attention call, forward and backward."""
    if strategy == "ulysses":
        return 8  # q, k, v, out all-to-alls and their adjoints
    if strategy == "allgather_kv":
        return 4  # K, V all-gathers; dK, dV reduce-scatters
    if strategy == "halo":
        return 2  # one K/V halo exchange; its gradients back
    if strategy == "ring":
        return 2 * (world - 1) + 2 * world  # K/V hops forward; K/V and dK/dV hops backward
    r = world // u
    return 8 + 2 * (r - 1) + 2 * r  # usp: Ulysses inside the group, a ring of P/U groups across


def choose(
    documents: Sequence[Sequence[int]] | Sequence[int],
    *,
    world: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    element_size: int,
    rates: Rates,
    is_causal: bool = True,
) -> Decision:
    """The strategy (and options) with the smallest estimated attention time for these steps."""
    steps = _check_steps(documents)
    _check_dims(world=world, heads=heads, kv_heads=kv_heads, head_dim=head_dim, element_size=element_size)
    tokens = sum(steps[0])
    longest = max(max(s, default=0) for s in steps)
    tl = tokens // world
    total_pairs = [sum(shard_work(s, 1, is_causal=is_causal)) for s in steps]
    # Pairs of a causal call are what pair_s was measured on; bidirectional work counts its pairs.
    plans: list[tuple[str, dict[str, Any], str | None]] = []

    def refuse_split(n: int) -> str | None:
        return f"{tokens} tokens do not split into {n} equal shards" if tokens % n else None

    plans.append(
        (
            "ulysses",
            {},
            refuse_split(world)
            or (f"{heads} heads cannot be split over {world} ranks" if heads < world else None),
        )
    )
    plans.append(
        (
            "halo",
            {"max_document_len": longest},
            refuse_split(world)
            or (
                f"the longest sampled document ({longest} tokens) is longer than a shard + 1 ({tl + 1})"
                if longest > tl + 1
                else None
            ),
        )
    )
    plans.append(
        (
            "ring",
            {"load_balance": "zigzag"} if is_causal else {},
            refuse_split(2 * world if is_causal else world),
        )
    )
    plans.append(("allgather_kv", {}, refuse_split(world)))
    for u in range(2, world):
        if world % u == 0:
            plans.append(("usp", {"ulysses_degree": u}, refuse_split(world) or (
                f"{heads} heads cannot be split over {u} ranks" if heads < u else None)))  # fmt: skip

    candidates = []
    for strategy, options, refused in plans:
        if refused is not None or world == 1 and strategy != "ulysses":
            candidates.append(Candidate(strategy, options, refused=refused or "one rank: nothing to split"))
            continue
        compute = comm = 0.0
        sent = 0
        for s, pairs in zip(steps, total_pairs, strict=True):
            if strategy == "ulysses":
                busiest = pairs * math.ceil(heads / world) / heads
            elif strategy == "usp":
                u = options["ulysses_degree"]
                busiest = max(shard_work(s, world // u, is_causal=is_causal)) * math.ceil(heads / u) / heads
            elif strategy == "ring" and is_causal:
                busiest = max(_zigzag_work(s, world, is_causal))
            else:  # contiguous shards: allgather_kv, halo, ring (bidirectional)
                busiest = max(shard_work(s, world, is_causal=is_causal))
            n = bytes_sent(
                strategy, tokens=tokens, heads=heads, kv_heads=kv_heads, head_dim=head_dim, world=world,
                element_size=element_size, ulysses_degree=options.get("ulysses_degree", 1),
                max_document_len=options.get("max_document_len"), is_causal=is_causal,
            )  # fmt: skip
            compute += busiest * rates.pair_s
            comm += (
                n / rates.bandwidth
                + _messages(strategy, world, options.get("ulysses_degree", 1)) * rates.latency_s
            )
            sent += n
        k = len(steps)
        candidates.append(Candidate(strategy, options, compute / k, comm / k, sent // k))
    runnable = [c for c in candidates if c.refused is None]
    if not runnable:
        raise ValueError(
            "ContextParallel('auto'): no strategy can run these steps: "
            + "; ".join(f"{c.label}: {c.refused}" for c in candidates)
        )
    chosen = min(runnable, key=lambda c: c.total_s)  # min keeps the first of equals: a fixed order
    return Decision(chosen, tuple(candidates), rates, world, len(steps), tokens)


# ---- rates measured on the group, once ----------------------------------------------------------


def measure_rates(
    group: dist.ProcessGroup,
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    seq_len: int | None = None,
    repeats: int = 3,
) -> Rates:
    """Time an all-to-all of two sizes (fit latency + size / bandwidth) and one causal varlen
    attention call, forward and backward, of `seq_len` tokens with these heads. Each is the slowest
    rank's best of `repeats`, so every rank gets the same figures."""
    from ..metadata import AttentionMetadata
    from ..ops.varlen import varlen_attn

    device = torch.device(device)
    world = dist.get_world_size(group)
    esize = torch.empty((), dtype=dtype).element_size()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def best(fn) -> float:
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return min(times[1:])

    small, large = 1 << 12, 1 << 22  # bytes one rank sends
    bufs = {
        n: torch.zeros(max(world, n // esize // world * world), dtype=dtype, device=device)
        for n in (small, large)
    }
    outs = {n: torch.empty_like(b) for n, b in bufs.items()}
    t_small = best(lambda: dist.all_to_all_single(outs[small], bufs[small], group=group))
    t_large = best(lambda: dist.all_to_all_single(outs[large], bufs[large], group=group))
    sent = {n: bufs[n].numel() * esize * (world - 1) // world for n in (small, large)}

    n = seq_len or (4096 if device.type == "cuda" else 256)
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(n, heads, head_dim, generator=gen, dtype=dtype).to(device).requires_grad_()
    k = torch.randn(n, kv_heads, head_dim, generator=gen, dtype=dtype).to(device).requires_grad_()
    v = torch.randn(n, kv_heads, head_dim, generator=gen, dtype=dtype).to(device).requires_grad_()
    meta = AttentionMetadata.from_lengths([n]).to(device)

    def attention() -> None:
        out = varlen_attn(q, k, v, meta.cu_seqlens, meta.cu_seqlens, n, n, is_causal=True, enable_gqa=True)
        out.backward(torch.ones_like(out))

    t_attn = best(attention)
    worst = torch.tensor([t_small, t_large, t_attn], dtype=torch.float64)
    if dist.get_backend(group) == "nccl":
        worst = worst.to(device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    t_small, t_large, t_attn = worst.tolist()
    slope = max((t_large - t_small) / max(sent[large] - sent[small], 1), 1e-15)
    latency = max(t_small - slope * sent[small], 0.0)
    return Rates(latency_s=latency, bandwidth=1.0 / slope, pair_s=t_attn / (n * (n + 1) // 2))


def resolve(
    group: dist.ProcessGroup,
    documents: Sequence[Sequence[int]] | Sequence[int],
    *,
    heads: int,
    kv_heads: int | None,
    head_dim: int,
    dtype: torch.dtype,
    is_causal: bool,
    rates: Rates | None,
    device: torch.device | str | None,
) -> Decision:
    """`choose` on rank 0 of `group` (rates measured first unless given) and the same decision on
    every rank; logs `Decision.line()` on rank 0."""
    kv = heads if kv_heads is None else kv_heads
    # A bad sample or shape fails on every rank, before any collective.
    _check_steps(documents)
    _check_dims(heads=heads, kv_heads=kv, head_dim=head_dim)
    if rates is None:
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if dist.get_backend(group) == "nccl"
                else "cpu"
            )
        rates = measure_rates(group, heads=heads, kv_heads=kv, head_dim=head_dim, dtype=dtype, device=device)
    esize = torch.empty((), dtype=dtype).element_size()
    try:
        mine: Decision | ValueError = choose(
            documents, world=dist.get_world_size(group), heads=heads, kv_heads=kv, head_dim=head_dim,
            element_size=esize, rates=rates, is_causal=is_causal,
        )  # fmt: skip
    except ValueError as e:  # raised on every rank below, after the broadcast, never on one alone
        mine = e
    box: list[Any] = [mine]
    dist.broadcast_object_list(box, group_src=0, group=group)
    decision = box[0]
    if isinstance(decision, ValueError):
        raise ValueError(str(decision))
    if dist.get_rank(group) == 0:
        log.info(decision.line())
    return decision
