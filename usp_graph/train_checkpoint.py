"""The training recipe's checkpoints: raw tensor bytes and a JSON index, read without pickle.

    ROOT/step_N/
      tensors.bin        every tensor's bytes back to back (C order, little-endian), nothing else
      checkpoint.json    {"format": "usp_graph.train", "version": 1, "step": N,
                          "model": {fqn: REF}, "optim": {fqn: {key: REF}}, "param_groups": [...]}
    REF = {"dtype": "float32", "shape": [4, 8], "offset": 0}   (its bytes: tensors.bin[offset:offset + nbytes])

Why not `torch.distributed.checkpoint`: its reader unpickles ``.metadata`` and loads non-tensor
items with ``torch.load(weights_only=False)``, so resuming a checkpoint someone else wrote could run
their code (issue 31). Nothing here unpickles, imports or evaluates file content: the index is JSON
decoded against a schema (`read_index`), every tensor is `torch.frombuffer` of a byte range whose
dtype and shape the model itself expects (`expect`), so a checkpoint can be wrong but not hostile,
and reading one costs at most the model's and optimizer's own size.

Layout: the *full* (unsharded) state. Every rank takes part in gathering it (FSDP2 shards it);
rank 0 writes it; every rank reads it on resume and keeps its own shard (`set_state_dict`), so a
checkpoint resumes on any ``--dp``/``--cp``/``--fsdp`` layout. The directory must be on a file
system that every rank sees (as it had to be for `torch.distributed.checkpoint`).

Saves are atomic: the files go to a sibling ``.step_N.tmp.<pid>`` directory, fsynced, which is
then renamed to ``step_N``; an existing ``step_N`` is swapped with it in one step on Linux
(``renameat2(RENAME_EXCHANGE)``; elsewhere moved aside first) and removed only after. An
interrupted save leaves at most a dot-directory that resume never looks at, and every earlier
checkpoint as it was.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
import sys
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CheckpointError",
    "Index",
    "find",
    "read_index",
    "read_regular_file",
    "read_state",
    "save_state",
]

FORMAT, VERSION = "usp_graph.train", 1
INDEX, DATA = "checkpoint.json", "tensors.bin"
MAX_INDEX_BYTES = 16 << 20
# Names in the file, mapped to torch dtypes only when tensors are built (stdlib-only decoding).
DTYPES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}  # fmt: skip
SCALAR_TYPES = (str, int, float, bool, type(None))


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or written; the message names the path and what is wrong."""


def read_regular_file(path: str, cap: int, what: str) -> bytes:
    """The bytes of a regular file of at most `cap` bytes, else `CheckpointError`.

    Opened non-blocking and checked on the open descriptor: a FIFO, a device (``/dev/zero``) or a
    directory is refused before any read, so nothing hangs or reads without bound."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise CheckpointError(f"{what} {path}: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"{what} {path}: not a regular file")
        # Bounded even when st_size lies (a file still growing, /proc): read one byte past the cap.
        data = f.read(cap + 1)
    if len(data) > cap:
        raise CheckpointError(f"{what} {path}: larger than {cap:,} bytes")
    return data


# ---- the index: a schema, decoded in one pass ------------------------------------------------------


@dataclass(frozen=True)
class Ref:
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Index:
    """A decoded ``checkpoint.json``: where each tensor's bytes are; nothing read from tensors.bin yet."""

    path: str
    step: int
    model: dict[str, Ref]
    optim: dict[str, dict[str, Ref | float]]
    param_groups: list[dict[str, Any]]
    data_bytes: int


def _fail(path: str, why: str) -> CheckpointError:
    return CheckpointError(f"--resume {path}: {why}")


