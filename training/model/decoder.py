"""The one model definition: a Llama decoder with the math of Hugging Face `LlamaForCausalLM`.

    h   = x + Attn(RMSNorm(x))            RMSNorm(x) = w * x / sqrt(mean(x^2) + eps)   (fp32 inside)
    out = h + W2( silu(W1 RMSNorm(h)) * W3 RMSNorm(h) )                                 (SwiGLU)
Attention is grouped-query (n_kv_heads <= n_heads, each K/V head shared by n_heads/n_kv_heads query
heads) with rotate-half RoPE: q' = q*cos + rotate_half(q)*sin, inv_freq_i = theta^(-2i/head_dim),
computed through `F.scaled_dot_product_attention` (flash/memory-efficient kernels on CUDA).
No biases; embeddings optionally tied to the output head. On CUDA q/k/v (and gate/up) run as one GEMM
each over the concatenated weights (`fuse_gemms`), the parameters staying separate; under autocast
the residual stream is bf16 (`Transformer.embed`), RMSNorm computing in fp32 either way.

Parameter names follow Meta's Llama layout; `training.model.gguf_names` maps them to Hugging Face and GGUF.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Annotated, Any, get_type_hints

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from training.runfiles.schema import (
    PositiveFloat,
    SchemaError,
    check,
    one_of,
    read_toml,
    reject_unknown,
    toml_tables,
)

# Upper bounds that no real model reaches: they turn a typo such as n_layers=10**9 into an error
# before anything is allocated or written, instead of a crash (or an hour of swapping) later.
MAX_DIM = 2**16  # d_model, ffn_dim, heads
MAX_LAYERS = 1024
MAX_VOCAB = 2**22
MAX_CONTEXT = 2**20
Dim = Annotated[int, Field(gt=0, le=MAX_DIM)]


@dataclass
class ModelConfig:
    """The model's shape. Every field is checked on construction (types and ranges from the one schema,
    training.runfiles.schema), so a bad value fails here by name and never as a ZeroDivisionError deeper in."""

    vocab_size: Annotated[int, Field(gt=0, le=MAX_VOCAB)] = 8192
    d_model: Dim = 512
    n_layers: Annotated[int, Field(gt=0, le=MAX_LAYERS)] = 8
    n_heads: Dim = 8
    n_kv_heads: Dim = 4
    ffn_dim: Dim = 1536
    max_seq_len: Annotated[int, Field(gt=0, le=MAX_CONTEXT)] = 512
    rope_theta: PositiveFloat = 10000.0
    norm_eps: Annotated[float, Field(gt=0, lt=1, allow_inf_nan=False)] = 1e-5
    tie_embeddings: bool = True
    init_std: PositiveFloat = 0.02

    def __post_init__(self) -> None:
        for name, type_ in field_types(ModelConfig).items():
            setattr(self, name, check(type_, getattr(self, name), f"model config {name}"))
        if self.d_model % self.n_heads:
            raise SchemaError(f"model config: d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise SchemaError(f"model config: n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise SchemaError(f"model config: head_dim = d_model / n_heads = {self.d_model // self.n_heads} "
                              "must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        check(dict, d, "model config")
        reject_unknown("model config key", d, field_types(cls))
        return cls(**d)


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """{field: its annotated type} of a config dataclass: the schema its values are checked against."""
    hints = get_type_hints(cls, include_extras=True)
    return {f.name: hints[f.name] for f in fields(cls)}


def model_table(table: dict, where: str) -> dict:
    """A [model] table (a preset's, a --config file's) checked key by key, strictly: TOML is typed, so
    `n_layers = "4"` or `n_layers = true` is a mistake. `where` names the file."""
    types = field_types(ModelConfig)
    reject_unknown("key", table, types, f"{where} [model]")
    return {k: check(types[k], v, f"{where} [model] {k}", strict=True) for k, v in table.items()}


# ------------------------------------------------------------------------------------------ presets
# A preset is a recipe, training/presets/NAME.toml: a [model] table (the shape) and a [train] table
# (the settings that preset wants where they differ from TrainConfig's defaults; training.train_config
# reads and checks that one). d_model and ffn_dim are multiples of 256 in every preset (tiny
# included, so tests quantize real Q4_K_M), so llama.cpp's K-quants (256-wide super-blocks) apply.
PRESET_DIR = Path(__file__).resolve().parents[1] / "presets"
PRESET_TABLES = ("model", "train")


@functools.cache
def preset_names() -> tuple[str, ...]:
    """Every shipped preset, smallest model first."""
    names = [p.stem for p in PRESET_DIR.glob("*.toml")]
    return tuple(sorted(names, key=lambda n: count_params(ModelConfig(**preset_tables(n)["model"]))))


@functools.cache
def preset_tables(name: str) -> dict[str, dict]:
    """{"model": {...}, "train": {...}} of preset `name`, the [model] table checked (cached: read once)."""
    path = PRESET_DIR / f"{name}.toml"
    if not path.is_file():
        raise unknown_preset(name)
    tables = toml_tables(read_toml(path, "preset"), PRESET_TABLES, str(path))
    return {"model": model_table(tables["model"], str(path)), "train": tables["train"]}


def unknown_preset(name: str) -> SchemaError:
    try:
        one_of("preset", name, preset_names())
    except SchemaError as e:
        return e
    return SchemaError(f"preset {name!r} not found in {PRESET_DIR}")


@functools.cache
def _preset_config(name: str) -> ModelConfig:
    return ModelConfig(**preset_tables(name)["model"])


class _Presets(Mapping[str, ModelConfig]):
    """PRESETS[name] -> that preset's ModelConfig, read from its TOML file on first use."""

    def __getitem__(self, name: str) -> ModelConfig:
        if name not in preset_names():
            raise KeyError(name)
        return _preset_config(name)

    def __iter__(self) -> Iterator[str]:
        return iter(preset_names())

    def __len__(self) -> int:
        return len(preset_names())


