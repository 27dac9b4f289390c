# B batch, L sequence (T text tokens, I image tokens, S = T + I joint), H heads, K head dim,
# D hidden dim, C image channels, E text feature dim, P pooled text dim, M mlp dim, A rope axes (3),
# N samples packed into one row
"""A small Flux-style MMDiT (multi-modal diffusion transformer) used as a reference model.

Text and image tokens keep separate weights in the double-stream blocks but attend jointly
over the concatenated ``[txt, img]`` sequence; single-stream blocks then process the joint
sequence with shared weights. Every block makes exactly one bidirectional, unmasked call to
``F.scaled_dot_product_attention`` (default scale), which is what the graph pass rewrites.
Positions enter only through a multi-axis RoPE computed from per-token ``ids``.

Packed mode (``txt_doc`` / ``img_doc`` given to :meth:`Flux.forward`): one row holds N samples of
different text and image lengths. Every token is modulated by its own sample's conditioning
vector, and the joint sequence is laid out in document order (sample 0's text then its image,
sample 1's text then image, ...) so each sample is one contiguous document for varlen
attention (``AttentionMetadata.from_lengths`` of the per-sample ``t_i + i_i``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

# Width of the sinusoidal timestep features fed to the time MLP.
TIME_FREQ_DIM = 256
# Flux samples t in [0, 1]; scaling to [0, 1000] spreads it over the sinusoid frequencies.
TIME_FACTOR = 1000.0


@dataclass(frozen=True)
class FluxConfig:
    """Sizes of a :class:`Flux` model (defaults are tiny, for tests)."""

    in_channels: int = 8
    hidden: int = 64
    n_heads: int = 4
    txt_dim: int = 32
    pooled_dim: int = 16
    n_double: int = 1
    n_single: int = 1
    mlp_ratio: float = 2.0
    axes_dims: tuple[int, ...] = (4, 6, 6)
    theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.hidden % self.n_heads != 0:
            raise ValueError(f"hidden={self.hidden} must be divisible by n_heads={self.n_heads}")
        if sum(self.axes_dims) != self.head_dim:
            raise ValueError(f"sum(axes_dims)={sum(self.axes_dims)} must equal head_dim={self.head_dim}")
        if any(d <= 0 or d % 2 != 0 for d in self.axes_dims):
            raise ValueError(f"every axes_dims entry must be positive and even, got {self.axes_dims}")

    @property
    def head_dim(self) -> int:
        """Per-head dimension K = hidden // n_heads."""
        return self.hidden // self.n_heads

    @property
    def mlp_dim(self) -> int:
        """Hidden width M of the block MLPs."""
        return int(self.hidden * self.mlp_ratio)


def timestep_embedding(
    timesteps_B: torch.Tensor, dim: int, dtype: torch.dtype, max_period: float = 10000.0
) -> torch.Tensor:
    """Sinusoidal features ``(B, dim)`` of (scaled) diffusion timesteps, cast to ``dtype``.

    Computed in at least float32: t * 1000 times high frequencies is too coarse in bf16.
    """
    angle_dtype = torch.promote_types(dtype, torch.float32)
    half = dim // 2
    exponents_F = torch.arange(half, device=timesteps_B.device, dtype=angle_dtype) / half
    freqs_F = torch.exp(-math.log(max_period) * exponents_F)
    args_BF = (TIME_FACTOR * timesteps_B.to(angle_dtype))[:, None] * freqs_F
    return torch.cat([torch.cos(args_BF), torch.sin(args_BF)], dim=-1).to(dtype)


