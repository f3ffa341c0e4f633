"""`train.py --init-from FOLDER`: start a run from an open Llama-architecture checkpoint in Hugging Face
layout (config.json, *.safetensors with or without model.safetensors.index.json, tokenizer.model).

Everything is read and checked before the run folder is written: the architecture (LlamaForCausalLM
only), each config.json field (honoured, or known to leave the forward pass alone, or refused by
name: never dropped), the tokenizer (a SentencePiece tokenizer.model, byte-identical to the one the
--data folder was prepared with), every tensor's name, shape and finiteness. Then a gate: prodip's
logits equal transformers' LlamaForCausalLM's on the data's first ids (fp32, <= PARITY_TOL), recorded
in gates.json as `init.parity`, before the first step.

The weights are HF's with names mapped through training.model.hf_names (our RoPE is HF's rotate-half, so no
permutation). transformers is needed for the gate only: `pip install 'prodip[init]'`.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from training.model.decoder import ModelConfig, Transformer
from training.model.hf_config import (
    ARCHITECTURE,
    CONFIG,
    FIELDS,
    MODEL_TYPE,
    SHAPE,
    InitFromError,
    checked_fields,
    read_config,
    rope_theta,
)
from training.model.hf_names import HF_NAMES, TIED_HEAD, ours_from_hf
from training.runfiles.gate_results import GateResult
from training.runfiles.json_records import loads
from training.text.fertility import format_table
from training.text.normalization import normalize
from training.text.tokenizer import ForeignSentencePiece, Tokenizer, TokenizerError
from training.text.vocab_extend import is_extension, new_row_sources, parse

TOKENIZER_MODEL, TOKENIZER_JSON = "tokenizer.model", "tokenizer.json"
INDEX = "model.safetensors.index.json"
PARITY_GATE, PARITY_TOL = "init.parity", 1e-4  # the bound: fp32 logits, max abs difference
VOCAB_ROWS = ("tok_embeddings.weight", TIED_HEAD)  # one row per piece: the base's rows, then the extension's
PARITY_TOKENS = 64  # ids of the data compared (fewer when --seq-len is shorter)
ORTHOGRAPHY = Path(__file__).resolve().parents[1] / "assets" / "text" / "orthography_bn.txt"
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")

HONOURED = {*FIELDS}
# Fields that leave LlamaForCausalLM's fp32 forward pass alone: bookkeeping, generation and output
# options, the stored dtype (prodip keeps fp32 master weights), pretraining_tp (sliced matmuls of the
# same product; the parity gate checks it), pad_token_id (no padding in pretraining windows).
IGNORED = {"transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache", "pad_token_id",
           "pretraining_tp", "output_attentions", "output_hidden_states", "return_dict", "tokenizer_class",
           "_attn_implementation_autoset"}


@dataclass
class Imported:
    """An HF folder checked against this run: its model shape (over the data's vocabulary), the data's
    tokenizer, the folder's own tokenizer.model and weight files. base_vocab < model_cfg.vocab_size when
    the data's tokenizer extends the folder's (training.text.vocab_extend)."""

    folder: Path
    model_cfg: ModelConfig
    tokenizer: Tokenizer
    weight_files: list[Path]
    base_proto: bytes
    base_vocab: int


def require_transformers() -> None:
    try:
        import transformers  # noqa: F401 - only whether it imports
    except ImportError:
        raise InitFromError("--init-from needs the `transformers` package for its import parity gate: "
                            "pip install 'prodip[init]'") from None


def resolve(spec: str) -> Path:
    """A local folder, or a hub id downloaded when the hub is reachable (never when offline)."""
    p = Path(spec)
    if p.is_dir():
        return p
    if p.exists():
        raise InitFromError(f"--init-from {spec}: not a folder (give the model's folder: {CONFIG}, *.safetensors, "
                            f"{TOKENIZER_MODEL})")
    if not HUB_ID.fullmatch(spec):
        raise InitFromError(f"--init-from {spec}: no such folder")
    hint = f"download the folder first (`hf download {spec} --local-dir DIR`) and pass --init-from DIR"
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        raise InitFromError(f"--init-from {spec}: not a local folder and the Hugging Face hub is offline "
                            f"(HF_HUB_OFFLINE); {hint}")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(spec, allow_patterns=["*.json", "*.safetensors", TOKENIZER_MODEL]))
    except Exception as e:  # noqa: BLE001 - network, auth and not-found errors all mean the same here
        raise InitFromError(f"--init-from {spec}: not a local folder and the hub did not give it "
                            f"({type(e).__name__}); {hint}") from None


def model_config(hf: dict, path: Path) -> ModelConfig:
    """prodip's ModelConfig of an HF LlamaConfig dict; every field honoured (read strictly: training.model.hf_config),
    ignored by reason, or refused by name."""
    archs, mtype = hf.get("architectures"), hf.get("model_type")
    if archs != [ARCHITECTURE] or mtype != MODEL_TYPE:  # first: another architecture's fields are not the point
        raise InitFromError(f"{path}: architectures {archs!r} (model_type {mtype!r}): only {ARCHITECTURE} "
                            f"(model_type {MODEL_TYPE!r}) can be imported")
    unknown = sorted(k for k in hf if k not in HONOURED and k not in IGNORED)
    if unknown:
        raise InitFromError(f"{path}: field {unknown[0]!r} = {hf[unknown[0]]!r} cannot be honoured (prodip "
                            f"does not implement it); refusing rather than dropping it")
    c = checked_fields(hf, path)
    if c["hidden_act"] != "silu":
        raise InitFromError(f"{path}: hidden_act {c['hidden_act']!r} cannot be honoured: prodip's MLP is SwiGLU (silu)")
    for k in ("attention_bias", "mlp_bias"):
        if c[k]:
            raise InitFromError(f"{path}: {k} = true cannot be honoured: prodip's projections have no biases")
    if c["attention_dropout"]:
        raise InitFromError(f"{path}: attention_dropout {c['attention_dropout']} cannot be honoured: prodip "
                            "trains without dropout")
    heads = c["num_attention_heads"]
    head_dim = c["head_dim"]
    if head_dim is not None and head_dim * heads != c["hidden_size"]:
        raise InitFromError(f"{path}: head_dim {head_dim} x {heads} heads != hidden_size {c['hidden_size']}: "
                            "prodip's head_dim is hidden_size / num_attention_heads")
    theta = rope_theta(c, hf, path)
    try:
        return ModelConfig(**{ours: c[k] for k, ours in SHAPE.items()},
                           n_kv_heads=heads if c["num_key_value_heads"] is None else c["num_key_value_heads"],
                           max_seq_len=c["max_position_embeddings"], rope_theta=theta,
                           norm_eps=c["rms_norm_eps"], tie_embeddings=c["tie_word_embeddings"],
                           init_std=c["initializer_range"])
    except ValueError as e:
        raise InitFromError(f"{path}: {e}") from None


def planned_config(spec: str, vocab_size: int | None) -> ModelConfig:
    """The model `--init-from spec` trains, from config.json alone (`--plan`: no weights, no transformers), over
    the data's vocabulary of `vocab_size` pieces (an extension's; None: the folder's own)."""
    folder = resolve(spec)
    cfg = model_config(read_config(folder), folder / CONFIG)
    if vocab_size is not None and vocab_size < cfg.vocab_size:
        raise InitFromError(f"{folder / CONFIG}: vocab_size {cfg.vocab_size} but the --data tokenizer has "
                            f"{vocab_size} pieces: prepare --data with the folder's {TOKENIZER_MODEL}")
    return cfg if vocab_size is None else replace(cfg, vocab_size=vocab_size)


def read_tokenizer(folder: Path) -> bytes:
    """The folder's SentencePiece tokenizer.model; a byte-level-BPE-only folder is refused saying why."""
    path = folder / TOKENIZER_MODEL
    if not path.is_file():
        if (folder / TOKENIZER_JSON).is_file():
            raise InitFromError(f"--init-from {folder}: its tokenizer is {TOKENIZER_JSON} only (byte-level BPE, no "
                                f"SentencePiece {TOKENIZER_MODEL}): prodip's training, GGUF export and tokenizer "
                                "parity carry SentencePiece models only")
        raise InitFromError(f"--init-from {folder}: no {TOKENIZER_MODEL} (a SentencePiece model is required)")
    return path.read_bytes()


def base_vocab_of(folder: Path, base: bytes, data_tok: Tokenizer, data: str) -> int:
    """How many of the data tokenizer's pieces are the folder's: all (the same file) or the base's part of
    an extension of it (vocab_extend); any other tokenizer is refused naming the fix."""
    path = folder / TOKENIZER_MODEL
    if hashlib.sha256(base).hexdigest() == data_tok.sha256:
        return data_tok.vocab_size
    if is_extension(base, data_tok.proto):
        return len(parse(base, str(path)).pieces)
    try:
        Tokenizer(base, path)
    except TokenizerError as e:  # a stock Llama tokenizer: no <pad>, no chat tokens
        why = str(e).split("; retrain")[0]
        raise InitFromError(f"--init-from {folder}: {why.replace('tokenizer ', '', 1)} (padding and chat turns need "
                            "them): prepare --data with `--extend-tokenizer` to add them (docs/init_from.md)") from None
    raise InitFromError(f"--data {data} was prepared with another tokenizer (sha256 {data_tok.sha256[:12]}) "
                        f"than --init-from {path} ({hashlib.sha256(base).hexdigest()[:12]}), nor an extension of it: "
                        f"prepare it with `python -m training.prepare ... --tokenizer {path}`")


def weight_files(folder: Path) -> list[Path]:
    index = folder / INDEX
    if index.is_file():
        try:
            wmap = loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(wmap.values()))
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise InitFromError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
        odd = [n for n in names if not isinstance(n, str) or n in ("", ".", "..") or "/" in n or "\\" in n]
        if odd:  # a name joined to the folder must stay in it
            raise InitFromError(f"{index}: weight_map names {odd[0]!r}: not a file name in {folder}")
        files = [folder / n for n in names]
        absent = [f for f in files if not f.is_file()]
        if absent:
            raise InitFromError(f"{index} names {absent[0].name}, which is not in {folder}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise InitFromError(f"--init-from {folder}: no *.safetensors weights (pytorch_model.bin is not read: pickle)")
    return files


def open_folder(spec: str, data_tokenizer: Tokenizer, data: str) -> Imported:
    """Everything about the folder that can be checked without reading the weights, against the data."""
    require_transformers()
    return inspect_folder(resolve(spec), data_tokenizer, data)


def inspect_folder(folder: Path, data_tokenizer: Tokenizer, data: str) -> Imported:
    """open_folder's checks without transformers (training.evaluate rebuilds a run's starting point with them)."""
    hf = read_config(folder)
    cfg = model_config(hf, folder / CONFIG)
    base = read_tokenizer(folder)
    base_vocab = base_vocab_of(folder, base, data_tokenizer, data)
    if base_vocab != cfg.vocab_size:
        raise InitFromError(f"{folder / CONFIG}: vocab_size {cfg.vocab_size} but {TOKENIZER_MODEL} has "
                            f"{base_vocab} pieces: prodip's vocabulary is its tokenizer's")
    for key, ours in (("bos_token_id", data_tokenizer.bos_id), ("eos_token_id", data_tokenizer.eos_id)):
        if hf.get(key) is not None and hf[key] != ours:
            raise InitFromError(f"{folder / CONFIG}: {key} {hf[key]} but {TOKENIZER_MODEL} has it at id {ours}")
    cfg = replace(cfg, vocab_size=data_tokenizer.vocab_size)  # the extended vocabulary, if the data's extends it
    return Imported(folder, cfg, data_tokenizer, weight_files(folder), base, base_vocab)


def _read_tensors(files: list[Path]):
    """(file, HF name, tensor) of every stored tensor, read one at a time (never a whole file at once)."""
    from safetensors import safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                    yield f, name, st.get_tensor(name)
        except Exception as e:  # noqa: BLE001 - SafetensorError subclasses Exception only; OSError too
            raise InitFromError(f"{f}: not a readable safetensors file ({' '.join(str(e).split())[:200]})") from None


@torch.no_grad()
def load_weights(model: Transformer, imp: Imported) -> None:
    """Every parameter of `model` from the folder's tensors, checked by name, shape and finiteness."""
    params = dict(model.named_parameters())  # a tied head appears once, as tok_embeddings.weight
    loaded: set[str] = set()
    tied_head = None
    for f, name, t in _read_tensors(imp.weight_files):
        ours = ours_from_hf(name)
        if ours is None:
            if name.endswith("rotary_emb.inv_freq"):  # a buffer older checkpoints store: rope_theta's, recomputed
                continue
            raise InitFromError(f"{f}: tensor {name!r} is not a LlamaForCausalLM parameter prodip knows")
        if ours == TIED_HEAD and model.cfg.tie_embeddings:
            tied_head = (f, t)
            continue
        p = params.get(ours)
        if p is None:
            raise InitFromError(f"{f}: tensor {name!r} has no place in a {model.cfg.n_layers}-layer model")
        want = (imp.base_vocab, *p.shape[1:]) if ours in VOCAB_ROWS else tuple(p.shape)
        if tuple(t.shape) != want:
            raise InitFromError(f"{f}: tensor {name!r} has shape {tuple(t.shape)}, the config says {want}")
        if not t.is_floating_point() or not torch.isfinite(t).all():
            raise InitFromError(f"{f}: tensor {name!r} is not finite floating point ({t.dtype})")
        p[:want[0]].copy_(t.to(p.dtype))
        loaded.add(ours)
    absent = [n for n in params if n not in loaded]
    if absent:
        hf = HF_NAMES[re.sub(r"^layers\.\d+\.", "layers.{bid}.", absent[0])].replace("{bid}", absent[0].split(".")[1])
        raise InitFromError(f"--init-from {imp.folder}: tensor {hf!r} is missing ({len(absent)} of {len(params)} absent)")
    if tied_head is not None and not torch.equal(tied_head[1].to(torch.float32),
                                                 params["tok_embeddings.weight"][:imp.base_vocab]):
        raise InitFromError(f"{tied_head[0]}: tie_word_embeddings is true but lm_head.weight differs from "
                            "model.embed_tokens.weight")
    if imp.base_vocab < model.cfg.vocab_size:
        init_new_rows(model, imp)


@torch.no_grad()
def init_new_rows(model: Transformer, imp: Imported) -> None:
    """Each appended piece's embedding (and untied head) row: the mean of the base rows of the text it
    spells in the base tokenizer (all base rows for a control piece); old rows untouched."""
    v = imp.base_vocab
    sources = new_row_sources(imp.base_proto, imp.tokenizer, v)
    for w in dict.fromkeys((model.tok_embeddings.weight, model.output.weight)):  # once when tied
        for i, ids in enumerate(sources):
            w[v + i] = w[ids].mean(0) if ids else w[:v].mean(0)


@torch.no_grad()
def parity_gate(model: Transformer, imp: Imported, ids: torch.Tensor) -> GateResult:
    """prodip's logits against transformers' LlamaForCausalLM's, both fp32 on the CPU, on `ids` (1, T). With an
    extended vocabulary: on the ids of base pieces, over the base vocabulary (the extension changes nothing
    there)."""
    import transformers

    ids = ids[:, (ids[0] < imp.base_vocab)]

    kw = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": torch.float32}
    ref = transformers.LlamaForCausalLM.from_pretrained(str(imp.folder), **kw).eval()
    want = ref(ids).logits
    del ref
    was_training = model.training
    got = model.eval()(ids)[..., :imp.base_vocab]
    model.train(was_training)
    diff = (got - want).abs().max().item()
    passed = diff <= PARITY_TOL  # a NaN compares False
    return GateResult(PARITY_GATE, passed, value=diff, threshold=f"<= {PARITY_TOL:g}",
                      detail=f"max |logit difference| vs transformers {transformers.__version__} LlamaForCausalLM "
                             f"on {ids.shape[1]} ids of the data, fp32" + (
                                 f", over the base's {imp.base_vocab} pieces of {model.cfg.vocab_size}"
                                 if imp.base_vocab < model.cfg.vocab_size else ""))


def normalization_note(base: bytes) -> str:
    """Whether prodip's normalize (training.text.normalization: NFC, BOM, CRLF) changes this tokenizer's ids on the
    shipped orthography text (both nukta spellings): if so, the base model saw other ids for that text."""
    sp = ForeignSentencePiece(base, "the base's tokenizer.model")
    lines = [ln for ln in ORTHOGRAPHY.read_text(encoding="utf-8").splitlines() if ln.strip()]
    changed = sum(sp.encode(ln) != sp.encode(normalize(ln)) for ln in lines)
    if not changed:
        return (f"normalization: a no-op for this tokenizer (the same ids with and without prodip's normalize "
                f"on all {len(lines)} lines of {ORTHOGRAPHY.name})")
    return (f"normalization: NOT a no-op for this tokenizer: prodip's normalize changes its ids on {changed} of "
            f"{len(lines)} lines of {ORTHOGRAPHY.name} (the base model saw those spellings un-normalized; "
            "prodip trains and serves normalized text)")


def fertility_note(tok: Tokenizer, data_report: dict | None) -> str:
    fert = (data_report or {}).get("fertility")
    if isinstance(fert, dict) and fert.get("tokenizer_sha256") in (None, tok.sha256):
        return "fertility of the imported tokenizer on --data (the tokenizer gate judges it):\n" + format_table(fert)
    return "no fertility report in --data for this tokenizer: the tokenizer gate measures it on the validation text"


def import_weights(model: Transformer, imp: Imported, ids: torch.Tensor) -> list[GateResult]:
    """Load the folder into `model` and pass the parity gate, or InitFromError naming the difference."""
    load_weights(model, imp)
    gate = parity_gate(model, imp, ids)
    if not gate.passed:
        raise InitFromError(f"--init-from {imp.folder}: import parity gate failed: max |logit difference| "
                            f"{gate.value:.3g} vs transformers > {PARITY_TOL:g}")
    return [gate]
