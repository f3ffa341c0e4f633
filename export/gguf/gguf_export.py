"""GGUF export for llama.cpp / ollama: F32 and F16 written by gguf-py, every other type made by
llama.cpp's own quantizer (llama_cpp.llama_model_quantize) from an F32 GGUF.

Architecture "llama" with the full hyper-parameter metadata, the SentencePiece vocabulary (pieces,
scores, token types), special ids and the chat template. Q and K rows are permuted from our
rotate-half RoPE layout to llama.cpp's (training.model.gguf_names.permute_rope); tensors are streamed one at a
time from the checkpoint, so the model is never held twice in memory.

K-quants work on 256-wide super-blocks: llama.cpp silently falls back to other types for tensors
whose input width is not divisible by 256. `inspect_gguf` reads a file back (gguf.GGUFReader) and
reports every tensor whose type is not the one asked for; the manifest records it.
"""

from __future__ import annotations

import ctypes
import os
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np

from export import ExportError
from export.manifest import Manifest, Source
from serving.backend import CHAT_TUNED_KEY
from serving.chat_session import run_chat_tuned
from training.model.gguf_names import lookup, permute_heads, permute_rope, to_gguf
from training.runfiles import layout
from training.runfiles.schema import suggest
from training.text.chat_template import CHAT_TEMPLATE

ARCH = "llama"
DIRECT_TYPES = ("F32", "F16")  # written here; everything else goes through llama.cpp's quantizer
SHORTCUTS = {"f32": "F32", "f16": "F16", "q8": "Q8_0", "q4": "Q4_K_M"}
TOKEN_TYPES = {"normal": gguf.TokenType.NORMAL, "unknown": gguf.TokenType.UNKNOWN,
               "control": gguf.TokenType.CONTROL, "byte": gguf.TokenType.BYTE,
               "unused": gguf.TokenType.UNUSED, "user_defined": gguf.TokenType.USER_DEFINED}
