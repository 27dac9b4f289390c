"""The one timing and results harness of the scripts in tools/.

Timing has one policy per kind of measurement:

- `time_ms`: a call repeated. On a GPU, CUDA events around each repetition, recorded back to back
  and read after one synchronize (with `barrier=`, the ranks meet before each repetition and each
  one is synchronized); median, min and max. On the CPU, `torch.utils.benchmark.Timer`: the mean of
  `reps` calls in one block (its own two warm-up calls count toward `warmup`).
- `time_interleaved`: several calls, alternating in each round (so drift hits them alike).
- `stopwatch`: something that happens once (a compile, a trace, a save): wall clock between device
  synchronizes.

Results: `Results(path, bench=...)` appends one JSON line per `write(...)`, each with the torch
version, the device name, the git commit, the command line and the measured fields, so a line is
self-describing and runs accumulate in one file.

Scripts run as ``python tools/NAME.py`` have tools/ on sys.path, so ``import harness`` just works.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils.benchmark as torch_benchmark

REPO_ROOT = Path(__file__).resolve().parent.parent
WARMUP = 3
REPS = 20
_CPU_TIMER_WARMUP = 2  # Timer.timeit(n) first runs max(n // 100, 2) calls untimed


@dataclass(frozen=True)
class Timing:
    """Milliseconds per call; `timer` says how they were taken."""

    median_ms: float
    min_ms: float
    max_ms: float
    reps: int
    timer: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def sync(device: torch.device | str | None) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _summary(times_ms: list[float], timer: str) -> Timing:
    return Timing(statistics.median(times_ms), min(times_ms), max(times_ms), len(times_ms), timer)


def time_ms(
    fn: Callable[[], Any],
    device: torch.device | str,
    *,
    warmup: int = WARMUP,
    reps: int = REPS,
    barrier: Callable[[], Any] | None = None,
) -> Timing:
    """Time `fn()` after `warmup` untimed calls (see the module docstring for the policy)."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    device = torch.device(device)
    if device.type != "cuda":
        for _ in range(max(warmup - _CPU_TIMER_WARMUP, 0)):
            fn()
        if barrier is not None:
            barrier()
        timer = torch_benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
        mean_ms = timer.timeit(reps).mean * 1e3
        return Timing(mean_ms, mean_ms, mean_ms, reps, "torch.utils.benchmark mean")
    for _ in range(warmup):
        fn()
    sync(device)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)
    ]
    for start, end in events:
        if barrier is not None:
            barrier()
        start.record()
        fn()
        end.record()
        if barrier is not None:
            sync(device)
    sync(device)
    return _summary([start.elapsed_time(end) for start, end in events], "cuda events")


def time_interleaved(
    fns: dict[str, Callable[[], Any]], device: torch.device | str, *, warmup: int = 1, reps: int = REPS
) -> dict[str, Timing]:
    """Time each of `fns` once per round, in turn, for `reps` rounds after `warmup` rounds."""
    device = torch.device(device)
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                sync(device)
                start.record()
                fn()
                end.record()
                sync(device)
                times[name].append(start.elapsed_time(end))
            else:
                with stopwatch(device) as watch:
                    fn()
                times[name].append(watch.seconds * 1e3)
    timer = "cuda events, interleaved" if device.type == "cuda" else "wall clock, interleaved"
    return {name: _summary(t, timer) for name, t in times.items()}


@dataclass
class Stopwatch:
    seconds: float = float("nan")


@contextlib.contextmanager
def stopwatch(device: torch.device | str | None = None) -> Iterator[Stopwatch]:
    """``with stopwatch(device) as w: ...`` then ``w.seconds``: wall clock of a one-off, with the
    device synchronized before and after."""
    watch = Stopwatch()
    sync(device)
    t0 = time.perf_counter()
    try:
        yield watch
    finally:
        sync(device)
        watch.seconds = time.perf_counter() - t0


