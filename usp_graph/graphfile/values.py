"""Argument values, fake-value descriptions and tensor data as JSON.

Argument grammar (what ``node.args`` / ``node.kwargs`` hold):

    null, true/false, 3, 0.5, "tanh"       None, bools, ints, finite floats, strings as themselves
    [a, b, ...]                             a list
    {"tuple": [a, b, ...]}                  a tuple
    {"node": "mm_3"}                        the value of an earlier node
    {"float": "inf" | "-inf" | "nan"}       non-finite floats (JSON has none)
    {"dtype": "float32"}  {"device": "cpu"}  {"layout": "strided"}  {"memory_format": "contiguous_format"}
    {"slice": [start, stop, step]}

Every other shape is refused when loading. Names are looked up in fixed tables (no getattr on
modules with file-chosen names).
"""

from __future__ import annotations

import base64
import math
import re
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from .errors import GraphFileSchemaError

__all__ = [
    "DTYPES",
    "encode_arg",
    "decode_arg",
    "dtype_name",
    "decode_dtype",
    "decode_device",
    "encode_tensor_data",
    "decode_tensor_data",
]

DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}
LAYOUTS: dict[str, torch.layout] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.layout)
}
MEMORY_FORMATS: dict[str, torch.memory_format] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.memory_format)
}
_DEVICE = re.compile(r"[a-z][a-z0-9_]{0,30}(:\d{1,4})?")
_MAX_DEPTH = 32


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def decode_dtype(v: Any, where: str) -> torch.dtype:
    if not isinstance(v, str) or v not in DTYPES:
        raise GraphFileSchemaError(f"{where}: {str(v)[:40]!r} is not a torch dtype name")
    return DTYPES[v]


def decode_device(v: Any, where: str) -> torch.device:
    if not isinstance(v, str) or not _DEVICE.fullmatch(v):
        raise GraphFileSchemaError(f"{where}: {str(v)[:40]!r} is not a device name like 'cpu' or 'cuda:0'")
    try:
        return torch.device(v)
    except (RuntimeError, ValueError) as e:
        raise GraphFileSchemaError(f"{where}: {v!r} is not a device torch knows: {e}") from None


