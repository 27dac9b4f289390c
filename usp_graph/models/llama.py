# B batch, L sequence, H heads, G kv heads, K head dim, D model dim, F ffn dim, V vocab, N documents
"""A small Llama-style decoder used as a reference model for the attention rewrite.

The model is deliberately plain: every attention layer makes exactly one call to
``F.scaled_dot_product_attention`` with ``is_causal=True`` and un-repeated GQA key/value
heads, which is the pattern the graph pass looks for. RoPE angles come from explicit
``position_ids`` so that packed rows of several documents (positions restarting at 0 at
each document start) are rotated exactly as if each document were run on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of a :class:`Llama` model (defaults are tiny, for tests)."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        """Per-head dimension K = dim // n_heads."""
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learnable per-channel scale (no bias, no mean-centering)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        rms_BL1 = torch.rsqrt(x_BLD.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return x_BLD * rms_BL1 * self.weight


def rope_cos_sin(
    position_ids_BL: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(cos_B1LK, sin_B1LK)`` for rotate-half RoPE at the given positions.

    Angles are computed in at least float32 (float64 if ``dtype`` is float64) so that the
    rotation is not limited by a low-precision model dtype, then cast to ``dtype``.
    """
    angle_dtype = torch.promote_types(dtype, torch.float32)
    half = head_dim // 2
    exponents_K2 = torch.arange(half, device=position_ids_BL.device, dtype=angle_dtype) * (2.0 / head_dim)
    inv_freq_K2 = theta**-exponents_K2
    angles_BLK2 = position_ids_BL.to(angle_dtype)[..., None] * inv_freq_K2
    # Rotate-half layout: the first and second halves of the head dim share a frequency.
    angles_BLK = torch.cat([angles_BLK2, angles_BLK2], dim=-1)
    cos_B1LK = angles_BLK.cos().to(dtype)[:, None]
    sin_B1LK = angles_BLK.sin().to(dtype)[:, None]
    return cos_B1LK, sin_B1LK


def apply_rope(x_BHLK: torch.Tensor, cos_B1LK: torch.Tensor, sin_B1LK: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x[i], x[i + K/2])`` by the position angle (rotate-half convention)."""
    x1_BHLK2, x2_BHLK2 = x_BHLK.chunk(2, dim=-1)
    rotated_BHLK = torch.cat([-x2_BHLK2, x1_BHLK2], dim=-1)
    return x_BHLK * cos_B1LK + rotated_BHLK * sin_B1LK


class Attention(nn.Module):
    """Grouped-query causal self-attention with RoPE and separate bias-free projections."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def forward(
        self,
        x_BLD: torch.Tensor,
        cos_B1LK: torch.Tensor,
        sin_B1LK: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, L, _ = x_BLD.shape
        H, G, K = self.n_heads, self.n_kv_heads, self.head_dim
        q_BHLK = self.wq(x_BLD).view(B, L, H, K).transpose(1, 2)
        k_BGLK = self.wk(x_BLD).view(B, L, G, K).transpose(1, 2)
        v_BGLK = self.wv(x_BLD).view(B, L, G, K).transpose(1, 2)
        q_BHLK = apply_rope(q_BHLK, cos_B1LK, sin_B1LK)
        k_BGLK = apply_rope(k_BGLK, cos_B1LK, sin_B1LK)
        # k/v keep their G heads (enable_gqa) so the graph pass sees the un-repeated tensors.
        # F.<name> is looked up at call time so a TorchFunctionMode / tracer can intercept it.
        if attn_mask is None:
            o_BHLK = F.scaled_dot_product_attention(
                q_BHLK, k_BGLK, v_BGLK, is_causal=True, enable_gqa=True, scale=K**-0.5
            )
        else:
            o_BHLK = F.scaled_dot_product_attention(
                q_BHLK, k_BGLK, v_BGLK, attn_mask=attn_mask, enable_gqa=True, scale=K**-0.5
            )
        o_BLD = o_BHLK.transpose(1, 2).reshape(B, L, H * K)
        return self.wo(o_BLD)


class SwiGLU(nn.Module):
    """Gated MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x_BLD)) * self.w3(x_BLD))


