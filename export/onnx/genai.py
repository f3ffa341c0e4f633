"""ONNX Runtime GenAI files beside our ONNX export, so apps built on `onnxruntime-genai` (C, C#,
Java, Python, mobile) open prodip's ONNX models directly.

Our decoder already has the interface GenAI's "llama" decoder drives: optimum's names
(`input_ids`, `attention_mask`, `position_ids`, `past_key_values.N.key/value` ->
`logits`, `present.N.key/value`), a (batch, kv_heads, past, head_dim) cache that grows each step,
dynamic batch/sequence/past. So we write, per variant:

    onnx/genai/<variant>/genai_config.json   the decoder description + greedy search defaults
    onnx/genai/<variant>/tokenizer.json      onnxruntime-extensions' tokenizer (from our SentencePiece model)
    onnx/genai/<variant>/tokenizer.model     our SentencePiece model
    onnx/genai/<variant>/tokenizer_config.json, special_tokens_map.json   as the HF export writes them

GenAI refuses a model path that leaves the config's folder (`..`), so the model file and its
external data are hard-linked into the folder (copied only where the file system cannot link):
no second copy of the weights on disk. (GenAI's own model builder was the other option: it rebuilds the graph from an HF folder
with fused GroupQueryAttention/RotaryEmbedding ops, which is a different graph from the one parity
verified; writing the config beside the verified graph keeps one ONNX graph per export.)

Text handed to GenAI's tokenizer must be NFC (`training.text.normalization.normalize`), as with transformers:
it does not normalize, prodip's every path does.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from export import ExportError
from export.hf.hf_export import (
    SPECIAL_TOKENS_FILE,
    TOKENIZER_CONFIG_FILE,
    special_tokens_map,
    tokenizer_config,
)
from export.hf.hf_tokenizer import write_tokenizer_json
from export.onnx.onnx_weights import external_data_files
from serving.backend import SamplingParams
from serving.backends.onnxrt_backend import CONFIG_FILE, TOKENIZER_FILE, VARIANT_FILES, read_config
from training.runfiles.file_ops import link_or_copy
from training.text.tokenizer import Tokenizer

GENAI_CONFIG = "genai_config.json"
GENAI_DIR = "genai"
TOKENIZER_JSON = "tokenizer.json"
MODEL_TYPE = "llama"  # GenAI's decoder-only family with this io layout
PAST_KEY, PAST_VALUE = "past_key_values.%d.key", "past_key_values.%d.value"
PRESENT_KEY, PRESENT_VALUE = "present.%d.key", "present.%d.value"


def genai_config(onnx_cfg: dict, model_file: str) -> dict:
    """genai_config.json for one ONNX variant, from our onnx_config.json."""
    cfg = onnx_cfg
    return {
        "model": {
            "type": MODEL_TYPE,
            "vocab_size": cfg["vocab_size"],
            "context_length": cfg["max_seq_len"],
            "bos_token_id": cfg["bos_id"],
            "eos_token_id": list(cfg["eos_ids"]),
            "pad_token_id": cfg["pad_id"],
            "decoder": {
                "filename": model_file,
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "hidden_size": cfg["model_config"]["d_model"],
                "head_size": cfg["head_dim"],
                "num_attention_heads": cfg["n_heads"],
                "num_key_value_heads": cfg["n_kv_heads"],
                "num_hidden_layers": cfg["n_layers"],
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                           "position_ids": "position_ids", "past_key_names": PAST_KEY, "past_value_names": PAST_VALUE},
                "outputs": {"logits": "logits", "present_key_names": PRESENT_KEY, "present_value_names": PRESENT_VALUE},
            },
        },
        # greedy by default: the same first tokens as our ONNX Runtime backend; apps override per request.
        # The repetition penalty is serving's one default (as in the HF export's generation_config.json).
        "search": {"do_sample": False, "num_beams": 1, "num_return_sequences": 1, "max_length": cfg["max_seq_len"],
                   "min_length": 0, "top_k": 1, "top_p": 1.0, "temperature": 1.0,
                   "repetition_penalty": SamplingParams().repetition_penalty,
                   "past_present_share_buffer": False, "early_stopping": True, "length_penalty": 1.0,
                   "no_repeat_ngram_size": 0, "diversity_penalty": 0.0},
    }


def write_genai_files(onnx_dir: Path, src, *, variants: tuple[str, ...] = ("fp32",), force: bool = False) -> list[Path]:
    """Write onnx_dir/genai/<variant>/ for each variant our export holds; returns the files."""
    onnx_dir = Path(onnx_dir)
    try:
        cfg = read_config(onnx_dir)
    except ValueError as e:  # ServingError: no/foreign onnx_config.json
        raise ExportError(str(e)) from None
    written: list[Path] = []
    for v in variants:
        if v not in cfg.get("files", {}):
            raise ExportError(f"{onnx_dir} holds no {v} ONNX model (it has {', '.join(cfg.get('files', {}))})")
        d = onnx_dir / GENAI_DIR / v
        target = d / GENAI_CONFIG
        if target.exists() and not force:
            raise ExportError(f"{target} exists; use --force to overwrite")
        d.mkdir(parents=True, exist_ok=True)
        model = onnx_dir / VARIANT_FILES[v]
        for f in [model, *external_data_files(model)]:  # model.onnx_data (model.onnx.data in older exports)
            written.append(link_or_copy(f, d / f.name))
        files = {TOKENIZER_CONFIG_FILE: tokenizer_config(src), SPECIAL_TOKENS_FILE: special_tokens_map()}
        for name, obj in files.items():
            (d / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
            written.append(d / name)
        (d / TOKENIZER_FILE).write_bytes((onnx_dir / TOKENIZER_FILE).read_bytes())
        # the HF export's tokenizer.json: our SentencePiece model + training.text.normalization.normalize, one builder
        written.append(write_tokenizer_json(Tokenizer.load(d / TOKENIZER_FILE), d / TOKENIZER_JSON))
        target.write_text(json.dumps(genai_config(cfg, model.name), indent=2) + "\n", encoding="utf-8")
        written += [d / TOKENIZER_FILE, target]  # the config last: it marks a complete folder
    return written


@dataclass(frozen=True)
class GenaiSpeed:
    load_s: float  # og.Model: session creation, weights read
    ttft_s: float  # the prompt's pass and the first new token
    tokens_per_s: float  # decode rate after the first token
    new_tokens: int


def load_genai(genai_dir: Path, threads: int | None = None):
    """og.Model over one genai/<variant> folder, on the CPU, with `threads` intra-op threads (None:
    onnxruntime's default, all cores)."""
    import onnxruntime_genai as og

    config = og.Config(str(genai_dir))
    config.clear_providers()  # CPU
    if threads is not None:
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    return og.Model(config)


def genai_greedy(model, ids: list[int], new_tokens: int, stop_ids: tuple[int, ...] = ()) -> list[int]:
    """Greedy continuation of `ids` by ONNX Runtime GenAI (stops at an id in `stop_ids`, not yielded)."""
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + new_tokens, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    out: list[int] = []
    while not gen.is_done() and len(out) < new_tokens:
        gen.generate_next_token()
        t = int(gen.get_next_tokens()[0])
        if t in stop_ids:
            break
        out.append(t)
    return out


def genai_generate_speed(genai_dir: Path, ids: list[int], new_tokens: int = 32, threads: int | None = None,
                         repeats: int = 2) -> GenaiSpeed:
    """ONNX Runtime GenAI's speed on one folder written by write_genai_files: load time, time to first
    token and greedy decode tokens/s for `new_tokens` tokens after the prompt `ids` (end-of-turn ids
    ignored, so every run decodes the same length; best of `repeats` after a warm-up). For the
    serving benchmark's table, beside our ONNX Runtime backend on the same model file."""
    import onnxruntime_genai as og

    t0 = time.perf_counter()
    model = load_genai(Path(genai_dir), threads)
    load_s = time.perf_counter() - t0
    best_first, best_rate = float("inf"), 0.0
    for run in range(repeats + 1):  # the first run warms up: not counted
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + new_tokens, min_length=len(ids) + new_tokens, do_sample=False)
        gen = og.Generator(model, params)
        t0 = time.perf_counter()
        gen.append_tokens(ids)
        gen.generate_next_token()
        first = time.perf_counter() - t0
        n = 1
        t1 = time.perf_counter()
        while not gen.is_done() and n < new_tokens:
            gen.generate_next_token()
            n += 1
        rate = (n - 1) / max(time.perf_counter() - t1, 1e-9)
        if run or not repeats:  # no repeats asked: the warm-up is all there is
            best_first, best_rate = min(best_first, first), max(best_rate, rate)
        del gen
    return GenaiSpeed(load_s, best_first, best_rate, n)


__all__ = ["CONFIG_FILE", "GENAI_CONFIG", "GENAI_DIR", "GenaiSpeed", "genai_config", "genai_generate_speed",
           "genai_greedy", "load_genai", "write_genai_files"]