PRESETS: Mapping[str, ModelConfig] = _Presets()


def preset(name: str, **overrides) -> ModelConfig:
    """A fresh ModelConfig of preset `name`, with `overrides` (checked like every ModelConfig)."""
    if name not in preset_names():
        raise unknown_preset(name)
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


# Fused projections: Attention computes q, k, v with one GEMM against cat([wq, wk, wv]) and FeedForward
# gate and up with one against cat([w1, w3]); the parameters stay separate nn.Linear modules (checkpoint,
# optimizer state, FSDP2, export names unchanged) and the cat is redone each forward, its backward a
# split. The cat copies the weights once per call, which a GEMM of enough rows amortizes (training,
# prefill) and a decode step of one token per sequence does not: below FUSE_MIN_ROWS rows the three
# GEMMs run as before. FUSE_DEVICES: where the one GEMM pays (docs/scale.md, "Fused projections").
FUSE_MIN_ROWS = 256
FUSE_DEVICES = ("cuda",)
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def plain_linear(m: nn.Module) -> bool:
    """Calling `m` is exactly F.linear(x, m.weight): an nn.Linear itself (not a subclass: a quantized or
    float8 Linear, a parametrization), its forward not replaced on the instance, no bias, and no hook
    that would expect to see the call (export.gguf.imatrix_torch's pre-hooks, a debugger's)."""
    return (type(m) is nn.Linear and m.bias is None and "forward" not in m.__dict__
            and not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks))


def fuse_gemms(x: torch.Tensor, *mods: nn.Module) -> bool:
    """Whether `mods` (projections of the same input x) run as one fused GEMM: on FUSE_DEVICES, for at
    least FUSE_MIN_ROWS rows, never while exporting or tracing (the ONNX graph keeps one MatMul per
    named weight, export.onnx.onnx_graph's initializer plan), and only when each module is plain_linear."""
    if x.device.type not in FUSE_DEVICES or x.numel() < FUSE_MIN_ROWS * x.shape[-1]:
        return False
    if torch.jit.is_tracing() or torch.onnx.is_in_onnx_export() or torch.compiler.is_exporting():
        return False
    glob = torch.nn.modules.module
    return not any(getattr(glob, h) for h in _GLOBAL_HOOKS) and all(plain_linear(m) for m in mods)