def encode_arg(v: Any, where: str) -> Any:
    """An argument value -> JSON (ValueError naming `where` for a value files cannot hold)."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        if math.isfinite(v):
            return v
        return {"float": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
    if isinstance(v, fx.Node):
        return {"node": v.name}
    if isinstance(v, tuple):
        return {"tuple": [encode_arg(x, where) for x in v]}
    if isinstance(v, list):
        return [encode_arg(x, where) for x in v]
    if isinstance(v, torch.dtype):
        return {"dtype": dtype_name(v)}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    if isinstance(v, torch.layout):
        return {"layout": str(v).removeprefix("torch.")}
    if isinstance(v, torch.memory_format):
        return {"memory_format": str(v).removeprefix("torch.")}
    if isinstance(v, slice):
        return {"slice": [encode_arg(x, where) for x in (v.start, v.stop, v.step)]}
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise ValueError(
            f"{where}: a symbolic value ({v}) is a constant argument, not a node; graph files hold "
            "symbolic sizes only as nodes (e.g. aten.sym_size) so they are recomputed at replay"
        )
    raise ValueError(
        f"{where}: an argument of type {type(v).__name__} ({v!r:.60}) cannot be saved in a graph file"
    )


def decode_arg(data: Any, node: Callable[[str], fx.Node], where: str, depth: int = 0) -> Any:
    """JSON -> an argument value; `node(name)` resolves a reference to an earlier node."""
    if depth > _MAX_DEPTH:
        raise GraphFileSchemaError(f"{where}: arguments nested deeper than {_MAX_DEPTH}")
    if isinstance(data, int) and not isinstance(data, bool) and not -(2**63) <= data < 2**64:
        raise GraphFileSchemaError(f"{where}: an integer of {data.bit_length()} bits does not fit 64 bits")
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [decode_arg(x, node, f"{where}[{i}]", depth + 1) for i, x in enumerate(data)]
    if not isinstance(data, dict) or len(data) != 1:
        raise GraphFileSchemaError(
            f"{where}: expected a value or a one-key tagged object, got {_short(data)}"
        )
    ((tag, v),) = data.items()
    if tag == "node":
        if not isinstance(v, str):
            raise GraphFileSchemaError(f"{where}: a node reference must name a node, got {_short(v)}")
        return node(v)
    if tag == "tuple":
        if not isinstance(v, list):
            raise GraphFileSchemaError(f"{where}: a tuple holds a list, got {_short(v)}")
        return tuple(decode_arg(x, node, f"{where}[{i}]", depth + 1) for i, x in enumerate(v))
    if tag == "float":
        if v not in ("inf", "-inf", "nan"):
            raise GraphFileSchemaError(f"{where}: a tagged float is 'inf', '-inf' or 'nan', got {_short(v)}")
        return float(v)
    if tag == "dtype":
        return decode_dtype(v, where)
    if tag == "device":
        return decode_device(v, where)
    if tag == "layout":
        if not isinstance(v, str) or v not in LAYOUTS:
            raise GraphFileSchemaError(f"{where}: {_short(v)} is not a torch layout")
        return LAYOUTS[v]
    if tag == "memory_format":
        if not isinstance(v, str) or v not in MEMORY_FORMATS:
            raise GraphFileSchemaError(f"{where}: {_short(v)} is not a torch memory format")
        return MEMORY_FORMATS[v]
    if tag == "slice":
        if not isinstance(v, list) or len(v) != 3:
            raise GraphFileSchemaError(f"{where}: a slice is [start, stop, step], got {_short(v)}")
        parts = [decode_arg(x, node, f"{where}.slice[{i}]", depth + 1) for i, x in enumerate(v)]
        if not all(p is None or isinstance(p, (int, fx.Node)) and not isinstance(p, bool) for p in parts):
            raise GraphFileSchemaError(f"{where}: slice bounds are ints, nodes or null")
        return slice(*parts)
    raise GraphFileSchemaError(f"{where}: unknown value tag {tag[:40]!r}")


# ---- tensor data (buffers, constants) -------------------------------------------------------------


def encode_tensor_data(t: torch.Tensor) -> dict[str, Any]:
    """A real tensor's values: dtype, shape, device and little-endian bytes in base64.

    Callable while a FakeTensorMode is active (a torch.compile backend's hooks run inside
    AOTAutograd's): the real data is read with fake mode switched off. A fake tensor is encoded
    from the real constant it wraps (``FakeTensor.constant``); one without is refused.
    """
    from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

    if sys.byteorder != "little":
        raise ValueError(
            "graph files store tensor data little-endian; saving on a big-endian host is not supported"
        )
    if is_fake(t):
        real = getattr(t, "constant", None)
        if real is None:
            raise ValueError(
                f"a fake tensor ({dtype_name(t.dtype)}{list(t.shape)}) has no data to save; give the graph a real "
                "tensor (e.g. the module attribute's value, not its fake copy)"
            )
        t = real
    if t.device.type == "meta":
        raise ValueError(f"a meta tensor ({dtype_name(t.dtype)}{list(t.shape)}) has no data to save")
    with unset_fake_temporarily():
        cpu = t.detach().to("cpu").contiguous()
        # reshape(-1): a 0-d tensor (a scalar constant) cannot be viewed as bytes directly.
        raw = cpu.reshape(-1).view(torch.uint8).numpy().tobytes() if cpu.numel() else b""
    return {
        "dtype": dtype_name(t.dtype),
        "shape": list(t.shape),
        "device": str(t.device),
        "data": base64.b64encode(raw).decode("ascii"),
    }


def decode_tensor_data(data: Any, where: str) -> torch.Tensor:
    if not isinstance(data, dict) or set(data) != {"dtype", "shape", "device", "data"}:
        raise GraphFileSchemaError(f"{where}: tensor data has keys dtype, shape, device, data")
    dtype = decode_dtype(data["dtype"], f"{where}.dtype")
    device = decode_device(data["device"], f"{where}.device")
    shape = data["shape"]
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape
    ):
        raise GraphFileSchemaError(f"{where}.shape: a list of non-negative ints")
    if not isinstance(data["data"], str):
        raise GraphFileSchemaError(f"{where}.data: base64 text")
    try:
        raw = base64.b64decode(data["data"], validate=True)
    except ValueError:
        raise GraphFileSchemaError(f"{where}.data: not valid base64") from None
    numel = math.prod(shape)
    itemsize = dtype.itemsize
    if len(raw) != numel * itemsize:
        raise GraphFileSchemaError(
            f"{where}.data: {len(raw)} bytes for {numel} {dtype_name(dtype)} elements ({numel * itemsize} expected)"
        )
    if sys.byteorder != "little":
        raise GraphFileSchemaError(f"{where}: tensor data is little-endian; this host is big-endian")
    try:
        flat = (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        )
        t = flat.view(dtype).reshape(shape).clone() if numel else torch.empty(shape, dtype=dtype)
    except (RuntimeError, TypeError) as e:
        raise GraphFileSchemaError(
            f"{where}: cannot rebuild a {dtype_name(dtype)} tensor from bytes: {e}"
        ) from None
    if device.type != "cpu":
        try:
            t = t.to(device)
        except (RuntimeError, AssertionError) as e:
            raise GraphFileSchemaError(
                f"{where}: saved on {device}, which this process cannot use: {e}"
            ) from None
    return t


def _short(x: Any) -> str:
    s = repr(x)
    return s if len(s) <= 60 else s[:57] + "..."
