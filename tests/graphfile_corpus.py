"""Hostile graph files for the red-team tests, built in memory (no binary files are committed).

- `build_bases()`: valid files: a Llama train step (`trace_train_step` + `save`), a symbolic graph
  module (`make_fx(tracing_mode="symbolic")` + `save_graph_module`) and a static graph module with
  views, indexing, multi-output ops and in-place ops on intermediates (int sizes to mutate).
- `example_inputs(base)`: the inputs each base replays on (fresh tensors on every call).
- `crafted_corpus(bases)`: one `Crafted` file per attack of issue 17, several variants per class,
  each with a valid fingerprint, and the outcome the loader owes it (`EXPECT`).
- `mutate(data, rng)`: the seeded mutators of the fuzzers: byte-level (bit flips, cuts, splices),
  random JSON edits, and semantic edits that reach replay (op swaps of the same arity, int
  arguments, in-place writes to inputs, rewired arguments, reserved names).

Issue 17: "Graph files safe to load and replay from an untrusted source".
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from usp_graph.graphfile.document import canonical_bytes, dumps, fingerprint

# ---- base files -----------------------------------------------------------------------------------

STEP, GM_SYM, GM_OPS = "step", "gm_sym", "gm_ops"
BASES = (STEP, GM_SYM, GM_OPS)


def _llama():
    from usp_graph import AttentionMetadata
    from usp_graph.models import Llama, LlamaConfig, make_llama_batch

    config = LlamaConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Llama(config)
    batch = make_llama_batch(config, [3, 5], generator=torch.Generator().manual_seed(0))
    meta = AttentionMetadata.from_position_ids(batch["position_ids"], max_docs=4)
    return model, batch, meta


def _sym_fn(x_NC: torch.Tensor) -> torch.Tensor:
    return (x_NC * torch.tensor([1.0, 2.0, 3.0])).clamp(max=float("inf")).sum(0) / x_NC.shape[0]


def _ops_fn(x: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x (4, 6) float, idx (3,) int64 in [0, 4): views, indexing, multi-output ops, static sizes."""
    y = x.view(2, 12).t().contiguous()
    z = y.reshape(6, 4).transpose(0, 1)[1:3]
    w = torch.index_select(x, 0, idx)
    s = torch.softmax(w, -1) @ x.t()
    m, i = s.max(-1)
    a, b = torch.split(x, [2, 4], 1)
    c = torch.cat([a, b[:, :2]], 0)
    e = torch.nn.functional.embedding(idx, x)
    g = torch.gather(x, 1, idx.view(3, 1).expand(3, 2))
    u = x.unsqueeze(0).expand(2, 4, 6).sum(0)
    v = (x.clone() + 1) * w.sum()
    r = torch.arange(6) * 2 + x.new_zeros(6)
    return s, m, i, c, e, g, u, v, z.cumsum(1), torch.where(x > 0, x, 0.0), r, x[idx]


_BASES: dict[str, bytes] = {}


def use_bases(bases: dict[str, bytes]) -> None:
    """Make `build_bases` return these (a worker process reads them from disk instead of tracing)."""
    _BASES.update(bases)


def build_bases() -> dict[str, bytes]:
    """name -> the bytes of a valid graph file (deterministic; the train step takes ~4 s; built once)."""
    if _BASES:
        return _BASES
    from torch.fx.experimental.proxy_tensor import make_fx

    from usp_graph import trace_train_step
    from usp_graph.graphfile import save, save_graph_module
    from usp_graph.models import llama_loss

    model, batch, meta = _llama()
    out = {}
    with tempfile.TemporaryDirectory() as folder:
        save(trace_train_step(model, llama_loss, batch, meta), os.path.join(folder, "step.json"))
        save_graph_module(
            make_fx(_sym_fn, tracing_mode="symbolic")(torch.randn(4, 3)),
            os.path.join(folder, "gm_sym.json"),
            meta={"k": [1]},
        )
        x, idx = example_inputs(GM_OPS)
        save_graph_module(make_fx(_ops_fn)(x, idx), os.path.join(folder, "gm_ops.json"))
        for name in BASES:
            with open(os.path.join(folder, f"{name}.json"), "rb") as fh:
                out[name] = fh.read()
    use_bases(out)
    return _BASES


def example_inputs(base: str, *, rows: int = 4) -> Any:
    """Fresh inputs for a base: (params, batch, metadata) for the train step, a tuple of positional
    inputs for graph modules. `rows`: the dynamic dim of GM_SYM's input."""
    if base == STEP:
        from usp_graph import AttentionMetadata

        model, batch, meta = _llama()
        params = {n: torch.nn.Parameter(p.detach().clone()) for n, p in model.named_parameters()}
        return params, batch, AttentionMetadata(meta.cu_seqlens.clone(), meta.max_seqlen, meta.total_tokens)
    g = torch.Generator().manual_seed(1)
    if base == GM_SYM:
        return (torch.randn(rows, 3, generator=g),)
    if base == GM_OPS:
        return torch.randn(4, 6, generator=g), torch.tensor([3, 0, 2])
    raise ValueError(f"unknown base {base!r}; one of {BASES}")


# ---- documents ------------------------------------------------------------------------------------


def load_doc(data: bytes) -> dict[str, Any]:
    return json.loads(data)


def fast_fingerprint(doc: dict[str, Any]) -> str:
    """`fingerprint(doc)` in one C-encoded pass: sha256 of `canonical_bytes`, the same bytes the
    loader hashes piece by piece (tests/test_graphfile_limits.py checks the two agree; the loader's
    own check of every file still uses `fingerprint`). A document the encoder cannot write at once
    (nested past its recursion limit) goes through `fingerprint`, which raises the same errors."""
    try:
        body = canonical_bytes(doc)
    except RecursionError:
        return fingerprint(doc)
    return "sha256:" + hashlib.sha256(body).hexdigest()


def to_bytes(doc: dict[str, Any]) -> bytes:
    """The document with a fresh, valid fingerprint, as `save` writes it."""
    doc["fingerprint"] = fast_fingerprint(doc)
    return dumps(doc).encode()


def with_raw_value(doc: dict[str, Any], path: tuple[Any, ...], raw_json: str) -> bytes:
    """`doc` with the JSON text `raw_json` at `path` and a valid fingerprint, for values that
    `json.dumps` cannot write itself (nesting deeper than the recursion limit)."""
    marker = "\u2603usp_redteam_raw\u2603"
    doc = copy.deepcopy(doc)
    doc.pop("fingerprint", None)
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    parent[path[-1]] = marker
    quoted = json.dumps(marker)
    canonical = canonical_bytes(doc).decode().replace(quoted, raw_json)
    import hashlib

    doc["fingerprint"] = "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).replace(quoted, raw_json).encode()


def ref(name: str) -> dict[str, str]:
    return {"node": name}


