"""LoRA adapters on the linears of the one model definition (training.model.decoder), the base frozen.

    y = W x + (alpha / r) * B (A dropout(x))      A: (r, in), B: (out, r); B starts at zero (y = W x at step 0)
The adapter of a linear lives in the linear itself (`LoRALinear`, an nn.Linear subclass holding the same
base `weight` Parameter plus `lora_A`, `lora_B`), so the base keeps its names (`layers.0.attention.wq.weight`)
and the adapter's are `layers.0.attention.wq.lora_A` / `.lora_B`. llama.cpp applies the same formula at
run time (src/llama-adapter.cpp: scale = user_scale * alpha / rank), which export.gguf.lora_gguf writes for.

Why not PEFT's LoraLayer: PEFT replaces each targeted nn.Linear with a wrapper whose base weight is renamed
`<name>.base_layer.weight` (and the adapters `<name>.lora_A.default.weight`); every name-keyed contract of
this project (checkpoint check_fits, the gates' eager reference model, training.model.gguf_names' GGUF/HF maps) would
need a translation at each place, and importing PEFT pulls transformers into the training and serving path
for these thirty lines of arithmetic. The math and the init are PEFT's defaults (A Kaiming-uniform, B zero).

model.fuse_gemms already leaves a LoRALinear out of the fused q/k/v and gate/up GEMM on CUDA
(`plain_linear`: the type is not nn.Linear), so the adapter's term is never skipped.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass
from typing import Annotated

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from training.model.decoder import ModelConfig, Transformer
from training.runfiles.schema import PositiveFloat, PositiveInt, flag

# --lora-targets names -> the block's module paths (Meta's Llama layout, training.model.decoder)
TARGETS: dict[str, str] = {"q": "attention.wq", "k": "attention.wk", "v": "attention.wv", "o": "attention.wo",
                           "gate": "feed_forward.w1", "up": "feed_forward.w3", "down": "feed_forward.w2"}
DEFAULT_TARGETS = tuple(TARGETS)  # every linear of the block (QLoRA's finding: all of them, not just q/v)
DEFAULT_ALPHA_PER_RANK = 2.0  # --lora-alpha default: 2 x rank (scale 2), the common choice
DEFAULT_DROPOUT = 0.0
ADAPTER_SUFFIXES = (".lora_A", ".lora_B")


class LoRAError(ValueError):
    pass


@dataclass(frozen=True)
class LoRASpec:
    rank: int
    alpha: float
    dropout: float = DEFAULT_DROPOUT
    targets: tuple[str, ...] = DEFAULT_TARGETS

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict:
        return {**asdict(self), "targets": list(self.targets)}

    @classmethod
    def from_dict(cls, d: dict) -> LoRASpec:
        try:
            return cls(int(d["rank"]), float(d["alpha"]), float(d["dropout"]), tuple(d["targets"]))
        except (KeyError, TypeError, ValueError) as e:
            raise LoRAError(f"not an adapter description ({e!r})") from None


def parse_targets(text: str) -> tuple[str, ...]:
    """'q,v' -> ('q', 'v'); a name that matches no module is refused, listing those that exist."""
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [t for t in names if t not in TARGETS]
    if unknown or not names:
        raise LoRAError(f"--lora-targets {text!r}: {', '.join(unknown) or 'nothing'} matches no linear of the block; "
                        f"the block's linears are {', '.join(f'{k} ({v})' for k, v in TARGETS.items())}")
    return tuple(dict.fromkeys(names))


def target_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each --lora-targets name in a model of `cfg`."""
    d, f, q, kv = cfg.d_model, cfg.ffn_dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d), "gate": (d, f), "up": (d, f), "down": (f, d)}


def check_spec(spec: LoRASpec, cfg: ModelConfig) -> None:
    """Rank in 1..min(in, out) of every targeted linear, alpha > 0, dropout in [0, 1): before anything is built."""
    if spec.rank <= 0:
        raise LoRAError(f"--lora-rank {spec.rank}: must be a positive integer")
    shapes = target_shapes(cfg)
    for t in spec.targets:
        if t not in shapes:
            parse_targets(",".join(spec.targets))  # raises, naming the linears that exist
        limit = min(shapes[t])
        if spec.rank > limit:
            raise LoRAError(f"--lora-rank {spec.rank} is larger than the {t} linear ({TARGETS[t]}: "
                            f"{shapes[t][0]} -> {shapes[t][1]}) allows: at most {limit}")
    if not (spec.alpha > 0 and math.isfinite(spec.alpha)):
        raise LoRAError(f"--lora-alpha {spec.alpha:g}: must be a positive number")
    if not 0.0 <= spec.dropout < 1.0:
        raise LoRAError(f"--lora-dropout {spec.dropout:g}: must be in [0, 1)")