def rope_cos_sin(
    ids_BLA: torch.Tensor, axes_dims: tuple[int, ...], theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-axis RoPE tables ``(cos_B1LK2, sin_B1LK2)`` with K2 = K / 2 rotation pairs.

    Axis ``a`` of ``ids`` drives ``axes_dims[a] / 2`` consecutive rotation pairs, so e.g. an
    image token's row and column rotate disjoint slices of each head.
    """
    angle_dtype = torch.promote_types(dtype, torch.float32)
    angles = []
    for axis, axis_dim in enumerate(axes_dims):
        exponents_F = torch.arange(0, axis_dim, 2, device=ids_BLA.device, dtype=angle_dtype) / axis_dim
        inv_freq_F = theta**-exponents_F
        angles.append(ids_BLA[..., axis].to(angle_dtype)[..., None] * inv_freq_F)
    angles_BLK2 = torch.cat(angles, dim=-1)
    return angles_BLK2.cos().to(dtype)[:, None], angles_BLK2.sin().to(dtype)[:, None]


def apply_rope(x_BHLK: torch.Tensor, cos_B1LK2: torch.Tensor, sin_B1LK2: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs ``(x[2i], x[2i+1])`` by their per-axis angle."""
    x_BHLK2_2 = x_BHLK.unflatten(-1, (-1, 2))
    x0_BHLK2, x1_BHLK2 = x_BHLK2_2[..., 0], x_BHLK2_2[..., 1]
    out0_BHLK2 = x0_BHLK2 * cos_B1LK2 - x1_BHLK2 * sin_B1LK2
    out1_BHLK2 = x0_BHLK2 * sin_B1LK2 + x1_BHLK2 * cos_B1LK2
    return torch.stack([out0_BHLK2, out1_BHLK2], dim=-1).flatten(-2)


def attention(
    q_BHLK: torch.Tensor,
    k_BHLK: torch.Tensor,
    v_BHLK: torch.Tensor,
    cos_B1LK2: torch.Tensor,
    sin_B1LK2: torch.Tensor,
    attn_mask: torch.Tensor | None,
) -> torch.Tensor:
    """RoPE + bidirectional SDPA, returning ``(B, L, H*K)``."""
    q_BHLK = apply_rope(q_BHLK, cos_B1LK2, sin_B1LK2)
    k_BHLK = apply_rope(k_BHLK, cos_B1LK2, sin_B1LK2)
    # F.<name> is looked up at call time so a TorchFunctionMode / tracer can intercept it.
    if attn_mask is None:
        o_BHLK = F.scaled_dot_product_attention(q_BHLK, k_BHLK, v_BHLK)
    else:
        o_BHLK = F.scaled_dot_product_attention(q_BHLK, k_BHLK, v_BHLK, attn_mask=attn_mask)
    return o_BHLK.transpose(1, 2).flatten(2)


class MLPEmbedder(nn.Module):
    """Two-layer SiLU MLP that maps a conditioning vector into the hidden width."""

    def __init__(self, in_dim: int, hidden: int) -> None:
        super().__init__()
        self.in_layer = nn.Linear(in_dim, hidden)
        self.out_layer = nn.Linear(hidden, hidden)

    def forward(self, x_BE: torch.Tensor) -> torch.Tensor:
        return self.out_layer(F.silu(self.in_layer(x_BE)))


class QKNorm(nn.Module):
    """Per-head RMSNorm of q and k (learnable scale over K) to keep attention logits bounded."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.q_norm = nn.RMSNorm(head_dim, eps=1e-6)
        self.k_norm = nn.RMSNorm(head_dim, eps=1e-6)

    def forward(self, q_BHLK: torch.Tensor, k_BHLK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q_BHLK), self.k_norm(k_BHLK)


class Modulation(nn.Module):
    """adaLN modulation: ``n_sets`` triples (shift, scale, gate) from the conditioning vector."""

    def __init__(self, hidden: int, n_sets: int) -> None:
        super().__init__()
        self.n_chunks = 3 * n_sets
        self.lin = nn.Linear(hidden, self.n_chunks * hidden)

    def forward(self, vec_BD: torch.Tensor, doc_L: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Chunks of shape ``(B, 1, D)`` (one vector per row, broadcast over the tokens), or with
        ``doc_L`` (packed mode: ``vec_BD`` holds one vector per sample) ``(1, L, D)``: token l gets
        the chunks of sample ``doc_L[l]``."""
        return list(_per_token(self.lin(F.silu(vec_BD)), doc_L).chunk(self.n_chunks, dim=-1))


def _per_token(x_BF: torch.Tensor, doc_L: torch.Tensor | None) -> torch.Tensor:
    """``(B, 1, F)`` to broadcast over tokens, or with ``doc_L`` the per-token rows ``(1, L, F)``.

    Packed mode gathers after the modulation linear (per sample, not per token), which gives
    each token exactly its sample's values at a cost independent of the token count.
    """
    if doc_L is None:
        return x_BF[:, None]
    return x_BF.index_select(0, doc_L)[None]


class PackedLayout(NamedTuple):
    """Where the tokens of a packed row go (see :func:`packed_layout`).

    txt_doc_T / img_doc_I: sample of every text / image token (stream order). joint_doc_S: sample
    of every joint token in document order. perm_S: for each document-order position, its index
    in the stream order ``[txt, img]``. txt_pos_T / img_pos_I: the document-order position of
    every text / image token (the inverse of ``perm_S``, split by stream).
    """

    txt_doc_T: torch.Tensor
    img_doc_I: torch.Tensor
    joint_doc_S: torch.Tensor
    perm_S: torch.Tensor
    txt_pos_T: torch.Tensor
    img_pos_I: torch.Tensor


def packed_layout(txt_doc_T: torch.Tensor, img_doc_I: torch.Tensor) -> PackedLayout:
    """Document order of a packed row from non-decreasing per-token sample indices.

    Sample n's text goes right after every token of samples before n, and its image right after
    its text. Positions come from ``searchsorted`` (no sort, no host sync, static shapes).
    """
    n_txt, n_img = txt_doc_T.shape[0], img_doc_I.shape[0]
    # A text token is preceded by the image tokens of earlier samples (and the earlier text).
    txt_pos_T = torch.arange(n_txt, device=txt_doc_T.device) + torch.searchsorted(img_doc_I, txt_doc_T)
    # An image token is preceded by the text tokens of its own and earlier samples.
    img_pos_I = torch.arange(n_img, device=img_doc_I.device) + torch.searchsorted(
        txt_doc_T, img_doc_I, right=True
    )
    pos_S = torch.cat([txt_pos_T, img_pos_I])
    perm_S = torch.zeros_like(pos_S).scatter(0, pos_S, torch.arange(n_txt + n_img, device=pos_S.device))
    joint_doc_S = torch.cat([txt_doc_T, img_doc_I]).index_select(0, perm_S)
    return PackedLayout(txt_doc_T, img_doc_I, joint_doc_S, perm_S, txt_pos_T, img_pos_I)


def split_heads(qkv_BL3D: torch.Tensor, n_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a fused ``(B, L, 3*H*K)`` projection into q, k, v of shape ``(B, H, L, K)``."""
    B, L, _ = qkv_BL3D.shape
    qkv_3BHLK = qkv_BL3D.view(B, L, 3, n_heads, -1).permute(2, 0, 3, 1, 4)
    return qkv_3BHLK[0], qkv_3BHLK[1], qkv_3BHLK[2]


class StreamWeights(nn.Module):
    """Per-stream (txt or img) weights of a double block."""

    def __init__(self, config: FluxConfig) -> None:
        super().__init__()
        D = config.hidden
        self.mod = Modulation(D, n_sets=2)
        # LayerNorms carry no affine params: adaLN shift/scale provides them.
        self.norm1 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(D, 3 * D)
        self.qk_norm = QKNorm(config.head_dim)
        self.proj = nn.Linear(D, D)
        self.norm2 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(D, config.mlp_dim), nn.GELU(approximate="tanh"), nn.Linear(config.mlp_dim, D)
        )


class DoubleStreamBlock(nn.Module):
    """Separate txt/img weights, one joint attention over ``[txt, img]``."""

    def __init__(self, config: FluxConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.txt = StreamWeights(config)
        self.img = StreamWeights(config)

    def forward(
        self,
        txt_BTD: torch.Tensor,
        img_BID: torch.Tensor,
        vec_BD: torch.Tensor,
        cos_B1SK2: torch.Tensor,
        sin_B1SK2: torch.Tensor,
        attn_mask: torch.Tensor | None,
        layout: PackedLayout | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """With ``layout`` (packed mode) the joint attention runs in document order and
        ``cos/sin`` must be in that order too; txt/img inputs and outputs stay in stream order."""
        T = txt_BTD.shape[1]
        streams = [(self.txt, txt_BTD), (self.img, img_BID)]
        docs = (None, None) if layout is None else (layout.txt_doc_T, layout.img_doc_I)
        mods, qs, ks, vs = [], [], [], []
        for (weights, x_BLD), doc_L in zip(streams, docs, strict=True):
            shift1, scale1, gate1, shift2, scale2, gate2 = weights.mod(vec_BD, doc_L)
            mods.append((gate1, shift2, scale2, gate2))
            x_mod_BLD = (1 + scale1) * weights.norm1(x_BLD) + shift1
            q_BHLK, k_BHLK, v_BHLK = split_heads(weights.qkv(x_mod_BLD), self.n_heads)
            q_BHLK, k_BHLK = weights.qk_norm(q_BHLK, k_BHLK)
            qs.append(q_BHLK)
            ks.append(k_BHLK)
            vs.append(v_BHLK)
        # Joint attention: text and image tokens see each other in both directions.
        q_BHSK, k_BHSK, v_BHSK = torch.cat(qs, dim=2), torch.cat(ks, dim=2), torch.cat(vs, dim=2)
        if layout is not None:
            q_BHSK, k_BHSK, v_BHSK = (x.index_select(2, layout.perm_S) for x in (q_BHSK, k_BHSK, v_BHSK))
        o_BSD = attention(q_BHSK, k_BHSK, v_BHSK, cos_B1SK2, sin_B1SK2, attn_mask)
        if layout is None:
            o_txt_BTD, o_img_BID = o_BSD[:, :T], o_BSD[:, T:]
        else:
            o_txt_BTD = o_BSD.index_select(1, layout.txt_pos_T)
            o_img_BID = o_BSD.index_select(1, layout.img_pos_I)
        outs = []
        for (weights, x_BLD), (gate1, shift2, scale2, gate2), o_BLD in zip(
            streams, mods, (o_txt_BTD, o_img_BID), strict=True
        ):
            x_BLD = x_BLD + gate1 * weights.proj(o_BLD)
            x_BLD = x_BLD + gate2 * weights.mlp((1 + scale2) * weights.norm2(x_BLD) + shift2)
            outs.append(x_BLD)
        return outs[0], outs[1]


class SingleStreamBlock(nn.Module):
    """Shared weights over the joint sequence; attention and MLP run in parallel off one linear."""

    def __init__(self, config: FluxConfig) -> None:
        super().__init__()
        D, M = config.hidden, config.mlp_dim
        self.n_heads = config.n_heads
        self.hidden = D
        self.mlp_dim = M
        self.mod = Modulation(D, n_sets=1)
        self.pre_norm = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        # One fused input linear for q, k, v and the MLP hidden, one fused output linear.
        self.linear1 = nn.Linear(D, 3 * D + M)
        self.qk_norm = QKNorm(config.head_dim)
        self.linear2 = nn.Linear(D + M, D)

    def forward(
        self,
        x_BSD: torch.Tensor,
        vec_BD: torch.Tensor,
        cos_B1SK2: torch.Tensor,
        sin_B1SK2: torch.Tensor,
        attn_mask: torch.Tensor | None,
        layout: PackedLayout | None = None,
    ) -> torch.Tensor:
        """With ``layout`` (packed mode) ``x_BSD`` is the joint sequence in document order."""
        shift, scale, gate = self.mod(vec_BD, None if layout is None else layout.joint_doc_S)
        x_mod_BSD = (1 + scale) * self.pre_norm(x_BSD) + shift
        qkv_BS3D, mlp_BSM = self.linear1(x_mod_BSD).split([3 * self.hidden, self.mlp_dim], dim=-1)
        q_BHSK, k_BHSK, v_BHSK = split_heads(qkv_BS3D, self.n_heads)
        q_BHSK, k_BHSK = self.qk_norm(q_BHSK, k_BHSK)
        o_BSD = attention(q_BHSK, k_BHSK, v_BHSK, cos_B1SK2, sin_B1SK2, attn_mask)
        out_BSD = self.linear2(torch.cat([o_BSD, F.gelu(mlp_BSM, approximate="tanh")], dim=-1))
        return x_BSD + gate * out_BSD


class FinalLayer(nn.Module):
    """adaLN (shift, scale) then a linear projection back to image channels."""

    def __init__(self, config: FluxConfig) -> None:
        super().__init__()
        D = config.hidden
        self.norm = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.ada = nn.Linear(D, 2 * D)
        self.linear = nn.Linear(D, config.in_channels)
        # Small but non-zero init: the real Flux zero-inits here, which would leave every
        # upstream parameter without gradient on the first step; tests want all grads live.
        for lin in (self.ada, self.linear):
            nn.init.normal_(lin.weight, std=0.02)
            nn.init.normal_(lin.bias, std=0.02)

    def forward(
        self, x_BID: torch.Tensor, vec_BD: torch.Tensor, doc_I: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``doc_I`` (packed mode): the sample of every image token, indexing the rows of ``vec_BD``."""
        shift_B1D, scale_B1D = _per_token(self.ada(F.silu(vec_BD)), doc_I).chunk(2, dim=-1)
        return self.linear((1 + scale_B1D) * self.norm(x_BID) + shift_B1D)


class Flux(nn.Module):
    """Flux-style MMDiT: double-stream blocks, then single-stream blocks, then a final layer."""

    def __init__(self, config: FluxConfig) -> None:
        super().__init__()
        self.config = config
        D = config.hidden
        self.img_in = nn.Linear(config.in_channels, D)
        self.txt_in = nn.Linear(config.txt_dim, D)
        self.time_in = MLPEmbedder(TIME_FREQ_DIM, D)
        self.vector_in = MLPEmbedder(config.pooled_dim, D)
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(config) for _ in range(config.n_double))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(config) for _ in range(config.n_single))
        self.final_layer = FinalLayer(config)

    def forward(
        self,
        img_BIC: torch.Tensor,
        txt_BTE: torch.Tensor,
        timesteps_B: torch.Tensor,
        img_ids_BI3: torch.Tensor,
        txt_ids_BT3: torch.Tensor,
        pooled_BP: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        *,
        txt_doc_T: torch.Tensor | None = None,
        img_doc_I: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Return the prediction for the image tokens, ``(B, I, C)``.

        ``attn_mask`` (bool, broadcastable to ``(B, H, S, S)`` over the joint ``[txt, img]``
        sequence, True = attend) is passed to every attention call when given.

        Packed mode: ``txt_doc_T`` and ``img_doc_I`` (int64, non-decreasing, values in
        ``0..N-1``) give the sample of every text / image token of a single row (B = 1), and
        ``timesteps`` / ``pooled`` hold one entry per sample (length N). Each token is modulated
        by its sample's vector and the attention calls see the joint sequence in document order
        (sample by sample, text then image), so ``AttentionMetadata.from_lengths`` of the
        per-sample ``t_i + i_i`` describes it (an ``attn_mask`` then refers to that order too).
        The output stays in the input's image-token order, ``(1, I, C)``.
        """
        layout = None
        if txt_doc_T is not None or img_doc_I is not None:
            _check_packed(
                img_BIC, txt_BTE, timesteps_B, img_ids_BI3, txt_ids_BT3, pooled_BP, txt_doc_T, img_doc_I
            )
            assert txt_doc_T is not None and img_doc_I is not None
            layout = packed_layout(txt_doc_T, img_doc_I)
        img_BID = self.img_in(img_BIC)
        txt_BTD = self.txt_in(txt_BTE)
        temb_BF = timestep_embedding(timesteps_B, TIME_FREQ_DIM, img_BID.dtype)
        vec_BD = self.time_in(temb_BF) + self.vector_in(pooled_BP)
        # Text comes first in the joint sequence, so its RoPE ids do too.
        ids_BS3 = torch.cat([txt_ids_BT3, img_ids_BI3], dim=1)
        if layout is not None:
            ids_BS3 = ids_BS3.index_select(1, layout.perm_S)
        cos_B1SK2, sin_B1SK2 = rope_cos_sin(ids_BS3, self.config.axes_dims, self.config.theta, img_BID.dtype)
        for block in self.double_blocks:
            txt_BTD, img_BID = block(txt_BTD, img_BID, vec_BD, cos_B1SK2, sin_B1SK2, attn_mask, layout)
        T = txt_BTD.shape[1]
        x_BSD = torch.cat([txt_BTD, img_BID], dim=1)
        if layout is not None:
            x_BSD = x_BSD.index_select(1, layout.perm_S)
        for block in self.single_blocks:
            x_BSD = block(x_BSD, vec_BD, cos_B1SK2, sin_B1SK2, attn_mask, layout)
        if layout is None:
            return self.final_layer(x_BSD[:, T:], vec_BD)
        return self.final_layer(x_BSD.index_select(1, layout.img_pos_I), vec_BD, layout.img_doc_I)


def _is_real(t: torch.Tensor) -> bool:
    """False while compiling or tracing (fake/meta/functional tensors), when values can't be read."""
    return not (torch.compiler.is_compiling() or t.is_meta or is_fake(t) or type(t) is not torch.Tensor)


def _check_packed(
    img_BIC: torch.Tensor,
    txt_BTE: torch.Tensor,
    timesteps_N: torch.Tensor,
    img_ids_BI3: torch.Tensor,
    txt_ids_BT3: torch.Tensor,
    pooled_NP: torch.Tensor,
    txt_doc_T: torch.Tensor | None,
    img_doc_I: torch.Tensor | None,
) -> None:
    """ValueError unless the packed-mode inputs describe one row of N samples consistently.

    Shapes are always checked; the index values (range, order) only in eager, where reading them
    is possible (it is a host sync on GPU).
    """
    if txt_doc_T is None or img_doc_I is None:
        raise ValueError("packed mode needs both txt_doc_T and img_doc_I (or neither)")
    for name, doc, stream in (("txt_doc_T", txt_doc_T, txt_BTE), ("img_doc_I", img_doc_I, img_BIC)):
        if doc.dtype != torch.int64 or doc.dim() != 1:
            raise ValueError(
                f"{name} must be a 1-D int64 tensor, got {doc.dtype} of shape {tuple(doc.shape)}"
            )
        if doc.shape[0] != stream.shape[1]:
            raise ValueError(
                f"{name} has {doc.shape[0]} entries but the row has {stream.shape[1]} such tokens"
            )
    for name, t in (("img", img_BIC), ("txt", txt_BTE), ("img_ids", img_ids_BI3), ("txt_ids", txt_ids_BT3)):
        if t.shape[0] != 1:
            raise ValueError(f"packed mode takes one row (B = 1), got {name} of shape {tuple(t.shape)}")
    N = timesteps_N.shape[0]
    if timesteps_N.dim() != 1 or pooled_NP.shape[0] != N:
        raise ValueError(
            f"packed mode needs one timestep and one pooled vector per sample, got timesteps of shape "
            f"{tuple(timesteps_N.shape)} and pooled of shape {tuple(pooled_NP.shape)}"
        )
    for name, doc in (("txt_doc_T", txt_doc_T), ("img_doc_I", img_doc_I)):
        if not _is_real(doc) or doc.numel() == 0:
            continue
        lo, hi = int(doc.min()), int(doc.max())
        if lo < 0 or hi >= N:
            raise ValueError(
                f"{name} has sample indices in [{lo}, {hi}] but timesteps/pooled hold N = {N} samples"
            )
        if bool((doc[1:] < doc[:-1]).any()):
            i = int((doc[1:] < doc[:-1]).nonzero()[0])
            raise ValueError(
                f"{name} must be non-decreasing (samples packed one after another), but "
                f"{name}[{i + 1}] = {int(doc[i + 1])} < {name}[{i}] = {int(doc[i])}"
            )


def flux_loss(model: Flux, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean squared error between the model's image prediction and ``batch["target"]``.

    A packed batch (keys ``txt_doc`` / ``img_doc``, see :func:`make_packed_flux_batch`) runs the
    packed mode; every image token of it is real, so this is the MSE over all samples' tokens.
    """
    out_BIC = model(
        batch["img"],
        batch["txt"],
        batch["timesteps"],
        batch["img_ids"],
        batch["txt_ids"],
        batch["pooled"],
        batch.get("attn_mask"),
        txt_doc_T=batch.get("txt_doc"),
        img_doc_I=batch.get("img_doc"),
    )
    return F.mse_loss(out_BIC, batch["target"])


def image_ids(img_len: int, grid_width: int | None = None) -> torch.Tensor:
    """RoPE ids ``(I, 3)`` for ``img_len`` patches laid out row-major on a grid.

    Axis 0 is left at zero (Flux uses it for text/reference-image offsets), axis 1 is the row
    and axis 2 the column. The default width is ``ceil(sqrt(img_len))``.
    """
    width = grid_width if grid_width is not None else max(1, math.ceil(math.sqrt(img_len)))
    idx_I = torch.arange(img_len)
    ids_I3 = torch.zeros(img_len, 3)
    ids_I3[:, 1] = idx_I // width
    ids_I3[:, 2] = idx_I % width
    return ids_I3


def make_flux_batch(
    config: FluxConfig,
    batch_size: int,
    txt_len: int,
    img_len: int,
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    grid_width: int | None = None,
) -> dict[str, torch.Tensor]:
    """Random batch with keys ``img, txt, timesteps, img_ids, txt_ids, pooled, target``.

    Text ids are all zero (text carries no spatial position); image ids are a row-major
    ``(row, col)`` grid in axes 1 and 2 (see :func:`image_ids`). Timesteps are in ``[0, 1)``.
    """

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=dtype)

    batch = {
        "img": randn(batch_size, img_len, config.in_channels),
        "txt": randn(batch_size, txt_len, config.txt_dim),
        "timesteps": torch.rand(batch_size, generator=generator, dtype=dtype),
        "img_ids": image_ids(img_len, grid_width).to(dtype).expand(batch_size, -1, -1).contiguous(),
        "txt_ids": torch.zeros(batch_size, txt_len, 3, dtype=dtype),
        "pooled": randn(batch_size, config.pooled_dim),
        "target": randn(batch_size, img_len, config.in_channels),
    }
    return {name: t.to(device) for name, t in batch.items()}


def make_packed_flux_batch(
    config: FluxConfig,
    txt_lens: Sequence[int],
    img_lens: Sequence[int],
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Random packed batch: one row holding N samples, sample n with ``txt_lens[n]`` text and
    ``img_lens[n]`` image tokens, and the joint document lengths ``[t_n + i_n]``.

    Keys are those of :func:`make_flux_batch` plus ``txt_doc`` / ``img_doc`` (int64 sample of every
    text / image token). Streams keep their own order (all text tokens, sample by sample, in
    ``txt``; all image tokens in ``img``); ``timesteps`` and ``pooled`` have one entry per sample.
    Each sample's image ids are its own row-major grid (:func:`image_ids`), text ids are zero.
    The joint lengths are what ``AttentionMetadata.from_lengths`` takes for the packed forward.
    """
    txt_lens, img_lens = [int(n) for n in txt_lens], [int(n) for n in img_lens]
    if len(txt_lens) != len(img_lens) or not txt_lens:
        raise ValueError(
            f"need one text and one image length per sample (N >= 1), got {len(txt_lens)} and {len(img_lens)}"
        )
    if any(n < 0 for n in txt_lens + img_lens):
        raise ValueError(f"lengths must be non-negative, got txt {txt_lens} and img {img_lens}")
    N, n_txt, n_img = len(txt_lens), sum(txt_lens), sum(img_lens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=dtype)

    def doc_ids(lens: list[int]) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(N), torch.tensor(lens, dtype=torch.long))

    batch = {
        "img": randn(1, n_img, config.in_channels),
        "txt": randn(1, n_txt, config.txt_dim),
        "timesteps": torch.rand(N, generator=generator, dtype=dtype),
        "img_ids": torch.cat([image_ids(n) for n in img_lens]).to(dtype)[None],
        "txt_ids": torch.zeros(1, n_txt, 3, dtype=dtype),
        "pooled": randn(N, config.pooled_dim),
        "target": randn(1, n_img, config.in_channels),
        "txt_doc": doc_ids(txt_lens),
        "img_doc": doc_ids(img_lens),
    }
    joint_lens = [t + i for t, i in zip(txt_lens, img_lens, strict=True)]
    return {name: t.to(device) for name, t in batch.items()}, joint_lens
