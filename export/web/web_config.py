"""prodip-web.json, tokenizer.json and card.md of the web export (export.web.web_export): everything the pages
must agree on with native serving is computed here, in Python, from the one place each is defined.

- the chat template: `training.text.chat_template.render` run on marker messages and cut at the markers, so the
  page joins bos + (prefix + content + suffix per message) + generation prompt and gets render()'s
  text byte for byte (tests/test_web_export.py checks the join against render());
- the sampling defaults: `serving.backend.SamplingParams()`, serving's default max_tokens and the share
  of the context kept for a reply (serving.chat_session.MAX_REPLY_SHARE);
- the bytes of every token: `training.text.tokenizer.piece_bytes` (what native stream decoding joins);
- the normal form text is put in before tokenizing: `training.text.normalization.NORMAL_FORM`.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from export import ExportError
from training.runfiles import layout

if TYPE_CHECKING:
    from export.web.web_export import WebPlan
    from training.text.tokenizer import Tokenizer

CONFIG_FILE = "prodip-web.json"
CARD_FILE = "card.md"
TOKENIZER_JSON = "tokenizer.json"
FORMAT, VERSION = "prodip-web", 1
MARK = "\ue000"  # a private-use character: no template text contains it, NFC leaves it alone


def chat_parts() -> dict:
    """training.text.chat_template's template cut into the pieces around each message's content."""
    from training.text.chat_template import ROLES, STOP_STRINGS, render

    bos = render([], add_generation_prompt=False)
    roles = {}
    for role in ROLES:
        text = render([{"role": role, "content": MARK}], add_generation_prompt=False)[len(bos):]
        prefix, _, suffix = text.partition(MARK)
        roles[role] = {"prefix": prefix, "suffix": suffix}
    gen = render([], add_generation_prompt=True)[len(bos):]
    return {"bos": bos, "roles": roles, "generation_prompt": gen, "stop": list(STOP_STRINGS)}


def join_chat(parts: dict, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """What the page does with chat_parts() (common.js renderChat), for the test against render()."""
    text = parts["bos"] + "".join(parts["roles"][m["role"]]["prefix"] + m["content"] + parts["roles"][m["role"]]["suffix"]
                                  for m in messages)
    return text + (parts["generation_prompt"] if add_generation_prompt else "")


def sampling_defaults() -> dict:
    """Serving's defaults (temperature, top_k, top_p, repetition_penalty) and its default reply length."""
    from serving.backend import DEFAULT_MAX_TOKENS, PENALTY_LAST_N, SamplingParams
    from serving.chat_session import MAX_REPLY_SHARE

    d = asdict(SamplingParams())
    return {"max_tokens": DEFAULT_MAX_TOKENS, "temperature": d["temperature"], "top_k": d["top_k"],
            "top_p": d["top_p"], "repetition_penalty": d["repetition_penalty"], "llama_penalty_last_n": PENALTY_LAST_N,
            "max_reply_share": MAX_REPLY_SHARE}


def find_tokenizer(export_dir: Path, manifest: dict) -> Tokenizer:
    """The run's tokenizer.model whose sha256 the manifest records (the ONNX folder's, the run's, the checkpoint's)."""
    from training.text.tokenizer import Tokenizer

    want = manifest.get("tokenizer_sha256")
    src = manifest.get("source", {})
    places = [export_dir / layout.ONNX_DIR, export_dir.parent, src.get("run_dir"), src.get("checkpoint")]
    for place in places:
        f = Path(place) / "tokenizer.model" if place else None
        if f is not None and f.is_file():
            tok = Tokenizer.load(f)
            if want is None or tok.sha256 == want:
                return tok
    raise ExportError(f"{export_dir}: no tokenizer.model with the sha256 {layout.MANIFEST} records "
                      f"({want}) found beside the export, in the run or its checkpoint")


def token_table(tok: Tokenizer) -> dict:
    """Ids the pages need, and each token's bytes (hex) as native stream decoding joins them."""
    from training.text.tokenizer import CHAT_SPECIALS, piece_bytes

    table = [tok.sp.decode([p.id]).encode("utf-8") if p.kind == "unknown" else piece_bytes(p.text, p.kind)
             for p in tok.pieces()]
    return {"bos_id": tok.bos_id, "eos_ids": [tok.eos_id, tok.im_end_id], "vocab_size": tok.vocab_size,
            "chat_specials": list(CHAT_SPECIALS),  # what encode(allow_special=True) turns into tokens
            "strip_leading_space": bool(tok.trainer_spec()["add_dummy_prefix"]),
            "piece_bytes": [b.hex() for b in table]}


def onnx_shape(export_dir: Path) -> dict | None:
    from serving.backends.onnxrt_backend import CONFIG_FILE as ONNX_CONFIG
    from serving.backends.onnxrt_backend import read_config

    if not (export_dir / layout.ONNX_DIR / ONNX_CONFIG).is_file():
        return None
    cfg = read_config(export_dir / layout.ONNX_DIR)
    return {k: int(cfg[k]) for k in ("n_layers", "n_kv_heads", "head_dim", "vocab_size", "max_seq_len")}


def config(p: WebPlan, shards: list[Path], onnx: dict[str, list[Path]], manifest: dict, tok: Tokenizer) -> dict:
    from training.text.normalization import NORMAL_FORM

    rel = lambda f: f.relative_to(p.web_dir).as_posix()  # noqa: E731
    gguf_type = next((e.get("type") for r, e in manifest["files"].items()
                      if p.gguf is not None and (p.export_dir / r).resolve() == p.gguf.resolve()), None)
    return {
        "format": FORMAT, "version": VERSION, "name": p.export_dir.parent.name,
        "n_ctx": int(manifest.get("config", {}).get("max_seq_len") or 0),
        "gguf": {"file": p.gguf.name, "type": gguf_type, "shards": [rel(f) for f in shards]},
        "onnx": {v: {"model": rel(fs[0]), "data": [rel(f) for f in fs[1:]]} for v, fs in onnx.items()},
        "onnx_shape": onnx_shape(p.export_dir) if onnx else None,
        "chat": chat_parts(), "normal_form": NORMAL_FORM, "sampling": sampling_defaults(),
        "card": CARD_FILE, "tokenizer": TOKENIZER_JSON, **token_table(tok),
    }


def write_config(p: WebPlan, shards: list[Path], onnx: dict[str, list[Path]]) -> list[Path]:
    """prodip-web.json, tokenizer.json and card.md into p.web_dir."""
    from export.hf.hf_tokenizer import write_tokenizer_json
    from export.manifest import read_manifest

    manifest = read_manifest(p.manifest_path)
    tok = find_tokenizer(p.export_dir, manifest)
    out = [write_tokenizer_json(tok, p.web_dir / TOKENIZER_JSON)]
    card = p.web_dir / CARD_FILE
    readme = p.export_dir / "README.md"
    if readme.is_file():
        shutil.copyfile(readme, card)
    else:
        card.write_text(f"# {p.export_dir.parent.name}\n\n(no model card yet: `python -m export` writes it)\n",
                        encoding="utf-8")
    out.append(card)
    cfg = p.web_dir / CONFIG_FILE
    cfg.write_text(json.dumps(config(p, shards, onnx, manifest, tok), ensure_ascii=False), encoding="utf-8")
    return [*out, cfg]
