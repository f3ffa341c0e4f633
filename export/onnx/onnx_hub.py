"""The Hugging Face files beside our ONNX model, so transformers.js (and optimum) open RUN/export/onnx as
it is, with no copying or renaming:

    onnx/config.json             the HF export's config.json (model_type "llama") + "transformers.js_config"
    onnx/generation_config.json  the HF export's: serving's sampling defaults (export.hf.hf_export.generation_config)
    onnx/tokenizer.json          the HF export's tokenizer (export.hf.hf_tokenizer) and its tokenizer_config.json

What transformers.js 4.x requests of a model folder (src/utils/model-loader.js, models/session.js):
config.json, generation_config.json, tokenizer.json, tokenizer_config.json, and `SUBFOLDER/model.onnx`
plus `SUBFOLDER/model.onnx_data` when config.json's "transformers.js_config" says the model keeps its
weights outside the graph (`use_external_data_format`: node reads the data by the name the graph records,
a browser only fetches the files it is told of). SUBFOLDER defaults to "onnx"; our model sits at the top
of the folder, so a user passes `subfolder: ""` (docs/onnx.md). "dtype": "fp32" picks model.onnx (no
suffix) on every device; model-int8.onnx / model-int4.onnx open with `model_file_name`.
"""

from __future__ import annotations

import json
from pathlib import Path

from export.hf import hf_export as hf
from export.hf.hf_tokenizer import TOKENIZER_JSON, write_tokenizer_json
from serving.backends.onnxrt_backend import VARIANT_FILES

TRANSFORMERS_JS_KEY = "transformers.js_config"
HUB_FILES = (hf.CONFIG_FILE, hf.GENERATION_FILE, TOKENIZER_JSON, hf.TOKENIZER_CONFIG_FILE)


def transformers_js_config(variants: list[str]) -> dict:
    """transformers.js's own section of config.json: fp32 by default, one external-data file per model."""
    return {"dtype": "fp32", "use_external_data_format": {VARIANT_FILES[v]: 1 for v in variants}}


def write_hub_files(src, folder: Path, variants: list[str]) -> list[Path]:
    """config.json, generation_config.json, tokenizer.json and tokenizer_config.json in `folder` for the
    ONNX `variants` written there; returns them. `src` is an export.manifest.Source."""
    folder = Path(folder)
    config = {**hf.hf_config(src), TRANSFORMERS_JS_KEY: transformers_js_config(variants)}
    files = {hf.CONFIG_FILE: config, hf.GENERATION_FILE: hf.generation_config(src),
             hf.TOKENIZER_CONFIG_FILE: hf.tokenizer_config_for(src.config.max_seq_len, hf.FAST_CLASS)}
    for name, obj in files.items():
        (folder / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    write_tokenizer_json(src.tokenizer, folder / TOKENIZER_JSON)
    return [folder / n for n in HUB_FILES]