def call(name: str, target: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    node = {"name": name, "op": "call_function", "target": target, "args": list(args)}
    if kwargs:
        node["kwargs"] = kwargs
    return node


def placeholder(name: str) -> dict[str, Any]:
    return {"name": name, "op": "placeholder"}


def get_attr(name: str, target: str | None = None) -> dict[str, Any]:
    return {"name": name, "op": "get_attr", "target": target or name}


def output(*names: str) -> dict[str, Any]:
    value = ref(names[0]) if len(names) == 1 else [ref(n) for n in names]
    return {"name": "output", "op": "output", "args": [value]}


def tensor_data(t: torch.Tensor) -> dict[str, Any]:
    from usp_graph.graphfile.values import encode_tensor_data

    return encode_tensor_data(t)


def gm_doc(
    bases: dict[str, bytes],
    nodes: list[dict[str, Any]],
    *,
    inputs: list[dict[str, Any]] | None = None,
    constants: dict[str, torch.Tensor] | None = None,
    guards: list[Any] | None = None,
    static: bool = False,
) -> dict[str, Any]:
    """A graph-module document over GM_SYM's header: one float32 input ``x`` of shape ($s75, 3)
    ((4, 3) when static) unless `inputs` says otherwise."""
    doc = load_doc(bases[GM_SYM])
    doc["graph"] = {"nodes": nodes, "meta": {}}
    doc["inputs"] = inputs or [
        {"node": "x", "name": "x", "role": "input", "kind": "tensor", "dtype": "float32",
         "shape": [4, 3] if static else ["$s75", 3], "device": "cpu"}
    ]  # fmt: skip
    doc["constants"] = {k: tensor_data(v) for k, v in (constants or {}).items()}
    doc["guards"] = guards or []
    return doc


def step_doc(
    bases: dict[str, bytes], extra: list[dict[str, Any]], *, at: str = "after_inputs"
) -> dict[str, Any]:
    """The train step with `extra` nodes inserted after the placeholders (or before the output)."""
    doc = load_doc(bases[STEP])
    nodes = doc["graph"]["nodes"]
    i = (
        max(k for k, n in enumerate(nodes) if n["op"] == "placeholder") + 1
        if at == "after_inputs"
        else len(nodes) - 1
    )
    nodes[i:i] = extra
    return doc


def rename(doc: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    """Rename node `old` to `new` everywhere: node names, references, input specs, constants."""

    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            if set(x) == {"node"} and x["node"] == old:
                return {"node": new}
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    for n in doc["graph"]["nodes"]:
        if n.get("name") == old:
            n["name"] = new
            if n["op"] == "placeholder" and "target" in n:
                n["target"] = new
        for k in ("args", "kwargs"):
            if k in n:
                n[k] = walk(n[k])
    for spec in doc["inputs"]:
        if spec.get("node") == old:
            spec["node"] = new
    return doc


def rename_constant(doc: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    doc["constants"][new] = doc["constants"].pop(old)
    for n in doc["graph"]["nodes"]:
        if n["op"] == "get_attr" and n.get("target") == old:
            n["target"] = new
    return doc


# ---- the crafted corpus ---------------------------------------------------------------------------

# What a crafted file must do (on top of the invariants every file owes: no crash, no hang, the
# caller's tensors and the global RNG state unchanged, no file written, bitwise-equal outputs
# across a heap disturbance):
EXPECT = {
    "load_error": "refused at load with a GraphFileError",
    "refused": "refused with a GraphFileError at load, or at replay before anything runs",
    "replay_error": "loads, then replay raises GraphReplayError (the shapes only mismatch at replay)",
    "refused_or_correct": "refused at load, or replays to the same outputs as the file with plain names",
    "bounded": "any allowed outcome, within the time and memory limits of the test",
    "no_side_effects": "any allowed outcome (refused, or runs with inputs, RNG state and files untouched)",
}


@dataclass(frozen=True)
class Crafted:
    """One hostile file: `cls` is the class of issue 17, `expect` a key of EXPECT, `base` the base
    whose example inputs replay it (`rows`: GM_SYM's dynamic dim), `reference` the bytes whose
    replay the file must match (names), `marker` a path the file must not create."""

    name: str
    cls: str
    data: bytes
    expect: str
    base: str = GM_SYM
    rows: int = 4
    reference: bytes | None = None
    marker: str | None = None
    isolated: bool = False  # run in its own process (memory measured)


def marker_path(name: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"usp_graph_redteam_{os.getuid()}_{name}")


_BIG = 1 << 24  # elements: 64 MiB of float32 past a 12-element input


def _memory_safety(b: dict[str, bytes]) -> list[Crafted]:
    x = [placeholder("x")]
    idx_far = torch.tensor([1_000_000])
    cases = {
        # the issue's files: a view past the storage, then a write / a read
        "reshape_alias_fill": [call("a", "aten._reshape_alias.default", ref("x"), [_BIG], [1]),
                               call("f", "aten.fill_.Scalar", ref("a"), 7.0), output("f")],
        "reshape_alias_stride_fill": [call("a", "aten._reshape_alias.default", ref("x"), [64], [1 << 18]),
                                      call("f", "aten.fill_.Scalar", ref("a"), -1.0), output("x")],
        "reshape_alias_clone": [call("a", "aten._reshape_alias.default", ref("x"), [1 << 18], [1]),
                                call("c", "aten.clone.default", ref("a")), output("c")],
        "reshape_alias_copy": [call("c", "aten._reshape_alias_copy.default", ref("x"), [1 << 16], [1]),
                               output("c")],
        "as_strided_clone": [call("a", "aten.as_strided.default", ref("x"), [1 << 16], [1]),
                             call("c", "aten.clone.default", ref("a")), output("c")],
        "as_strided_offset_read": [call("a", "aten.as_strided.default", ref("x"), [12], [1], 1 << 16),
                                   call("c", "aten.mul.Tensor", ref("a"), ref("a")), output("c")],
        "as_strided_copy_read": [call("c", "aten.as_strided_copy.default", ref("x"), [4096], [3]), output("c")],
        "as_strided_negative_offset": [call("a", "aten.as_strided.default", ref("x"), [4], [1], -(1 << 20)),
                                       call("c", "aten.clone.default", ref("a")), output("c")],
        "as_strided_inplace_then_clone": [call("k", "aten.clone.default", ref("x")),
                                          call("a", "aten.as_strided_.default", ref("k"), [1 << 16], [1]),
                                          call("c", "aten.clone.default", ref("a")), output("c")],
        "as_strided_scatter_write": [call("s", "aten.full.default", [1 << 16], 3.0),
                                     call("c", "aten.as_strided_scatter.default", ref("x"), ref("s"), [1 << 16], [1]),
                                     output("c")],
        "as_strided_zero_stride_add_": [call("k", "aten.clone.default", ref("x")),
                                        call("a", "aten.as_strided.default", ref("k"), [8, 8], [1 << 14, 1]),
                                        call("f", "aten.add_.Scalar", ref("a"), 1.0), output("k")],
        "unsafe_view_read": [call("c", "aten._unsafe_view.default", ref("x"), [1 << 16]),
                             call("d", "aten.clone.default", ref("c")), output("d")],
        "unsafe_index_read": [get_attr("i"), call("c", "aten._unsafe_index.Tensor", ref("x"), [ref("i")]),
                              output("c")],
        "unsafe_index_put_write": [get_attr("i"), call("v", "aten.full.default", [1, 3], 5.0),
                                   call("c", "aten._unsafe_index_put.default", ref("x"), [ref("i")], ref("v")),
                                   output("c")],
        "index_put_impl_unsafe": [get_attr("i"), call("k", "aten.clone.default", ref("x")),
                                  call("v", "aten.full.default", [1, 3], 5.0),
                                  call("c", "aten._index_put_impl_.default", ref("k"), [ref("i")], ref("v"), False, True),
                                  output("c")],
        "unsafe_masked_index_read": [get_attr("i"), call("m", "aten.full.default", [1], True, dtype={"dtype": "bool"}),
                                     call("c", "aten._unsafe_masked_index.default", ref("x"), ref("m"), [ref("i")], 0.0),
                                     output("c")],
        "resize_clone_grows": [call("k", "aten.clone.default", ref("x")),
                               call("r", "aten.resize_.default", ref("k"), [1 << 12]), output("r")],
        "empty_output": [call("e", "aten.empty.memory_format", [64]), output("e")],
        "empty_strided_output": [call("e", "aten.empty_strided.default", [8, 8], [8, 1]), output("e")],
        "new_empty_output": [call("e", "aten.new_empty.default", ref("x"), [32]), output("e")],
    }  # fmt: skip
    out = []
    for name, nodes in cases.items():
        consts = {"i": idx_far} if any(n.get("op") == "get_attr" for n in nodes) else None
        doc = gm_doc(b, x + nodes, constants=consts, static=True)
        # An uninitialized tensor is heap content too; a zero-filling replay is also correct there.
        expect = "no_side_effects" if "empty" in name else "refused"
        out.append(Crafted(name, "memory_safety", to_bytes(doc), expect))
    # backward kernels that trust the shape of a saved statistic (mean, rstd, softmax output,
    # logsumexp) and read it once per row of the gradient: a 1-element statistic for 16K rows
    rows = 1 << 14
    stats = {
        "layer_norm_backward_short_stats": (
            [call("g", "aten.full.default", [rows, 3], 1.0), get_attr("m"), get_attr("w"),
             call("r", "aten.native_layer_norm_backward.default", ref("g"), ref("g"), [3], ref("m"), ref("m"), ref("w"),
                  ref("w"), [True, True, True]),
             call("o", "operator.getitem", ref("r"), 0), output("o")],
            {"m": torch.ones(1, 1), "w": torch.ones(3)}),
        "log_softmax_backward_short_output": (
            [call("g", "aten.full.default", [rows, 3], 1.0), get_attr("m"),
             call("o", "aten._log_softmax_backward_data.default", ref("g"), ref("m"), 1, {"dtype": "float32"}),
             output("o")],
            {"m": torch.ones(1, 3)}),
        "softmax_backward_short_output": (
            [call("g", "aten.full.default", [rows, 3], 1.0), get_attr("m"),
             call("o", "aten._softmax_backward_data.default", ref("g"), ref("m"), 1, {"dtype": "float32"}),
             output("o")],
            {"m": torch.ones(1, 3)}),
        "sdpa_cpu_backward_short_logsumexp": (
            [call("g", "aten.full.default", [1, 1, 4096, 8], 1.0), get_attr("m"),
             call("r", "aten._scaled_dot_product_flash_attention_for_cpu_backward.default", ref("g"), ref("g"), ref("g"),
                  ref("g"), ref("g"), ref("m"), 0.0, False),
             call("o", "operator.getitem", ref("r"), 1), output("o")],
            {"m": torch.ones(1, 1, 1)}),
        "rms_norm_backward_short_rstd": (
            [call("g", "aten.full.default", [rows, 3], 1.0), get_attr("m"), get_attr("w"),
             call("r", "aten._fused_rms_norm_backward.default", ref("g"), ref("g"), [3], ref("m"), ref("w"), [True, True]),
             call("o", "operator.getitem", ref("r"), 0), output("o")],
            {"m": torch.ones(1, 1), "w": torch.ones(3)}),
    }  # fmt: skip
    for name, (nodes, consts) in stats.items():
        out.append(
            Crafted(
                name,
                "memory_safety",
                to_bytes(gm_doc(b, x + nodes, constants=consts, static=True)),
                "refused",
            )
        )
    # sparse tensors built from unchecked indices, then densified
    for name, index, target in (
        ("sparse_coo_dims_2pow40_to_dense", 2**40, "aten._to_dense.default"),
        ("sparse_coo_dims_negative_to_dense", -5, "aten._to_dense.default"),
        ("sparse_coo_dims_2pow40_to_dense_via_sum", 2**40, "aten.sum.default"),
    ):
        nodes = x + [
            get_attr("i"), get_attr("v"),
            call("s", "aten._sparse_coo_tensor_with_dims_and_tensors.default", 1, 0, [4], ref("i"), ref("v"),
                 dtype={"dtype": "float32"}, layout={"layout": "sparse_coo"}, device={"device": "cpu"}),
            call("d", target, ref("s")), output("d"),
        ]  # fmt: skip
        consts = {"i": torch.tensor([[index]]), "v": torch.tensor([1.0])}
        out.append(
            Crafted(
                name, "memory_safety", to_bytes(gm_doc(b, nodes, constants=consts, static=True)), "refused"
            )
        )
    nodes = x + [get_attr("i"), get_attr("v"),
                 call("s", "aten._sparse_coo_tensor_unsafe.default", ref("i"), ref("v"), [4]),
                 call("d", "aten._to_dense.default", ref("s")), output("d")]  # fmt: skip
    consts = {"i": torch.tensor([[2**40]]), "v": torch.tensor([1.0])}
    out.append(Crafted("sparse_coo_unsafe_to_dense", "memory_safety",
                       to_bytes(gm_doc(b, nodes, constants=consts, static=True)), "refused"))  # fmt: skip
    nodes = x + [get_attr("crow"), get_attr("col"), get_attr("v"),
                 call("s", "aten._sparse_csr_tensor_unsafe.default", ref("crow"), ref("col"), ref("v"), [2, 2]),
                 call("d", "aten._to_dense.default", ref("s")), output("d")]  # fmt: skip
    consts = {"crow": torch.tensor([0, 1, 1]), "col": torch.tensor([1 << 30]), "v": torch.tensor([1.0])}
    out.append(Crafted("sparse_csr_unsafe_to_dense", "memory_safety",
                       to_bytes(gm_doc(b, nodes, constants=consts, static=True)), "refused"))  # fmt: skip
    # the same attacks inside a real train step, on an activation
    doc = load_doc(b[STEP])
    nodes = doc["graph"]["nodes"]
    k = next(i for i, n in enumerate(nodes) if n.get("target") == "aten.mm.default")
    mm = nodes[k]["name"]
    nodes[k + 1 : k + 1] = [
        call("evil_alias", "aten._reshape_alias.default", ref(mm), [_BIG], [1]),
        call("evil_fill", "aten.fill_.Scalar", ref("evil_alias"), 3.0),
    ]
    out.append(
        Crafted("step_reshape_alias_fill_activation", "memory_safety", to_bytes(doc), "refused", base=STEP)
    )
    doc = load_doc(b[STEP])
    nodes = doc["graph"]["nodes"]
    loss = doc["graph"]["nodes"][-1]["args"][0]["tuple"][0]["node"]
    nodes[-1:-1] = [
        call("evil_strided", "aten.as_strided.default", ref(loss), [1 << 16], [1]),
        call("evil_sum", "aten.sum.default", ref("evil_strided")),
        call("evil_loss", "aten.add.Tensor", ref(loss), ref("evil_sum")),
    ]
    nodes[-1]["args"][0]["tuple"][0] = ref("evil_loss")
    out.append(
        Crafted("step_as_strided_heap_read_into_loss", "memory_safety", to_bytes(doc), "refused", base=STEP)
    )
    return out


def _side_effects(b: dict[str, bytes]) -> list[Crafted]:
    out = []
    x = [placeholder("x")]
    global_ops = {
        "manual_seed": [call("s", "aten.manual_seed.default", 1337), output("x")],
        "manual_seed_in_step": None,
        "save_tensor": [call("s", "aten.save.default", ref("x"), marker_path("save_tensor")), output("x")],
        "save_list": [call("s", "aten.save.default", [ref("x")], marker_path("save_list")), output("x")],
        "print": [call("s", "aten._print.default", "usp_graph red team was here"), output("x")],
        "bernoulli_global_rng": [call("s", "aten.bernoulli.p", ref("x"), 0.5), output("s")],
        "normal_global_rng": [call("k", "aten.clone.default", ref("x")), call("s", "aten.normal_.default", ref("k")),
                              output("s")],
        "rand_global_rng": [call("s", "aten.rand.default", [4]), output("s")],
        "assert_async_fails": [call("z", "aten.zeros.default", [1]), call("s", "aten._assert_async.msg", ref("z"), "boom"),
                               output("x")],
    }  # fmt: skip
    for name, nodes in global_ops.items():
        if nodes is None:
            doc = step_doc(b, [call("evil_seed", "aten.manual_seed.default", 1337)])
            out.append(Crafted(name, "side_effects", to_bytes(doc), "refused", base=STEP))
            continue
        marker = marker_path(name) if name.startswith("save") else None
        expect = "no_side_effects" if "rng" in name else "refused"
        out.append(
            Crafted(name, "side_effects", to_bytes(gm_doc(b, x + nodes, static=True)), expect, marker=marker)
        )
    # writes to the caller's tensors: parameters, batch, metadata, graph-module inputs
    p, ids, cu = "p_tok_embeddings_weight", "in_input_ids", "cu_seqlens_N1"
    writes = {
        "mul_scalar_param": [call("evil", "aten.mul_.Scalar", ref(p), 0)],
        "zero_param": [call("evil", "aten.zero_.default", ref("p_norm_weight"))],
        "fill_param": [call("evil", "aten.fill_.Scalar", ref("p_lm_head_weight"), 1.0)],
        "copy_into_param": [call("z", "aten.zeros.default", [32, 16]), call("evil", "aten.copy_.default", ref(p), ref("z"))],
        "add_out_param": [call("evil", "aten.add.out", ref(p), ref(p), out=ref(p))],
        "mul_out_param": [call("evil", "aten.mul.out", ref(p), ref(p), out=ref(p))],
        "foreach_mul_params": [call("evil", "aten._foreach_mul_.Scalar", [ref(p), ref("p_norm_weight")], 0.0)],
        "foreach_zero_params": [call("evil", "aten._foreach_zero_.default", [ref(p)])],
        "view_then_mul_param": [call("v", "aten.view.default", ref(p), [-1]), call("evil", "aten.mul_.Scalar", ref("v"), 0)],
        "detach_then_zero_param": [call("v", "aten.detach.default", ref(p)), call("evil", "aten.zero_.default", ref("v"))],
        "alias_then_neg_param": [call("v", "aten.alias.default", ref(p)), call("evil", "aten.neg_.default", ref("v"))],
        "t_then_copy_param": [call("v", "aten.t.default", ref(p)), call("z", "aten.ones.default", [16, 32]),
                              call("evil", "aten.copy_.default", ref("v"), ref("z"))],
        "slice_then_fill_param": [call("v", "aten.slice.Tensor", ref(p), 0, 0, 4), call("evil", "aten.fill_.Scalar", ref("v"), 9.0)],
        "t_inplace_param": [call("evil", "aten.t_.default", ref(p))],
        "resize_param": [call("evil", "aten.resize_.default", ref(p), [1])],
        "requires_grad_param": [call("evil", "aten.requires_grad_.default", ref(p), False)],
        "detach_inplace_param": [call("evil", "aten.detach_.default", ref(p))],
        "uniform_param": [call("evil", "aten.uniform_.default", ref(p))],
        "add_batch": [call("evil", "aten.add_.Scalar", ref(ids), 1)],
        "index_put_batch": [call("i", "aten.zeros.default", [1], dtype={"dtype": "int64"}),
                            call("v", "aten.full.default", [1], 7, dtype={"dtype": "int64"}),
                            call("s", "aten.select.int", ref(ids), 0, 0),
                            call("evil", "aten.index_put_.default", ref("s"), [ref("i")], ref("v"))],
        "zero_metadata": [call("evil", "aten.zero_.default", ref(cu))],
        "sub_out_metadata": [call("evil", "aten.sub.out", ref(cu), ref(cu), out=ref(cu))],
        "fused_adamw_params": [call("evil", "aten._fused_adamw_.default", [ref(p)], [ref(p)], [ref(p)], [ref(p)], [], [],
                                    lr=1.0, beta1=0.9, beta2=0.9, weight_decay=0.0, eps=1e-8, amsgrad=False,
                                    maximize=False)],
    }  # fmt: skip
    for name, nodes in writes.items():
        out.append(
            Crafted(f"step_{name}", "side_effects", to_bytes(step_doc(b, nodes)), "refused", base=STEP)
        )
    # the same after the forward pass, where the write happens late (other ops have run)
    doc = step_doc(b, [call("evil", "aten.mul_.Scalar", ref(p), 0)], at="before_output")
    out.append(Crafted("step_mul_scalar_param_at_end", "side_effects", to_bytes(doc), "refused", base=STEP))
    gm_writes = {
        "gm_mul_input": [call("evil", "aten.mul_.Scalar", ref("x"), 0), output("x")],
        "gm_copy_into_input": [call("z", "aten.zeros.default", [4, 3]), call("evil", "aten.copy_.default", ref("x"), ref("z")),
                               output("x")],
        "gm_exp_out_input": [call("evil", "aten.exp.out", ref("x"), out=ref("x")), output("x")],
        "gm_foreach_add_input": [call("evil", "aten._foreach_add_.Scalar", [ref("x")], 1.0), output("x")],
        "gm_unsqueeze_inplace_input": [call("evil", "aten.unsqueeze_.default", ref("x"), 0), output("x")],
        "gm_as_strided_inplace_input": [call("evil", "aten.as_strided_.default", ref("x"), [2], [1]), output("x")],
        "gm_expand_then_add_input": [call("v", "aten.expand.default", ref("x"), [4, 3]),
                                     call("evil", "aten.add_.Scalar", ref("v"), 1), output("x")],
        "gm_diagonal_then_zero_input": [call("v", "aten.diagonal.default", ref("x")),
                                        call("evil", "aten.zero_.default", ref("v")), output("x")],
        "gm_reshape_alias_then_fill_input": [call("v", "aten._reshape_alias.default", ref("x"), [12], [1]),
                                             call("evil", "aten.fill_.Scalar", ref("v"), 0.0), output("x")],
        "gm_masked_fill_inplace_input": [call("m", "aten.gt.Scalar", ref("x"), 0),
                                         call("evil", "aten.masked_fill_.Scalar", ref("x"), ref("m"), 0.0), output("x")],
    }  # fmt: skip
    for name, nodes in gm_writes.items():
        out.append(Crafted(name, "side_effects", to_bytes(gm_doc(b, x + nodes, static=True)), "refused"))
    return out


# Names FX's generated code or GraphModule attributes give a meaning to.
RESERVED_NAMES = ("self", "forward", "training", "graph", "code", "_code", "meta", "__init__", "_modules",
                  "__class__", "_parameters", "_buffers", "state_dict", "__dict__", "_graph", "recompile",
                  "torch", "device", "inf", "nan", "NoneType", "fx_pytree", "pytree", "getattr", "print",
                  "__builtins__", "_usp_check", "None", "lambda", "class", "return", "_tensor_constant0",
                  "to", "__call__", "_forward_hooks")  # fmt: skip


def _names(b: dict[str, bytes]) -> list[Crafted]:
    out = []
    base = load_doc(b[GM_SYM])  # x_1 -> mul(const) -> clamp -> sum_1 -> sym_size_int -> div

    def self_before_get_attr(name: str) -> tuple[bytes, bytes]:
        def make(n: str) -> bytes:
            nodes = [placeholder("x"), call(n, "aten.mul.Tensor", ref("x"), 2), get_attr("c"),
                     call("ct", "aten.t.default", ref("c")), call("o", "aten.add.Tensor", ref("ct"), ref(n)),
                     output("o")]  # fmt: skip
            consts = {"c": torch.arange(12.0).reshape(3, 4)}
            return to_bytes(gm_doc(b, nodes, constants=consts, inputs=[
                {"node": "x", "name": "x", "role": "input", "kind": "tensor", "dtype": "float32",
                 "shape": [4, 3], "device": "cpu"}]))  # fmt: skip

        return make(name), make("plain_name")

    for name in ("self", "forward", "training", "_code", "torch", "getattr", "c"):
        data, reference = self_before_get_attr(name)
        out.append(
            Crafted(f"node_{name}_before_get_attr", "names", data, "refused_or_correct", reference=reference)
        )
    for name in ("self", "forward", "graph", "__class__", "torch", "inf", "nan", "_usp_check", "None"):
        doc = rename(copy.deepcopy(base), "x_1", name)
        ok = rename(copy.deepcopy(base), "x_1", "plain_input")
        out.append(
            Crafted(
                f"placeholder_{name}", "names", to_bytes(doc), "refused_or_correct", reference=to_bytes(ok)
            )
        )
    for name in RESERVED_NAMES:
        if not name.isidentifier() or name in ("None", "lambda", "class", "return"):
            continue
        doc = rename_constant(copy.deepcopy(base), "_tensor_constant0", name)
        for n in doc["graph"]["nodes"]:
            if n["op"] == "get_attr":
                n["name"] = "read_constant"
        doc = rename(doc, "_tensor_constant0", "read_constant")
        ok = rename_constant(copy.deepcopy(base), "_tensor_constant0", "plain_constant")
        out.append(
            Crafted(f"constant_{name}", "names", to_bytes(doc), "refused_or_correct", reference=to_bytes(ok))
        )
    for name in ("forward", "device", "inf", "nan", "pytree", "fx_pytree", "__class__", "_modules", "meta", "code",
                 "__builtins__", "NoneType", "print", "_tensor_constant0_1"):  # fmt: skip
        doc = rename(copy.deepcopy(base), "mul", name)
        ok = rename(copy.deepcopy(base), "mul", "plain_node")
        out.append(
            Crafted(f"node_{name}", "names", to_bytes(doc), "refused_or_correct", reference=to_bytes(ok))
        )
    # a node named like the constant a get_attr reads, placed before it
    doc = copy.deepcopy(base)
    doc["graph"]["nodes"].insert(1, call("_tensor_constant0", "aten.mul.Tensor", ref("x_1"), 3))
    doc["graph"]["nodes"][2]["name"] = "read_c"
    for n in doc["graph"]["nodes"][3:]:
        n["args"] = json.loads(
            json.dumps(n.get("args", [])).replace('{"node": "_tensor_constant0"}', '{"node": "read_c"}')
        )
    out.append(
        Crafted(
            "node_named_like_a_constant", "names", to_bytes(doc), "refused_or_correct", reference=b[GM_SYM]
        )
    )
    # the train step: a parameter placeholder named self
    doc = rename(load_doc(b[STEP]), "p_norm_weight", "self")
    ok = rename(load_doc(b[STEP]), "p_norm_weight", "plain_param")
    out.append(Crafted("step_placeholder_self", "names", to_bytes(doc), "refused_or_correct", base=STEP,
                       reference=to_bytes(ok)))  # fmt: skip
    doc = load_doc(b[STEP])
    victim = next(n["name"] for n in doc["graph"]["nodes"] if n.get("target") == "aten.mm.default")
    doc = rename(doc, victim, "forward")
    ok = rename(load_doc(b[STEP]), victim, "plain_mm")
    out.append(Crafted("step_node_forward", "names", to_bytes(doc), "refused_or_correct", base=STEP,
                       reference=to_bytes(ok)))  # fmt: skip
    return out


def _schema_gaps(b: dict[str, bytes]) -> list[Crafted]:
    x = [placeholder("x")]
    cases = {
        "int_for_tensor_mm": [call("c", "aten.mm.default", ref("x"), 3), output("c")],
        "int_for_tensor_self": [call("c", "aten.add.Tensor", 5, ref("x")), output("c")],
        "int_for_tensor_index": [call("c", "aten.index_select.default", ref("x"), 0, 7), output("c")],
        "float_for_tensor_where": [call("c", "aten.where.self", 1.5, ref("x"), ref("x")), output("c")],
        "list_node_for_tensor": [call("s", "aten.split.Tensor", ref("x"), 2), call("c", "aten.mul.Tensor", ref("s"), 2),
                                 output("c")],
        "symint_node_for_tensor": [call("n", "aten.sym_size.int", ref("x"), 0), call("c", "aten.mm.default", ref("n"), ref("x")),
                                   output("c")],
        "none_node_for_tensor": [call("n", "aten._foreach_abs_.default", []), call("c", "aten.neg.default", ref("n")),
                                 output("c")],
        "tensor_node_for_int_list": [call("c", "aten.view.default", ref("x"), ref("x")), output("c")],
        "tensor_node_for_int": [call("c", "aten.sum.dim_IntList", ref("x"), [ref("x")]), output("c")],
        "tensor_node_for_scalar": [call("c", "aten.add.Scalar", ref("x"), ref("x")), output("c")],
        "tuple_node_for_tensor": [call("m", "aten.max.dim", ref("x"), 0), call("c", "aten.neg.default", ref("m")), output("c")],
        "getitem_out_of_range": [call("s", "aten.split_with_sizes.default", ref("x"), [2, 2]),
                                 call("g", "operator.getitem", ref("s"), 5), output("g")],
        "getitem_negative_out_of_range": [call("m", "aten.max.dim", ref("x"), 0),
                                          call("g", "operator.getitem", ref("m"), -3), output("g")],
        "getitem_on_tensor": [call("g", "operator.getitem", ref("x"), 1000), output("g")],
        "getitem_on_symint": [call("n", "aten.sym_size.int", ref("x"), 0), call("g", "operator.getitem", ref("n"), 0),
                              output("g")],
        "getitem_of_split_list_too_far": [call("s", "aten.split.Tensor", ref("x"), 1),
                                          call("g", "operator.getitem", ref("s"), 4), output("g")],
        "dtype_mismatch_mm": [get_attr("i"), call("c", "aten.mm.default", ref("x"), ref("i")), output("c")],
        "float_index_select": [get_attr("f"), call("c", "aten.index_select.default", ref("x"), 0, ref("f")), output("c")],
        "bad_dtype_kwarg": [call("c", "aten.sum.dim_IntList", ref("x"), [0], dtype={"dtype": "qint8"}), output("c")],
        "symint_arith_on_tensor": [call("c", "operator.add", ref("x"), 1), output("c")],
        "dim_out_of_range": [call("c", "aten.sum.dim_IntList", ref("x"), [7]), output("c")],
    }  # fmt: skip
    consts = {"i": torch.ones(3, 3, dtype=torch.int64), "f": torch.tensor([0.5])}
    out = []
    for name, nodes in cases.items():
        used = {n["target"] for n in nodes if n.get("op") == "get_attr"}
        doc = gm_doc(b, x + nodes, static=True, constants={k: v for k, v in consts.items() if k in used})
        out.append(Crafted(name, "schema_gaps", to_bytes(doc), "refused"))
    return out


def _pow_tower(base: Any, levels: int, exp: int = 64) -> Any:
    for _ in range(levels):
        base = ["Pow", base, exp]
    return base


def _resources(b: dict[str, bytes]) -> list[Crafted]:
    out = []
    gm = load_doc(b[GM_SYM])

    def add(name: str, doc_or_bytes: Any, *, base: str = GM_SYM, isolated: bool = False) -> None:
        data = doc_or_bytes if isinstance(doc_or_bytes, bytes) else to_bytes(doc_or_bytes)
        out.append(Crafted(name, "resources", data, "bounded", base=base, isolated=isolated))

    doc = copy.deepcopy(gm)
    doc["guards"] = [[["Eq", _pow_tower("$s75", 4), 7], "x.py:1 in f"]]  # the issue's 2.4 KB file
    add("guard_pow_tower_4", doc)
    doc = copy.deepcopy(gm)
    doc["guards"] = [[["Eq", _pow_tower(["Add", "$s75", 1], 3), 7], "x.py:1 in f"]]
    add("guard_pow_tower_of_sum", doc)
    doc = copy.deepcopy(gm)
    doc["guards"] = [[["Ge", ["Mul", *[["Add", "$s75", k] for k in range(1, 200)]], 0], "x.py:1 in f"]]
    add("guard_product_of_200_sums", doc)
    doc = copy.deepcopy(gm)
    doc["guards"] = [[["Eq", _pow_tower(["Add", "$s75", 1], 2, 63), 7], "x.py:1 in f"]] * 300
    add("guards_300_copies", doc)
    doc = copy.deepcopy(gm)
    doc["inputs"][0]["shape"] = [_pow_tower("$s75", 4), 3]
    add("input_shape_pow_tower", doc)
    doc = copy.deepcopy(gm)
    doc["graph"]["nodes"][0]["meta"]["val"]["tensor"]["shape"] = [_pow_tower(["Add", "$s75", 2], 3), 3]
    add("fake_value_pow_tower", doc)
    doc = copy.deepcopy(gm)
    doc["guards"] = [
        [["Eq", ["ModularIndexing", _pow_tower("$s75", 3), _pow_tower("$s75", 3), 7], 1], "x.py:1 in f"]
    ]
    add("guard_modular_indexing_towers", doc)
    doc = copy.deepcopy(gm)
    doc["guards"] = [
        [["Eq", ["PowByNatural", ["PowByNatural", ["PowByNatural", "$s75", 64], 64], 64], 7], "x.py:1 in f"]
    ]
    add("guard_pow_by_natural_tower", doc)
    nested = "$s75"
    for _ in range(16):  # a tree of 2**16 leaves: JSON has no sharing, the file holds them all
        nested = ["Add", ["Mul", nested, nested], 1]
    doc = copy.deepcopy(gm)
    doc["guards"] = [[["Ge", nested, 0], "x.py:1 in f"]]
    add("guard_wide_tree_depth_32", doc)
    step = load_doc(b[STEP])
    step["train_step"]["token_checks"].append(["evil", None, _pow_tower("T", 4)])
    add("step_token_check_pow_tower", step, base=STEP)
    # deep nesting, everywhere a file nests
    for where, path in (("meta", ("meta", "deep")), ("node_args", ("graph", "nodes", 3, "args", 1)),
                        ("guard", ("guards",)), ("node_meta", ("graph", "nodes", 3, "meta", "usp_deep"))):  # fmt: skip
        for depth in (900, 100_000):
            raw = "[" * depth + "]" * depth
            if where == "guard":
                raw = "[[" + '["Not",' * depth + "true" + "]" * depth + ',"x.py:1 in f"]]'
            add(f"deep_{where}_{depth}", with_raw_value(gm, path, raw))
    step = load_doc(b[STEP])
    add("deep_batch_tree_900", with_raw_value(step, ("train_step", "batch_tree"), '{"list":[' * 900 + "]}" * 900),
        base=STEP)  # fmt: skip
    # large files: many small JSON objects (parsing costs ~20x the file size in Python objects)
    bulk = "[" + ",".join(['{"a":0}'] * (3 << 20)) + "]"  # 24 MiB
    add("large_json_many_objects", with_raw_value(gm, ("meta", "bulk"), bulk), isolated=True)
    doc = copy.deepcopy(gm)
    doc["symbols"].update({f"s{i}": {"hint": 2, "min": 0, "max": None} for i in range(20_000)})
    add("large_json_20k_symbols", doc)
    doc = copy.deepcopy(gm)
    nodes = doc["graph"]["nodes"]
    chain = [call(f"n{i}", "aten.neg.default", ref(f"n{i - 1}" if i else "x_1")) for i in range(20_000)]
    nodes[1:1] = chain
    add("large_json_20k_nodes", doc)
    return out


def _replay_time(b: dict[str, bytes]) -> list[Crafted]:
    """Files whose shapes fit the sizes they were saved with and only mismatch the replayed ones."""
    x = [placeholder("x")]
    out = []

    def add(
        name: str, nodes: list[dict[str, Any]], expect: str, *, rows: int = 5, consts: Any = None
    ) -> None:
        doc = gm_doc(b, x + nodes, constants=consts)
        out.append(Crafted(name, "replay_time", to_bytes(doc), expect, rows=rows))

    add(
        "broadcast_against_constant",
        [get_attr("c"), call("o", "aten.add.Tensor", ref("x"), ref("c")), output("o")],
        "replay_error",
        consts={"c": torch.ones(4, 3)},
    )
    add("view_to_saved_numel", [call("o", "aten.view.default", ref("x"), [12]), output("o")], "replay_error")
    add("cat_with_constant_rows", [get_attr("c"), call("t", "aten.t.default", ref("x")),
                                   call("o", "aten.cat.default", [ref("t"), ref("c")], 1), output("o")],
        "replay_error", consts={"c": torch.ones(4, 4)})  # fmt: skip
    add(
        "expand_to_saved_size",
        [call("o", "aten.expand.default", ref("x"), [4, 3]), output("o")],
        "replay_error",
    )
    add("mm_needs_square", [call("o", "aten.mm.default", ref("x"), ref("x")), output("o")], "refused", rows=4)
    add("index_select_data_dependent", [get_attr("i"), call("o", "aten.index_select.default", ref("x"), 0, ref("i")),
                                        output("o")], "refused", rows=2, consts={"i": torch.tensor([3])})  # fmt: skip
    add("embedding_data_dependent", [get_attr("w"), get_attr("i"), call("o", "aten.embedding.default", ref("w"), ref("i")),
                                     output("o")], "refused", consts={"w": torch.ones(3, 2), "i": torch.tensor([7])})  # fmt: skip
    add("huge_full_from_size", [call("n", "aten.sym_size.int", ref("x"), 0), call("m", "operator.mul", ref("n"), 1 << 40),
                                call("o", "aten.full.default", [ref("m")], 1.0), output("o")], "refused")  # fmt: skip
    add(
        "huge_full_constant",
        [call("o", "aten.full.default", [1 << 20, 1 << 20], 0.0), output("o")],
        "refused",
    )
    add("huge_arange", [call("o", "aten.arange.start", 0, 1 << 45), output("o")], "refused")
    add("huge_expand_then_clone", [call("e", "aten.expand.default", ref("x"), [1 << 30, 5, 3]),
                                   call("o", "aten.clone.default", ref("e")), output("o")], "refused")  # fmt: skip
    add("local_scalar_view", [call("s", "aten.sum.default", ref("x")), call("v", "aten._local_scalar_dense.default", ref("s")),
                              call("o", "aten.view.default", ref("x"), [ref("v")]), output("o")], "refused")  # fmt: skip
    add("repeat_interleave_data_dependent", [get_attr("r"), call("o", "aten.repeat_interleave.Tensor", ref("r")),
                                             output("o")], "refused", consts={"r": torch.tensor([-3, 2])})  # fmt: skip
    # the train step: a reshape to the traced token count, replayed with other boundaries is fine,
    # but a static size baked in where the dim was dynamic only breaks when T changes
    doc = load_doc(b[STEP])
    for n in doc["graph"]["nodes"]:
        if n.get("target") == "aten.view.default" and isinstance(n["args"][1], list):
            n["args"][1] = [9 if isinstance(d, int) and d == 8 else d for d in n["args"][1]]
    out.append(
        Crafted("step_view_with_wrong_static_size", "replay_time", to_bytes(doc), "refused", base=STEP)
    )
    # usp's attention ops fed boundaries or a max_seqlen from the file instead of the metadata
    for name, target, arg, value, expect in (
        ("varlen_fwd_cu_q_past_tokens", "usp.varlen_fwd.default", 3, [0, 1000, 2000, 3000, 4000], "refused"),
        ("varlen_fwd_cu_k_past_tokens", "usp.varlen_fwd.default", 4, [0, 1000, 2000, 3000, 4000], "refused"),
        ("varlen_fwd_cu_not_monotonic", "usp.varlen_fwd.default", 3, [0, 6, 2, 8, 8], "refused"),
        ("varlen_fwd_cu_negative", "usp.varlen_fwd.default", 3, [-100, 0, 8, 8, 8], "refused"),
        ("varlen_fwd_cu_too_few_tokens", "usp.varlen_fwd.default", 3, [0, 8], "refused"),
        ("varlen_bwd_cu_past_tokens", "usp.varlen_bwd.default", 3, [0, 1000, 2000, 3000, 4000], "refused"),
        ("varlen_fwd_max_seqlen_0", "usp.varlen_fwd.default", 5, 0, "refused"),
        ("varlen_fwd_max_seqlen_negative", "usp.varlen_fwd.default", 5, -5, "refused"),
        ("varlen_fwd_max_seqlen_2pow40", "usp.varlen_fwd.default", 5, 2**40, "no_side_effects"),
    ):
        doc = load_doc(b[STEP])
        nodes = doc["graph"]["nodes"]
        k = next(i for i, n in enumerate(nodes) if n.get("target") == target)
        if isinstance(value, list):
            nodes.insert(k, get_attr("evil_cu"))
            doc["constants"]["evil_cu"] = tensor_data(torch.tensor(value, dtype=torch.int32))
            nodes[k + 1]["args"][arg] = ref("evil_cu")
        else:
            nodes[k]["args"][arg] = value
        out.append(Crafted(name, "replay_time", to_bytes(doc), expect, base=STEP))
    return out


def crafted_corpus(bases: dict[str, bytes] | None = None) -> list[Crafted]:
    """Every crafted file (names are unique)."""
    b = bases or build_bases()
    corpus = (
        _memory_safety(b) + _side_effects(b) + _names(b) + _schema_gaps(b) + _resources(b) + _replay_time(b)
    )
    names = [c.name for c in corpus]
    assert len(set(names)) == len(names), sorted(n for n in names if names.count(n) > 1)
    return corpus


# ---- random values (byte-level and JSON-level fuzzing) -------------------------------------------

_STRINGS = ["", "T", "max_seqlen", "$s1", "x", "output", "aten.mm.default", "aten.add.Tensor", "usp.varlen_fwd.default",
            "operator.getitem", "builtins.exec", "os.system", "eval", "aten.from_file.default", "aten.__dict__.default",
            "prims.iota.default", "_c10d_functional.wait_tensor.default", "float32", "cpu", "cuda:0", "tensor", "node",
            "Mul", "placeholder", "call_function", "call_method", "get_attr", "sha256:" + "0" * 64, "é\u0000\ud7ff", "a" * 300,
            "x.py:1 in f", "0"]  # fmt: skip
_INTS = [0, 1, -1, 2, 7, 255, 2**31, 2**62, 2**63, -(2**63), 2**64, 2**200, 10**40]
_FLOATS = [0.5, -0.0, 1e308, -1e-308, 3.0]


def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(12 if depth < 3 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice(_INTS)
    if kind == 3:
        return rng.choice(_FLOATS)
    if kind == 4:
        return rng.choice(_STRINGS)
    if kind == 5:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 6:
        return {
            "node": rng.choice(
                ["nowhere", "output", "p_tok_embeddings_weight", "in_input_ids", "mm", 3, None]
            )
        }
    if kind == 7:
        tag = rng.choice(["tuple", "float", "dtype", "device", "layout", "memory_format", "slice", "symint", "tensor",
                          "int", "bool", "dict", "list", "nope"])  # fmt: skip
        return {tag: _value(rng, depth + 1)}
    if kind == 8:  # size expressions
        fn = rng.choice(["Add", "Mul", "Pow", "FloorDiv", "Mod", "PythonMod", "Max", "Eq", "Lt", "And", "Not",
                         "Rational", "Sqrt", "ModularIndexing", "CeilDiv"])  # fmt: skip
        return [fn, *(_value(rng, depth + 1) if rng.random() < 0.5 else rng.choice(["T", 2, 0, -3, 64, 10**6])
                      for _ in range(rng.randrange(4)))]  # fmt: skip
    if kind == 9:
        return {"tensor": {"dtype": rng.choice(["float32", "int64", "qint8", "bogus", 1]),
                           "shape": [_value(rng, depth + 1) for _ in range(rng.randrange(3))],
                           "device": rng.choice(["cpu", "cuda:0", "meta", "nope:1", "cpu:99999"])}}  # fmt: skip
    if kind == 10:
        return {rng.choice(_STRINGS): _value(rng, depth + 1) for _ in range(rng.randrange(3))}
    return rng.choice([[1, 2], ["T", 4], {"tuple": []}, {"float": "inf"}, {"dtype": "int32"}])


def _paths(x: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(x, dict):
        for k, v in x.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            out += _paths(v, (*prefix, i))
    return out


def _get(x: Any, path: tuple) -> Any:
    for p in path:
        x = x[p]
    return x


def mutate_doc_randomly(doc: dict, rng: random.Random) -> str:
    """A random JSON-level edit anywhere in the document; returns what it did. A node edit needs a
    node list, which an earlier edit of the same case may have replaced or deleted (seed 20790, case
    175: the graph became ``{"layout": "float32"}``): then the edit goes to a section instead."""
    graph = doc.get("graph")
    nodes = graph.get("nodes") if isinstance(graph, dict) else None
    choice = rng.randrange(8)
    if choice <= 3 and not (isinstance(nodes, list) and nodes and all(isinstance(n, dict) for n in nodes)):
        choice = 4
    if choice <= 2:  # a node's target / op / name / args / kwargs / meta
        node = rng.choice(nodes)
        field = rng.choice(["target", "op", "name", "args", "args", "kwargs", "meta", "meta"])
        # (args a first edit made a string, say, get a plain field edit: seed 52, case 22)
        if field == "args" and node.get("args") and rng.random() < 0.7 and isinstance(node["args"], list):
            i = rng.randrange(len(node["args"]))
            how = rng.randrange(3)
            if how == 0:
                node["args"][i] = _value(rng)
            elif how == 1:
                del node["args"][i]
            else:
                node["args"].insert(i, _value(rng))
            return f"node {node['name']!r} args[{i}] ({['replaced', 'deleted', 'inserted'][how]})"
        if field == "meta" and isinstance(node.get("meta"), dict) and node["meta"] and rng.random() < 0.7:
            paths = _paths(node["meta"])[1:]
            path = rng.choice(paths)
            parent = _get(node["meta"], path[:-1])
            parent[path[-1]] = _value(rng)
            return f"node {node['name']!r} meta{list(path)}"
        if rng.random() < 0.2:
            node.pop(field, None)
            return f"node {node.get('name')!r} lost {field}"
        node[field] = _value(rng) if rng.random() < 0.6 else rng.choice(_STRINGS)
        return f"node {node.get('name')!r} {field} <- {str(node[field])[:40]}"
    if choice == 3:  # reorder / drop / duplicate nodes
        i, j = rng.randrange(len(nodes)), rng.randrange(len(nodes))
        how = rng.randrange(3)
        if how == 0:
            nodes[i], nodes[j] = nodes[j], nodes[i]
        elif how == 1:
            del nodes[i]
        else:
            nodes.insert(j, copy.deepcopy(nodes[i]))
        return f"nodes {i}, {j} ({['swapped', 'deleted', 'duplicated'][how]})"
    # anywhere in a section: symbols, guards, inputs, world, constants, train_step, meta, versions, ...
    section = rng.choice([k for k in doc if k != "fingerprint"])
    paths = _paths(doc[section])
    path = (section, *rng.choice(paths))
    parent = _get(doc, path[:-1])
    if isinstance(parent, dict) and rng.random() < 0.25:
        del parent[path[-1]]
        return f"deleted {list(path)}"
    if isinstance(parent, list) and rng.random() < 0.25:
        parent.insert(path[-1], _value(rng))
        return f"inserted at {list(path)}"
    parent[path[-1]] = _value(rng)
    return f"replaced {list(path)} <- {str(parent[path[-1]])[:40]}"


def mutate_bytes(data: bytes, rng: random.Random, edit: Callable[[dict, random.Random], str] = mutate_doc_randomly,
                 *, byte_level: bool = True) -> tuple[bytes, str]:  # fmt: skip
    """Byte-level damage (when `byte_level`, 3 in 10) or 1-2 document edits by `edit`, most of them
    re-fingerprinted so they reach the checks behind the hash."""
    kind = rng.randrange(10) if byte_level else 9
    if kind == 0:
        b = bytearray(data)
        flips = [rng.randrange(len(b)) for _ in range(rng.randrange(1, 5))]
        for i in flips:
            b[i] ^= 1 << rng.randrange(8)
        return bytes(b), f"[bit_flips] at {flips}"
    if kind == 1:
        cut = rng.randrange(len(data))
        return data[:cut], f"[truncation] at {cut}"
    if kind == 2:
        i, j = sorted(rng.randrange(len(data)) for _ in range(2))
        return (data[:i] + data[j:], f"[splice] bytes {i}:{j} deleted") if rng.random() < 0.5 else (
            data[:j] + data[i:j] + data[j:], f"[splice] bytes {i}:{j} duplicated")  # fmt: skip
    doc = json.loads(data)
    tag = "[json_edit] " if edit is mutate_doc_randomly else ""  # semantic edits tag themselves
    what = "; ".join(tag + edit(doc, rng) for _ in range(rng.randrange(1, 3)))
    if rng.random() < 0.9 or not byte_level:
        try:
            doc["fingerprint"] = fast_fingerprint(doc)
        except ValueError:
            pass
    else:
        what += " (stale fingerprint)"
    return dumps(doc).encode() if rng.random() < 0.8 else json.dumps(doc).encode(), what


# ---- semantic mutations (they reach replay) -------------------------------------------------------


@cache
def _op_arities() -> dict[tuple[int, int], list[str]]:
    """(required positional, max positional) -> targets of aten/prims ops with that signature."""
    out: dict[tuple[int, int], list[str]] = {}
    for s in torch._C._jit_get_all_schemas():
        ns, _, op = s.name.partition("::")
        if ns not in ("aten", "prims") or not op.isidentifier():
            continue
        pos = [a for a in s.arguments if not a.kwarg_only]
        required = sum(1 for a in pos if not a.has_default_value())
        out.setdefault((required, len(pos)), []).append(f"{ns}.{op}.{s.overload_name or 'default'}")
    return out


# Ops that view memory by explicit sizes, skip index checks, write in place, allocate without
# initializing, or touch global state: the ones a hostile swap reaches for first.
RISKY_OPS = ("aten._reshape_alias.default", "aten.as_strided.default", "aten.as_strided_.default",
             "aten.as_strided_scatter.default", "aten._reshape_alias_copy.default", "aten.as_strided_copy.default",
             "aten._unsafe_view.default", "aten._unsafe_index.Tensor", "aten._unsafe_index_put.default",
             "aten._index_put_impl_.default", "aten.resize_.default", "aten.empty_like.default",
             "aten.new_empty.default", "aten.new_empty_strided.default", "aten.empty.memory_format",
             "aten.fill_.Scalar", "aten.zero_.default", "aten.copy_.default", "aten.mul_.Scalar", "aten.add_.Tensor",
             "aten.index_put_.default", "aten.scatter_.value", "aten.t_.default", "aten.transpose_.default",
             "aten.unsqueeze_.default", "aten.squeeze_.dim", "aten.detach_.default", "aten.bernoulli.p",
             "aten.normal_.default", "aten.uniform_.default", "aten.manual_seed.default", "aten.seed.default",
             "aten.save.default", "aten.expand.default", "aten.view.default", "aten.narrow.default",
             "aten.unfold.default", "aten.diagonal.default", "aten.alias.default", "aten.select.int",
             "aten.slice.Tensor", "aten.index_select.default", "aten.gather.default", "aten.embedding.default",
             "aten.masked_fill_.Scalar", "aten.index_fill_.int_Scalar", "aten._local_scalar_dense.default",
             "aten.requires_grad_.default", "aten._foreach_mul_.Scalar", "aten._foreach_zero_.default",
             "aten._sparse_coo_tensor_unsafe.default", "aten._to_dense.default", "aten.set_.source_Tensor",
             "aten.repeat_interleave.Tensor", "aten.nonzero.default", "aten._assert_async.default",
             "aten.sym_constrain_range.default", "aten.lift_fresh.default")  # fmt: skip

_SIZES = [0, 1, -1, 2, 3, -2, 4, 5, 6, 7, 8, 12, 16, 100, 1 << 16, 1 << 24, 2**31 - 1, 2**31, -(2**31), 2**40, 2**62,
          2**63 - 1, -(2**63)]  # fmt: skip
_IN_PLACE = (("aten.mul_.Scalar", [0]), ("aten.add_.Scalar", [1]), ("aten.zero_.default", []),
             ("aten.fill_.Scalar", [3.0]), ("aten.neg_.default", []), ("aten.t_.default", []),
             ("aten.resize_.default", [[1]]), ("aten.as_strided_.default", [[1], [1]]), ("aten.sigmoid_.default", []),
             ("aten.unsqueeze_.default", [0]), ("aten.detach_.default", []), ("aten.requires_grad_.default", [False]),
             ("aten.uniform_.default", []), ("aten.clamp_.default", [0.0]), ("aten.copy_.default", ["SELF"]))  # fmt: skip
_ALIASES = ("aten.view.default", "aten.alias.default", "aten.detach.default", "aten.t.default",
            "aten._reshape_alias.default", "aten.expand.default", "aten.unsqueeze.default")  # fmt: skip


def _calls(doc: dict) -> list[dict]:
    return [n for n in doc["graph"]["nodes"] if n.get("op") == "call_function"]


def _positional_range(target: str) -> tuple[int, int] | None:
    ns, op, overload = target.split(".")
    try:
        schema = getattr(getattr(getattr(torch.ops, ns), op), overload)._schema
    except (AttributeError, RuntimeError):
        return None
    pos = [a for a in schema.arguments if not a.kwarg_only]
    return sum(1 for a in pos if not a.has_default_value()), len(pos)


@cache
def _table_ops() -> tuple[str, ...]:
    """The ops the loader's closed table allows, when it has one: swaps among them reach replay."""
    try:
        from usp_graph.graphfile import optable
    except ImportError:
        return ()
    return tuple(sorted(t for t in getattr(optable, "OBSERVED", ()) | getattr(optable, "EXTRA", ())
                        if isinstance(t, str) and t.count(".") == 2))  # fmt: skip


def _signature(target: str) -> tuple[str, ...] | None:
    ns, op, overload = target.split(".")
    try:
        schema = getattr(getattr(getattr(torch.ops, ns), op), overload)._schema
    except (AttributeError, RuntimeError):
        return None
    return tuple(str(a.type) for a in schema.arguments if not a.kwarg_only and not a.has_default_value())


@cache
def _same_signature() -> dict[tuple[str, ...], tuple[str, ...]]:
    """Required positional argument types -> the table's ops (plus RISKY_OPS) that take exactly them."""
    out: dict[tuple[str, ...], list[str]] = {}
    for t in sorted(set(_table_ops()) | set(RISKY_OPS)):
        sig = _signature(t)
        if sig is not None:
            out.setdefault(sig, []).append(t)
    return {k: tuple(v) for k, v in out.items()}


def _swap_same_types(doc: dict, rng: random.Random) -> str:
    """Swap an op for one taking the same argument types (add <-> mul, view <-> expand, ...): such
    files pass the argument-kind checks and reach the replay-time validators."""
    calls = [n for n in _calls(doc) if isinstance(n.get("target"), str) and n["target"].count(".") == 2]
    rng.shuffle(calls)
    for node in calls[:10]:
        sig = _signature(node["target"])
        pool = [t for t in _same_signature().get(sig, ()) if t != node["target"]] if sig is not None else []
        if pool:
            old, node["target"] = node["target"], rng.choice(pool)
            return f"node {node['name']!r}: {old} -> {node['target']} (same argument types)"
    return _change_ints(doc, rng)


def _swap_op(doc: dict, rng: random.Random) -> str:
    node = rng.choice([n for n in _calls(doc) if n["target"].count(".") == 2] or _calls(doc))
    n_args = len(node.get("args", []))
    r = rng.random()
    if r < 0.6:
        pool = [t for t in RISKY_OPS + tuple(n["target"] for n in _calls(doc)) + (_table_ops() if r < 0.3 else ())
                if "." in t]  # fmt: skip
        fits = []
        for t in pool:
            r = _positional_range(t) if t.count(".") == 2 else None
            if r and r[0] <= n_args <= r[1]:
                fits.append(t)
        pool = fits or pool
    else:
        pool = [t for (lo, hi), ts in _op_arities().items() if lo <= n_args <= hi for t in ts]
    new = rng.choice(pool)
    old, node["target"] = node["target"], new
    if rng.random() < 0.5:
        node.pop("kwargs", None)
    return f"node {node['name']!r}: {old} -> {new}"


def _int_slots(x: Any, path: tuple = ()) -> list[tuple]:
    if isinstance(x, bool):
        return []
    if isinstance(x, int):
        return [path]
    if isinstance(x, list):
        return [p for i, v in enumerate(x) for p in _int_slots(v, (*path, i))]
    if isinstance(x, dict) and set(x) == {"tuple"} and isinstance(x["tuple"], list):
        return [p for i, v in enumerate(x["tuple"]) for p in _int_slots(v, (*path, "tuple", i))]
    return []


def _change_ints(doc: dict, rng: random.Random) -> str:
    slots = [(n, ("args", *p)) for n in _calls(doc) for p in _int_slots(n.get("args", []))]
    slots += [(n, ("kwargs", k, *p)) for n in _calls(doc) for k, v in (n.get("kwargs") or {}).items()
              for p in _int_slots(v)]  # fmt: skip
    if not slots:
        return _swap_op(doc, rng)
    node, path = rng.choice(slots)
    parent = _get(node, path[:-1])
    old = parent[path[-1]]
    how = rng.randrange(3)
    new = (
        rng.choice(_SIZES)
        if how == 0
        else (old + rng.choice([-1, 1]) if how == 1 else old * rng.choice([-1, 2, 1 << 20]))
    )
    parent[path[-1]] = new
    return f"node {node['name']!r} {list(path)}: {old} -> {new}"


def _change_scalars(doc: dict, rng: random.Random) -> str:
    node = rng.choice(_calls(doc))
    args = node.setdefault("args", [])
    value = rng.choice([{"float": "nan"}, {"float": "inf"}, {"float": "-inf"}, 1e308, -0.0, True, None,
                        {"dtype": rng.choice(["float64", "complex64", "int8", "bool", "qint8", "float8_e4m3fn", "bits8",
                                              "uint64", "bfloat16"])},
                        {"device": rng.choice(["meta", "cpu", "cuda"])}, {"layout": "sparse_coo"},
                        {"memory_format": "channels_last"}])  # fmt: skip
    if args and rng.random() < 0.7:
        i = rng.randrange(len(args))
        args[i] = value
        return f"node {node['name']!r} args[{i}] <- {value}"
    key = rng.choice(["dtype", "device", "layout", "memory_format", "alpha", "out", "pin_memory"])
    node.setdefault("kwargs", {})[key] = value
    return f"node {node['name']!r} kwargs[{key}] <- {value}"


def _rewire(doc: dict, rng: random.Random) -> str:
    nodes = doc["graph"]["nodes"]
    i = rng.randrange(len(nodes))
    node = nodes[i]
    slots = [p for p in _paths(node.get("args", [])) if p and isinstance(_get(node["args"], p), dict)
             and set(_get(node["args"], p)) == {"node"}]  # fmt: skip
    earlier = [n["name"] for n in nodes[:i] if isinstance(n.get("name"), str)]
    if not slots or not earlier:
        return _swap_op(doc, rng)
    path = rng.choice(slots)
    new = rng.choice(earlier)
    _get(node["args"], path[:-1])[path[-1]] = {"node": new}
    return f"node {node.get('name')!r} args{list(path)} -> {new}"


def _insert_in_place(doc: dict, rng: random.Random) -> str:
    nodes = doc["graph"]["nodes"]
    placeholders = [n["name"] for n in nodes if n.get("op") == "placeholder"]
    if not placeholders:
        return _swap_op(doc, rng)
    first = len(placeholders)
    victim = rng.choice(placeholders)
    k = rng.randrange(first, len(nodes))  # anywhere before the output
    target = victim
    new: list[dict] = []
    if rng.random() < 0.3:
        alias = rng.choice(_ALIASES)
        extra = {"aten.view.default": [[-1]], "aten._reshape_alias.default": [[-1], [1]],
                 "aten.expand.default": [[-1]], "aten.unsqueeze.default": [0]}.get(alias, [])  # fmt: skip
        new.append(call(f"evil_alias_{k}", alias, ref(victim), *extra))
        target = f"evil_alias_{k}"
    how = rng.randrange(4)
    if how == 0:
        op, rest = rng.choice(_IN_PLACE)
        rest = [ref(target) if r == "SELF" else r for r in rest]
        new.append(call(f"evil_{k}", op, ref(target), *rest))
    elif how == 1:
        op = rng.choice(["aten.mul.out", "aten.add.out", "aten.sub.out", "aten.maximum.out"])
        other = rng.choice(placeholders)
        new.append(call(f"evil_{k}", op, ref(other), ref(other), out=ref(target)))
    elif how == 2:
        op = rng.choice(
            ["aten._foreach_mul_.Scalar", "aten._foreach_add_.Scalar", "aten._foreach_zero_.default"]
        )
        group = [ref(target)] + [ref(p) for p in rng.sample(placeholders, min(2, len(placeholders)))]
        new.append(call(f"evil_{k}", op, group, *([] if "zero" in op else [0.5])))
    else:
        op = rng.choice(["aten.index_put_.default", "aten.index_fill_.int_Scalar", "aten.scatter_.value"])
        new.append(call(f"evil_idx_{k}", "aten.zeros.default", [1], dtype={"dtype": "int64"}))
        if op == "aten.index_put_.default":
            new.append(call(f"evil_{k}", op, ref(target), [ref(f"evil_idx_{k}")], ref(f"evil_idx_{k}")))
        elif op == "aten.index_fill_.int_Scalar":
            new.append(call(f"evil_{k}", op, ref(target), 0, ref(f"evil_idx_{k}"), 1))
        else:
            new.append(call(f"evil_{k}", op, ref(target), 0, ref(f"evil_idx_{k}"), 1))
    nodes[k:k] = new
    return f"inserted {[n['target'] for n in new]} on input {victim!r} at {k}"


def _reserved_name(doc: dict, rng: random.Random) -> str:
    nodes = doc["graph"]["nodes"]
    node = rng.choice([n for n in nodes if isinstance(n.get("name"), str) and n.get("op") != "output"])
    name = rng.choice(RESERVED_NAMES)
    if node.get("op") == "get_attr" and rng.random() < 0.5 and node.get("target") in doc.get("constants", {}):
        rename_constant(doc, node["target"], name)
        return f"constant {node['target']!r} renamed {name!r}"
    old = node["name"]
    rename(doc, old, name)
    return f"node {old!r} renamed {name!r}"


SEMANTIC = (_swap_op, _swap_same_types, _swap_same_types, _change_ints, _change_ints, _change_scalars, _rewire, _insert_in_place,
            _insert_in_place, _reserved_name)  # fmt: skip


def mutate_semantically(doc: dict, rng: random.Random) -> str:
    fn = rng.choice(SEMANTIC)
    return f"[{fn.__name__.lstrip('_')}] " + fn(doc, rng)


# What `mutate` can do, as the tags its descriptions carry ("[swap_op] ...; [rewire] ...").
MUTATION_CLASSES = ("bit_flips", "truncation", "splice", "json_edit",
                    *dict.fromkeys(f.__name__.lstrip("_") for f in SEMANTIC))  # fmt: skip


def mutation_classes(what: str) -> set[str]:
    """The classes of mutation a description from `mutate` names."""
    return set(re.findall(r"\[(\w+)\]", what)) & set(MUTATION_CLASSES)


def mutate(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """One fuzz case from a valid file: 3 in 10 random (bytes or JSON), 7 in 10 semantic edits that
    keep the file well-formed and re-fingerprinted, so many of them load and replay."""
    if rng.random() < 0.3:
        return mutate_bytes(data, rng)
    return mutate_bytes(data, rng, mutate_semantically, byte_level=False)
