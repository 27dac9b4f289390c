# B batch, L sequence (T text tokens, I image tokens, S = T + I joint), H heads, K head dim,
# D hidden dim, C image channels, E text feature dim, P pooled text dim, M mlp dim, A rope axes (3)
"""A small Flux-style MMDiT (multi-modal diffusion transformer) used as a reference model.

Text and image tokens keep separate weights in the double-stream blocks but attend jointly
over the concatenated ``[txt, img]`` sequence; single-stream blocks then process the joint
sequence with shared weights. Every block makes exactly one bidirectional, unmasked call to
``F.scaled_dot_product_attention`` (default scale), which is what the graph pass rewrites.
Positions enter only through a multi-axis RoPE computed from per-token ``ids``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

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

    def forward(self, vec_BD: torch.Tensor) -> list[torch.Tensor]:
        # Each chunk is (B, 1, D) so it broadcasts over the token axis.
        return list(self.lin(F.silu(vec_BD))[:, None].chunk(self.n_chunks, dim=-1))


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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        T = txt_BTD.shape[1]
        streams = [(self.txt, txt_BTD), (self.img, img_BID)]
        mods, qs, ks, vs = [], [], [], []
        for weights, x_BLD in streams:
            shift1, scale1, gate1, shift2, scale2, gate2 = weights.mod(vec_BD)
            mods.append((gate1, shift2, scale2, gate2))
            x_mod_BLD = (1 + scale1) * weights.norm1(x_BLD) + shift1
            q_BHLK, k_BHLK, v_BHLK = split_heads(weights.qkv(x_mod_BLD), self.n_heads)
            q_BHLK, k_BHLK = weights.qk_norm(q_BHLK, k_BHLK)
            qs.append(q_BHLK)
            ks.append(k_BHLK)
            vs.append(v_BHLK)
        # Joint attention: text and image tokens see each other in both directions.
        o_BSD = attention(
            torch.cat(qs, dim=2),
            torch.cat(ks, dim=2),
            torch.cat(vs, dim=2),
            cos_B1SK2,
            sin_B1SK2,
            attn_mask,
        )
        outs = []
        for (weights, x_BLD), (gate1, shift2, scale2, gate2), o_BLD in zip(
            streams, mods, (o_BSD[:, :T], o_BSD[:, T:]), strict=True
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
    ) -> torch.Tensor:
        shift, scale, gate = self.mod(vec_BD)
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

    def forward(self, x_BID: torch.Tensor, vec_BD: torch.Tensor) -> torch.Tensor:
        shift_B1D, scale_B1D = self.ada(F.silu(vec_BD))[:, None].chunk(2, dim=-1)
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
    ) -> torch.Tensor:
        """Return the prediction for the image tokens, ``(B, I, C)``.

        ``attn_mask`` (bool, broadcastable to ``(B, H, S, S)`` over the joint ``[txt, img]``
        sequence, True = attend) is passed to every attention call when given.
        """
        img_BID = self.img_in(img_BIC)
        txt_BTD = self.txt_in(txt_BTE)
        temb_BF = timestep_embedding(timesteps_B, TIME_FREQ_DIM, img_BID.dtype)
        vec_BD = self.time_in(temb_BF) + self.vector_in(pooled_BP)
        # Text comes first in the joint sequence, so its RoPE ids do too.
        ids_BS3 = torch.cat([txt_ids_BT3, img_ids_BI3], dim=1)
        cos_B1SK2, sin_B1SK2 = rope_cos_sin(ids_BS3, self.config.axes_dims, self.config.theta, img_BID.dtype)
        for block in self.double_blocks:
            txt_BTD, img_BID = block(txt_BTD, img_BID, vec_BD, cos_B1SK2, sin_B1SK2, attn_mask)
        T = txt_BTD.shape[1]
        x_BSD = torch.cat([txt_BTD, img_BID], dim=1)
        for block in self.single_blocks:
            x_BSD = block(x_BSD, vec_BD, cos_B1SK2, sin_B1SK2, attn_mask)
        return self.final_layer(x_BSD[:, T:], vec_BD)


def flux_loss(model: Flux, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean squared error between the model's image prediction and ``batch["target"]``."""
    out_BIC = model(
        batch["img"],
        batch["txt"],
        batch["timesteps"],
        batch["img_ids"],
        batch["txt_ids"],
        batch["pooled"],
        batch.get("attn_mask"),
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
