"""Where the GPU waits: the idle gaps between kernels in a torch.profiler trace, each with what the
host was doing when the gap began and which call launched the kernel that ended it.

    python tools/gpu_gaps.py TRACE.json [--top 15] [--min-us 20]

A step's time is its kernels' time plus the gaps between them. A gap is the GPU waiting for the
host: a synchronization (a host read drains the queue, then the GPU idles while the host issues the
next kernel) or host work slower than the kernels it launches. `bench_paths_gpu.py --profile N`
prints this table for one step of each row.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# trace event categories: what runs on the GPU, what runs on the host
_DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")
_HOST = ("cpu_op", "user_annotation", "python_function")


def _busy(events: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """The GPU's busy intervals (us), overlapping kernels (other streams) merged."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events)
    merged: list[tuple[float, float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _host_stack(host: list[dict[str, Any]], at: float, depth: int) -> list[str]:
    """The names of the host ops running at time `at`, outermost first, the innermost `depth`."""
    running = [e for e in host if float(e["ts"]) <= at < float(e["ts"]) + float(e.get("dur", 0))]
    running.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0))))
    return [e["name"] for e in running][-depth:]


def idle_gaps(trace: dict[str, Any], top: int = 15, min_us: float = 20.0, depth: int = 4) -> dict[str, Any]:
    """The GPU's idle gaps of at least `min_us` between its first and last kernel, the longest
    `top` of them with the host ops running where each began (``host``, innermost last) and the
    launch of the kernel that ended it (``then``), plus the totals: ``busy_ms``, ``idle_ms``
    (every gap, short ones too), ``span_ms`` (first kernel's start to last kernel's end)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    device = [e for e in events if e.get("cat") in _DEVICE]
    if not device:
        return {"busy_ms": 0.0, "idle_ms": 0.0, "span_ms": 0.0, "gaps": [], "counted": 0}
    busy = _busy(device)
    host = [e for e in events if e.get("cat") in _HOST]
    launches = {
        e.get("args", {}).get("correlation"): e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver")
        and e.get("args", {}).get("correlation") is not None
    }
    next_kernel = sorted(device, key=lambda e: float(e["ts"]))
    gaps = []
    idle = 0.0
    k = 0
    for (_, end), (start, _) in zip(busy[:-1], busy[1:], strict=True):
        idle += start - end
        if start - end < min_us:
            continue
        while k < len(next_kernel) and float(next_kernel[k]["ts"]) < start:
            k += 1
        gaps.append((start - end, end, next_kernel[k] if k < len(next_kernel) else None))
    gaps.sort(key=lambda g: -g[0])
    shown = []
    for us, end, ending in gaps[:top]:  # the host stacks of the longest only (a scan of the trace each)
        launch = launches.get(ending.get("args", {}).get("correlation")) if ending else None
        shown.append(
            {
                "us": round(us, 1),
                "at_ms": round((end - busy[0][0]) / 1e3, 3),
                "host": _host_stack(host, end, depth),
                "then": (ending or {}).get("name", "")[:80],
                "launched_by": _host_stack(host, float(launch["ts"]), depth) if launch else [],
            }
        )
    return {
        "busy_ms": round(sum(e - s for s, e in busy) / 1e3, 3),
        "idle_ms": round(idle / 1e3, 3),
        "span_ms": round((busy[-1][1] - busy[0][0]) / 1e3, 3),
        "counted": len(gaps),
        "gaps": shown,
    }


def print_gaps(label: str, found: dict[str, Any]) -> None:
    print(
        f"  {label}: GPU busy {found['busy_ms']} ms, idle {found['idle_ms']} ms between kernels over "
        f"{found['span_ms']} ms; {found['counted']} gaps of the minimum or more, the longest:"
    )
    for g in found["gaps"]:
        print(f"    {g['us']:8.1f} us at {g['at_ms']:8.3f} ms  host: {' > '.join(g['host'])[-150:]}")
        print(f"               then {g['then']}  launched in: {' > '.join(g['launched_by'])[-120:]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace", type=Path, help="a chrome trace (torch.profiler's export_chrome_trace)")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--min-us", type=float, default=20.0)
    a = p.parse_args(argv)
    print_gaps(a.trace.name, idle_gaps(json.loads(a.trace.read_text()), a.top, a.min_us))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
