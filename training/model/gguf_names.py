"""The one name map: our parameter names <-> Hugging Face LlamaForCausalLM <-> GGUF (llama.cpp).

One declarative table (`TENSORS`), in the spirit of gguf-py's tensor_mapping, read by every writer
(`export.hf.hf_export`, `export.gguf.gguf_export`) and by `export.parity.native_parity`; its HF names are training.model.hf_names' (which
`train.py --init-from` reads in reverse). GGUF names come from gguf-py's own constants so
they cannot drift from what llama.cpp expects.

RoPE layout: our model (like HF) rotates halves of each head (`rotate_half`); llama.cpp's "llama"
architecture rotates adjacent pairs. convert_hf_to_gguf.py therefore permutes the rows of the Q and
K projections (`LlamaModel.permute`); without it the GGUF loads fine and answers garbage. `Tensor.permute`
says which head count the permutation uses ("q": n_heads, "k": n_kv_heads).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import gguf
import numpy as np

from training.model.decoder import ModelConfig
from training.model.hf_names import HF_NAMES, TIED_HEAD

Permute = Literal["q", "k"] | None


@dataclass(frozen=True)
class Tensor:
    ours: str  # "{bid}" stands for the block index
    gguf_kind: gguf.MODEL_TENSOR
    permute: Permute = None

    @property
    def hf(self) -> str:  # the HF half of the map lives in training.model.hf_names (import reads it too)
        return HF_NAMES[self.ours]

    @property
    def gguf(self) -> str:
        return gguf.TENSOR_NAMES[self.gguf_kind] + ".weight"


T = gguf.MODEL_TENSOR
TENSORS: tuple[Tensor, ...] = (
    Tensor("tok_embeddings.weight", T.TOKEN_EMBD),
    Tensor("layers.{bid}.attention_norm.weight", T.ATTN_NORM),
    Tensor("layers.{bid}.attention.wq.weight", T.ATTN_Q, "q"),
    Tensor("layers.{bid}.attention.wk.weight", T.ATTN_K, "k"),
    Tensor("layers.{bid}.attention.wv.weight", T.ATTN_V),
    Tensor("layers.{bid}.attention.wo.weight", T.ATTN_OUT),
    Tensor("layers.{bid}.ffn_norm.weight", T.FFN_NORM),
    Tensor("layers.{bid}.feed_forward.w1.weight", T.FFN_GATE),
    Tensor("layers.{bid}.feed_forward.w2.weight", T.FFN_DOWN),
    Tensor("layers.{bid}.feed_forward.w3.weight", T.FFN_UP),
    Tensor("norm.weight", T.OUTPUT_NORM),
    Tensor(TIED_HEAD, T.OUTPUT),  # absent when embeddings are tied
)
assert [t.ours for t in TENSORS] == list(HF_NAMES), "training.model.gguf_names.TENSORS and training.model.hf_names.HF_NAMES disagree"


class TensorNameError(ValueError):
    pass


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(template).replace(re.escape("{bid}"), r"(?P<bid>\d+)") + "$")


_BY_FORMAT = {fmt: [(_pattern(getattr(t, fmt)), t) for t in TENSORS] for fmt in ("ours", "hf", "gguf")}
Format = Literal["ours", "hf", "gguf"]


def lookup(name: str, fmt: Format = "ours") -> tuple[Tensor, int | None]:
    """The table row of `name` (given in format `fmt`) and its block index (None outside blocks)."""
    for pat, t in _BY_FORMAT[fmt]:
        m = pat.match(name)
        if m:
            return t, int(m["bid"]) if "bid" in m.groupdict() else None
    raise TensorNameError(f"tensor {name!r} is not in training.model.gguf_names.TENSORS ({fmt} names)")


def convert(name: str, src: Format, dst: Format) -> str:
    t, bid = lookup(name, src)
    out = getattr(t, dst)
    return out.format(bid=bid) if bid is not None else out


def to_hf(name: str) -> str:
    return convert(name, "ours", "hf")


def to_gguf(name: str) -> str:
    return convert(name, "ours", "gguf")


def from_hf(name: str) -> str:
    return convert(name, "hf", "ours")


def from_gguf(name: str) -> str:
    return convert(name, "gguf", "ours")


def expected_names(cfg: ModelConfig) -> list[str]:
    """Our parameter names in writing order (token embedding, blocks, final norm, head if untied)."""
    names = []
    for t in TENSORS:
        if t.ours == TIED_HEAD and cfg.tie_embeddings:
            continue
        if "{bid}" in t.ours:
            continue
        names.append(t.ours)
    blocks = [t.ours for t in TENSORS if "{bid}" in t.ours]
    head = names[:1]
    tail = names[1:]
    return head + [b.format(bid=i) for i in range(cfg.n_layers) for b in blocks] + tail


def permute_heads(cfg: ModelConfig, which: Permute) -> int | None:
    return {"q": cfg.n_heads, "k": cfg.n_kv_heads, None: None}[which]


def permute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rotate-half row order -> llama.cpp's interleaved-pair order (convert_hf_to_gguf LlamaModel.permute)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `permute_rope` (reading a GGUF back into our layout)."""
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))
