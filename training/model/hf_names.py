"""Our parameter names <-> Hugging Face LlamaForCausalLM's: the HF half of the one name map.

It lives in `training` because importing an HF checkpoint (training.model.hf_import, `train.py --init-from`)
reads it, and `training` imports no other stage; `training.model.gguf_names` builds its table (HF and GGUF names)
on this one, so the two directions cannot drift apart. "{bid}" stands for the block index.
"""

from __future__ import annotations

import re

# ours -> HF, in writing order (token embedding, one block's tensors, final norm, head)
HF_NAMES: dict[str, str] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{bid}.attention_norm.weight": "model.layers.{bid}.input_layernorm.weight",
    "layers.{bid}.attention.wq.weight": "model.layers.{bid}.self_attn.q_proj.weight",
    "layers.{bid}.attention.wk.weight": "model.layers.{bid}.self_attn.k_proj.weight",
    "layers.{bid}.attention.wv.weight": "model.layers.{bid}.self_attn.v_proj.weight",
    "layers.{bid}.attention.wo.weight": "model.layers.{bid}.self_attn.o_proj.weight",
    "layers.{bid}.ffn_norm.weight": "model.layers.{bid}.post_attention_layernorm.weight",
    "layers.{bid}.feed_forward.w1.weight": "model.layers.{bid}.mlp.gate_proj.weight",
    "layers.{bid}.feed_forward.w2.weight": "model.layers.{bid}.mlp.down_proj.weight",
    "layers.{bid}.feed_forward.w3.weight": "model.layers.{bid}.mlp.up_proj.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent when embeddings are tied
}
TIED_HEAD = "output.weight"


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(template).replace(re.escape("{bid}"), r"(?P<bid>\d+)") + "$")


_FROM_HF = [(_pattern(hf), ours) for ours, hf in HF_NAMES.items()]


def ours_from_hf(name: str) -> str | None:
    """Our name of HF tensor `name`, or None when it is not one of LlamaForCausalLM's parameters."""
    for pat, ours in _FROM_HF:
        m = pat.match(name)
        if m:
            return ours.format(bid=m["bid"]) if "bid" in m.groupdict() else ours
    return None