class DecoderBlock(nn.Module):
    """Pre-norm residual block: attention then SwiGLU MLP."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = SwiGLU(config.dim, config.ffn_dim)

    def forward(
        self,
        x_BLD: torch.Tensor,
        cos_B1LK: torch.Tensor,
        sin_B1LK: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x_BLD = x_BLD + self.attn(self.attn_norm(x_BLD), cos_B1LK, sin_B1LK, attn_mask)
        return x_BLD + self.mlp(self.mlp_norm(x_BLD))


class Llama(nn.Module):
    """Llama-style decoder-only language model (embedding, decoder blocks, norm, untied head)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(DecoderBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids_BL: torch.Tensor,
        position_ids_BL: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Return logits ``(B, L, V)``.

        ``attn_mask`` (bool, broadcastable to ``(B, H, L, L)``, True = attend) replaces the
        plain causal mask; it is how tests build a document-causal reference for packed rows.
        """
        x_BLD = self.tok_embeddings(input_ids_BL)
        # RoPE tables are shared by all layers, so build them once per forward.
        cos_B1LK, sin_B1LK = rope_cos_sin(
            position_ids_BL, self.config.head_dim, self.config.rope_theta, x_BLD.dtype
        )
        for layer in self.layers:
            x_BLD = layer(x_BLD, cos_B1LK, sin_B1LK, attn_mask)
        return self.lm_head(self.norm(x_BLD))


def llama_loss(model: Llama, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Token-mean next-token cross entropy over labels != -100, in the model dtype.

    ``batch`` holds ``input_ids``, ``position_ids``, ``labels`` and optionally ``attn_mask``.
    """
    logits_BLV = model(batch["input_ids"], batch["position_ids"], batch.get("attn_mask"))
    labels_BL = batch["labels"]
    return F.cross_entropy(
        logits_BLV.reshape(-1, logits_BLV.shape[-1]), labels_BL.reshape(-1), ignore_index=IGNORE_INDEX
    )


def document_causal_mask(lengths: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """Bool mask ``(1, 1, L, L)``, True where query i may attend key j (same document, j <= i).

    This is the dense reference for a packed row; zero-length documents are skipped.
    """
    doc_ids_L = torch.repeat_interleave(
        torch.arange(len(lengths), device=device),
        torch.tensor(list(lengths), dtype=torch.long, device=device),
    )
    L = doc_ids_L.numel()
    same_doc_LL = doc_ids_L[:, None] == doc_ids_L[None, :]
    causal_LL = torch.ones(L, L, dtype=torch.bool, device=device).tril()
    return (same_doc_LL & causal_LL)[None, None]


def make_llama_batch(
    config: LlamaConfig,
    lengths: Sequence[int],
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    with_attn_mask: bool = False,
) -> dict[str, torch.Tensor]:
    """Random packed single-row batch (B=1, L=sum(lengths)) of documents with the given lengths.

    ``position_ids`` restart at 0 at each document start; ``labels`` are the next token of
    the same document and -100 at each document's last token (so nothing is predicted across
    a document boundary). Zero-length documents contribute nothing. With ``with_attn_mask``
    the batch also carries the dense document-causal mask from :func:`document_causal_mask`.
    """
    lengths = [int(n) for n in lengths]
    if any(n < 0 for n in lengths):
        raise ValueError(f"document lengths must be non-negative, got {lengths}")
    L = sum(lengths)
    input_ids_L = torch.randint(0, config.vocab_size, (L,), generator=generator)
    position_ids_L = torch.cat(
        [torch.arange(n, dtype=torch.long) for n in lengths] or [torch.zeros(0, dtype=torch.long)]
    )
    labels_L = torch.full((L,), IGNORE_INDEX, dtype=torch.long)
    start = 0
    for n in lengths:
        # Token t predicts token t+1 within the document; the last token has no target.
        # (Guarded because an empty slice end of start - 1 would wrap around when start == 0.)
        if n >= 2:
            labels_L[start : start + n - 1] = input_ids_L[start + 1 : start + n]
        start += n
    batch = {
        "input_ids": input_ids_L[None].to(device),
        "position_ids": position_ids_L[None].to(device),
        "labels": labels_L[None].to(device),
    }
    if with_attn_mask:
        batch["attn_mask"] = document_causal_mask(lengths, device=device)
    return batch
