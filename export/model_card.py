"""The model card: README.md in the export folder (config, size, tokenizer fertility, gates, training
curves, files, parity), rebuilt after every export from what is on disk."""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import fields
from pathlib import Path

from export.manifest import Manifest, Source, human_size
from training.model.decoder import count_params
from training.runfiles import layout


def _read_json(path: Path) -> dict | None:
    """The card is rebuilt from whatever is on disk: a missing or broken file leaves its section out."""
    try:
        return layout.read_json(path) if path.is_file() else None
    except layout.LayoutError:
        return None


def data_report(src: Source) -> tuple[Path | None, dict | None]:
    """The tokenizer fertility report of the run's data folder (the run config's train.data)."""
    if src.run_dir is None:
        return None, None
    try:
        run_cfg = layout.read_run_config(src.run_dir) or {}
    except layout.LayoutError:
        return None, None
    data = (run_cfg.get("train") or {}).get("data")
    if not data:
        return None, None
    for base in (Path(data), src.run_dir / data, src.run_dir.parent / data):
        if (base / layout.DATA_REPORT).is_file():
            return base, _read_json(base / layout.DATA_REPORT)
    return Path(data), None


def gates_table(src: Source) -> str | None:
    from training.gates import GateReport, GateResult

    g = _read_json(src.run_dir / layout.GATES) if src.run_dir else None
    if not g or "results" not in g:
        return None
    known = {f.name for f in fields(GateResult)}
    try:
        rep = GateReport([GateResult(**{k: v for k, v in r.items() if k in known}) for r in g["results"]],
                         g.get("skipped_by_user", []))
    except TypeError:
        return None
    return f"{rep.table()}\n\n{rep.summary()}"


def copy_curves(src: Source, out_dir: Path) -> Path | None:
    """RUN/curves.png copied beside the card (the export folder travels without its run), atomically;
    None when the run drew none. A copy left by an earlier export of a run that has none is removed,
    so the card never shows curves of another run."""
    theirs = src.run_dir / layout.CURVES if src.run_dir else None
    ours = out_dir / layout.CURVES
    if theirs is None or not theirs.is_file():
        ours.unlink(missing_ok=True)
        return None
    tmp = ours.with_name(ours.name + ".tmp")
    shutil.copyfile(theirs, tmp)
    os.replace(tmp, ours)
    return ours


