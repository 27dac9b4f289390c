"""One rule, two paths: what eager `attention_mode` and the compiled backend refuse under packed
documents must be the same verdict for the same model (issue 30). Here: attention computed without
SDPA (transformers' "eager" matmul + softmax), which usp cannot rewrite and which would attend
across the documents.

# B batch, L tokens per row
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("transformers")

from tests.realmodels import compile_usp, make_lm  # noqa: E402
from usp_graph import AttentionMetadata, attention_mode, documents  # noqa: E402

LENGTHS = (3, 1, 4)
POS = torch.cat([torch.arange(n) for n in LENGTHS])[None]
IDS = torch.arange(sum(LENGTHS))[None] % 64
META = AttentionMetadata.from_lengths(LENGTHS, max_docs=4)


def _model(impl: str):
    model = make_lm("llama")
    model.set_attn_implementation(impl)
    return model


def _eager(model, packed: bool):
    with attention_mode(META if packed else None):
        return model(input_ids=IDS, position_ids=POS, use_cache=False).logits


def _compiled(model, packed: bool):
    compiled = compile_usp(model)
    if packed:
        with documents(META):
            return compiled(input_ids=IDS, position_ids=POS, use_cache=False).logits
    return compiled(input_ids=IDS, position_ids=POS, use_cache=False).logits


# (attn_implementation, packed documents) -> refused?
TABLE = [
    ("eager", True, True),
    ("eager", False, False),
    ("sdpa", True, False),
    ("usp", True, False),
]


@pytest.mark.parametrize("path", [_eager, _compiled], ids=["eager", "compiled"])
@pytest.mark.parametrize("impl,packed,refused", TABLE)
def test_attention_without_sdpa_gets_the_same_verdict_eager_and_compiled(path, impl, packed, refused):
    torch._dynamo.reset()
    model = _model(impl)
    if refused:
        with pytest.raises(
            ValueError, match='without scaled_dot_product_attention.*attn_implementation="usp"'
        ):
            path(model, packed)
    else:
        assert path(model, packed).shape == (1, sum(LENGTHS), 64)
    torch._dynamo.reset()


def test_flex_attention_under_packed_documents_is_refused_in_eager():
    """transformers runs flex_attention through torch.compile (inductor: fp32, it has no fp64 CPU
    kernel); the refusal is found while Dynamo traces the mode and raised as itself, a ValueError,
    at the next call in eager (not as Dynamo's "Observed exception")."""
    model = _model("flex_attention").float()
    with pytest.raises(ValueError, match='without scaled_dot_product_attention.*attn_implementation="usp"'):
        with torch.no_grad():
            _eager(model, True)
    with torch.no_grad():  # one document per row: flex attention runs as written
        assert _eager(model, False).shape == (1, sum(LENGTHS), 64)


def test_flex_attention_in_float64_is_refused_before_inductor():
    """In fp64 inductor has no CPU kernel for flex attention: the refusal comes first, as itself (it
    used to crash inside inductor)."""
    model = _model("flex_attention")
    assert next(model.parameters()).dtype == torch.float64
    torch._dynamo.reset()
    with pytest.raises(ValueError, match='without scaled_dot_product_attention.*attn_implementation="usp"'):
        with torch.no_grad():
            _eager(model, True)
    torch._dynamo.reset()


@pytest.mark.parametrize("path", [_eager, _compiled], ids=["eager", "compiled"])
def test_a_decoder_called_without_position_ids_is_refused_eager_and_compiled(path):
    """Llama without position_ids counts its rotary positions along the packed row (an arange over
    it), not per document; with position_ids it runs (the TABLE above)."""
    torch._dynamo.reset()
    model = _model("sdpa")
    ids = (torch.arange(sum(LENGTHS)) * 5 % 64)[None]
    with pytest.raises(ValueError, match="counts positions along the row that reach the queries or keys"):
        if path is _eager:
            with attention_mode(META):
                model(input_ids=ids, use_cache=False)
        else:
            with documents(META):
                compile_usp(model)(input_ids=ids, use_cache=False)
    torch._dynamo.reset()


def _bert(path, positions: bool):
    model = make_lm("bert")
    kwargs = {"position_ids": POS} if positions else {}
    if path == "eager":
        with attention_mode(META):
            return model(input_ids=IDS, **kwargs).last_hidden_state
    with documents(META):
        return compile_usp(model)(input_ids=IDS, **kwargs).last_hidden_state


@pytest.mark.parametrize("path", ["eager", "compiled"])
@pytest.mark.parametrize("positions", [False, True], ids=["own_position_table", "position_ids"])
def test_positions_from_the_models_own_table_get_the_same_verdict_eager_and_compiled(path, positions):
    """BERT called without position_ids embeds a slice of its position_ids buffer: positions that
    count along the packed row, not per document. Refused under packed documents on both paths;
    with position_ids (and its zero token_type_ids buffer) it runs."""
    torch._dynamo.reset()
    if positions:
        assert _bert(path, True).shape == (1, sum(LENGTHS), 32)
    else:
        with pytest.raises(ValueError, match="position table"):
            _bert(path, False)
    torch._dynamo.reset()


# ---- one table of forms, both paths ---------------------------------------------------------------
# Each decision of `usp_graph.graph_inputs` (cross- or self-attention, positions counted along the
# row, convolutions along the sequence, attention without SDPA) in several forms, as small fp64
# modules. Every form runs under packed documents through eager `attention_mode` and through
# `torch.compile(backend="usp")` and must get the table's verdict on both: refused with the same
# message class, or each document's own result (fp64, against each document run alone) and the
# same bits on both paths.
#
# B batch (1), L tokens (12), D width, H heads, S key/value tokens of cross-attention

L_, D_, H_ = 12, 8, 2
DOCS = (5, 3, 4)
KV_DOCS = (2, 4, 3)
ROW_META = AttentionMetadata.from_lengths(DOCS, max_docs=4)
KV_META = AttentionMetadata.from_lengths(KV_DOCS, max_docs=4)
PACKED_POS = torch.cat([torch.arange(n) for n in DOCS])[None]

CROSS = "cross-attention.*kv"
ROW_POSITIONS = "counts or mixes tokens along the whole row.*looks up positions that count along the row"
POSITIONS_IN_ATTENTION = (
    "counts or mixes tokens along the whole row.*counts positions along the row that reach the queries"
)
CONVOLUTION = "counts or mixes tokens along the whole row.*convolves along the sequence"
CONTRACTION = "counts or mixes tokens along the whole row.*contracts over the sequence"
NOT_SDPA = 'without scaled_dot_product_attention.*attn_implementation="usp"'


def _heads(t):
    return t.unflatten(-1, (H_, -1)).transpose(1, 2)


def _attend(q, k, v, *, causal=True):
    return (
        F.scaled_dot_product_attention(_heads(q), _heads(k), _heads(v), is_causal=causal)
        .transpose(1, 2)
        .flatten(-2)
    )


class _QKV(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D_, D_), nn.Linear(D_, D_), nn.Linear(D_, D_)

    def forward(self, x):
        return _attend(self.q(x), self.k(x), self.v(x))


# -- cross- or self-attention: decided on positive evidence only (keys from part of what the
#    queries come from); unknown provenance (an input through layout ops) is no evidence


class _FusedProjection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D_, 3 * D_)

    def forward(self, x):
        return _attend(*self.qkv(x).chunk(3, -1))


