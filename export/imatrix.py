"""Importance-matrix (imatrix) quantization with llama.cpp's own tools.

A K-quant stores each 256-wide super-block with scales chosen to minimise the rounding error. Plain
quantization weighs every input column of a weight equally; with an importance matrix — the mean
square of each column's *input activation* over calibration text — the scales minimise the error
the model actually sees, which is what makes Q4_K_M (and IQ types) usable on small models.

    compute_imatrix(f16_or_f32_gguf, text, out)         llama-imatrix on (NFC-normalized) Bangla text
    check_imatrix(imatrix, model_gguf)                  refuse an imatrix from another model
    quantize_with_imatrix(src_gguf, dst, type, imatrix) llama-quantize --imatrix
    export_gguf_imatrix(src, out_dir, types, manifest)  the `python -m export gguf --imatrix` path

The importance matrix itself can also come from the PyTorch checkpoint (export.gguf.imatrix_torch: what
the export path uses, so a tied output head can get an entry too); the file format and the
calibration text are export.gguf.imatrix_format's, shared by both.

The calibration text that ships (`training/assets/calibration/calibration_bn.txt`) is original
writing, disjoint from the training corpus and from `training/assets/eval/heldout_bn.txt`, so the
KL measured on the held-out file is not flattered by calibrating on it.

Files are written to a temporary name and renamed into place only when the tool succeeded, so a
failure never leaves a partial file and an existing file is replaced only with `force`.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from export import ExportError
from export.gguf.imatrix_format import (
    DEFAULT_CHUNK_TOKENS,
    IMATRIX_SUFFIX,
    check_imatrix,
    check_model,
    imatrix_entries,
    imatrix_path,
    mean_squares,
    read_calibration,
)
from export.gguf.imatrix_torch import torch_imatrix
from export.gguf.llama_tools import run_tool
from export.manifest import made_folder
from training.runfiles import layout
from training.runfiles.file_ops import Input, check_apart

CALIBRATION_DIR = Path(__file__).resolve().parents[1] / "training" / "assets" / "calibration"
DEFAULT_CALIBRATION = CALIBRATION_DIR / "calibration_bn.txt"
# the check against a plain twin scores both files here: original Bangla, disjoint from the calibration
HELDOUT_TEXT = Path(__file__).resolve().parents[1] / "training" / "assets" / "eval" / "heldout_bn.txt"
# Types that quantize_with_imatrix accepts: the K-quants and IQ types an imatrix improves (legacy
# Q8_0/F16 gain nothing and are quantized without one).
IMATRIX_TYPES = ("Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K",
                 "IQ4_XS", "IQ4_NL", "IQ3_S", "IQ3_M", "IQ3_XXS", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS")
TOOL_TIMEOUT_S = 3600


def _normalized_copy(text: Path, tmp_dir: Path) -> Path:
    """llama-imatrix tokenizes the file's bytes as they are; every prodip path tokenizes NFC text."""
    body = read_calibration(text)
    out = tmp_dir / text.name  # llama-imatrix records this name in imatrix.datasets
    out.write_text(body, encoding="utf-8")
    return out


def compute_imatrix(model: Path, text: Path, out: Path, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                    threads: int | None = None, force: bool = False) -> Path:
    """Run llama-imatrix on `model` (an F32/F16 llama GGUF) over `text`; write `out` (GGUF format)."""
    model, text, out = Path(model), Path(text), Path(out)
    check_model(model)
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



def quantize_with_imatrix(src: Path, dst: Path, type_name: str, imatrix: Path, *, threads: int | None = None,
                          force: bool = False, embedding_type: str | None = None) -> Path:
    """`llama-quantize --imatrix IMATRIX SRC DST TYPE`, after check_imatrix, through the binding's
    llama_model_quantize: the same llama.cpp call the tool makes (its main() only loads the file
    into llama_model_imatrix_data), so no tool build is needed to quantize."""
    import ctypes

    from export.gguf.gguf_export import _llama_cpp, quantize_params

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
    from export.gguf.gguf_export import quantize_gguf
    from serving.backends.llamacpp_backend import LlamaCppBackend
    from training.model.logprobs import kl_rows

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
    """The `python -m export gguf RUN --imatrix [TEXT]` path: F32/F16 as usual (export.gguf.gguf_export), the
    imatrix computed on the F32 base over `text`, every K/IQ type quantized with it. Written files
    are recorded in the manifest with the imatrix and its calibration text; returns every path
    written (the imatrix file included)."""
    from export.gguf.gguf_export import (
        DIRECT_TYPES,
        canonical_type,
        export_gguf,
        gguf_path,
        inspect_gguf,
        write_gguf,
    )

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

    from training.runfiles.cli_harness import ArgumentParser
    from training.runfiles.schema import PositiveInt, SchemaError, flag, one_of

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
    from training.runfiles.cli_harness import run_main

    def run(args) -> None:
        if args.command == "compute":
            check_apart("--out", args.out, [Input("MODEL", args.model), Input("--text", args.text)], ExportError)
            out = compute_imatrix(args.model, args.text, args.out, chunk_tokens=args.chunk, threads=args.threads,
                                  force=args.force)
            print(f"wrote {out} ({len(imatrix_entries(out))} weights)")
        else:
            check_apart("DST", args.dst, [Input("SRC", args.src), Input("--imatrix", args.imatrix)], ExportError)
            out = quantize_with_imatrix(args.src, args.dst, args.type, args.imatrix, threads=args.threads,
                                        force=args.force)
            print(f"wrote {out}")

    return run_main(build_parser(), argv, run)


if __name__ == "__main__":
    raise SystemExit(main())
