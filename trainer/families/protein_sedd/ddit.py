"""DDiT: the diffusion transformer used by SEDD (Lou, Meng, Ermon, ICML 2024).

Port of ``model/transformer.py`` and ``model/rotary.py`` from
github.com/louaaron/Score-Entropy-Discrete-Diffusion, in plain torch (no flash-attn, no einops):
attention goes through ``F.scaled_dot_product_attention`` and accepts an optional key padding mask.
The model is single-device; distributed wrapping belongs to the trainer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

DDIT_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, n_heads=4, n_blocks=2, cond_dim=32),
    "small": dict(hidden_size=768, n_heads=12, n_blocks=12, cond_dim=128),
    "medium": dict(hidden_size=1024, n_heads=16, n_blocks=24, cond_dim=128),
}


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN modulation ``x * (1 + scale) + shift`` (shift/scale already broadcastable to x)."""
    return x * (1 + scale) + shift


def _bias_dropout_add_scale(
    x: torch.Tensor, scale: torch.Tensor, residual: torch.Tensor, prob: float, training: bool
) -> torch.Tensor:
    # Reference order (fused_add_dropout_scale.py): dropout first, then the adaLN gate, then residual.
    return residual + scale * F.dropout(x, p=prob, training=training)


class LayerNorm(nn.Module):
    """Bias-free LayerNorm (weight only), normalising in fp32 for stability under bf16."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones([dim]))
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.float(), [self.dim])
        return (y * self.weight.float()).to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding (non-interleaved, ``rotate_half`` convention) for head dim ``dim``."""

    def __init__(self, dim: int, base: float = 10_000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [seq_len, dim], computed in fp32."""
        t = torch.arange(seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.to(device=device, dtype=torch.float32))
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, H, L, D] by cos/sin [L, D] (rotation done in fp32)."""
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


class TimestepEmbedder(nn.Module):
    """Sinusoidal frequency embedding of the scalar noise level followed by an MLP (SiLU)."""

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size, bias=True),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size, bias=True),
        )
        self.frequency_embedding_size = frequency_embedding_size

    @staticmethod
    def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000) -> torch.Tensor:
        """[N] (possibly fractional) -> [N, dim] cos/sin embedding."""
        half = dim // 2
        freqs = torch.exp(
            -math.log(max_period) * torch.arange(start=0, end=half, dtype=torch.float32) / half
        ).to(device=t.device)
        args = t[:, None].float() * freqs[None]
        embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if dim % 2:
            embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
        return embedding

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        t_freq = self.timestep_embedding(t, self.frequency_embedding_size)
        return self.mlp(t_freq.to(self.mlp[0].weight.dtype))