class _FusedPassedIn(nn.Module):
    """q, k, v cut from one projection the caller computed: views of one input."""

    def forward(self, qkv):
        q, k, v = qkv.unflatten(-1, (3, D_)).unbind(-2)
        return _attend(q, k, v)


class _RawInputs(nn.Module):
    """q, k, v handed in as three tensors: nothing says they are different streams."""

    def forward(self, q, k, v):
        return _attend(q, k, v)


class _Modulated(_QKV):
    """The tokens modulated by a per-sample conditioning vector (a diffusion transformer's)."""

    def __init__(self) -> None:
        super().__init__()
        self.mod = nn.Linear(D_, D_)

    def forward(self, x, c):
        return super().forward(x * (1 + self.mod(c))[:, None])


class _Cross(_QKV):
    """Queries from the tokens, keys and values from a text encoder's states."""

    def forward(self, x, text):
        return _attend(self.q(x), self.k(text), self.v(text), causal=False)


class _MemoryKeys(_QKV):
    """Keys and values from learned memory tokens: another stream, of its own length."""

    def __init__(self) -> None:
        super().__init__()
        self.memory = nn.Parameter(torch.randn(1, 9, D_))

    def forward(self, x):
        m = self.memory.expand(x.shape[0], -1, -1)
        return _attend(self.q(x), self.k(m), self.v(m), causal=False)


