"""Hugging Face export: the LlamaForCausalLM layout that transformers loads offline.

    hf/config.json  model.safetensors  generation_config.json  tokenizer.json  tokenizer.model
    tokenizer_config.json  special_tokens_map.json

Weights keep our rotate-half RoPE layout (the same as HF's), renamed through training.model.gguf_names, in fp32;
with tied embeddings lm_head.weight is not stored (tie_word_embeddings=true). The tokenizer is
tokenizer.json (export.hf.hf_tokenizer): our SentencePiece model *and* training.text.normalization.normalize as one
`tokenizers` pipeline, so AutoTokenizer gives training's ids on raw text (both nukta spellings, CRLF,
a BOM) with no prodip code. tokenizer_config.json names PreTrainedTokenizerFast, which loads that file
as it is (transformers 5's LlamaTokenizer would rebuild the pipeline without our normalizer).
tokenizer.model stays for SentencePiece-based tools (llama.cpp's convert_hf_to_gguf.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from export import ExportError
from export.hf.hf_tokenizer import TOKENIZER_JSON, write_tokenizer_json
from export.manifest import Manifest, Source
from serving.backend import SamplingParams
from training.model.gguf_names import to_hf
from training.runfiles import layout
from training.runfiles.file_ops import removed_on_failure, save_safetensors
from training.text.chat_template import CHAT_TEMPLATE
from training.text.tokenizer import BOS, CHAT_SPECIALS, EOS, PAD, UNK, Tokenizer

# Hugging Face's own file names inside RUN/export/hf (transformers looks for exactly these; they
# only happen to share spellings with a prodip checkpoint's files)
CONFIG_FILE, WEIGHTS_FILE, GENERATION_FILE = "config.json", "model.safetensors", "generation_config.json"
TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_FILE = (
    "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")
FILES = (CONFIG_FILE, WEIGHTS_FILE, GENERATION_FILE, TOKENIZER_JSON, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE,
         SPECIAL_TOKENS_FILE)
# The class transformers builds from tokenizer_config.json: the fast tokenizer exactly as tokenizer.json
# says (the HF export), or LlamaTokenizer, converted from tokenizer.model alone (folders without
# tokenizer.json: transformers' conversion applies no normalizer, so text must be NFC already).
FAST_CLASS, SPM_CLASS = "PreTrainedTokenizerFast", "LlamaTokenizer"


def hf_config(src: Source) -> dict:
    cfg, tok = src.config, src.tokenizer
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,  # transformers 4.x
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},  # transformers 5.x
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": cfg.tie_embeddings,
        "use_cache": True,
        "bos_token_id": tok.bos_id,
        "eos_token_id": tok.eos_id,
        "pad_token_id": tok.pad_id,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def generation_config(src: Source) -> dict:
    tok, p = src.tokenizer, SamplingParams()
    return {
        "bos_token_id": tok.bos_id,
        "eos_token_id": [tok.eos_id, tok.im_end_id],  # a chat turn ends with <|im_end|>
        "pad_token_id": tok.pad_id,
        "do_sample": True,
        "temperature": p.temperature,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "repetition_penalty": p.repetition_penalty,
        "max_new_tokens": p.max_new_tokens,
    }


def tokenizer_config(src: Source, tokenizer_class: str = SPM_CLASS) -> dict:
    return tokenizer_config_for(src.config.max_seq_len, tokenizer_class)


def tokenizer_config_for(max_seq_len: int, tokenizer_class: str = SPM_CLASS) -> dict:
    spm_only = {
        "legacy": False,  # with add_prefix_space=False: no dummy "▁" before the text, as trained
        "sp_model_kwargs": {},
    }
    return {
        "tokenizer_class": tokenizer_class,
        **(spm_only if tokenizer_class == SPM_CLASS else {}),
        # For every class: llama.cpp's convert_hf_to_gguf.py reads it (absent: llama.cpp's default,
        # a leading-space token on the first word of every text, unlike training).
        "add_prefix_space": False,
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": PAD,
        "additional_special_tokens": list(CHAT_SPECIALS),
        "clean_up_tokenization_spaces": False,
        "spaces_between_special_tokens": False,
        "model_max_length": max_seq_len,
        "chat_template": CHAT_TEMPLATE,
    }


def special_tokens_map() -> dict:
    return {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD,
            "additional_special_tokens": list(CHAT_SPECIALS)}


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer(tok: Tokenizer, d: Path, max_seq_len: int) -> list[Path]:
    """The tokenizer files of an HF folder: what AutoTokenizer.from_pretrained(d) reads."""
    _write_json(d / TOKENIZER_CONFIG_FILE, tokenizer_config_for(max_seq_len, FAST_CLASS))
    _write_json(d / SPECIAL_TOKENS_FILE, special_tokens_map())
    tok.save(d / TOKENIZER_FILE)
    return [write_tokenizer_json(tok, d / TOKENIZER_JSON), d / TOKENIZER_FILE, d / TOKENIZER_CONFIG_FILE,
            d / SPECIAL_TOKENS_FILE]


def export_hf(src: Source, out_dir: Path, manifest: Manifest, *, force: bool = False) -> list[Path]:
    """Write the HF folder under `out_dir/hf`; returns the written paths. The folder is written whole
    beside its place and renamed into it: a failure (a full disk) is one line and leaves no half-written
    export (an earlier hf/ stays as it was until the new one is complete)."""
    d = out_dir / layout.HF_DIR
    if (d / WEIGHTS_FILE).exists() and not force:
        raise ExportError(f"{d / WEIGHTS_FILE} exists; use --force to overwrite")
    tmp = out_dir / f".tmp-{layout.HF_DIR}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    with removed_on_failure(tmp, lambda why: ExportError(
            f"could not write the HF export {d} ({why}); nothing of it was kept: free some space, then run the "
            "same command again")):
        tmp.mkdir(parents=True)
        # Renaming keys shares the tensors: one fp32 copy of the model in memory (safetensors needs all).
        weights = {to_hf(name): t.contiguous() for name, t in src.tensors()}
        save_safetensors(weights, tmp / WEIGHTS_FILE, metadata={"format": "pt"})  # the user's umask, not 0600
        del weights
        _write_json(tmp / CONFIG_FILE, hf_config(src))
        _write_json(tmp / GENERATION_FILE, generation_config(src))
        write_tokenizer(src.tokenizer, tmp, src.config.max_seq_len)
        _put_in_place(tmp, d)
    paths = [d / f for f in FILES]
    for p in paths:
        manifest.add(p, "hf", "F32" if p.name == WEIGHTS_FILE else p.suffix.lstrip("."))
    return paths


def _put_in_place(tmp: Path, d: Path) -> None:
    """`tmp` renamed to `d`; an older `d` (--force) moved aside first and removed once the new one is there."""
    old = d.with_name(f".old-{d.name}-{os.getpid()}")
    if d.exists():
        d.replace(old)
    try:
        tmp.replace(d)
    except BaseException:
        if old.exists():
            old.replace(d)
        raise
    shutil.rmtree(old, ignore_errors=True)