def render(src: Source, out_dir: Path, manifest: Manifest) -> str:
    cfg = src.config
    total, non_emb = count_params(cfg), count_params(cfg, non_embedding=True)
    out = [f"# {src.name}", "",
           "A Bangla-first Llama language model trained with prodip, exported to Hugging Face safetensors, "
           "ONNX and GGUF (llama.cpp / ollama), with cross-backend logit parity checked against the "
           "PyTorch checkpoint.", "",
           "## Source", "",
           f"- checkpoint: `{manifest.data['source']['checkpoint']}` (step {src.step})",
           f"- tokenizer sha256: `{src.tokenizer.sha256}`",
           f"- prodip {manifest.data['prodip_version']}", "",
           "## Model", "",
           f"Parameters: {total:,} ({non_emb:,} non-embedding). Llama decoder: RMSNorm, SwiGLU, grouped-query "
           "attention, rotate-half RoPE, no biases.", "",
           "| setting | value |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in cfg.to_dict().items()]
    data_dir, report = data_report(src)
    out += ["", "## Tokenizer", "",
            f"SentencePiece BPE, {cfg.vocab_size:,} pieces, byte fallback, no dummy prefix; text is "
            "normalized to NFC (training.text.normalization.normalize) before tokenization everywhere. Chat: ChatML "
            "(`<|im_start|>` / `<|im_end|>`).", ""]
    report = (report or {}).get("fertility", report)  # prepare nests it under "fertility"
    if report and "languages" in report:
        from training.text.fertility import format_table

        out += [f"Fertility on held-out text of `{data_dir}`:", "", format_table(report), ""]
    out += adapter_section(src, manifest)
    gates = gates_table(src)
    if gates:
        out += ["## Training gates", "", gates, ""]
    if (out_dir / layout.CURVES).is_file():
        out += ["## Training curves", "",
                f"Loss, validation bits per byte, learning rate, gradient norm and throughput over the "
                f"run, from its `{layout.LOG}`:", "", f"![training curves]({layout.CURVES})", ""]
    out += ["## Files", "", "| file | format | type | size | sha256 |", "|---|---|---|---:|---|"]
    for rel, e in sorted(manifest.files().items()):
        out.append(f"| `{rel}` | {e['format']} | {e['type']} | {human_size(e['size'])} | `{e['sha256'][:16]}…` |")
    fallbacks = {rel: e["fallbacks"] for rel, e in manifest.files("gguf").items() if e.get("fallbacks")}
    if fallbacks:
        out += ["", "K-quant fallbacks (tensors llama.cpp stored in another type than asked):", ""]
        out += [f"- `{rel}`: " + ", ".join(f"{f['tensor']} → {f['type']}" for f in fl) for rel, fl in fallbacks.items()]
    parity = out_dir / layout.PARITY_MD
    if parity.is_file():
        body = parity.read_text(encoding="utf-8").split("\n", 2)[-1]  # drop its "# Parity" title
        out += ["", "## Parity", "", body.strip()]
    out += ["", "## Use", "",
            "```bash",
            "# transformers (offline)",
            "python -c \"from transformers import AutoModelForCausalLM, AutoTokenizer; "
            "m = AutoModelForCausalLM.from_pretrained('hf'); t = AutoTokenizer.from_pretrained('hf')\"",
            "# llama.cpp / ollama",
            "ollama create prodip -f gguf/Modelfile && ollama run prodip",
            "python -m serving gguf/<file>.gguf",
            *adapter_use(manifest),
            "```", ""]
    return "\n".join(out)


def adapter_section(src: Source, manifest: Manifest) -> list[str]:
    """An adapter run's card names the base (path + sha256 of its weights) and the adapter (training.lora_run)."""
    lora = src.state.get("lora")
    if not isinstance(lora, dict):
        return []
    spec, base = lora.get("spec") or {}, lora.get("base") or {}
    onnx = any(e.get("merged") and e["format"] == "onnx" for e in manifest.files().values())
    return ["## LoRA adapter", "",
            f"This export is a LoRA adapter trained on a frozen base (`training/sft.py --lora-rank`); "
            f"`{manifest.data['source']['checkpoint']}` holds the adapter alone.", "",
            f"- base: `{base.get('path')}` (its `model.safetensors` sha256 `{base.get('sha256')}`)",
            f"- adapter: rank {spec.get('rank')}, alpha {spec.get('alpha')}, dropout {spec.get('dropout')}, "
            f"on the linears {', '.join(spec.get('targets', []))} of every block",
            "- files: the base's GGUF files with the adapter as a llama.cpp LoRA GGUF (`*-lora-F32.gguf`), or "
            "`*-merged-*.gguf` with it folded in; `hf/` (the base) with `hf-lora/` (the adapter in PEFT's layout)",
            *(["- ONNX (`onnx/`): base + adapter **merged** into the weights (ONNX applies no adapter at run time)"]
              if onnx else []),
            "- parity: against the PyTorch fp32 base + adapter", ""]


def adapter_use(manifest: Manifest) -> list[str]:
    out = []
    if manifest.files("hf-lora"):
        out += ["# transformers + PEFT: the base with the adapter",
                "python -c \"from peft import PeftModel; from transformers import AutoModelForCausalLM; "
                "m = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained('hf'), 'hf-lora')\""]
    lora = next(iter(manifest.files("gguf-lora")), None)
    base = next((rel for rel, e in manifest.files("gguf").items() if e["type"] == "F16" and not e.get("merged")), None)
    if lora and base:
        out += ["# llama.cpp: the base GGUF with the adapter applied at run time",
                f"python -m serving {base} --lora {lora}"]
    return out


KEPT_SECTION = re.compile(r"<!-- prodip:([\w-]+):begin -->.*?<!-- prodip:\1:end -->", flags=re.S)


def _kept_sections(text: str) -> str:
    """Sections other commands own (evaluation results between <!-- prodip:NAME:begin/end -->
    markers), carried over when the card is rebuilt so a re-export never erases them."""
    return "\n\n".join(m.group(0) for m in KEPT_SECTION.finditer(text))


def write_card(src: Source, out_dir: Path, manifest: Manifest) -> Path:
    path = out_dir / layout.CARD
    kept = _kept_sections(path.read_text(encoding="utf-8")) if path.is_file() else ""
    copy_curves(src, out_dir)
    text = render(src, out_dir, manifest)
    path.write_text(text + ("\n" + kept + "\n" if kept else ""), encoding="utf-8")
    return path