# -- positions counted along the row: refused whatever makes them, unless the caller passed them


class _Positions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(64, D_), nn.Embedding(80, D_)
        self.attn = _QKV()
        self.register_buffer("table", torch.arange(64)[None], persistent=False)

    def positions(self, ids, pos):
        return pos

    def forward(self, ids, pos=None):
        return self.attn(self.tok(ids) + self.pos(self.positions(ids, pos)))


class _Arange(_Positions):
    def positions(self, ids, pos):
        return torch.arange(ids.shape[-1])[None]


class _ArangeOffset(_Positions):  # BART's learned positions: offset 2
    def positions(self, ids, pos):
        return torch.arange(ids.shape[-1]) + 2


class _ArangeExpanded(_Positions):
    def positions(self, ids, pos):
        return torch.arange(ids.shape[-1], device=ids.device).expand(ids.shape)


class _CumsumOfOnes(_Positions):
    def positions(self, ids, pos):
        return torch.ones_like(ids).cumsum(-1) - 1


class _FromInputIds(_Positions):
    """RoBERTa's create_position_ids_from_input_ids (padding index 1), here with no padding."""

    def positions(self, ids, pos):
        mask = ids.ne(1).int()
        return (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + 1


class _OwnTable(_Positions):  # BERT without position_ids: its buffer sliced to the row
    def positions(self, ids, pos):
        return self.table[:, : ids.shape[1]]


class _OwnTableOffset(_Positions):
    def positions(self, ids, pos):
        return self.table[:, 3 : ids.shape[1] + 3]


class _PassedOffset(_Positions):
    def positions(self, ids, pos):
        return pos + 2


class _Rotary(nn.Module):
    """Rotary positions (relative in exact arithmetic) from the position ids passed in."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.attn = nn.Embedding(64, D_), _QKV()

    def positions(self, ids, pos):
        return pos

    def forward(self, ids, pos=None):
        x = self.tok(ids)
        half = D_ // H_ // 2
        angle = self.positions(ids, pos)[0].to(x.dtype)[:, None] * 0.3 ** torch.arange(half, dtype=x.dtype)
        cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)

        def rotate(t):  # per head: (B, H, L, K)
            a, b = t.chunk(2, -1)
            return t * cos + torch.cat([-b, a], -1) * sin

        q, k, v = (_heads(f(x)) for f in (self.attn.q, self.attn.k, self.attn.v))
        out = F.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True)
        return out.transpose(1, 2).flatten(-2)


class _RotaryFromArange(_Rotary):
    """A decoder called without position ids counts its rotary positions along the row."""

    def positions(self, ids, pos):
        return torch.arange(ids.shape[-1])[None]


class _RotaryFromFloatArange(_Rotary):
    """Rotary positions from an arange of floats: not read as positions (a float arange is what
    rotary embeddings count frequencies with, over the head dim); relative, so each document's own
    result in fp64."""

    def positions(self, ids, pos):
        return torch.arange(ids.shape[-1], dtype=torch.float64)[None]


class _RotaryTableLookup(_Rotary):
    """GPT-J's rotary: sines and cosines looked up in a table by position (an index into a table,
    not a selection within the row)."""

    def __init__(self) -> None:
        super().__init__()
        half = D_ // H_ // 2
        angle = torch.arange(64.0, dtype=torch.float64)[:, None] * 0.3 ** torch.arange(
            half, dtype=torch.float64
        )
        self.register_buffer("angles", angle, persistent=False)

    def forward(self, ids, pos=None):
        x = self.tok(ids)
        angle = self.angles[torch.arange(ids.shape[-1]) if pos is None else pos[0]]
        cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)

        def rotate(t):
            a, b = t.chunk(2, -1)
            return t * cos + torch.cat([-b, a], -1) * sin

        q, k, v = (_heads(f(x)) for f in (self.attn.q, self.attn.k, self.attn.v))
        out = F.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True)
        return out.transpose(1, 2).flatten(-2)


class _RotaryFrequencies(nn.Module):
    """Rotary positions passed in, frequencies counted by an arange of floats over half a head dim
    as long as the row (usp's Llama, head dim 8, on a row of 4 tokens was refused): no positions."""

    def __init__(self, half: int) -> None:
        super().__init__()
        k = 2 * half
        self.tok, self.q, self.k, self.v = (
            nn.Embedding(64, k),
            nn.Linear(k, k),
            nn.Linear(k, k),
            nn.Linear(k, k),
        )
        self.half = half

    def forward(self, ids, pos):
        x = self.tok(ids)
        freq = 0.5 ** (torch.arange(self.half, dtype=x.dtype) / self.half)  # (K/2,): K/2 == L
        angle = pos[0].to(x.dtype)[:, None] * torch.cat([freq, freq])

        def rotate(t):
            a, b = t.chunk(2, -1)
            return t * angle.cos() + torch.cat([-b, a], -1) * angle.sin()

        q, k, v = (f(x)[:, None] for f in (self.q, self.k, self.v))
        return F.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True)[:, 0]