def fused_linear(x: torch.Tensor, *mods: nn.Linear) -> torch.Tensor:
    """x @ cat([m.weight for m in mods]).T: the outputs of `mods` side by side, in one GEMM. Under
    autocast each weight is cast before the cat, so the copy is made in the compute dtype (as
    nn.Linear's own cast would be), not in fp32 and then cast again."""
    dev = x.device.type
    ws = [m.weight for m in mods]
    if torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        ws = [w.to(dtype) for w in ws]
    return F.linear(x, torch.cat(ws))


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
        if fuse_gemms(x, self.wq, self.wk, self.wv):  # one GEMM against [wq; wk; wv], split after
            kv = self.n_kv_heads * self.head_dim
            q, k, v = fused_linear(x, self.wq, self.wk, self.wv).split((self.n_heads * self.head_dim, kv, kv), -1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if past_kv is not None:
            k = torch.cat((past_kv[0], k), dim=2)
            v = torch.cat((past_kv[1], v), dim=2)
        present = (k, v)
        rep = self.n_heads // self.n_kv_heads
        if attn_mask is None and past_kv is None:
            if rep > 1 and q.is_cuda and q.dtype == torch.float32:
                # on CUDA only cuDNN and flash (bf16/fp16) take enable_gqa: fp32 would fall back to the math
                # kernel, which holds (T x T) scores per head; expanded K/V keep memory-efficient eligible
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
                rep = 1
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
        if fuse_gemms(x, self.w1, self.w3):  # one GEMM against [w1; w3], split after
            gate, up = fused_linear(x, self.w1, self.w3).chunk(2, dim=-1)
        else:
            gate, up = self.w1(x), self.w3(x)
        return self.w2(F.silu(gate) * up)


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
        self.compile_loss = False  # set by training.distributed.compile_blocks: see chunked_cross_entropy
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

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """The residual stream's start. Under autocast it is kept in the compute dtype (bf16): each
        block adds its bf16 output to a bf16 stream, as FSDP2's bf16 parameters do, instead of
        promoting the stream to fp32 at every addition; RMSNorm still computes in fp32. Without
        autocast (fp32 training, serving, export) the stream is the parameters' dtype, as before."""
        x = self.tok_embeddings(idx)
        dev = x.device.type
        if torch.is_autocast_enabled(dev) and x.is_floating_point():
            x = x.to(torch.get_autocast_dtype(dev))
        return x

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, loss_mask: torch.Tensor | None = None,
                reduction: str = "mean", return_logits: bool | None = None):
        """Training/eval path over full causal windows. Returns logits, or (logits, loss) with targets.

        `loss_mask` (same shape as targets, 0/1) restricts the loss to chosen positions (SFT).
        With targets, logits are returned only when asked (`return_logits`; default: in eval mode):
        a training step needs the loss alone, which `chunked_cross_entropy` computes a few rows of
        logits at a time, never holding the whole batch's (B*T x vocab) logits in fp32.
        """
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        cos, sin = rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta)
        x = self.embed(idx)
        for layer in self.layers:
            if self.activation_checkpointing and self.training:
                x, _ = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x, _ = layer(x, cos, sin)
        h = self.norm(x)
        if targets is None:
            return self.output(h)
        if return_logits is None:
            return_logits = not self.training
        if return_logits or reduction == "none":  # per-token losses: the reference path
            logits = self.output(h)
            return (logits if return_logits else None), token_loss(logits, targets, loss_mask, reduction)
        return None, chunked_cross_entropy(h, self.output.weight, targets, loss_mask, reduction,
                                           compiled=self.compile_loss and h.device.type in COMPILE_LOSS_DEVICES)

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
        x = self.embed(input_ids)
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
    # a Python count divides on the device: torch.tensor(n, device=cuda) would be a synchronous host copy
    return flat.sum() / (loss_mask.sum().clamp_min(1) if loss_mask is not None else flat.numel())


# The chunked loss computes at most this many bytes of fp32 logits at once: 2048 rows of a 32 k vocab
# (large enough that each chunk's GEMM runs at full speed on a GPU).
CE_CHUNK_BYTES = 2**28
# Where a --compile run compiles the loss's per-chunk work too (`_ce_chunk`, one Inductor kernel pair
# from the head GEMM's bf16 output to the bf16 d logits: no fp32 logits, log-probabilities or softmax
# ever written to memory; eagerly each of those is a full pass over rows x vocab fp32 values, ~20 GB
# per 400m micro-batch). CUDA only, where that traffic is the cost (docs/scale.md, "The loss").
COMPILE_LOSS_DEVICES = ("cuda",)


