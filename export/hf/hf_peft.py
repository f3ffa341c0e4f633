"""The HF export of an adapter run: the base's HF folder (export.hf.hf_export) and, beside it, the adapter in PEFT's
layout, so transformers + PEFT load the pair offline with no prodip code:

    hf/        the base checkpoint's LlamaForCausalLM folder (export.hf.hf_export.export_hf of the base)
    hf-lora/   adapter_config.json  adapter_model.safetensors

    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("hf"), "hf-lora")

adapter_model.safetensors holds what PEFT's save_pretrained writes: for each adapted linear
`base_model.model.<HF name of the linear>.lora_A.weight` (r, in) and `.lora_B.weight` (out, r), fp32. The
HF export keeps our rotate-half RoPE row order (export.hf.hf_export), so no row of B is permuted (unlike the GGUF's).
PEFT computes W x + (lora_alpha / r) B (A x), training.model.lora's formula. adapter_config.json's
base_model_name_or_path is the absolute path of hf/ at export time (what AutoPeftModelForCausalLM opens);
after moving the folders, give the base to PeftModel.from_pretrained as above.

The adapter lives in its own folder, not inside hf/: transformers loads an adapter_config.json it finds in
a model folder as an adapter onto base_model_name_or_path, so `from_pretrained("hf")` would no longer be
the base.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from export import ExportError
from export.manifest import Manifest
from training.model.gguf_names import to_hf
from training.model.lora import TARGETS, adapted_modules
from training.runfiles import layout
from training.runfiles.file_ops import save_safetensors

LORA_HF_DIR = "hf-lora"
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModel wraps LlamaForCausalLM as base_model.model


def hf_module(name: str) -> str:
    """Our module path (`layers.0.attention.wq`) -> the HF one (`model.layers.0.self_attn.q_proj`)."""
    return to_hf(f"{name}.weight").removesuffix(".weight")


def peft_config(spec, base_dir: Path) -> dict:
    """adapter_config.json: PEFT's LoraConfig fields, the targets by their HF module names."""
    alpha = int(spec.alpha) if float(spec.alpha).is_integer() else float(spec.alpha)
    targets = sorted({hf_module(f"layers.0.{TARGETS[t]}").rsplit(".", 1)[-1] for t in spec.targets})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_dir.resolve()),
            "r": spec.rank, "lora_alpha": alpha, "lora_dropout": spec.dropout, "target_modules": targets,
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
            "layers_to_transform": None, "revision": None}


def peft_tensors(model) -> dict:
    out = {}
    for name, m in adapted_modules(model).items():
        key = f"{PEFT_PREFIX}{hf_module(name)}"
        out[f"{key}.lora_A.weight"] = m.lora_A.detach().float().contiguous()
        out[f"{key}.lora_B.weight"] = m.lora_B.detach().float().contiguous()
    return out


def planned(out_dir: Path) -> list[Path]:
    return [out_dir / LORA_HF_DIR / ADAPTER_WEIGHTS, out_dir / LORA_HF_DIR / ADAPTER_CONFIG]


def write_peft_adapter(src, out_dir: Path, manifest: Manifest) -> list[Path]:
    """out_dir/hf-lora/ for the adapter of `src` (export.gguf.lora_gguf.AdapterSource), its base in out_dir/hf."""
    d = out_dir / LORA_HF_DIR
    try:
        d.mkdir(parents=True, exist_ok=True)
        weights, config = planned(out_dir)
        save_safetensors(peft_tensors(src.model()), weights, metadata={"format": "pt"})
        cfg = peft_config(src.model().lora_spec, out_dir / layout.HF_DIR)
        config.write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    except OSError as e:
        raise ExportError(f"could not write the PEFT adapter {d} ({e.strerror or e})") from None
    manifest.add(weights, "hf-lora", "F32", rank=cfg["r"], alpha=cfg["lora_alpha"])
    manifest.add(config, "hf-lora", "json")
    return [weights, config]


def peft_backend(hf_dir: Path, adapter_dir: Path):
    """transformers on hf/ with PEFT's PeftModel applying hf-lora/: exactly the user's two lines above."""
    from peft import PeftModel

    from serving.backends.transformers_backend import TransformersBackend

    b = TransformersBackend(hf_dir)
    with warnings.catch_warnings():  # PEFT asks transformers for a renamed attribute (a FutureWarning per load)
        warnings.simplefilter("ignore", FutureWarning)
        b.model = PeftModel.from_pretrained(b.model, str(adapter_dir), is_trainable=False).eval()
    b.name = "transformers+peft"
    b.path = adapter_dir
    return b
