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


def python_holders(
    min_bytes: int, *, exclude: Any = (), depth: int = 4, lines: int = 40, device: str = "cuda"
) -> list[str]:
    """Who in Python holds each `device` tensor of at least `min_bytes` not in `exclude` (parameters,
    their gradients and optimizer states, say): chains of referrers, by type, up to `depth` steps
    and `lines` lines in all. A tensor held only from C++ (an autograd node's saved tensors, a
    compiled graph's own buffers) has no Python holder and is not listed; a compile's fake tensors
    (which hold no memory) are left out."""
    import gc
    import types
    import warnings

    from torch._subclasses.fake_tensor import is_fake

    gc.collect()
    skip = {id(t) for t in exclude}
    objects = gc.get_objects()
    with warnings.catch_warnings():  # isinstance on a deprecated alias warns
        warnings.simplefilter("ignore")
        found = [
            o for o in objects
            if isinstance(o, torch.Tensor) and o.device.type == device and id(o) not in skip
            and not is_fake(o) and o.untyped_storage().nbytes() >= min_bytes
        ]  # fmt: skip
    out: list[str] = []
    seen = {id(objects), id(found)}

    def name(o: Any) -> str:
        if isinstance(o, types.FrameType):
            return f"frame {o.f_code.co_filename}:{o.f_lineno} {o.f_code.co_name}"
        if isinstance(o, types.FunctionType):
            return f"function {o.__qualname__}"
        if isinstance(o, dict):
            return f"dict {list(o)[:5]}"
        if isinstance(o, (list, tuple)):
            return f"{type(o).__name__} of {len(o)}"
        return f"{type(o).__module__}.{type(o).__qualname__}"

    def walk(o: Any, level: int) -> None:
        if level > depth or len(out) >= lines:
            return
        referrers = gc.get_referrers(o)
        seen.add(id(referrers))
        for r in referrers:
            if id(r) in seen or len(out) >= lines or type(r).__name__.endswith("iterator"):
                continue
            seen.add(id(r))
            out.append("  " * level + "<- " + name(r)[:160])
            if not isinstance(r, (types.ModuleType, type)):
                walk(r, level + 1)

    for t in found:
        out.append(f"{tuple(t.shape)} {t.dtype} ({t.untyped_storage().nbytes() / 2**30:.3f} GiB)")
        walk(t, 1)
    del objects
    return out
