"""GGUF files prodip did not write: tiny random transformers models of other architectures (Qwen2,
Gemma), converted by llama.cpp's own `convert_hf_to_gguf.py`, as a user's downloaded GGUF would be.

Everything is made offline:
- the tokenizer is a small SentencePiece model trained here on the shipped corpus, with the chat
  markers of both templates as single pieces; it is saved the way HF SentencePiece models ship
  (`tokenizer.model` + `tokenizer_config.json` holding the special tokens and the chat template);
- the models are random-initialized from a tiny config (2 layers, hidden 64) and `save_pretrained`;
- the converter (its script, its `conversion/` package and its `gguf-py`) is taken from the llama.cpp
  tree vendored in the pinned llama-cpp-python sdist that `scripts/build_llama_tools.sh` (run by
  `scripts/setup.sh --llama-tools`) keeps in ~/.cache/prodip/llama-tools/src, so the files are what
  the very llama.cpp we serve with writes. Without that sdist every test here skips as opt-in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import CORPUS, OPT_IN, REPO, built_once

SDIST_ENV = "PRODIP_LLAMA_SDIST"  # the same knob scripts/build_llama_tools.sh reads
SDIST_DIR = Path(os.environ.get("PRODIP_LLAMA_TOOLS_CACHE", Path.home() / ".cache" / "prodip" / "llama-tools")) / "src"
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion", "gguf-py")
CONVERT_TIMEOUT_S = 300

VOCAB = 640  # > 70: the Gemma converter writes FIM specials at ids 67..70
HIDDEN = 64
LAYERS = 2
HEADS = 4
CONTEXT = 256
LONG_CONTEXT = 32768  # the no-template model claims a long trained context: serving must not allocate it all
SEED = 0

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' "
    "else message['role'] %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
SPECIALS = ("<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>")
UNK, BOS, EOS, PAD = 0, 1, 2, 3


@dataclass(frozen=True)
class Foreign:
    qwen2: Path  # ChatML template, <|im_end|> ends a turn
    gemma: Path  # Gemma's own template (<start_of_turn>model)
    no_template: Path  # Qwen2 without tokenizer.chat_template, claiming a LONG_CONTEXT


def llama_sdist() -> Path | None:
    import llama_cpp

    env = os.environ.get(SDIST_ENV)
    p = Path(env) if env else SDIST_DIR / f"llama_cpp_python-{llama_cpp.__version__}.tar.gz"
    return p if p.is_file() else None


def extract_converter(sdist: Path, dest: Path) -> Path:
    """llama.cpp's converter out of the sdist (only the parts it needs); returns the script."""
    root = sdist.name.removesuffix(".tar.gz") + "/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.startswith(root)
                   and m.name[len(root):].split("/", 1)[0] in CONVERTER_PARTS]
        tar.extractall(dest, members=members, filter="data")
    return dest / root / "convert_hf_to_gguf.py"


def train_tokenizer(out: Path) -> Path:
    """A small SentencePiece BPE with byte fallback, the chat markers as user-defined pieces."""
    import sentencepiece as spm

    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted(CORPUS.glob("*.txt")))
    path = out / "tokenizer.model"
    with open(path, "wb") as f:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(text.splitlines()), model_writer=f, model_type="bpe", vocab_size=VOCAB,
            byte_fallback=True, character_coverage=1.0, user_defined_symbols=list(SPECIALS),
            unk_id=UNK, bos_id=BOS, eos_id=EOS, pad_id=PAD, num_threads=1, minloglevel=2)
    return path


def _special_ids(sp_model: Path) -> dict[str, int]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    return {t: sp.piece_to_id(t) for t in ("<unk>", "<s>", "</s>", "<pad>", *SPECIALS)}


