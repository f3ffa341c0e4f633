"""The one model definition: a Llama decoder with the math of Hugging Face `LlamaForCausalLM`.

    h   = x + Attn(RMSNorm(x))            RMSNorm(x) = w * x / sqrt(mean(x^2) + eps)   (fp32 inside)
    out = h + W2( silu(W1 RMSNorm(h)) * W3 RMSNorm(h) )                                 (SwiGLU)
Attention is grouped-query (n_kv_heads <= n_heads, each K/V head shared by n_heads/n_kv_heads query
heads) with rotate-half RoPE: q' = q*cos + rotate_half(q)*sin, inv_freq_i = theta^(-2i/head_dim),
computed through `F.scaled_dot_product_attention` (flash/memory-efficient kernels on CUDA).
No biases; embeddings optionally tied to the output head.

Parameter names follow Meta's Llama layout; `export.names` maps them to Hugging Face and GGUF.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelConfig:
    vocab_size: int = 8192
    d_model: int = 512
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_dim: int = 1536
    max_seq_len: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("head_dim must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        return cls(**d)


# d_model and ffn_dim are multiples of 256 in every preset (tiny included, so tests quantize real
# Q4_K_M), so llama.cpp's K-quants (256-wide super-blocks) apply without falling back to other types.
PRESETS: dict[str, ModelConfig] = {
    # tests: ~2 M params, trains in seconds on CPU
    "tiny": ModelConfig(vocab_size=2048, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=768,
                        max_seq_len=256),
    # CPU quickstart: ~17 M params (12.6 M non-embedding)
    "small": ModelConfig(vocab_size=8192, d_model=512, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=1536,
                         max_seq_len=512),
    # the reference run's size, deep-and-thin as MobileLLM-350M / SmolLM2-360M: ~0.39 B params
    "400m": ModelConfig(vocab_size=32768, d_model=1024, n_layers=32, n_heads=16, n_kv_heads=4, ffn_dim=2816,
                        max_seq_len=2048),
    # TinyLlama's shape: ~1.06 B params
    "1b": ModelConfig(vocab_size=32768, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_dim=5632,
                      max_seq_len=2048),
}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return ModelConfig.from_dict({**PRESETS[name].to_dict(), **overrides})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (..., seq, head_dim) for integer positions, computed in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # (..., seq, head_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, D); cos/sin: (B, T, D) or (T, D)
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    return (x * cos.to(x.dtype)) + (rotate_half(x) * sin.to(x.dtype))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x, cos, sin, past_kv=None, attn_mask=None):
        """x: (B,T,C). past_kv: optional (k, v) of shape (B, n_kv_heads, P, head_dim).

        attn_mask: None means causal over the T new tokens (no past); otherwise a bool/float mask of
        shape (B, 1, T, P+T) that SDPA applies as given. Returns (out, (k, v) incl. past).
        """
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if past_kv is not None:
            k = torch.cat((past_kv[0], k), dim=2)
            v = torch.cat((past_kv[1], v), dim=2)
        present = (k, v)
        rep = self.n_heads // self.n_kv_heads
        if attn_mask is None and past_kv is None:
            # training path: SDPA shares each K/V head across `rep` query heads itself (no copies)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=rep > 1)
        else:
            if rep > 1:  # explicit repeat: the form every ONNX exporter and runtime understands
                k = k.repeat_interleave(rep, dim=1)
                v = v.repeat_interleave(rep, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return self.wo(y), present


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)  # gate
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)  # down
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)  # up

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin, past_kv=None, attn_mask=None):
        a, present = self.attention(self.attention_norm(x), cos, sin, past_kv, attn_mask)
        h = x + a
        return h + self.feed_forward(self.ffn_norm(h)), present


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.activation_checkpointing = False
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, init_std) for matrices, residual projections scaled by 1/sqrt(2*n_layers)."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            elif name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.cfg.n_layers))
            else:
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, loss_mask: torch.Tensor | None = None,
                reduction: str = "mean"):
        """Training/eval path over full causal windows. Returns logits, or (logits, loss) with targets.

        `loss_mask` (same shape as targets, 0/1) restricts the loss to chosen positions (SFT).
        """
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        cos, sin = rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta)
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            if self.activation_checkpointing and self.training:
                x, _ = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x, _ = layer(x, cos, sin)
        logits = self.output(self.norm(x))
        if targets is None:
            return logits
        loss = token_loss(logits, targets, loss_mask, reduction)
        return logits, loss

    def forward_with_cache(self, input_ids: torch.Tensor, position_ids: torch.Tensor, past_key_values: list | None,
                           attention_mask: torch.Tensor | None = None):
        """Incremental decoding (serving, ONNX export). `attention_mask` (B, P+T) marks real tokens.

        Returns (logits (B,T,V) in fp32, presents: list of (k, v) per layer incl. the new tokens).
        """
        B, T = input_ids.shape
        P = 0 if not past_key_values else past_key_values[0][0].shape[2]
        cos, sin = rope_cos_sin(position_ids, self.cfg.head_dim, self.cfg.rope_theta)
        # Causal mask over [past, new]: new token t (absolute P+t) sees keys 0..P+t that are real.
        key_pos = torch.arange(P + T, device=input_ids.device)
        query_pos = torch.arange(T, device=input_ids.device) + P
        mask = key_pos[None, :] <= query_pos[:, None]  # (T, P+T)
        mask = mask[None, None].expand(B, 1, T, P + T)
        if attention_mask is not None:
            mask = mask & attention_mask[:, None, None, :].bool()
        x = self.tok_embeddings(input_ids)
        presents = []
        for i, layer in enumerate(self.layers):
            x, present = layer(x, cos, sin, past_key_values[i] if past_key_values else None, mask)
            presents.append(present)
        return self.output(self.norm(x)).float(), presents


def token_loss(logits, targets, loss_mask=None, reduction: str = "mean"):
    """Cross-entropy in fp32. reduction: 'mean' over counted tokens, 'sum', or 'none' (per token)."""
    flat = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), reduction="none")
    flat = flat.view(targets.shape)
    if loss_mask is not None:
        flat = flat * loss_mask
    if reduction == "none":
        return flat
    if reduction == "sum":
        return flat.sum()
    denom = loss_mask.sum().clamp_min(1) if loss_mask is not None else torch.tensor(flat.numel(), device=flat.device)
    return flat.sum() / denom


def count_params(cfg: ModelConfig, *, non_embedding: bool = False) -> int:
    """Exact parameter count (tied embeddings counted once)."""
    d, f, hd = cfg.d_model, cfg.ffn_dim, cfg.head_dim
    attn = d * cfg.n_heads * hd * 2 + d * cfg.n_kv_heads * hd * 2
    block = attn + 3 * d * f + 2 * d
    emb = cfg.vocab_size * d
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    total = cfg.n_layers * block + d + emb + head
    return total - emb if non_embedding else total


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6N (forward+backward matmuls, N = non-embedding params plus the
    output head) + the attention term 6 * n_layers * seq_len * d_attn (QK^T and AV; PaLM appendix B,
    causal masking not discounted, as is conventional for MFU)."""
    n = count_params(cfg, non_embedding=True) + cfg.vocab_size * cfg.d_model  # lm head matmul counts
    return 6.0 * n + 6.0 * cfg.n_layers * seq_len * cfg.n_heads * cfg.head_dim