def _no_constants(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def _int(x: Any, lo: int = 0) -> bool:
    return type(x) is int and x >= lo


def _ref(path: str, where: str, r: Any) -> Ref:
    if not (isinstance(r, dict) and set(r) == {"dtype", "shape", "offset"}):
        raise _fail(path, f"{where}: a tensor entry is {{dtype, shape, offset}}")
    dtype, shape, offset = r["dtype"], r["shape"], r["offset"]
    if dtype not in DTYPES:
        raise _fail(path, f"{where}: dtype {str(dtype)[:40]!r} is not one of {', '.join(DTYPES)}")
    if not (isinstance(shape, list) and len(shape) <= 8 and all(_int(n) for n in shape) and _int(offset)):
        raise _fail(path, f"{where}: shape must be a list of at most 8 ints >= 0, offset an int >= 0")
    return Ref(dtype, tuple(shape), offset, math.prod(shape) * DTYPES[dtype])


def _number(x: Any) -> float | None:
    """`x` as a finite float, or None: not a JSON number (a bool, a string), not finite, or an int
    too large for a float (a 400-digit lr)."""
    if type(x) not in (int, float):
        return None
    try:
        f = float(x)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


# AdamW's hyperparameters (the recipe's optimizer), taken from the checkpoint once each is a number
# in the range torch's AdamW accepts (eps > 0: with eps 0 a zero second moment divides by zero).
# Every other option (amsgrad, maximize, capturable, foreach, ...) changes what a step computes or
# which state it keeps, so `read_state` requires the live optimizer's value.
HYPERPARAMETERS: dict[str, tuple[str, Any]] = {
    "lr": ("a number >= 0", lambda x: x >= 0),
    "eps": ("a number > 0", lambda x: x > 0),
    "weight_decay": ("a number >= 0", lambda x: x >= 0),
    "betas": ("two numbers in [0, 1)", lambda x: 0 <= x < 1),
}


def _shown(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:30] + f"... ({len(text)} characters)"


def _option(path: str, key: str, v: Any) -> Any:
    """One param group option, decoded: a hyperparameter in its range, else a JSON scalar or a
    list of numbers (a tuple, as torch's optimizers keep betas)."""
    if key in HYPERPARAMETERS:
        what, ok = HYPERPARAMETERS[key]
        if key == "betas":
            numbers = [_number(x) for x in v] if isinstance(v, list) and len(v) == 2 else [None]
        else:
            numbers = [_number(v)]
        if any(x is None or not ok(x) for x in numbers):
            raise _fail(path, f"optimizer option {key!r} must be {what}, got {_shown(v)}")
        return tuple(numbers) if key == "betas" else numbers[0]
    if isinstance(v, list):
        if not all(_number(x) is not None for x in v):
            raise _fail(path, f"param group option {key[:40]!r} must be a list of finite numbers")
        return tuple(v)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and _number(v) is None:
        raise _fail(path, f"param group option {key[:40]!r} must be a finite number, got {_shown(v)}")
    if not isinstance(v, SCALAR_TYPES):
        raise _fail(path, f"param group option {key[:40]!r} must be a number, string, bool, null or list")
    return v


def _param_groups(path: str, groups: Any) -> list[dict[str, Any]]:
    if not (isinstance(groups, list) and groups and all(isinstance(g, dict) for g in groups)):
        raise _fail(path, "param_groups must be a non-empty list of objects")
    out = []
    for g in groups:
        params = g.get("params")
        if not (isinstance(params, list) and all(isinstance(p, str) for p in params)):
            raise _fail(path, "each param group needs params: a list of parameter names")
        group: dict[str, Any] = {"params": list(params)}
        group.update((k, _option(path, k, v)) for k, v in g.items() if k != "params")
        out.append(group)
    return out


def _state_entry(path: str, fqn: str, key: str, v: Any) -> Ref | float:
    """One per-parameter optimizer state entry: a tensor reference or a finite number."""
    where = f"optim {fqn[:80]!r} {key[:40]!r}"
    if isinstance(v, dict):
        return _ref(path, where, v)
    if _number(v) is None:
        raise _fail(path, f"{where}: must be a tensor entry or a finite number, got {_shown(v)}")
    return float(v)


def read_index(path: str) -> Index:
    """Decode ``path/checkpoint.json`` and check it against ``path/tensors.bin``'s size.

    Raises `CheckpointError` for anything malformed, a tensor range outside the data file, two
    ranges that overlap, or a data file longer or shorter than the ranges (a truncated save)."""
    raw = read_regular_file(os.path.join(path, INDEX), MAX_INDEX_BYTES, "--resume")
    try:
        doc = json.loads(raw, parse_constant=_no_constants)
    except (ValueError, RecursionError) as e:
        raise _fail(path, f"{INDEX} is not valid JSON ({str(e)[:120]})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise _fail(path, f"{INDEX} is not a usp_graph.train checkpoint index")
    if doc.get("version") != VERSION:
        raise _fail(
            path, f"checkpoint version {str(doc.get('version'))[:20]!r}; this usp_graph reads {VERSION}"
        )
    if doc.get("byteorder", "little") != sys.byteorder:
        raise _fail(
            path,
            f"written on a {str(doc.get('byteorder'))[:10]!r}-endian machine; this one is {sys.byteorder}",
        )
    step = doc.get("step")
    if not _int(step, 1):
        raise _fail(path, "step must be an int >= 1")
    model, optim = doc.get("model"), doc.get("optim")
    if not (isinstance(model, dict) and model and isinstance(optim, dict)):
        raise _fail(path, "model (non-empty) and optim must be objects")
    refs: list[Ref] = []
    model_refs = {str(k): _ref(path, f"model {k[:80]!r}", r) for k, r in model.items()}
    refs += model_refs.values()
    optim_refs: dict[str, dict[str, Ref | float]] = {}
    for fqn, state in optim.items():
        if not isinstance(state, dict):
            raise _fail(path, f"optim {fqn[:80]!r} must be an object")
        entry = {str(k): _state_entry(path, fqn, k, v) for k, v in state.items()}
        refs += [r for r in entry.values() if isinstance(r, Ref)]
        optim_refs[fqn] = entry
    groups = _param_groups(path, doc.get("param_groups"))
    try:
        st = os.stat(os.path.join(path, DATA))
    except OSError as e:
        raise _fail(path, f"{DATA}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):  # a FIFO would block the read, a device never end
        raise _fail(path, f"{DATA} is not a regular file")
    size = st.st_size
    at = 0
    for r in sorted(refs, key=lambda r: r.offset):  # the ranges tile the data file exactly
        if r.offset != at:
            raise _fail(path, f"tensor byte ranges overlap or leave a gap at byte {min(r.offset, at)}")
        at += r.nbytes
    if at != size:
        raise _fail(
            path, f"{DATA} is {size:,} bytes, its index describes {at:,} (truncated or not this index's file)"
        )
    return Index(path, step, model_refs, optim_refs, groups, size)


def find(path: str) -> str:
    """The checkpoint `path` names: `path` itself, or its newest ``step_N`` that holds an index."""
    if os.path.isfile(os.path.join(path, INDEX)):
        return path
    if not os.path.isdir(path):
        raise CheckpointError(f"--resume {path}: no such directory")
    steps, pickled = [], os.path.isfile(os.path.join(path, ".metadata"))
    for name in os.listdir(path):
        if name.startswith("step_") and name[5:].isdigit():
            if os.path.isfile(os.path.join(path, name, INDEX)):
                steps.append(int(name[5:]))
            pickled = pickled or os.path.isfile(os.path.join(path, name, ".metadata"))
    if steps:
        return os.path.join(path, f"step_{max(steps)}")
    if pickled:
        raise CheckpointError(
            f"--resume {path}: a torch.distributed.checkpoint directory; its .metadata is a pickle, which can "
            "run code when loaded, so the recipe reads only checkpoints it wrote itself (checkpoint.json + tensors.bin)"
        )
    raise CheckpointError(
        f"--resume {path}: no checkpoint there (give a --save DIR or one of its step_N directories)"
    )


# ---- reading tensors ------------------------------------------------------------------------------


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _check_model(path: str, index: Index, model_expect: dict[str, tuple[Any, tuple[int, ...]]]) -> None:
    names = set(model_expect)
    if set(index.model) != names:
        missing, extra = sorted(names - set(index.model)), sorted(set(index.model) - names)
        raise _fail(
            path,
            f"not this model's checkpoint (missing {missing[:3]}, unexpected {[n[:80] for n in extra[:3]]})",
        )
    for name, r in index.model.items():
        dtype, shape = model_expect[name]
        if r.shape != tuple(shape):
            raise _fail(path, f"{name} has shape {list(r.shape)}, the model's is {list(shape)}")
        if _torch_dtype(r.dtype) != dtype:
            raise _fail(
                path, f"{name} is {r.dtype}, the model's is {str(dtype).removeprefix('torch.')} (--dtype)"
            )


def _check_groups(path: str, index: Index, groups: list[dict[str, Any]]) -> set[str]:
    """The saved param groups hold the live optimizer's parameters and options: hyperparameters
    (`HYPERPARAMETERS`, already in range) are taken; every other option must be the live one.
    Returns the optimized parameters' names."""
    if len(index.param_groups) != len(groups):
        raise _fail(
            path, f"{len(index.param_groups)} optimizer param groups, the optimizer has {len(groups)}"
        )
    params: set[str] = set()
    for saved, live in zip(index.param_groups, groups, strict=True):
        if sorted(saved["params"]) != sorted(live["params"]):
            raise _fail(
                path, "the optimizer's param groups hold other parameters (not this model's checkpoint?)"
            )
        if set(saved) != set(live):
            raise _fail(path, f"optimizer options {sorted(set(saved) ^ set(live))[:3]} differ from AdamW's")
        for k, v in saved.items():
            if k in HYPERPARAMETERS or k == "params":
                continue
            if type(v) is not type(live[k]) or v != live[k]:
                raise _fail(
                    path,
                    f"optimizer option {k!r} is {_shown(v)}; the recipe's AdamW runs with {live[k]!r} (it "
                    "changes what a step computes or which state it keeps)",
                )
        params.update(saved["params"])
    return params


# What `read_state` accepts for each kind of per-parameter optimizer state entry.
STATE_KINDS = ("step", "param", "param_nonnegative")


def _check_state_refs(
    path: str, index: Index, model_expect: dict, params: set[str], state_keys: dict
) -> None:
    for fqn, state in index.optim.items():
        if fqn not in params:
            raise _fail(path, f"optimizer state for {fqn[:80]!r}, which is not an optimized parameter")
        if set(state) != set(state_keys):
            raise _fail(
                path,
                f"optimizer state of {fqn} has {[k[:40] for k in sorted(state)[:5]]}, not {sorted(state_keys)}",
            )
        dtype, shape = model_expect[fqn]
        for k, r in state.items():
            if state_keys[k] != "step":
                ok = isinstance(r, Ref) and r.shape == tuple(shape) and _torch_dtype(r.dtype) == dtype
            else:
                ok = not isinstance(r, Ref) or (r.shape == () and r.dtype.startswith(("float", "bfloat")))
            if not ok:
                raise _fail(path, f"optimizer {k!r} of {fqn} has the wrong kind, dtype or shape")


def _check_state_values(path: str, step: int, state: dict[str, dict[str, Any]], state_keys: dict) -> None:
    """The values a step would divide by or count with: a step count is a whole number in
    [0, the checkpoint's step]; moments are finite, second moments >= 0."""
    import torch

    for fqn, entry in state.items():
        for k, v in entry.items():
            kind = state_keys[k]
            if kind == "step":
                n = float(v)
                if not (math.isfinite(n) and n == int(n) and 0 <= n <= step):
                    raise _fail(path, f"optimizer {k!r} of {fqn} is {n!r}, not a whole number in [0, {step}]")
            elif not bool(torch.isfinite(v).all()):
                raise _fail(path, f"optimizer {k!r} of {fqn} holds values that are not finite")
            elif kind == "param_nonnegative" and bool((v < 0).any()):
                raise _fail(path, f"optimizer {k!r} of {fqn} holds negative values (it is a mean of squares)")


def read_state(
    index: Index,
    model_expect: dict[str, tuple[Any, tuple[int, ...]]],
    *,
    groups: list[dict[str, Any]],
    state_keys: dict[str, str],
) -> tuple[dict, dict]:
    """The full model and optimizer state dicts of `index`, checked against the live ones first.

    `model_expect` maps each model state name to (torch dtype, global shape); `groups` are the live
    optimizer's param groups (parameter names under ``params``); `state_keys` names the kind
    (`STATE_KINDS`) of each per-parameter optimizer state entry: ``"param"`` (the parameter's dtype
    and shape, finite), ``"param_nonnegative"`` (also >= 0) or ``"step"`` (shape (), any float
    dtype, or a number: a whole count in [0, the checkpoint's step]). Nothing is read before the
    names, dtypes, shapes and options hold (the bytes read are bounded by the model's and
    optimizer's own size), and nothing is returned before the optimizer's values do: the first
    optimizer step finds the state it expects."""
    path = index.path
    unknown = sorted(set(state_keys.values()) - set(STATE_KINDS))
    assert not unknown, f"state kinds {unknown} are not among {STATE_KINDS}"
    _check_model(path, index, model_expect)
    params = _check_groups(path, index, groups)
    _check_state_refs(path, index, model_expect, params, state_keys)

    import torch

    def load(f, r: Ref):
        if r.nbytes == 0:
            return torch.empty(r.shape, dtype=_torch_dtype(r.dtype))
        f.seek(r.offset)
        buf = bytearray(r.nbytes)
        if f.readinto(buf) != r.nbytes:
            raise _fail(path, f"{DATA} ended early (changed while reading?)")
        return torch.frombuffer(buf, dtype=_torch_dtype(r.dtype)).reshape(r.shape)

    try:
        with open(os.path.join(path, DATA), "rb") as f:
            msd = {name: load(f, r) for name, r in index.model.items()}
            state = {
                fqn: {k: load(f, v) if isinstance(v, Ref) else v for k, v in entry.items()}
                for fqn, entry in index.optim.items()
            }
    except OSError as e:
        raise _fail(path, f"{DATA}: {e.strerror or e}") from None
    _check_state_values(path, index.step, state, state_keys)
    groups = [dict(g, params=list(g["params"])) for g in index.param_groups]
    return msd, {"state": state, "param_groups": groups}


# ---- writing --------------------------------------------------------------------------------------


def _write_item(f, t) -> int:
    """Append one tensor's bytes to `f`; returns how many (a seam for the interrupted-save test)."""
    import torch

    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel():
        f.write(memoryview(flat.view(torch.uint8).numpy()))
    return flat.numel() * flat.element_size()


def _exchange(a: str, b: str) -> bool:
    """Swap two directories in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a libc without it (glibc < 2.28, musl)
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_state(root: str, step: int, msd: dict, osd: dict) -> str:
    """Write ``root/step_{step}`` atomically from full state dicts; returns its path.

    The previous ``step_{step}`` (if any) and every other checkpoint stay whole until the new
    one is: an exception at any point leaves them as they were and removes the partial copy."""
    import torch

    final = os.path.join(root, f"step_{step}")
    tmp = os.path.join(root, f".step_{step}.tmp.{os.getpid()}")
    old = os.path.join(root, f".step_{step}.old.{os.getpid()}")
    try:
        os.makedirs(root, exist_ok=True)
        if os.path.lexists(final) and not os.path.isdir(final):
            raise CheckpointError(f"--save {root}: {final} exists and is not a directory")
        shutil.rmtree(tmp, ignore_errors=True)
        os.mkdir(tmp)
    except OSError as e:
        raise CheckpointError(f"--save {root}: {e.strerror or e}") from None

    def ref(t, at: int) -> dict:
        return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": at}

    try:
        at = 0
        index: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "byteorder": sys.byteorder,
            "step": step,
        }
        index["model"], index["optim"] = {}, {}
        with open(os.path.join(tmp, DATA), "wb") as f:
            for name, t in msd.items():
                index["model"][name] = ref(t, at)
                at += _write_item(f, t)
            for fqn, state in osd["state"].items():
                entry = index["optim"][fqn] = {}
                for k, v in state.items():
                    if isinstance(v, torch.Tensor):
                        entry[k] = ref(v, at)
                        at += _write_item(f, v)
                    else:
                        entry[k] = v
            f.flush()
            os.fsync(f.fileno())
        index["param_groups"] = osd["param_groups"]
        with open(os.path.join(tmp, INDEX), "w") as f:
            json.dump(index, f, allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        # Rename into place. A same-named old checkpoint (a directory cannot be renamed over a
        # non-empty one) is swapped with the new one in one step where the kernel can; else moved
        # aside first. Either way it is deleted only once the new one has its name.
        if not os.path.isdir(final):
            os.rename(tmp, final)
        elif _exchange(tmp, final):
            os.rename(tmp, old)  # the old checkpoint, now under the temporary name
        else:
            os.rename(final, old)
            os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.isdir(old) and not os.path.exists(final):
            os.rename(old, final)
        if isinstance(e, OSError):
            raise CheckpointError(f"--save {root}: {e.strerror or e}") from None
        raise
    shutil.rmtree(old, ignore_errors=True)
    return final