class EmbeddingLayer(nn.Module):
    """Token embedding table with kaiming-uniform init (as the reference, not nn.Embedding's N(0,1))."""

    def __init__(self, dim: int, vocab_dim: int):
        super().__init__()
        self.embedding = nn.Parameter(torch.empty((vocab_dim, dim)))
        torch.nn.init.kaiming_uniform_(self.embedding, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding[x]


class DDiTBlock(nn.Module):
    """Pre-LN transformer block with adaLN-zero conditioning (shift/scale/gate for attn and MLP)."""

    def __init__(self, dim: int, n_heads: int, cond_dim: int, mlp_ratio: int = 4, dropout: float = 0.1):
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"hidden size {dim} is not divisible by n_heads {n_heads}")
        self.n_heads = n_heads
        self.norm1 = LayerNorm(dim)
        self.attn_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.attn_out = nn.Linear(dim, dim, bias=False)
        self.norm2 = LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim, bias=True),
            nn.GELU(approximate="tanh"),
            nn.Linear(mlp_ratio * dim, dim, bias=True),
        )
        self.dropout = dropout
        # adaLN-zero: every block starts as the identity map.
        self.adaLN_modulation = nn.Linear(cond_dim, 6 * dim, bias=True)
        self.adaLN_modulation.weight.data.zero_()
        self.adaLN_modulation.bias.data.zero_()

    def forward(
        self,
        x: torch.Tensor,
        rotary_cos_sin: tuple[torch.Tensor, torch.Tensor],
        c: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, L, D], c [B, cond_dim], attn_mask bool [B, 1, 1, L] (True = may be attended to)."""
        b, s, d = x.shape
        (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp) = self.adaLN_modulation(c)[
            :, None
        ].chunk(6, dim=2)

        x_skip = x
        h = modulate(self.norm1(x), shift_msa, scale_msa)
        qkv = self.attn_qkv(h).view(b, s, 3, self.n_heads, d // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, L, Dh]
        cos, sin = rotary_cos_sin
        q = apply_rotary_pos_emb(q, cos, sin)
        k = apply_rotary_pos_emb(k, cos, sin)
        # Reference uses attention dropout 0 (flash_attn dropout_p=0.).
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=False)
        h = h.transpose(1, 2).reshape(b, s, d)
        x = _bias_dropout_add_scale(self.attn_out(h), gate_msa, x_skip, self.dropout, self.training)

        h = self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return _bias_dropout_add_scale(h, gate_mlp, x, self.dropout, self.training)


class DDitFinalLayer(nn.Module):
    """Final LayerNorm + adaLN (shift, scale) + zero-initialised projection to the vocabulary."""

    def __init__(self, hidden_size: int, out_channels: int, cond_dim: int):
        super().__init__()
        self.norm_final = LayerNorm(hidden_size)
        self.linear = nn.Linear(hidden_size, out_channels)
        self.linear.weight.data.zero_()
        self.linear.bias.data.zero_()
        self.adaLN_modulation = nn.Linear(cond_dim, 2 * hidden_size, bias=True)
        self.adaLN_modulation.weight.data.zero_()
        self.adaLN_modulation.bias.data.zero_()

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c)[:, None].chunk(2, dim=2)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DDiT(nn.Module):
    """SEDD score network: maps (x_t, sigma) to log concentration ratios log s(x_t, sigma)[i, y].

    ``vocab_size`` is the number of diffusion states, i.e. ``graph.dim`` (for the absorbing graph it
    includes the mask state, which the reference adds as ``tokens + 1``).
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        n_heads: int,
        n_blocks: int,
        cond_dim: int,
        dropout: float = 0.1,
        scale_by_sigma: bool = True,
        absorbing: bool = True,
        mlp_ratio: int = 4,
    ):
        super().__init__()
        if scale_by_sigma and not absorbing:
            # Same restriction as the reference's assert: the sigma scaling is the absorbing prior.
            raise ValueError("scale_by_sigma=True is only defined for the absorbing graph")
        self.vocab_size = vocab_size
        self.absorbing = absorbing
        self.scale_by_sigma = scale_by_sigma
        self.vocab_embed = EmbeddingLayer(hidden_size, vocab_size)
        self.sigma_map = TimestepEmbedder(cond_dim)
        self.rotary_emb = Rotary(hidden_size // n_heads)
        self.blocks = nn.ModuleList(
            [DDiTBlock(hidden_size, n_heads, cond_dim, mlp_ratio=mlp_ratio, dropout=dropout) for _ in range(n_blocks)]
        )
        self.output_layer = DDitFinalLayer(hidden_size, vocab_size, cond_dim)

    def forward(
        self, indices: torch.Tensor, sigma: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """indices [B, L] long, sigma [B] (or scalar / [B, 1]) total noise, attention_mask [B, L]
        (nonzero/True = real token; padded keys are not attended to). Returns log-score [B, L, V]."""
        b, s = indices.shape
        sigma = torch.as_tensor(sigma, device=indices.device).reshape(-1)
        if sigma.numel() == 1 and b != 1:
            sigma = sigma.expand(b)
        x = self.vocab_embed(indices)
        c = F.silu(self.sigma_map(sigma)).to(x.dtype)
        rotary_cos_sin = self.rotary_emb(s, indices.device)

        attn_mask = None
        if attention_mask is not None:
            keep = attention_mask.to(torch.bool)
            # An all-padding row would give NaN softmax; let it attend everywhere (output is unused).
            keep = keep | ~keep.any(dim=-1, keepdim=True)
            attn_mask = keep[:, None, None, :]

        for block in self.blocks:
            x = block(x, rotary_cos_sin, c, attn_mask)
        x = self.output_layer(x, c)

        if self.scale_by_sigma:
            # Absorbing-prior parameterisation: at init the score equals the ratio for a uniform
            # posterior over the vocab_size - 1 real tokens, 1 / ((e^sigma - 1)(V - 1)).
            esigm1 = torch.where(sigma < 0.5, torch.expm1(sigma), sigma.exp() - 1)
            x = x - esigm1.log().to(x.dtype)[:, None, None] - math.log(x.shape[-1] - 1)

        # The ratio of a state to itself is 1; fixing it keeps reverse_rate/staggered_score exact.
        return torch.scatter(x, -1, indices[..., None], torch.zeros_like(x[..., :1]))


def count_flops_per_token(model_cfg: Mapping[str, Any], seq_len: int, vocab_size: int | None = None) -> float:
    """Approximate training (forward + backward) FLOPs per token of a DDiT.

    ``6 * N`` for the per-token matmul parameters N (qkv, attn out, MLP, output head; the embedding
    lookup is free) plus ``12 * n_blocks * seq_len * hidden`` for non-causal attention scores and
    values, plus the per-sequence conditioning (adaLN, sigma MLP) amortised over ``seq_len``.
    ``vocab_size`` defaults to ``model_cfg["vocab_size"]`` (0 if absent).
    """
    d = int(model_cfg["hidden_size"])
    n = int(model_cfg["n_blocks"])
    cond = int(model_cfg["cond_dim"])
    r = int(model_cfg.get("mlp_ratio", 4))
    v = int(vocab_size if vocab_size is not None else model_cfg.get("vocab_size", 0))
    per_token_params = n * (4 * d * d + 2 * r * d * d) + d * v
    per_seq_params = n * 6 * d * cond + 2 * d * cond + 256 * cond + cond * cond
    attention = 12 * n * seq_len * d
    return 6.0 * per_token_params + attention + 6.0 * per_seq_params / seq_len