def chunked_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          loss_mask: torch.Tensor | None = None, reduction: str = "mean",
                          chunk_rows: int | None = None, compiled: bool = False) -> torch.Tensor:
    """token_loss(h @ weight.T, targets, loss_mask, reduction) for reduction 'mean' or 'sum', computed
    `chunk_rows` rows at a time: each chunk's logits exist (in fp32) only while its loss and
    gradients are computed, in the forward pass, so no (B*T x vocab) tensor is ever held. `compiled`:
    each chunk's softmax and d logits run as one compiled kernel (`_ce_chunk`), never in fp32 memory."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"chunked_cross_entropy: reduction {reduction!r} (per-token losses need the logits)")
    rows = chunk_rows or max(1, CE_CHUNK_BYTES // (4 * weight.shape[0]))
    mask = None if loss_mask is None else loss_mask.reshape(-1)
    if reduction == "sum":
        denom = torch.ones((), device=h.device)
    elif mask is not None:
        denom = mask.sum().clamp_min(1)
    else:  # a fill kernel, not torch.tensor(n, device=...): that is a pageable host copy and a sync on CUDA
        denom = torch.full((), targets.numel(), device=h.device)
    return _ChunkedCrossEntropy.apply(h.reshape(-1, h.shape[-1]), weight, targets.reshape(-1), mask, denom, rows,
                                      compiled)


def _ce_chunk(hi: torch.Tensor, wc: torch.Tensor, ti: torch.Tensor, scale: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's per-row cross-entropy and, unless `scale` is None, its d logits = (softmax - onehot) *
    scale in the compute dtype. Eager, each step is a pass over the chunk's fp32 logits; compiled, the same
    math (`_ce_chunk_fusible`) fuses into kernels that read the GEMM's bf16 output and write bf16."""
    logp = torch.log_softmax((hi @ wc.T).float(), dim=-1)  # this chunk's fp32 logits, and no more
    ce = -logp.gather(1, ti[:, None]).squeeze(1)  # = F.cross_entropy(reduction="none")
    if scale is None:
        return ce, None
    g = logp.exp_()  # softmax, in place
    g[torch.arange(len(ti), device=g.device), ti] -= 1
    return ce, (g * scale).to(hi.dtype)


def _ce_chunk_fusible(hi: torch.Tensor, wc: torch.Tensor, ti: torch.Tensor, scale: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """_ce_chunk in the form Inductor fuses: the one-hot as a comparison with an index range instead of
    an in-place write (which would need the fp32 softmax in memory first), the softmax from logsumexp.
    Eagerly it would hold fp32 logits and a bool one-hot: only ever run compiled."""
    logits = (hi @ wc.T).float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    ce = (lse - logits.gather(1, ti[:, None])).squeeze(1)
    if scale is None:
        return ce, None
    onehot = torch.arange(logits.shape[1], device=ti.device)[None, :] == ti[:, None]
    return ce, ((torch.exp(logits - lse) - onehot.float()) * scale).to(hi.dtype)


@functools.cache
def _compiled_ce_chunk():
    # static shapes: every chunk but a last partial one has the same rows (400m: 8 of 2048 per micro-batch)
    return torch.compile(_ce_chunk_fusible, dynamic=False)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """loss = sum_i(mask_i * CE(h_i @ W.T, t_i)) / denom. The gradients (a scalar loss: they only scale
    in backward) are computed chunk by chunk in forward: d logits = (softmax - onehot) * mask / denom."""

    @staticmethod
    def forward(ctx, h, weight, targets, mask, denom, rows: int, compiled: bool = False):
        # the dtype the head's matmul runs in: autocast's (bf16) when on, like nn.Linear's
        dev = h.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
        hc, wc = h.to(dtype), weight.to(dtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        chunk = _compiled_ce_chunk() if compiled else _ce_chunk
        ce = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for i in range(0, h.shape[0], rows):
            hi, ti = hc[i:i + rows], targets[i:i + rows]
            scale = None
            if need_h or need_w:
                scale = 1 / denom if mask is None else mask[i:i + rows, None] / denom
            ce[i:i + rows], g = chunk(hi, wc, ti, scale)
            if g is not None:
                if need_h:
                    grad_h[i:i + rows] = g @ wc
                if need_w:
                    grad_w += (g.T @ hi).float()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.w_dtype = weight.dtype
        loss = ce if mask is None else ce * mask
        return loss.sum() / denom

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        gh = None if grad_h is None else grad_h * grad_out.to(grad_h.dtype)
        gw = None if grad_w is None else (grad_w * grad_out).to(ctx.w_dtype)
        return gh, gw, None, None, None, None, None


def count_params(cfg: ModelConfig, *, non_embedding: bool = False) -> int:
    """Exact parameter count (tied embeddings counted once)."""
    d, f, hd = cfg.d_model, cfg.ffn_dim, cfg.head_dim
    attn = d * cfg.n_heads * hd * 2 + d * cfg.n_kv_heads * hd * 2
    block = attn + 3 * d * f + 2 * d
    emb = cfg.vocab_size * d
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    total = cfg.n_layers * block + d + emb + head
    return total - emb if non_embedding else total