class _ArangeAsIndex(_QKV):
    """An arange over the row used to select tokens (a packed layout's permutation, here the
    identity), not as positions: it reaches the queries only as an index."""

    def __init__(self, getitem: bool = False) -> None:
        super().__init__()
        self.getitem = getitem

    def forward(self, x):
        order = torch.arange(x.shape[1])
        perm = torch.zeros_like(order).scatter(0, order, order)
        return super().forward(x[:, perm] if self.getitem else x.index_select(1, perm))


# -- convolutions: along the sequence and wider than one token mix neighbouring documents


class _Conv1dModule(nn.Module):  # LFM2's short causal convolution
    def __init__(self, width: int = 3, groups: int = D_) -> None:
        super().__init__()
        self.conv = nn.Conv1d(D_, D_, width, padding=width - 1, groups=groups)
        self.attn = _QKV()

    def forward(self, x):
        return self.attn(self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2))


class _FunctionalConv(nn.Module):
    def __init__(self, conv=F.conv1d) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D_, 1, 4))
        self.attn, self.conv_fn = _QKV(), conv

    def forward(self, x):
        y = self.conv_fn(x.transpose(1, 2), self.weight, None, 1, 3, 1, D_)
        return self.attn(y[..., : x.shape[1]].transpose(1, 2))


