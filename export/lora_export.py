"""`python -m export {gguf,safetensors,onnx,all,parity} ADAPTER_RUN`: the exports of an adapter run
(training/sft.py --lora-rank), written into ADAPTER_RUN/export/ (or --out):

    gguf         the base's GGUF files (F16 always, plus the asked types) and the adapter as a llama.cpp LoRA
                 GGUF (export.gguf.lora_gguf); with --merge instead one `NAME-merged-TYPE.gguf` per type, the adapter
                 folded into the weights. A base file the base run's own export holds already (same checkpoint,
                 same type, its sha256 checked against that export's manifest) is linked or copied, not
                 re-quantized; otherwise it is written here.
    safetensors  hf/ (the base, export.hf.hf_export) and hf-lora/ (the adapter in PEFT's layout, export.hf.hf_peft)
    onnx         onnx/ from the merged weights (base + adapter: ONNX has no run-time adapters)
    all          all three; parity  the comparison again, on what the folder holds

Parity (unless --no-parity) writes parity.json and parity.md as every export does (export.parity.lora_parity: the
PyTorch fp32 base + adapter as the reference), and the card (export.model_card) names the base and the adapter.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path

from export import ExportError
from export.gguf.gguf_export import canonical_type, export_gguf, gguf_path
from export.gguf.lora_gguf import (
    LORA_FILE_TYPE,
    AdapterSource,
    is_adapter,
    load_adapter_source,
    lora_path,
    merged_source,
    write_lora_gguf,
)
from export.manifest import Manifest, default_out_dir, human_size, made_folder
from training.checkpoint import checkpoint_io as ckpt
from training.runfiles import layout
from training.runfiles.file_ops import Input, check_apart, link_or_copy, save_safetensors, sha256_file


def planned(src: AdapterSource, out: Path, args: argparse.Namespace, types: list[str]) -> list[Path]:
    """Every file the command writes (checked before the first byte: nothing is overwritten without --force)."""
    from export.hf.hf_export import WEIGHTS_FILE
    from export.hf.hf_peft import planned as peft_planned

    files: list[Path] = []
    if args.command in ("safetensors", "all"):
        files += [out / layout.HF_DIR / WEIGHTS_FILE, *peft_planned(out)]
    if args.command in ("onnx", "all"):
        from export.onnx.onnx_export import planned_outputs

        files += planned_outputs(out / layout.ONNX_DIR, args.int8, args.int4)
    if args.command in ("gguf", "all"):
        if args.merge:
            files += [gguf_path(out, merged_source(src), canonical_type(t)) for t in types]
        else:
            files += [gguf_path(out, src.base, canonical_type(t)) for t in [*types, "F16"]] + [lora_path(out, src)]
    return files


def base_export(src: AdapterSource, types: list[str]) -> dict[str, tuple[Path, dict]]:
    """type -> (file, manifest entry) of the base run's own export that this export may reuse: an export of the
    same base checkpoint and tokenizer, a plain (not importance-matrix) file whose sha256 is its manifest's."""
    folder = default_out_dir(src.base)
    try:
        m = Manifest.read(folder)
    except (ExportError, layout.LayoutError):
        return {}
    if (m.data["source"].get("checkpoint") != str(src.base.path.resolve())
            or m.data.get("tokenizer_sha256") != src.base.tokenizer.sha256):
        return {}
    found = {}
    for t in types:
        p = gguf_path(folder, src.base, t)
        e = m.files("gguf").get(p.relative_to(folder).as_posix())
        if e and e.get("type") == t and "imatrix" not in e and p.is_file() and sha256_file(p) == e.get("sha256"):
            found[t] = (p, e)
    return found


def write_base_gguf(src: AdapterSource, out: Path, types: list[str], manifest: Manifest, args) -> list[Path]:
    """The base's GGUF files: reused from the base run's verified export where it has them, else written here."""
    types = list(dict.fromkeys(canonical_type(t) for t in [*types, "F16"]))
    reuse = base_export(src, types) if out.resolve() != default_out_dir(src.base).resolve() else {}
    written = []
    for t, (theirs, entry) in reuse.items():
        ours = gguf_path(out, src.base, t)
        link_or_copy(theirs, ours)
        extra = {k: v for k, v in entry.items() if k not in ("format", "type", "size", "sha256")}
        if manifest.add(ours, "gguf", t, **extra, reused_from=str(theirs))["sha256"] != entry["sha256"]:
            raise ExportError(f"{ours}: its copy of {theirs} does not match that export's sha256")
        print(f"reused {theirs} (sha256 verified against {default_out_dir(src.base) / layout.MANIFEST})")
        written.append(ours)
    rest = [t for t in types if t not in reuse]
    return written + (export_gguf(src.base, out, rest, manifest, force=args.force, nthread=args.threads) if rest else [])


def write_gguf_files(src: AdapterSource, out: Path, types: list[str], manifest: Manifest, args) -> list[Path]:
    if args.merge:
        files = export_gguf(merged_source(src), out, types, manifest, force=args.force, nthread=args.threads)
        for p in files:  # parity compares these without the adapter (export.parity.lora_parity)
            manifest.files()[p.relative_to(out).as_posix()]["merged"] = True
        return files
    bases = write_base_gguf(src, out, types, manifest, args)
    spec = src.model().lora_spec
    adapter = write_lora_gguf(src, lora_path(out, src))
    manifest.add(adapter, "gguf-lora", LORA_FILE_TYPE, rank=spec.rank, alpha=spec.alpha, base=str(src.base.path),
                 base_sha256=src.state["lora"]["base"]["sha256"])
    return [*bases, adapter]