def peak_extra_gib(fn: Callable[[], Any], device: torch.device | str) -> float:
    """GiB that one call of `fn` allocates above what was held before it (activations, workspaces,
    results); 0.0 off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0.0
    sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    sync(device)
    del result
    return (torch.cuda.max_memory_allocated(device) - base) / 2**30


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint sorted intervals covering the same time as `intervals`."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def exposed_time(comm: list[tuple[float, float]], compute: list[tuple[float, float]]) -> tuple[float, float]:
    """(time some communication kernel runs, time communication runs while no compute kernel
    does): the exposed communication of a step, from kernel intervals (any unit)."""
    c, k = _union(comm), _union(compute)
    total = sum(b - a for a, b in c)
    hidden, j = 0.0, 0
    for a, b in c:
        while j < len(k) and k[j][1] <= a:
            j += 1
        i = j
        while i < len(k) and k[i][0] < b:
            hidden += min(b, k[i][1]) - max(a, k[i][0])
            i += 1
    return total, total - hidden


def profile_comm(fn: Callable[[], Any], device: torch.device | str) -> dict[str, float] | None:
    """One call of `fn` under torch.profiler: the GPU kernels' busy time (ms), the communication
    kernels' (names with "nccl"), and the communication no compute kernel overlaps (exposed);
    None off CUDA (gloo runs no kernels)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    comm, compute = [], []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or e.time_range.end <= e.time_range.start:
            continue
        span = (float(e.time_range.start), float(e.time_range.end))  # microseconds
        (comm if "nccl" in e.name.lower() else compute).append(span)
    busy = _union(comm + compute)
    comm_us, exposed_us = exposed_time(comm, compute)
    span_us = busy[-1][1] - busy[0][0] if busy else 0.0
    return {"gpu_span_ms": span_us / 1e3, "comm_ms": comm_us / 1e3, "exposed_comm_ms": exposed_us / 1e3}


FLOP_CONVENTION = (
    "useful FLOPs only; per document of n tokens fwd = 4*n^2*H*K (bidirectional) or "
    "4*n(n+1)/2*H*K (causal); fwd+bwd = 3.5 * fwd"
)


def attention_flops(lengths: list[int], heads: int, head_dim: int, causal: bool) -> tuple[float, float]:
    """(fwd, fwd+bwd) useful FLOPs of attention over documents of these lengths: no padding, no
    cross-document or masked-out work; backward = 2.5 x forward (the FlashAttention benchmark
    convention)."""
    pairs = sum(n * (n + 1) // 2 if causal else n * n for n in lengths)
    fwd = 4.0 * pairs * heads * head_dim
    return fwd, 3.5 * fwd


def free_memory(device: torch.device | str) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


_START = time.perf_counter()


def log(message: str) -> None:
    """A progress line with the seconds since start (compiles make some steps slow)."""
    print(f"[{time.perf_counter() - _START:6.1f}s] {message}", flush=True)


# ------------------------------------------------------------------------------------------------
# Results


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=10, check=True
    ).stdout.strip()


def git_commit() -> str | None:
    """The checkout's commit, with "+dirty" when tracked files differ from it."""
    try:
        commit = _git("rev-parse", "--short=12", "HEAD")
        return commit + ("+dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")
    except Exception:
        return None


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def environment(device: torch.device | str) -> dict[str, Any]:
    """What every result line carries besides its own fields."""
    try:
        import triton

        triton_version: str | None = triton.__version__
    except Exception:
        triton_version = None
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "host": platform.node(),
        "device": str(device),
        "device_name": device_name(device),
        "git_commit": git_commit(),
        "command": shlex.join(sys.argv),
    }


class Results:
    """Appends result records as JSON lines to `path` (nothing is written when `path` is None)."""

    def __init__(self, path: str | Path | None, *, bench: str, device: torch.device | str) -> None:
        self.path = None if path is None else Path(path)
        self.header = {"bench": bench, **environment(device)}

    def write(self, **fields: Any) -> dict[str, Any]:
        record = {**self.header, **fields}
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:
                f.write(json.dumps(record, default=str) + "\n")
        return record


def add_json_arg(parser: Any) -> None:
    """The `--json PATH` option every benchmark takes."""
    parser.add_argument("--json", type=Path, default=None, help="append the results here as JSON lines")
