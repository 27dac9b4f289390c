"""What is alive at a step's peak of allocated GPU memory, grouped by where it was allocated.

`peak_live(step)` runs `step()` once under torch's allocator history (Python stacks only) and walks
the trace: allocated bytes rise with each ``alloc`` and fall with each ``free_completed``, from the
bytes allocated when the step began. At the maximum it takes the blocks then alive that the step
allocated and groups them by their allocation site: the innermost frame outside torch's own Python
(for inductor's generated code, the line that allocates the buffer, read from the generated file),
and the innermost frame of the model or usp_graph beside it. Used by `bench_paths_gpu.py
--memory-trace` to say why one row's peak is above another's.
"""

from __future__ import annotations

import linecache
import os
from collections.abc import Callable
from typing import Any

import torch

_TORCH = os.sep + "torch" + os.sep
_OWN = ("usp_graph", "transformers")


def _site(frames: list[dict[str, Any]]) -> tuple[str, str]:
    """(allocation site, the model's or usp's innermost frame) of one trace entry's frames."""
    site = owner = ""
    for f in frames:  # innermost first
        path, line, name = f.get("filename", "?"), f.get("line", 0), f.get("name", "?")
        generated = "torchinductor" in path
        if not site and (generated or _TORCH not in path):
            text = linecache.getline(path, line).strip() if generated else ""
            site = f"{os.path.basename(path)}:{line} {name}" + (f" `{text[:110]}`" if text else "")
        if not owner and any(o + os.sep in path for o in _OWN):
            owner = f"{path.rsplit(os.sep + 'site-packages' + os.sep, 1)[-1]}:{line} {name}"
        if site and owner:
            break
    if not site and frames:
        f = frames[0]
        site = f"{os.path.basename(f.get('filename', '?'))}:{f.get('line', 0)} {f.get('name', '?')}"
    return site, owner


def peak_live(step: Callable[[], Any], *, top: int = 15, max_entries: int = 400_000) -> dict[str, Any]:
    """One `step()` under the allocator history: the peak (GiB), the bytes alive before the step,
    the site of the allocation that reached the peak, and the `top` groups alive then."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    live: dict[int, dict[str, Any]] = {}
    now = best = base
    best_live: dict[int, dict[str, Any]] = {}
    best_at = None
    for i, e in enumerate(trace):
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = e
            now += e["size"]
            if now > best:
                best, best_at, best_live = now, i, dict(live)
        elif action == "free_completed":
            now -= e["size"]
            live.pop(e["addr"], None)
    groups: dict[tuple[str, str], list[int]] = {}
    for e in best_live.values():
        g = groups.setdefault(_site(e.get("frames", [])), [0, 0])
        g[0] += e["size"]
        g[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "peak_gib": round(best / 2**30, 3),
        "before_step_gib": round(base / 2**30, 3),
        "peak_at": f"{best_at} of {len(trace)} trace entries",
        "peak_site": " | ".join(_site(trace[best_at].get("frames", []))) if best_at is not None else None,
        "live": [
            {"gib": round(b / 2**30, 3), "blocks": n, "site": site, "owner": owner}
            for (site, owner), (b, n) in ranked
        ],
    }


def live_now(*, top: int = 15) -> list[dict[str, Any]]:
    """The blocks allocated now, grouped by allocation site as `peak_live` groups them. Blocks
    allocated before the history was turned on (`record_history`) have no frames: one group."""
    torch.cuda.synchronize()
    groups: dict[tuple[str, str], list[int]] = {}
    for seg in torch.cuda.memory._snapshot()["segments"]:
        for b in seg["blocks"]:
            if b["state"] != "active_allocated":
                continue
            frames = b.get("frames") or []
            g = groups.setdefault(_site(frames) if frames else ("(no history)", ""), [0, 0])
            g[0] += b["size"]
            g[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return [
        {"gib": round(b / 2**30, 3), "blocks": n, "site": site, "owner": owner}
        for (site, owner), (b, n) in ranked
    ]


def record_history(max_entries: int = 400_000) -> None:
    """Turn the allocator history on (Python stacks) for `live_now`."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")


def print_peak(label: str, result: dict[str, Any]) -> None:
    print(f"  {label}: peak {result['peak_gib']} GiB ({result['before_step_gib']} before the step), "
          f"at {result['peak_at']}: {result['peak_site']}")  # fmt: skip
    for g in result["live"]:
        print(f"    {g['gib']:7.3f} GiB {g['blocks']:4d}x  {g['site'][:150]}  [{g['owner']}]")
