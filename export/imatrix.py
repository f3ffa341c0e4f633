"""Importance-matrix (imatrix) quantization with llama.cpp's own tools.

A K-quant stores each 256-wide super-block with scales chosen to minimise the rounding error. Plain
quantization weighs every input column of a weight equally; with an importance matrix — the mean
square of each column's *input activation* over calibration text — the scales minimise the error
the model actually sees, which is what makes Q4_K_M (and IQ types) usable on small models.

    compute_imatrix(f16_or_f32_gguf, text, out)         llama-imatrix on (NFC-normalized) Bangla text
    check_imatrix(imatrix, model_gguf)                  refuse an imatrix from another model
    quantize_with_imatrix(src_gguf, dst, type, imatrix) llama-quantize --imatrix
    export_gguf_imatrix(src, out_dir, types, manifest)  the `python -m export gguf --imatrix` path

The calibration text that ships (`training/assets/calibration/calibration_bn.txt`) is original
writing, disjoint from the training corpus and from `training/assets/eval/heldout_bn.txt`, so the
KL measured on the held-out file is not flattered by calibrating on it.

Files are written to a temporary name and renamed into place only when the tool succeeded, so a
failure never leaves a partial file and an existing file is replaced only with `force`.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np

from export import ExportError
from export.llama_tools import run_tool
from export.manifest import made_folder
from training import layout
from training.text import normalize

CALIBRATION_DIR = Path(__file__).resolve().parents[1] / "training" / "assets" / "calibration"
DEFAULT_CALIBRATION = CALIBRATION_DIR / "calibration_bn.txt"
# the check against a plain twin scores both files here: original Bangla, disjoint from the calibration
HELDOUT_TEXT = Path(__file__).resolve().parents[1] / "training" / "assets" / "eval" / "heldout_bn.txt"
IMATRIX_SUFFIX = ".imatrix.gguf"  # llama-imatrix's GGUF format (its default since 2025)
IN_SUM2, COUNTS = ".in_sum2", ".counts"  # the two tensors llama-imatrix writes per weight
DATASETS_KEY = "imatrix.datasets"
CHUNK_COUNT_KEY, CHUNK_SIZE_KEY = "imatrix.chunk_count", "imatrix.chunk_size"
WEIGHTINGS = ("activation", "fisher")  # torch_importance's statistics
IMATRIX_ARCH = "imatrix"  # gguf-py's writer needs an architecture; llama.cpp's loader reads only the keys above
# llama-imatrix splits the text into chunks of this many tokens; short enough that the shipped
# calibration text (~5k tokens with a 2k vocabulary, ~3k with 32k) gives at least a dozen chunks
DEFAULT_CHUNK_TOKENS = 256
# Tensors whose importance matrix must be present: every matmul weight. token_embd is a row lookup
# (get_rows), not a matmul, so llama-imatrix never sees activations for it.
MATMUL_WEIGHT = re.compile(r"^(blk\.\d+\.[a-z_]+|output)\.weight$")
# Types that quantize_with_imatrix accepts: the K-quants and IQ types an imatrix improves (legacy
# Q8_0/F16 gain nothing and are quantized without one).
IMATRIX_TYPES = ("Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K",
                 "IQ4_XS", "IQ4_NL", "IQ3_S", "IQ3_M", "IQ3_XXS", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS")
TOOL_TIMEOUT_S = 3600


def imatrix_path(out_dir: Path, name: str) -> Path:
    return out_dir / layout.GGUF_DIR / f"{name}{IMATRIX_SUFFIX}"


def _reader(path: Path, what: str) -> gguf.GGUFReader:
    if not path.is_file():
        raise ExportError(f"{what} not found: {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # gguf-py raises ValueError / struct.error / IndexError on foreign or truncated files
        raise ExportError(f"{path}: not a readable GGUF {what} ({type(e).__name__}: {e})") from None


def _check_model(path: Path) -> gguf.GGUFReader:
    r = _reader(path, "model")
    arch = r.fields.get(gguf.Keys.General.ARCHITECTURE)
    if arch is None or arch.contents() != "llama":
        got = arch.contents() if arch is not None else None
        raise ExportError(f"{path}: architecture {got!r} is not 'llama'; prodip computes importance matrices "
                          "for GGUF files written by `python -m export gguf`")
    return r


def imatrix_entries(path: Path) -> dict[str, int]:
    """{weight name: input width} of a llama-imatrix GGUF file."""
    r = _reader(path, "importance matrix")
    if DATASETS_KEY not in r.fields and not any(t.name.endswith(IN_SUM2) for t in r.tensors):
        raise ExportError(f"{path}: not an importance matrix (no {DATASETS_KEY} and no *{IN_SUM2} tensors); "
                          "prodip reads the GGUF imatrix format llama-imatrix writes")
    return {t.name[:-len(IN_SUM2)]: int(t.shape[0]) for t in r.tensors if t.name.endswith(IN_SUM2)}


def model_matmul_widths(path: Path) -> dict[str, int]:
    """{weight name: input width (ne0)} of every matmul weight of a llama GGUF."""
    r = _check_model(path)
    return {t.name: int(t.shape[0]) for t in r.tensors if len(t.shape) >= 2 and MATMUL_WEIGHT.match(t.name)}


def check_imatrix(imatrix: Path, model: Path) -> dict[str, int]:
    """Refuse an importance matrix that does not belong to `model`: every matmul weight of the model
    needs an entry of its input width, and the imatrix may name no weight the model lacks.
    (llama-quantize itself only warns about a missing entry and quantizes that tensor blind.)"""
    entries = imatrix_entries(imatrix)
    weights = model_matmul_widths(model)
    foreign = sorted(set(entries) - set(weights) - {"token_embd.weight"})
    missing = sorted(set(weights) - set(entries))
    wrong = sorted(n for n in set(weights) & set(entries) if weights[n] != entries[n])
    if foreign or wrong or missing:
        detail = (f"{len(foreign)} weights the model lacks (e.g. {foreign[0]})" if foreign else
                  f"{wrong[0]} has width {entries[wrong[0]]}, the model's {weights[wrong[0]]}" if wrong else
                  f"no entry for {len(missing)} of the model's {len(weights)} weights (e.g. {missing[0]})")
        raise ExportError(f"{imatrix} is an importance matrix of another model: {detail}")
    return entries


def read_imatrix(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{weight name: (in_sum2 (nmat, width), counts (nmat, 1))} of a llama-imatrix GGUF file."""
    imatrix_entries(path)  # refuses files that are not importance matrices
    r = gguf.GGUFReader(path)
    arrays = {t.name: np.array(t.data, dtype=np.float32).reshape(-1, int(t.shape[0])) for t in r.tensors}
    return {n[:-len(IN_SUM2)]: (a, arrays[n[:-len(IN_SUM2)] + COUNTS]) for n, a in arrays.items()
            if n.endswith(IN_SUM2) and n[:-len(IN_SUM2)] + COUNTS in arrays}