K_QUANTS = {gguf.GGMLQuantizationType[n] for n in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K")}
IQ_QUANTS = {t for t in gguf.GGMLQuantizationType if t.name.startswith("IQ")}
# llama.cpp gives output/token_embd a higher-precision type in most mixes (e.g. Q6_K for Q4_0)
HEAD_UPGRADES = {gguf.GGMLQuantizationType.Q6_K, gguf.GGMLQuantizationType.Q8_0}
F32 = gguf.GGMLQuantizationType.F32


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:  # pragma: no cover - a dependency of prodip
        raise ExportError(f"quantized GGUF needs llama-cpp-python ({e})") from None
    return llama_cpp


def file_types() -> dict[str, int]:
    """Every llama.cpp file type name (as in llama-quantize: Q4_K_M, Q8_0, ...) -> its ftype number."""
    lc = _llama_cpp()
    out = {"F32": lc.LLAMA_FTYPE_ALL_F32}
    prefix = "LLAMA_FTYPE_MOSTLY_"
    for k in dir(lc):
        if k.startswith(prefix):
            out[k[len(prefix):]] = getattr(lc, k)
    return out


def canonical_type(name: str) -> str:
    """'q4' -> 'Q4_K_M', 'q8_0' -> 'Q8_0'; an unknown name raises ExportError with the nearest one."""
    key = SHORTCUTS.get(name.lower(), name.upper())
    types = file_types()
    if key not in types:
        raise ExportError(f"unknown GGUF type {name!r}{suggest(key, types)}; choose from {', '.join(sorted(types))}")
    return key


def gguf_path(out_dir: Path, src: Source, type_name: str) -> Path:
    return out_dir / layout.GGUF_DIR / f"{src.name}-{type_name}.gguf"


def metadata(src: Source, file_type: int) -> list[tuple[str, object, gguf.GGUFValueType]]:
    """(key, value, type) for every GGUF key we write, in order."""
    cfg, tok = src.config, src.tokenizer
    K, V = gguf.Keys, gguf.GGUFValueType
    a = ARCH
    pieces = list(tok.pieces())
    spec = tok.trainer_spec()
    tuned = run_chat_tuned(src.run_dir or src.path)
    return [
        (K.General.NAME, src.name, V.STRING),
        (K.General.FILE_TYPE, file_type, V.UINT32),
        (K.General.QUANTIZATION_VERSION, gguf.GGML_QUANT_VERSION, V.UINT32),
        (K.LLM.CONTEXT_LENGTH.format(arch=a), cfg.max_seq_len, V.UINT32),
        (K.LLM.EMBEDDING_LENGTH.format(arch=a), cfg.d_model, V.UINT32),
        (K.LLM.BLOCK_COUNT.format(arch=a), cfg.n_layers, V.UINT32),
        (K.LLM.FEED_FORWARD_LENGTH.format(arch=a), cfg.ffn_dim, V.UINT32),
        (K.Attention.HEAD_COUNT.format(arch=a), cfg.n_heads, V.UINT32),
        (K.Attention.HEAD_COUNT_KV.format(arch=a), cfg.n_kv_heads, V.UINT32),
        (K.Attention.KEY_LENGTH.format(arch=a), cfg.head_dim, V.UINT32),
        (K.Attention.VALUE_LENGTH.format(arch=a), cfg.head_dim, V.UINT32),
        (K.Attention.LAYERNORM_RMS_EPS.format(arch=a), cfg.norm_eps, V.FLOAT32),
        (K.Rope.DIMENSION_COUNT.format(arch=a), cfg.head_dim, V.UINT32),
        (K.Rope.FREQ_BASE.format(arch=a), cfg.rope_theta, V.FLOAT32),
        (K.LLM.VOCAB_SIZE.format(arch=a), cfg.vocab_size, V.UINT32),
        (K.Tokenizer.MODEL, "llama", V.STRING),  # SentencePiece ("SPM") in llama.cpp
        (K.Tokenizer.PRE, "default", V.STRING),
        (K.Tokenizer.LIST, [p.text for p in pieces], V.ARRAY),
        (K.Tokenizer.SCORES, [float(p.score) for p in pieces], V.ARRAY),
        (K.Tokenizer.TOKEN_TYPE, [int(TOKEN_TYPES[p.kind]) for p in pieces], V.ARRAY),
        (K.Tokenizer.BOS_ID, tok.bos_id, V.UINT32),
        (K.Tokenizer.EOS_ID, tok.eos_id, V.UINT32),
        (K.Tokenizer.UNK_ID, tok.unk_id, V.UINT32),
        (K.Tokenizer.PAD_ID, tok.pad_id, V.UINT32),
        (K.Tokenizer.EOT_ID, tok.im_end_id, V.UINT32),  # a chat turn ends here
        (K.Tokenizer.ADD_BOS, True, V.BOOL),
        (K.Tokenizer.ADD_EOS, False, V.BOOL),
        (K.Tokenizer.ADD_PREFIX, bool(spec["add_dummy_prefix"]), V.BOOL),
        (K.Tokenizer.CHAT_TEMPLATE, CHAT_TEMPLATE, V.STRING),
    ] + ([] if tuned is None else [(CHAT_TUNED_KEY, tuned, V.BOOL)])  # serving: chat or plain completion


def _value_type(value: object) -> gguf.GGUFValueType:
    V = gguf.GGUFValueType
    if isinstance(value, bool):
        return V.BOOL
    if isinstance(value, int):
        return V.UINT32
    if isinstance(value, float):
        return V.FLOAT32
    if isinstance(value, str):
        return V.STRING
    raise ExportError(f"unsupported GGUF metadata value {value!r}")


def write_gguf(src: Source, path: Path, type_name: str = "F16", *, permute_qk: bool = True,
               metadata_overrides: Mapping[str, object] | None = None) -> Path:
    """Write an F32 or F16 GGUF (norms stay F32), streaming one tensor at a time.

    `permute_qk=False` and `metadata_overrides` exist to plant defects in tests (parity must catch
    them) and to set extra keys; a normal export uses neither."""
    if type_name not in DIRECT_TYPES:
        raise ExportError(f"write_gguf writes {DIRECT_TYPES}; quantized types go through quantize_gguf")
    ftype = file_types()[type_name]
    out_dtype = np.float32 if type_name == "F32" else np.float16
    kv = {k: (v, t) for k, v, t in metadata(src, ftype)}
    for k, v in (metadata_overrides or {}).items():
        kv[k] = (v, _value_type(v))
    w = gguf.GGUFWriter(None, ARCH)
    for k, (v, t) in kv.items():
        if t == gguf.GGUFValueType.ARRAY:
            w.add_array(k, v)
        else:
            w.add_key_value(k, v, t)
    plan = []
    for name in src.tensor_names():
        shape = src.shapes[name]
        dtype = np.dtype(np.float32 if len(shape) == 1 else out_dtype)  # 1-D norms stay F32
        w.add_tensor_info(to_gguf(name), shape, dtype, int(np.prod(shape)) * dtype.itemsize)
        plan.append((name, dtype))
    def arrays():  # one tensor in memory at a time
        for (name, dtype), (name2, t) in zip(plan, src.tensors(), strict=True):
            assert name == name2
            arr = t.numpy()
            row, _ = lookup(name)
            if permute_qk and row.permute:
                arr = permute_rope(arr, permute_heads(src.config, row.permute))
            yield np.ascontiguousarray(arr, dtype=dtype)

    return write_tensors(w, path, arrays())


def write_tensors(w: gguf.GGUFWriter, path: Path, arrays) -> Path:
    """Write a GGUFWriter whose metadata and tensor infos are set, with `arrays` (in tensor-info order)
    as the data, to `path` atomically: a temporary file renamed into place, removed on any failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        w.write_header_to_file(tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for arr in arrays:
            w.write_tensor_data(arr)
        w.close()
        os.replace(tmp, path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return path


def quantize_params(type_name: str, *, nthread: int | None = None, embedding_type: str | None = None):
    """llama_model_quantize_params for `type_name`; `embedding_type` (a ggml type name such as F16)
    overrides the type llama.cpp's mix gives token_embd (`llama-quantize --token-embedding-type`)."""
    lc = _llama_cpp()
    from llama_cpp import _logger  # noqa: F401  (installs llama-cpp-python's log callback)

    _logger.set_verbose(False)
    params = lc.llama_model_quantize_default_params()
    params.ftype = file_types()[type_name]
    params.nthread = nthread or os.cpu_count() or 1
    if embedding_type is not None:
        try:
            params.token_embedding_type = int(gguf.GGMLQuantizationType[embedding_type])
        except KeyError:
            raise ExportError(f"unknown ggml type {embedding_type!r} for the token embedding") from None
    return params


def quantize_gguf(src_path: Path, dst_path: Path, type_name: str, *, nthread: int | None = None,
                  embedding_type: str | None = None) -> Path:
    """llama.cpp's own quantizer (what `llama-quantize` runs), from an F32/F16 GGUF."""
    lc = _llama_cpp()
    params = quantize_params(type_name, nthread=nthread, embedding_type=embedding_type)
    tmp = dst_path.with_name(dst_path.name + ".tmp")
    rc = lc.llama_model_quantize(str(src_path).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise ExportError(f"llama.cpp failed to quantize {src_path.name} to {type_name} (return code {rc})")
    os.replace(tmp, dst_path)
    return dst_path


def read_field(reader: gguf.GGUFReader, key: str) -> object:
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def allowed_types(type_name: str) -> set[gguf.GGMLQuantizationType]:
    """Tensor types that count as `type_name` for 2-D weights (the mix llama.cpp uses on purpose)."""
    Q = gguf.GGMLQuantizationType
    if type_name == "F32":
        return {Q.F32}
    if type_name in ("F16", "BF16"):
        return {Q[type_name]}
    if "_K" in type_name:
        return set(K_QUANTS)
    if type_name.startswith("IQ"):
        return IQ_QUANTS | K_QUANTS
    return ({Q[type_name]} if type_name in Q.__members__ else set()) | HEAD_UPGRADES


def inspect_gguf(path: Path, type_name: str) -> dict:
    """Read a GGUF back: architecture, tensor type counts, and every tensor that fell back."""
    r = gguf.GGUFReader(path)
    counts = Counter(t.tensor_type.name for t in r.tensors)
    allowed = allowed_types(type_name)
    fallbacks = []
    for t in r.tensors:
        if len(t.shape) < 2:
            if t.tensor_type != F32:
                fallbacks.append({"tensor": t.name, "type": t.tensor_type.name, "width": int(t.shape[0])})
            continue
        if t.tensor_type not in allowed:
            fallbacks.append({"tensor": t.name, "type": t.tensor_type.name, "width": int(t.shape[0])})
    return {"architecture": read_field(r, gguf.Keys.General.ARCHITECTURE),
            "file_type": read_field(r, gguf.Keys.General.FILE_TYPE),
            "tensor_types": dict(sorted(counts.items())), "fallbacks": fallbacks}


def export_gguf(src: Source, out_dir: Path, types: list[str], manifest: Manifest, *, force: bool = False,
                nthread: int | None = None) -> list[Path]:
    """Write each requested type; quantized ones from the F32 file (a temporary one if F32 was not asked)."""
    names = list(dict.fromkeys(canonical_type(t) for t in types))
    targets = {t: gguf_path(out_dir, src, t) for t in names}
    existing = [str(p) for p in targets.values() if p.exists()]
    if existing and not force:
        raise ExportError(f"{existing[0]} exists; use --force to overwrite")
    written: list[Path] = []
    for t in names:
        if t in DIRECT_TYPES:
            written.append(write_gguf(src, targets[t], t))
    quant = [t for t in names if t not in DIRECT_TYPES]
    if quant:
        base = targets.get("F32")
        tmp_base = None
        if base is None:
            tmp_base = base = out_dir / layout.GGUF_DIR / f".{src.name}-F32.quant-source.gguf"
            write_gguf(src, base, "F32")
        try:
            for t in quant:
                written.append(quantize_gguf(base, targets[t], t, nthread=nthread))
        finally:
            if tmp_base is not None:
                tmp_base.unlink(missing_ok=True)
    for p in written:
        t = next(k for k, v in targets.items() if v == p)
        info = inspect_gguf(p, t)
        if info["architecture"] != ARCH:
            raise ExportError(f"{p}: wrote architecture {info['architecture']!r}, expected {ARCH!r}")
        manifest.add(p, "gguf", t, tensor_types=info["tensor_types"], fallbacks=info["fallbacks"])
    return written