def write_merged_onnx(src: AdapterSource, out: Path, manifest: Manifest, args) -> list[Path]:
    """onnx/ from base + adapter merged (export.onnx.onnx_export streams weights from a checkpoint's model.safetensors:
    the merged weights are written to a temporary one beside the export first)."""
    from export.onnx.onnx_export import export_onnx
    from serving.backends.onnxrt_backend import VARIANT_FILES

    merged = merged_source(src)
    tmp = out / f".merged-weights-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        save_safetensors({k: v.contiguous() for k, v in merged.weights.items()}, tmp / ckpt.MODEL_FILE)
        onnx_dir = out / layout.ONNX_DIR
        paths = export_onnx(dataclasses.replace(merged, path=tmp), onnx_dir, int8=args.int8, int4=args.int4,
                            force=args.force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    by_file = {f: v for v, f in VARIANT_FILES.items()}
    for p in paths:
        if p.name == "onnx_config.json":  # the source is the adapter checkpoint, merged: not the temporary file
            meta = json.loads(p.read_text(encoding="utf-8"))
            meta["source"] = {"checkpoint": str(src.path), "step": src.step, "merged": "base + LoRA adapter",
                              "base": str(src.base.path)}
            p.write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        if p.parent == onnx_dir:
            manifest.add(p, "onnx", by_file.get(p.name, p.suffix.lstrip(".")), merged=True)
    return paths


def write_all(src: AdapterSource, out: Path, manifest: Manifest, args, types: list[str]) -> list[Path]:
    files: list[Path] = []
    if args.command in ("safetensors", "all"):
        from export.hf.hf_export import export_hf
        from export.hf.hf_peft import write_peft_adapter

        files += export_hf(src.base, out, manifest, force=args.force)
        files += write_peft_adapter(src, out, manifest)
        manifest.save()
    if args.command in ("onnx", "all"):
        files += write_merged_onnx(src, out, manifest, args)
        manifest.save()
    if args.command in ("gguf", "all"):
        files += write_gguf_files(src, out, types, manifest, args)
    manifest.save()
    return files


def export_adapter(args: argparse.Namespace, types: list[str]) -> int:
    """The command on an adapter run: files written, parity run, card; 0, or 1 on a parity breach."""
    from export.model_card import write_card
    from export.parity.lora_parity import run_adapter_parity
    from export.parity.native_parity import parse_thresholds

    src = load_adapter_source(args.path, None)
    out = args.out or (src.run_dir or src.path) / layout.EXPORT
    run = src.run_dir  # the rule every export keeps: never write where it reads (RUN/export is its own)
    check_apart("--out", out, [Input("CHECKPOINT_DIR", src.path), Input("RUN_DIR", run, out_inside_ok=True),
                               Input("RUN_DIR", run and run / layout.CHECKPOINTS),
                               Input("the base checkpoint", src.base.path)], ExportError)
    if args.command == "parity":
        manifest = Manifest.read(out)
        if manifest.data["source"]["checkpoint"] != str(src.path.resolve()):
            raise ExportError(f"--out {out} holds exports of {manifest.data['source']['checkpoint']}, not of {src.path}")
    else:
        manifest = Manifest.open(out, src, force=args.force)
        existing = [p for p in planned(src, out, args, types) if p.exists()]
        if existing and not args.force:
            raise ExportError(f"{existing[0]} exists; use --force to overwrite (nothing was written)")
        with made_folder(out):
            manifest.save()
            for p in write_all(src, out, manifest, args, types):
                print(f"wrote {p} ({human_size(p.stat().st_size)})")
    passed = True
    if args.command == "parity" or not args.no_parity:
        report = run_adapter_parity(src, out, manifest, thresholds=parse_thresholds(args.threshold),
                                    n_new=args.new_tokens)
        print(report.table())
        print(f"wrote {out / layout.PARITY_JSON} and {out / layout.PARITY_MD}")
        if not (passed := report.passed):
            why = "no backend was compared" if not report.results else "parity thresholds breached"
            print(f"error: {why} (see {out / layout.PARITY_MD})", file=sys.stderr)
    print(f"wrote {write_card(src, out, manifest)}")
    return 0 if passed else 1


def export_adapter_run(args: argparse.Namespace, types: list[str]) -> int | None:
    """`python -m export` on an adapter run: its exit code; None for any other run (export.__main__ goes on)."""
    if not is_adapter(args.path, args.step):
        if args.merge:
            raise ExportError(f"--merge: {args.path} is not an adapter run (training/sft.py --lora-rank)")
        return None
    unsupported = [f for f, on in (("--imatrix", args.imatrix is not None), ("--step", args.step is not None),
                                   ("--genai", args.genai), ("--texts", args.texts is not None)) if on]
    if unsupported:
        raise ExportError(f"{args.path} is an adapter run: {', '.join(unsupported)} not supported for it (its newest "
                          "checkpoint is exported: the base's files plus the adapter, or merged with --merge)")
    if args.merge and args.command not in ("gguf", "all"):
        raise ExportError(f"--merge is for GGUF files (`gguf` or `all`), not `{args.command}`: hf/ + hf-lora/ keep "
                          "the adapter apart (PEFT's layout) and onnx/ is always merged")
    return export_adapter(args, types)