class LoRALinear(nn.Linear):
    """`base`'s weight (the same Parameter, frozen) plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, spec: LoRASpec):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.weight.requires_grad_(False)
        self.register_parameter("bias", None)
        dev, dt = base.weight.device, base.weight.dtype
        self.lora_A = nn.Parameter(torch.empty(spec.rank, self.in_features, device=dev, dtype=dt))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, spec.rank, device=dev, dtype=dt))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # nn.Linear's (and PEFT's) init
        self.scale, self.p = spec.scale, spec.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(x, self.p, self.training) if self.p else x
        return F.linear(x, self.weight) + F.linear(F.linear(h, self.lora_A), self.lora_B) * self.scale

    def delta(self) -> torch.Tensor:
        """scale * B @ A: what merging adds to the base weight."""
        return (self.lora_B.float() @ self.lora_A.float()) * self.scale


def adapted_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def add_adapters(model: Transformer, spec: LoRASpec) -> list[str]:
    """Freeze every parameter of `model` and put an adapter on each targeted linear (in place; the model's
    weights loaded before). Returns the adapted modules' names. `model.lora_spec` records `spec`."""
    check_spec(spec, model.cfg)
    for p in model.parameters():
        p.requires_grad_(False)
    names = []
    for i, block in enumerate(model.layers):
        for t in spec.targets:
            parent_path, attr = TARGETS[t].rsplit(".", 1)
            parent = block.get_submodule(parent_path)
            setattr(parent, attr, LoRALinear(getattr(parent, attr), spec))
            names.append(f"layers.{i}.{TARGETS[t]}")
    model.lora_spec = spec
    return names


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors alone, keyed by parameter name: what an adapter checkpoint holds."""
    return {n: p for n, p in model.named_parameters() if n.endswith(ADAPTER_SUFFIXES)}


def trainable_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@torch.no_grad()
def merge(model: nn.Module) -> None:
    """Fold every adapter into its base weight and put plain nn.Linear modules back (export --merge)."""
    for name, m in adapted_modules(model).items():
        parent_path, _, attr = name.rpartition(".")
        lin = nn.Linear(m.in_features, m.out_features, bias=False, device=m.weight.device, dtype=m.weight.dtype)
        lin.weight.copy_((m.weight.float() + m.delta()).to(m.weight.dtype))
        setattr(model.get_submodule(parent_path), attr, lin)
    if hasattr(model, "lora_spec"):
        del model.lora_spec




# ------------------------------------------------------------------------------ the CLI's flags
Dropout = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)]  # 1 would drop every input of the adapter


def targets_flag(text: str) -> tuple[str, ...]:
    """--lora-targets as argparse's `type=`: a name that matches no linear is refused while parsing."""
    try:
        return parse_targets(text)
    except LoRAError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(f"--lora-targets {text!r}: ")) from None


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA (train an adapter on the frozen --init model instead of every weight)")
    g.add_argument("--lora-rank", type=flag(PositiveInt), default=None, metavar="R",
                   help="train rank-R adapters on the block's linears, the base frozen; checkpoints hold the "
                        "adapter alone (a few MB) and name the base by path and sha256")
    g.add_argument("--lora-alpha", type=flag(PositiveFloat), default=None,
                   help=f"the adapter's scale is alpha / rank (default alpha = {DEFAULT_ALPHA_PER_RANK:g} x rank)")
    g.add_argument("--lora-dropout", type=flag(Dropout), default=None,
                   help=f"dropout on the adapter's input while training, in [0, 1) (default {DEFAULT_DROPOUT:g})")
    g.add_argument("--lora-targets", type=targets_flag, default=None, metavar="q,k,v,o,gate,up,down",
                   help=f"which linears of each block get an adapter (default all: {','.join(DEFAULT_TARGETS)})")


def spec_from_args(args: argparse.Namespace, cfg: ModelConfig) -> LoRASpec | None:
    """The adapter the flags ask for, checked against the model (None without --lora-rank)."""
    given = [f"--lora-{k}" for k in ("alpha", "dropout", "targets") if getattr(args, f"lora_{k}") is not None]
    if args.lora_rank is None:
        if given:
            raise LoRAError(f"{', '.join(given)} given without --lora-rank (the adapter's rank turns LoRA on)")
        return None
    spec = LoRASpec(rank=args.lora_rank,
                    alpha=args.lora_alpha if args.lora_alpha is not None else DEFAULT_ALPHA_PER_RANK * args.lora_rank,
                    dropout=args.lora_dropout if args.lora_dropout is not None else DEFAULT_DROPOUT,
                    targets=args.lora_targets if args.lora_targets is not None else DEFAULT_TARGETS)
    check_spec(spec, cfg)
    return spec