class _ConvOverFeatures(nn.Module):
    """A convolution along each token's features, not along the sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.attn = nn.Conv1d(1, 1, 3, padding=1), _QKV()

    def forward(self, x):
        return self.attn(self.conv(x.reshape(-1, 1, D_)).reshape(x.shape))


# -- attention computed without SDPA


class _MatmulSoftmax(_QKV):
    def forward(self, x):
        q, k, v = (_heads(f(x)) for f in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / D_**0.5
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        return (scores.masked_fill(causal, float("-inf")).softmax(-1) @ v).transpose(1, 2).flatten(-2)


class _MatmulSoftmaxHeadsFolded(_QKV):
    """diffusers' classic AttnProcessor: heads folded into the batch, baddbmm + softmax over
    (B * H, L, L) scores (eager counted rows as B * H and missed it for more than one head)."""

    def forward(self, x):
        q, k, v = (_heads(f(x)).flatten(0, 1) for f in (self.q, self.k, self.v))
        probs = torch.baddbmm(q.new_zeros(q.shape[0], q.shape[1], k.shape[1]), q, k.transpose(1, 2)).softmax(
            -1
        )
        return (probs @ v).unflatten(0, (x.shape[0], H_)).transpose(1, 2).flatten(-2)


class _CrossMatmulSoftmax(_QKV):
    """Cross-attention without SDPA onto packed prompts: (B, H, L, M) scores, M the text's length."""

    def forward(self, x, text):
        q, k, v = _heads(self.q(x)), _heads(self.k(text)), _heads(self.v(text))
        return ((q @ k.transpose(-1, -2) / D_**0.5).softmax(-1) @ v).transpose(1, 2).flatten(-2)


class _Joint(_QKV):
    """Joint attention (diffusers' Flux): every sample's text before every sample's image."""

    def forward(self, x, text):
        joint = torch.cat([text, x], dim=1)
        out = _attend(self.q(joint), self.k(joint), self.v(joint), causal=False)
        return out[:, text.shape[1] :]


class _LinearAttention(_QKV):
    """Sana's ReLU linear attention: k^T v summed over the row, no softmax and no SDPA."""

    def forward(self, x):
        q, k, v = (F.relu(_heads(f(x))) for f in (self.q, self.k, self.v))
        kv = k.transpose(-1, -2) @ v  # (B, H, K, K): a sum over every token of the row
        return (q @ kv).transpose(1, 2).flatten(-2)


class _SoftmaxGate(_QKV):
    """A softmax over features (a gate), beside SDPA: no attention scores."""

    def forward(self, x):
        return super().forward(x * torch.softmax(x, dim=-1))