def write_imatrix(entries: dict[str, tuple[np.ndarray, np.ndarray]], out: Path, *, datasets: list[str],
                  chunk_count: int, chunk_size: int) -> Path:
    """Write `entries` in llama-imatrix's GGUF format (what llama-quantize --imatrix reads)."""
    w = gguf.GGUFWriter(out, IMATRIX_ARCH)
    w.add_string("general.type", "imatrix")
    w.add_array(DATASETS_KEY, datasets)
    w.add_uint32(CHUNK_COUNT_KEY, chunk_count)
    w.add_uint32(CHUNK_SIZE_KEY, chunk_size)
    for name in sorted(entries):  # llama-imatrix's deterministic order
        sums, counts = entries[name]
        w.add_tensor(name + IN_SUM2, np.ascontiguousarray(sums, dtype=np.float32))
        w.add_tensor(name + COUNTS, np.ascontiguousarray(counts, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def calibration_chunks(ids: list[int], bos: int, chunk_tokens: int) -> list[list[int]]:
    """The token stream cut as llama-imatrix cuts it: whole chunks of chunk_tokens (the tail is
    dropped), the first token of each replaced by BOS."""
    return [[bos, *ids[i + 1:i + chunk_tokens]] for i in range(0, len(ids) - chunk_tokens + 1, chunk_tokens)]


def torch_importance(run: Path, text: Path, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                     names: tuple[str, ...] | None = None, weighting: str = "activation",
                     ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The importance matrix computed from the PyTorch fp32 checkpoint itself, in llama-imatrix's
    layout: {GGUF weight name: (sum over calibration tokens of each input column's squared
    activation (1, width), token count (1, 1))}, over the chunks llama-imatrix would use.

    It covers what llama-imatrix cannot: with tied embeddings the output head is `token_embd.weight`,
    which llama-imatrix skips by name (it collects only `blk.*` and `output.weight`), so llama-quantize
    picks the head's Q6_K scales blind; the head's input is the final norm's output. `names` keeps
    only those GGUF weights (None: all).

    weighting "activation" is llama-imatrix's statistic, E[x_j^2]. "fisher" weighs each token by the
    squared norm of the loss gradient at the weight's output, E[|g_t|^2 x_tj^2] / E[|g_t|^2]: the
    diagonal of the weight's empirical Fisher summed over output rows, i.e. the second-order term of
    the loss change a rounding error causes (tokens whose output barely matters count less)."""
    import torch

    from export.names import to_gguf
    from training.checkpoint import load_model

    if weighting not in WEIGHTINGS:
        raise ExportError(f"unknown importance weighting {weighting!r}; choose from {', '.join(WEIGHTINGS)}")
    fisher = weighting == "fisher"
    model, ck = load_model(run)
    tied = model.cfg.tie_embeddings
    body = _read_calibration(Path(text))
    ids = ck.tokenizer.encode(body, bos=True)
    chunks = calibration_chunks(ids, ck.tokenizer.bos_id, min(chunk_tokens, model.cfg.max_seq_len))
    if not chunks:
        raise ExportError(f"{text}: calibration text is {len(ids)} tokens, shorter than one chunk ({chunk_tokens})")
    sums: dict[str, torch.Tensor] = {}
    weight_sums: dict[str, float] = {}
    inputs_of: dict[str, torch.Tensor] = {}
    hooks = []
    for mod_name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        g = "token_embd.weight" if mod_name == "output" and tied else to_gguf(mod_name + ".weight")
        if names is not None and g not in names:
            continue

        def keep_input(_m, inputs, g=g) -> None:
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).double()
            if fisher:
                inputs_of[g] = x
            else:
                sums[g] = sums.get(g, 0) + (x * x).sum(0)

        def weigh(_m, _grad_in, grad_out, g=g) -> None:
            w = grad_out[0].detach().reshape(-1, grad_out[0].shape[-1]).double().square().sum(-1)
            x = inputs_of.pop(g)
            sums[g] = sums.get(g, 0) + (w[:, None] * x * x).sum(0)
            weight_sums[g] = weight_sums.get(g, 0.0) + float(w.sum())

        hooks.append(mod.register_forward_pre_hook(keep_input))
        if fisher:
            hooks.append(mod.register_full_backward_hook(weigh))
    try:
        for c in chunks:
            x = torch.tensor([c])
            if fisher:  # the summed next-token loss of the chunk (its last token has no target)
                logits = model(x)[0, :-1]
                torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").backward()
                model.zero_grad(set_to_none=True)
            else:
                with torch.inference_mode():
                    model(x)
    finally:
        for h in hooks:
            h.remove()
    n = float(len(chunks) * len(chunks[0]))
    if fisher:  # rescale so the mean token weight is 1: magnitudes comparable with llama-imatrix's
        sums = {g: s * (n / weight_sums[g]) for g, s in sums.items()}
    return {g: (s.float().numpy()[None], np.array([[n]], np.float32)) for g, s in sums.items()}


def add_head_importance(imatrix: Path, run: Path, text: Path, *,
                        chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> bool:
    """Add the tied output head's entry (token_embd.weight, from the PyTorch model: see
    torch_importance) to a llama-imatrix file, in place; False when the model has an untied head
    (llama-imatrix --process-output already covers `output.weight`)."""
    entries = read_imatrix(imatrix)
    head = torch_importance(run, text, chunk_tokens=chunk_tokens, names=("token_embd.weight",))
    if not head:
        return False
    r = gguf.GGUFReader(imatrix)
    datasets = list(r.fields[DATASETS_KEY].contents())
    count = int(r.fields[CHUNK_COUNT_KEY].contents())
    size = int(r.fields[CHUNK_SIZE_KEY].contents())
    tmp = imatrix.with_name(f".{imatrix.name}.tmp")
    try:
        write_imatrix({**entries, **head}, tmp, datasets=datasets, chunk_count=count, chunk_size=size)
        os.replace(tmp, imatrix)
    finally:
        tmp.unlink(missing_ok=True)
    return True


def torch_imatrix(run: Path, text: Path, out: Path, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                  weighting: str = "activation", head: bool = False, force: bool = False) -> Path:
    """torch_importance over `text`, written to `out` in llama-imatrix's GGUF format. With `head` the
    tied output head (token_embd.weight) gets an entry too; off by default, as llama-imatrix: on the
    suite's model it raised the Q4_K_M KL to 1.13x plain's (tests/test_imatrix.py)."""
    out = Path(out)
    if out.exists() and not force:
        raise ExportError(f"{out} exists; use --force to overwrite")
    entries = torch_importance(run, text, chunk_tokens=chunk_tokens, weighting=weighting)
    if not head:
        entries.pop("token_embd.weight", None)
    n_chunks = int(next(iter(entries.values()))[1][0, 0]) // chunk_tokens
    tmp = out.with_name(f".{out.name}.tmp")
    with made_folder(out.parent):  # a failed write leaves no empty folder behind
        try:
            write_imatrix(entries, tmp, datasets=[Path(text).name], chunk_count=n_chunks, chunk_size=chunk_tokens)
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
    return out


def _read_calibration(text: Path) -> str:
    if not text.is_file():
        raise ExportError(f"calibration text not found: {text}")
    try:
        body = normalize(text.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ExportError(f"{text}: calibration text is not UTF-8 ({e.reason} at byte {e.start})") from None
    if not body.strip():
        raise ExportError(f"{text}: calibration text is empty")
    return body


def _normalized_copy(text: Path, tmp_dir: Path) -> Path:
    """llama-imatrix tokenizes the file's bytes as they are; every prodip path tokenizes NFC text."""
    body = _read_calibration(text)
    out = tmp_dir / text.name  # llama-imatrix records this name in imatrix.datasets
    out.write_text(body, encoding="utf-8")
    return out


def compute_imatrix(model: Path, text: Path, out: Path, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                    threads: int | None = None, force: bool = False) -> Path:
    """Run llama-imatrix on `model` (an F32/F16 llama GGUF) over `text`; write `out` (GGUF format)."""
    model, text, out = Path(model), Path(text), Path(out)
    _check_model(model)
    if out.exists() and not force:
        raise ExportError(f"{out} exists; use --force to overwrite")
    if not text.is_file():  # before the output folder is made: a failed run creates nothing
        raise ExportError(f"calibration text not found: {text}")
    # a failed run leaves no empty --out folder behind
    with made_folder(out.parent), tempfile.TemporaryDirectory(dir=out.parent, prefix=".imatrix-") as td:
        calib = _normalized_copy(text, Path(td))
        tmp = Path(td) / ("result" + IMATRIX_SUFFIX)
        args = ["-m", model, "-f", calib, "-o", tmp, "--output-format", "gguf", "-c", str(chunk_tokens),
                "--process-output", "--no-ppl", "-b", str(chunk_tokens)]
        if threads:
            args += ["-t", str(threads)]
        p = run_tool("llama-imatrix", args, timeout=TOOL_TIMEOUT_S)
        if not tmp.is_file():
            raise ExportError(f"llama-imatrix wrote no file ({p.stderr.strip().splitlines()[-1:]})")
        check_imatrix(tmp, model)  # the tool's own output must cover the model, or calibration was too short
        os.replace(tmp, out)
    return out


def mean_squares(imatrix: Path) -> dict[str, np.ndarray]:
    """{weight name: in_sum2 / counts}, what llama-quantize hands llama.cpp (tools/quantize/quantize.cpp)."""
    out = {}
    for name, (sums, counts) in read_imatrix(imatrix).items():
        c = counts.reshape(-1, 1)
        out[name] = np.where(c > 0, sums / np.maximum(c, 1), 1.0).astype(np.float32).reshape(-1)
    return out


def quantize_with_imatrix(src: Path, dst: Path, type_name: str, imatrix: Path, *, threads: int | None = None,
                          force: bool = False, embedding_type: str | None = None) -> Path:
    """`llama-quantize --imatrix IMATRIX SRC DST TYPE`, after check_imatrix, through the binding's
    llama_model_quantize: the same llama.cpp call the tool makes (its main() only loads the file
    into llama_model_imatrix_data), so no tool build is needed to quantize."""
    import ctypes

    from export.gguf import _llama_cpp, quantize_params

    src, dst, imatrix = Path(src), Path(dst), Path(imatrix)
    if type_name not in IMATRIX_TYPES:
        raise ExportError(f"{type_name} does not use an importance matrix; choose one of {', '.join(IMATRIX_TYPES)}")
    if dst.exists() and not force:
        raise ExportError(f"{dst} exists; use --force to overwrite")
    check_imatrix(imatrix, src)
    lc = _llama_cpp()
    params = quantize_params(type_name, nthread=threads, embedding_type=embedding_type)
    values = mean_squares(imatrix)
    keep = [np.ascontiguousarray(v, dtype=np.float32) for v in values.values()]  # alive during the call
    data = (lc.llama_model_imatrix_data * (len(keep) + 1))()
    for i, (name, v) in enumerate(zip(values, keep, strict=True)):
        data[i].name = name.encode()
        data[i].data = v.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        data[i].size = v.size
    data[len(keep)].name = None  # the array's terminator
    params.imatrix = ctypes.cast(data, ctypes.POINTER(lc.llama_model_imatrix_data))
    tmp = dst.with_name(f".{dst.name}.tmp")
    with made_folder(dst.parent):  # a failed quantization leaves no empty folder behind
        try:
            rc = lc.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
            if rc != 0 or not tmp.is_file():
                raise ExportError(f"llama.cpp failed to quantize {src.name} to {type_name} with {imatrix.name} "
                                  f"(return code {rc})")
            os.replace(tmp, dst)
        finally:
            tmp.unlink(missing_ok=True)
    return dst


def heldout_windows(ids: list[int], bos: int, n_ctx: int) -> list[list[int]]:
    """A token stream cut into n_ctx windows, each starting with BOS (as a prompt does)."""
    body = ids[1:] if ids and ids[0] == bos else ids
    step = n_ctx - 1
    return [[bos, *body[i:i + step]] for i in range(0, len(body), step) if len(body[i:i + step]) >= 8]


def versus_plain(base: Path, weighted: Path, type_name: str, *, heldout: Path = HELDOUT_TEXT,
                 nthread: int | None = None) -> tuple[float, float]:
    """(KL of the imatrix file, KL of the same type quantized without one) against the F32 base on the
    held-out text: an importance matrix is not always better (on an under-trained model it made
    Q4_K_M's KL 1.4-1.9x worse, docs/export.md), so the export measures the file it writes."""
    from export.gguf import quantize_gguf
    from serving.llamacpp import LlamaCppBackend
    from training.logprobs import kl_rows

    with tempfile.TemporaryDirectory(dir=weighted.parent) as td:
        plain = quantize_gguf(base, Path(td) / f"plain-{type_name}.gguf", type_name, nthread=nthread)
        ref = LlamaCppBackend(base, threads=nthread)
        try:
            text = heldout.read_text(encoding="utf-8")
            ids = ref.tokenize(text)  # BOS first
            windows = heldout_windows(ids, ids[0], ref.n_ctx) if ids else []
            if not windows:
                raise ExportError(f"{heldout}: held-out text too short to compare {weighted.name} with plain {type_name}")
            refs = [ref.logits(w) for w in windows]
        finally:
            ref.close()
        kls = []
        for path in (weighted, plain):
            b = LlamaCppBackend(path, threads=nthread)
            try:
                kls.append(float(np.concatenate([kl_rows(r, b.logits(w)) for r, w in zip(refs, windows, strict=True)]).mean()))
            finally:
                b.close()
    return kls[0], kls[1]


def export_gguf_imatrix(src, out_dir: Path, types: list[str], manifest, *, text: Path = DEFAULT_CALIBRATION,
                        force: bool = False, nthread: int | None = None) -> list[Path]:
    """The `python -m export gguf RUN --imatrix [TEXT]` path: F32/F16 as usual (export.gguf), the
    imatrix computed on the F32 base over `text`, every K/IQ type quantized with it. Written files
    are recorded in the manifest with the imatrix and its calibration text; returns every path
    written (the imatrix file included)."""
    from export.gguf import DIRECT_TYPES, canonical_type, export_gguf, gguf_path, inspect_gguf, write_gguf

    names = list(dict.fromkeys(canonical_type(t) for t in types))
    plain = [t for t in names if t not in IMATRIX_TYPES]
    weighted = [t for t in names if t in IMATRIX_TYPES]
    im_path = imatrix_path(out_dir, src.name)
    targets = {t: gguf_path(out_dir, src, t) for t in weighted}
    existing = [str(p) for p in [*targets.values(), im_path] if p.exists()]
    if existing and not force:  # checked before anything is written: nothing overwritten
        raise ExportError(f"{existing[0]} exists; use --force to overwrite")
    text = Path(text)
    if not text.is_file():
        raise ExportError(f"calibration text not found: {text}")
    written = export_gguf(src, out_dir, plain, manifest, force=force, nthread=nthread) if plain else []
    if not weighted:
        return written
    base = gguf_path(out_dir, src, "F32")
    tmp_base = None
    if "F32" not in names:
        tmp_base = base = out_dir / layout.GGUF_DIR / f".{src.name}-F32.imatrix-source.gguf"
        write_gguf(src, base, "F32")
    try:
        torch_imatrix(src.path, text, im_path, force=force)
        check_imatrix(im_path, base)
        written.append(im_path)
        manifest.add(im_path, "gguf-imatrix", "imatrix", calibration=str(text))
        for t in weighted:
            p = quantize_with_imatrix(base, targets[t], t, im_path, threads=nthread, force=force)
            info = inspect_gguf(p, t)
            kl, kl_plain = versus_plain(base, p, t, nthread=nthread)
            if kl > kl_plain:
                print(f"warning: {p.name}: the importance matrix made {t} worse on held-out Bangla (KL vs F32 "
                      f"{kl:.3e}, plain {kl_plain:.3e}); export without --imatrix for the plain file",
                      file=sys.stderr)
            manifest.add(p, "gguf", t, tensor_types=info["tensor_types"], fallbacks=info["fallbacks"],
                         imatrix=im_path.name, calibration=text.name, heldout_kl=kl, heldout_kl_plain=kl_plain)
            written.append(p)
    finally:
        if tmp_base is not None:
            tmp_base.unlink(missing_ok=True)
    assert all(t not in DIRECT_TYPES for t in weighted)
    return written


def build_parser():
    """python -m export.imatrix compute MODEL.gguf --out FILE [--text TEXT]
    python -m export.imatrix quantize SRC.gguf DST.gguf --type Q4_K_M --imatrix FILE"""
    import argparse

    from training.cli import ArgumentParser
    from training.schema import PositiveInt, SchemaError, flag, one_of

    def imatrix_type(text: str) -> str:
        try:
            return one_of("imatrix GGUF type", text.upper(), IMATRIX_TYPES)
        except SchemaError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    ap = ArgumentParser(prog="python -m export.imatrix", description=build_parser.__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compute", help="llama-imatrix over calibration text")
    c.add_argument("model", type=Path)
    c.add_argument("--text", type=Path, default=DEFAULT_CALIBRATION, help="calibration text (default: the shipped Bangla)")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--chunk", type=flag(PositiveInt), default=DEFAULT_CHUNK_TOKENS, help="tokens per chunk")
    q = sub.add_parser("quantize", help="llama-quantize --imatrix")
    q.add_argument("src", type=Path)
    q.add_argument("dst", type=Path)
    q.add_argument("--type", default="Q4_K_M", type=imatrix_type, metavar="TYPE",
                   help=f"one of {', '.join(IMATRIX_TYPES)}")
    q.add_argument("--imatrix", type=Path, required=True)
    for p in (c, q):
        p.add_argument("--threads", type=flag(PositiveInt), default=None)
        p.add_argument("--force", action="store_true", help="overwrite the output")
    ap.add_argument("--debug", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    from training.cli import run_main

    def run(args) -> None:
        if args.command == "compute":
            out = compute_imatrix(args.model, args.text, args.out, chunk_tokens=args.chunk, threads=args.threads,
                                  force=args.force)
            print(f"wrote {out} ({len(imatrix_entries(out))} weights)")
        else:
            out = quantize_with_imatrix(args.src, args.dst, args.type, args.imatrix, threads=args.threads,
                                        force=args.force)
            print(f"wrote {out}")

    return run_main(build_parser(), argv, run)


if __name__ == "__main__":
    raise SystemExit(main())