def save_hf(arch: str, out: Path, sp_model: Path, template: str | None, eos: str, context: int = CONTEXT) -> Path:
    """A random tiny `arch` model + its tokenizer files, as `save_pretrained` writes them."""
    import torch
    import transformers

    ids = _special_ids(sp_model)
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, max_position_embeddings=context, bos_token_id=ids["<s>"],
                  eos_token_id=ids[eos], pad_token_id=ids["<pad>"])
    if arch == "qwen2":
        cfg, cls = transformers.Qwen2Config(num_key_value_heads=2, **common), transformers.Qwen2ForCausalLM
    elif arch == "gemma":
        cfg, cls = (transformers.GemmaConfig(num_key_value_heads=1, head_dim=HIDDEN // HEADS, **common),
                    transformers.GemmaForCausalLM)
    else:
        raise ValueError(arch)
    torch.manual_seed(SEED)
    cls(cfg).save_pretrained(out)
    (out / "tokenizer.model").write_bytes(sp_model.read_bytes())
    tc = {"bos_token": "<s>", "eos_token": eos, "unk_token": "<unk>", "pad_token": "<pad>",
          "add_bos_token": arch == "gemma", "add_eos_token": False,
          "added_tokens_decoder": {str(i): {"content": t, "special": True} for t, i in ids.items()}}
    if template is not None:
        tc["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=1), encoding="utf-8")
    return out


# One interpreter for every conversion (torch and transformers are imported once): the script runs as
# `__main__` from its own folder, so it imports its `conversion` package and its own gguf-py.
CONVERT_DRIVER = """
import runpy, sys
script, *jobs = sys.argv[1:]
sys.path.insert(0, script.rsplit("/", 1)[0])
for hf, out in zip(jobs[::2], jobs[1::2]):
    sys.argv = [script, hf, "--outfile", out, "--outtype", "f32"]
    runpy.run_path(script, run_name="__main__")
"""


def convert(script: Path, jobs: dict[Path, Path]) -> None:
    """llama.cpp's convert_hf_to_gguf.py (F32, nothing quantized away) on each HF folder -> GGUF file."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("NO_LOCAL_GGUF", None)
    args = [str(x) for pair in jobs.items() for x in pair]
    p = subprocess.run([sys.executable, "-c", CONVERT_DRIVER, str(script), *args], capture_output=True, text=True,
                       env=env, cwd=REPO, timeout=CONVERT_TIMEOUT_S)
    missing = [str(out) for out in jobs.values() if not out.is_file()]
    assert p.returncode == 0 and not missing, f"convert_hf_to_gguf.py failed ({p.returncode}):\n{p.stderr[-4000:]}"


def without_tensor(src: Path, dst: Path, tensor: str) -> Path:
    """A copy of `src` lacking one tensor: gguf-py reads it, llama.cpp refuses it (missing tensor)."""
    import gguf

    r = gguf.GGUFReader(src)
    arch = r.fields[gguf.Keys.General.ARCHITECTURE].contents()
    w = gguf.GGUFWriter(dst, arch)
    for f in r.fields.values():  # as gguf-py's gguf_new_metadata.py copies them
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    kept = [t for t in r.tensors if t.name != tensor]
    assert len(kept) == len(r.tensors) - 1, f"{src} has no tensor {tensor}"
    for t in kept:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in kept:
        w.write_tensor_data(t.data, tensor_endianess=r.endianess)
    w.close()
    return dst


@pytest.fixture(scope="session")
def foreign_ggufs(tmp_path_factory) -> Foreign:
    sdist = llama_sdist()
    if sdist is None:
        pytest.skip(f"{OPT_IN} the llama-cpp-python sdist (llama.cpp's convert_hf_to_gguf.py) is not in {SDIST_DIR}; "
                    f"run `bash scripts/setup.sh --dev --llama-tools` or set {SDIST_ENV}")

    def build(root: Path) -> Foreign:
        script = extract_converter(sdist, root / "llama.cpp")
        sp_model = train_tokenizer(root)
        made = {}
        for name, arch, template, eos, ctx in (("qwen2", "qwen2", CHATML, "<|im_end|>", CONTEXT),
                                               ("gemma", "gemma", GEMMA, "</s>", CONTEXT),
                                               ("no_template", "qwen2", None, "</s>", LONG_CONTEXT)):
            made[save_hf(arch, root / f"hf-{name}", sp_model, template, eos, ctx)] = root / f"{name}-F32.gguf"
        convert(script, made)
        return Foreign(*made.values())

    return built_once(tmp_path_factory, "foreign-gguf", build)