def _x(seed: int = 0, length: int = L_):
    return torch.randn(1, length, D_, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


_IDS = torch.randint(2, 64, (1, L_), generator=torch.Generator().manual_seed(3))  # no padding index 1

# name -> (module class, inputs, verdict: a message class refused, or None: each document's own result,
# kv: whether documents(..., kv=KV_META) gives the key/value stream's documents)
FORMS = {
    # cross- or self-attention
    "self_separate_projections": (_QKV, lambda: {"x": _x()}, None, False),
    "self_fused_projection": (_FusedProjection, lambda: {"x": _x()}, None, False),
    "self_fused_passed_in": (
        _FusedPassedIn,
        lambda: {"qkv": _x(1).repeat(1, 1, 3) * torch.arange(1.0, 4.0).repeat_interleave(D_)},
        None,
        False,
    ),
    "self_raw_inputs": (_RawInputs, lambda: {"q": _x(1), "k": _x(2), "v": _x(3)}, None, False),
    "self_modulated": (_Modulated, lambda: {"x": _x(), "c": _x(4, 1)[:, 0]}, None, False),
    "cross_without_kv": (_Cross, lambda: {"x": _x(), "text": _x(5, sum(KV_DOCS))}, CROSS, False),
    "cross_with_kv": (_Cross, lambda: {"x": _x(), "text": _x(5, sum(KV_DOCS))}, None, True),
    "cross_same_length_without_kv": (_Cross, lambda: {"x": _x(), "text": _x(6)}, CROSS, False),
    "memory_keys": (_MemoryKeys, lambda: {"x": _x()}, CROSS, False),
    # positions
    "positions_arange": (_Arange, lambda: {"ids": _IDS}, ROW_POSITIONS, False),
    "positions_arange_offset": (_ArangeOffset, lambda: {"ids": _IDS}, ROW_POSITIONS, False),
    "positions_arange_expanded": (_ArangeExpanded, lambda: {"ids": _IDS}, ROW_POSITIONS, False),
    "positions_cumsum_of_ones": (_CumsumOfOnes, lambda: {"ids": _IDS}, ROW_POSITIONS, False),
    "positions_from_input_ids": (_FromInputIds, lambda: {"ids": _IDS}, ROW_POSITIONS, False),
    "positions_own_table": (_OwnTable, lambda: {"ids": _IDS}, ROW_POSITIONS, False),
    "positions_own_table_offset": (_OwnTableOffset, lambda: {"ids": _IDS}, ROW_POSITIONS, False),
    "positions_passed": (_Positions, lambda: {"ids": _IDS, "pos": PACKED_POS}, None, False),
    "positions_passed_offset": (_PassedOffset, lambda: {"ids": _IDS, "pos": PACKED_POS}, None, False),
    "positions_rotary_passed": (_Rotary, lambda: {"ids": _IDS, "pos": PACKED_POS}, None, False),
    "positions_rotary_from_arange": (_RotaryFromArange, lambda: {"ids": _IDS}, POSITIONS_IN_ATTENTION, False),
    "positions_rotary_from_float_arange": (_RotaryFromFloatArange, lambda: {"ids": _IDS}, None, False),
    "positions_rotary_table_lookup": (
        _RotaryTableLookup,
        lambda: {"ids": _IDS},
        POSITIONS_IN_ATTENTION,
        False,
    ),
    "positions_rotary_table_lookup_passed": (
        _RotaryTableLookup,
        lambda: {"ids": _IDS, "pos": PACKED_POS},
        None,
        False,
    ),
    "rotary_frequencies_as_long_as_the_row": (
        lambda: _RotaryFrequencies(L_),
        lambda: {"ids": _IDS, "pos": PACKED_POS},
        None,
        False,
    ),
    "arange_as_index_select": (_ArangeAsIndex, lambda: {"x": _x()}, None, False),
    "arange_as_getitem_index": (lambda: _ArangeAsIndex(getitem=True), lambda: {"x": _x()}, None, False),
    # convolutions
    "conv1d_module": (_Conv1dModule, lambda: {"x": _x()}, CONVOLUTION, False),
    "conv1d_functional": (_FunctionalConv, lambda: {"x": _x()}, CONVOLUTION, False),
    "conv1d_torch": (lambda: _FunctionalConv(torch.conv1d), lambda: {"x": _x()}, CONVOLUTION, False),
    "conv1d_pointwise": (lambda: _Conv1dModule(width=1, groups=1), lambda: {"x": _x()}, None, False),
    "conv1d_over_features": (_ConvOverFeatures, lambda: {"x": _x()}, None, False),
    # attention without SDPA
    "matmul_softmax": (_MatmulSoftmax, lambda: {"x": _x()}, NOT_SDPA, False),
    "softmax_gate": (_SoftmaxGate, lambda: {"x": _x()}, None, False),
    "linear_attention": (_LinearAttention, lambda: {"x": _x()}, CONTRACTION, False),
    "matmul_softmax_heads_folded": (_MatmulSoftmaxHeadsFolded, lambda: {"x": _x()}, NOT_SDPA, False),
    "cross_matmul_softmax_with_kv": (
        _CrossMatmulSoftmax,
        lambda: {"x": _x(), "text": _x(5, sum(KV_DOCS))},
        NOT_SDPA,
        True,
    ),
}


def _per_document(model, inputs, kv: bool):
    """Each document run alone (its slice of every token input; under kv, its key document)."""
    outs, start, kv_start = [], 0, 0
    for i, n in enumerate(DOCS):
        piece = {}
        for name, t in inputs.items():
            if name == "text" and kv:
                piece[name] = t[:, kv_start : kv_start + KV_DOCS[i]]
            elif name in ("c", "text"):
                piece[name] = t
            else:
                piece[name] = t[:, start : start + n]
        outs.append(model(**piece))
        start += n
        kv_start += KV_DOCS[i] if kv else 0
    return torch.cat(outs, 1)


def _run(path: str, model, inputs, kv: bool):
    extra = {"kv": KV_META} if kv else {}
    if path == "eager":
        with attention_mode(ROW_META, **extra):
            return model(**inputs)
    compiled = compile_usp(model)
    with documents(ROW_META, **extra):
        return compiled(**inputs)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_each_form_gets_the_same_verdict_eager_and_compiled(form):
    make, inputs_of, refused, kv = FORMS[form]
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = make().double()
    inputs = inputs_of()
    got = {}
    for path in ("eager", "compiled"):
        if refused is not None:
            with pytest.raises(ValueError, match=refused):
                _run(path, model, inputs, kv)
        else:
            got[path] = _run(path, model, inputs, kv)
    torch._dynamo.reset()
    if refused is None:
        ref = _per_document(model, inputs, kv)
        assert (got["eager"] - ref).abs().max() <= 1e-10, form
        assert torch.equal(got["eager"], got["compiled"]), form


class _JointInOrder(_Joint):
    """The joined row put back in an order of the caller's (an index_select along it)."""

    def forward(self, x, text):
        joint = torch.cat([text, x], dim=1)
        order = torch.arange(joint.shape[1] - 1, -1, -1)
        joint = joint.index_select(1, order)
        return _attend(self.q(joint), self.k(joint), self.v(joint), causal=False)


@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_joint_attention_over_concatenated_streams_warns_under_packed_documents(path):
    # Flux-style joint attention: every sample's text before every sample's image. Documents of
    # whole samples then let them attend across each other (diffusers' Flux packed two samples
    # 0.09 off); documents described in the joined order are exact, so it warns, once.
    torch._dynamo.reset()
    torch.manual_seed(0)
    inputs = {"x": _x(), "text": _x(5, sum(KV_DOCS))}
    samples = AttentionMetadata.from_lengths([t + i for t, i in zip(KV_DOCS, DOCS, strict=True)])  # 21 tokens
    for make, warns in ((_Joint, True), (_JointInOrder, False)):
        model = make().double()
        run = model if path == "eager" else compile_usp(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):  # once per mode block / compiled graph
                with attention_mode(samples) if path == "eager" else documents(samples):
                    run(**inputs)
        said = [w for w in caught if "concatenated along the sequence" in str(w.message)]
        assert len(said) == (1 if warns else 0) or (path == "eager" and warns and len(said) == 2), [
            str(w.message)[:80] for w in said
        ]
        torch._dynamo.reset()


# ---- MoE experts: a per-token projection, never linear attention ------------------------------------


@pytest.mark.parametrize("path", ["eager", "compiled"])
@pytest.mark.parametrize("tokens", [32, 16], ids=["tokens_equal_hidden_size", "tokens_equal_expert_width"])
def test_moe_experts_are_not_linear_attention_whatever_the_token_count(path, tokens):
    """transformers' batched_mm experts multiply each token by its experts' weights, gathered per
    token (W[expert_ids]): a sum over the hidden size or the expert width, which a packed row of
    exactly that many tokens once made look like a sum over the sequence (issue 37). Each
    document's own result, fp64."""
    from tests.realmodels import make_sweep_model, packed_positions

    torch._dynamo.reset()
    model = make_sweep_model("qwen3_moe")  # hidden 32, expert width 16, batched_mm
    assert (model.config.hidden_size, model.config.moe_intermediate_size) == (32, 16)
    lengths = (tokens // 2 - 3, 3, tokens - tokens // 2)
    ids = torch.randint(0, 64, (1, tokens), generator=torch.Generator().manual_seed(1))
    pos = packed_positions(lengths)
    meta = AttentionMetadata.from_lengths(lengths)
    with torch.no_grad():
        if path == "eager":
            with attention_mode(meta):
                got = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        else:
            with documents(meta):
                got = compile_usp(model)(input_ids=ids, position_ids=pos, use_cache=False).logits
        parts, start = [], 0
        for n in lengths:
            s = slice(start, start + n)
            parts.append(model(input_ids=ids[:, s], position_ids=pos[:, s], use_cache=False).logits)
            start += n
    torch._dynamo.reset()
    assert (got - torch.cat(parts, 1)).abs().max() <= 1e-10
