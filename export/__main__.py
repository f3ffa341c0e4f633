"""python -m export {safetensors,onnx,gguf,all,parity,web} RUN_DIR|CHECKPOINT_DIR [--out DIR] [--step N] [--force]
   python -m export verify EXPORT_DIR   (every file against manifest.json's sha256: export.verify)

Writes under RUN_DIR/export/ by default (hf/, onnx/, gguf/, manifest.json, README.md) and prints what
it wrote, with sizes. Every export ends with a parity run against the PyTorch checkpoint (parity.json,
parity.md, the card's table); the command exits 1 when a parity threshold is breached, 2 on bad input.
RUN_DIR may be a run's store URL (s3://BUCKET/RUN): exported from its cache and, once parity passed,
written back to URL/export/ (export.writeback).

GGUF types: --f32 --f16 --q8 (Q8_0) --q4 (Q4_K_M) and --type NAME for any llama.cpp file type
(default: F16, Q8_0 and Q4_K_M); --imatrix [TEXT] quantizes K/IQ types with llama.cpp's importance matrix. ONNX: fp32 always, plus --int8 / --int4;
--genai adds the files ONNX Runtime GenAI opens (onnx/genai/<variant>/).
Parity thresholds: --threshold KIND.METRIC=VALUE (e.g. llama.cpp-Q4_K_M.kl=0.08), see export.parity.native_parity.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from export import ExportError
from export.manifest import (
    Manifest,
    Source,
    default_out_dir,
    human_size,
    is_export_folder,
    load_source,
    made_folder,
)
from export.parity.arm_parity import arm_results, check_arm_flag
from export.parity.browser_parity import add_browser_flag, check_browser_flag, with_browser_rows
from export.web.web_export import add_web_flags, web_after_all, web_command
from training.runfiles import layout
from training.runfiles.cli_harness import ArgumentParser, run_main
from training.runfiles.file_ops import Input, check_apart
from training.runfiles.schema import NonNegInt, PositiveInt, flag
from training.store.urls import local_path

if TYPE_CHECKING:
    from training.store.remote_run import Remote

COMMANDS = ("safetensors", "onnx", "gguf", "all", "parity", "verify", "web")
DEFAULT_GGUF = ("F16", "Q8_0", "Q4_K_M")
IMATRIX_DEFAULT_TEXT = Path("-")  # `--imatrix` without a value: export.imatrix.DEFAULT_CALIBRATION
EXIT_PARITY = 1  # files written, a parity threshold breached (bad input exits 2 through training.runfiles.cli_harness)
MAX_NEW_TOKENS = 4096  # greedy parity continuations: far beyond any context we export


def _path_or_url(text: str) -> Path | str:
    """A store URL stays a string (Path would fold `s3://` into `s3:/`); training.store.remote_run pulls it."""
    from training.store.remote_run import is_url

    return text if is_url(text) else Path(text)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m export", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=COMMANDS)
    p.add_argument("path", type=_path_or_url, metavar="RUN_DIR|CHECKPOINT_DIR",
                   help="a local folder, or a run's store URL (s3://BUCKET/PREFIX/RUN: its newest committed checkpoint "
                        "is pulled into ~/.cache/prodip/runs/, exported there and, once parity passed, "
                        "uploaded to URL/export/ (export.writeback); --out DIR: only to DIR)")
    p.add_argument("--out", type=local_path, help="export folder (default RUN_DIR/export)")
    p.add_argument("--step", type=flag(NonNegInt), help="checkpoint step (default: the newest complete one)")
    p.add_argument("--force", action="store_true", help="overwrite existing exports (and a URL's URL/export/)")
    g = p.add_argument_group("gguf")
    g.add_argument("--f32", action="store_true")
    g.add_argument("--f16", action="store_true")
    g.add_argument("--q8", action="store_true", help="Q8_0")
    g.add_argument("--q4", action="store_true", help="Q4_K_M")
    g.add_argument("--type", action="append", default=[], metavar="NAME", help="any llama.cpp file type, e.g. Q5_K_M")
    g.add_argument("--threads", type=flag(PositiveInt), default=None, help="quantizer threads (default: all cores)")
    g.add_argument("--merge", action="store_true",
                   help="an adapter run (sft.py --lora-rank): one GGUF per type with the adapter merged into the "
                        "base, instead of the base's GGUF files plus the adapter as a LoRA GGUF")
    g.add_argument("--imatrix", nargs="?", type=local_path, const=IMATRIX_DEFAULT_TEXT, default=None, metavar="TEXT",
                   help="quantize K/IQ types with an importance matrix (llama-imatrix's statistic, computed "
                        "from the checkpoint) on TEXT (default: the shipped Bangla calibration text)")
    o = p.add_argument_group("onnx")
    o.add_argument("--int8", action="store_true")
    o.add_argument("--int4", action="store_true")
    o.add_argument("--genai", action="store_true",
                   help="also write onnx/genai/<variant>/ for ONNX Runtime GenAI (genai_config.json, tokenizer.json)")
    q = p.add_argument_group("parity")
    q.add_argument("--no-parity", action="store_true", help="skip the parity run after exporting")
    q.add_argument("--threshold", action="append", default=[], metavar="KIND.METRIC=VALUE")
    q.add_argument("--new-tokens", type=flag(PositiveInt), default=None,
                   help=f"greedy continuation length (default 16, at most {MAX_NEW_TOKENS})")
    q.add_argument("--texts", type=local_path, help="extra texts (one per line) for tokenizer parity")
    q.add_argument("--arm", action="store_true", help="also run each GGUF on llama.cpp's aarch64 kernels (docs/arm.md)")
    add_browser_flag(q)
    add_web_flags(p)
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def gguf_types(args: argparse.Namespace) -> list[str]:
    flags = [t for f, t in (("f32", "F32"), ("f16", "F16"), ("q8", "Q8_0"), ("q4", "Q4_K_M")) if getattr(args, f)]
    return flags + list(args.type) or list(DEFAULT_GGUF)


def _report(paths: list[Path], t0: float) -> None:
    for p in paths:
        print(f"wrote {p} ({human_size(p.stat().st_size)})")
    print(f"  in {time.perf_counter() - t0:.1f} s")


def export_onnx_files(src: Source, out: Path, manifest: Manifest, args: argparse.Namespace) -> list[Path]:
    from export.onnx.onnx_export import export_onnx  # imported only when asked for: onnx is heavy
    from serving.backends.onnxrt_backend import VARIANT_FILES

    onnx_dir = out / layout.ONNX_DIR
    paths = export_onnx(src, onnx_dir, int8=args.int8, int4=args.int4, force=args.force, genai=args.genai)
    by_file = {f: v for v, f in VARIANT_FILES.items()}
    for p in paths:
        if p.parent == onnx_dir:  # genai/ holds hard links to these files and GenAI's own config: not parity's
            manifest.add(p, "onnx", by_file.get(p.name, p.suffix.lstrip(".")))
    return paths


def check_gates(src: Source) -> None:
    """Nothing is exported from a run whose configuration is damaged (run.json: the card and the manifest
    describe the run by it) or whose pre-flight gates failed (training.gates)."""
    from training.gates import require_passed

    if src.run_dir is None:
        return
    layout.read_run_config(src.run_dir)  # LayoutError naming run.json when it is damaged
    if (src.run_dir / layout.GATES).is_file():
        require_passed(src.run_dir)
    else:
        print(f"warning: {src.run_dir} has no {layout.GATES}: its pre-flight gates were never recorded", file=sys.stderr)


def planned_files(src: Source, out: Path, args: argparse.Namespace) -> list[Path]:
    """Every file the export command will write (besides manifest, card and Modelfiles, which are merged)."""
    files: list[Path] = []
    if args.command in ("safetensors", "all"):
        from export.hf.hf_export import WEIGHTS_FILE

        files.append(out / layout.HF_DIR / WEIGHTS_FILE)
    if args.command in ("onnx", "all"):
        from export.onnx.onnx_export import planned_outputs

        files += planned_outputs(out / layout.ONNX_DIR, args.int8, args.int4)
        if args.genai:
            from export.onnx.genai import GENAI_DIR

            files.append(out / layout.ONNX_DIR / GENAI_DIR)
    if args.command in ("gguf", "all"):
        from export.gguf.gguf_export import canonical_type, gguf_path

        files += [gguf_path(out, src, canonical_type(t)) for t in gguf_types(args)]
        if args.imatrix is not None:
            from export.imatrix import imatrix_path

            files.append(imatrix_path(out, src.name))
    return files


def check_out(src: Source, out: Path, args: argparse.Namespace) -> Manifest:
    """The export folder's manifest, once nothing in the way of writing is left: --out is a folder (or
    absent), its manifest is readable and of this checkpoint (or --force), and no file the command
    writes exists (or --force). `python -m export all` must not write hf/ and then refuse onnx/."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out}: exists and is not a folder")
    manifest = Manifest.open(out, src, force=args.force)
    existing = [p for p in planned_files(src, out, args) if p.exists()]
    if existing and not args.force:
        raise ExportError(f"{existing[0]} exists; use --force to overwrite (nothing was written)")
    if not args.force and not is_export_folder(out):  # a user's folder: its README.md is not our card
        raise ExportError(f"--out {out}: holds files but no {layout.MANIFEST}, so it is not a prodip export folder; "
                          "use a new or empty folder, or --force to write into it (nothing was written)")
    return manifest


def write_exports(src: Source, out: Path, manifest: Manifest, args: argparse.Namespace) -> Manifest:
    """Every requested format into `out`, each recorded in the manifest as soon as it is written. The
    manifest is written first (it marks the folder as prodip's); a command that fails before any
    export is recorded takes its manifest and the folders it made away again."""
    marked = (out / layout.MANIFEST).is_file()
    with made_folder(out):
        manifest.save()
        try:
            return _write_exports(src, out, manifest, args)
        except BaseException:
            if not marked and not manifest.data["files"]:
                (out / layout.MANIFEST).unlink(missing_ok=True)
            raise


def _write_exports(src: Source, out: Path, manifest: Manifest, args: argparse.Namespace) -> Manifest:
    if args.command in ("safetensors", "all"):
        from export.hf.hf_export import export_hf

        t0 = time.perf_counter()
        _report(export_hf(src, out, manifest, force=args.force), t0)
        manifest.save()
    if args.command in ("onnx", "all"):
        t0 = time.perf_counter()
        _report(export_onnx_files(src, out, manifest, args), t0)
        manifest.save()
    if args.command in ("gguf", "all"):
        from export.gguf.gguf_export import export_gguf
        from export.gguf.modelfile import write_modelfiles

        t0 = time.perf_counter()
        if args.imatrix is not None:
            from export.imatrix import DEFAULT_CALIBRATION, export_gguf_imatrix

            text = DEFAULT_CALIBRATION if args.imatrix == IMATRIX_DEFAULT_TEXT else args.imatrix
            paths = export_gguf_imatrix(src, out, gguf_types(args), manifest, text=text, force=args.force,
                                        nthread=args.threads)
        else:
            paths = export_gguf(src, out, gguf_types(args), manifest, force=args.force, nthread=args.threads)
        _report(paths, t0)
        for rel, e in manifest.files("gguf").items():
            for f in e.get("fallbacks", []):
                print(f"warning: {rel}: {f['tensor']} (width {f['width']}) stored as {f['type']}, not {e['type']}")
        ggufs = {e["type"]: out / rel for rel, e in manifest.files("gguf").items() if (out / rel).is_file()}
        for p in write_modelfiles(ggufs, src.config.max_seq_len):
            print(f"wrote {p}")
    print(f"wrote {manifest.save()}")
    return manifest


def read_texts(path: Path | None) -> list[str]:
    """--texts: UTF-8 lines, or an error naming the file."""
    if path is None:
        return []
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ExportError(f"--texts file not found: {path}") from None
    except IsADirectoryError:
        raise ExportError(f"--texts {path}: is a folder, not a text file") from None
    except UnicodeDecodeError as e:
        raise ExportError(f"--texts {path}: not UTF-8 text (byte {e.start})") from None


def check_options(args: argparse.Namespace) -> None:
    """Every option and input file that can be checked without the checkpoint: bad flags fail at once."""
    from export.parity.native_parity import parse_thresholds

    if args.new_tokens is not None and args.new_tokens > MAX_NEW_TOKENS:
        raise ExportError(f"--new-tokens = {args.new_tokens}: at most {MAX_NEW_TOKENS}")
    parse_thresholds(args.threshold)
    check_arm_flag(args)  # with --arm, the aarch64 runner must exist before anything is written
    if args.command in ("gguf", "all"):
        from export.gguf.gguf_export import canonical_type

        for t in args.type:  # an unknown type fails before the checkpoint is read
            try:
                canonical_type(t)
            except ExportError as e:
                raise ExportError(f"--type: {e}") from None
        # no llama.cpp tool needed: the importance comes from PyTorch, the quantizer from the binding
        if args.imatrix is not None and args.imatrix != IMATRIX_DEFAULT_TEXT and not args.imatrix.is_file():
            raise ExportError(f"--imatrix calibration text not found: {args.imatrix}")


def compared_kinds(manifest: Manifest, args: argparse.Namespace) -> set[str]:
    """The parity kinds (export.parity.native_parity's threshold kinds, the backends' names) the parity run after this
    command compares: what the manifest lists already plus what the command writes."""
    from export.gguf.gguf_export import canonical_type

    kinds: set[str] = set()
    for rel, e in manifest.files().items():
        if e["format"] == "hf" and rel.endswith(layout.MODEL_WEIGHTS):
            kinds |= {"safetensors", "transformers"}
        elif e["format"] == "onnx" and rel.endswith(".onnx"):
            kinds.add(f"onnx-{e['type']}")
        elif e["format"] == "gguf" and rel.endswith(".gguf"):
            kinds.add(f"llama.cpp-{e['type']}")
    if args.command in ("safetensors", "all"):
        kinds |= {"safetensors", "transformers"}
    if args.command in ("onnx", "all"):
        kinds |= {f"onnx-{v}" for v, on in (("fp32", True), ("int8", args.int8), ("int4", args.int4)) if on}
    if args.command in ("gguf", "all"):
        kinds |= {f"llama.cpp-{canonical_type(t)}" for t in gguf_types(args)}
    return kinds


def check_threshold_kinds(manifest: Manifest, args: argparse.Namespace) -> None:
    """A --threshold that no comparison would read is refused by name, never silently ignored."""
    if not args.threshold:
        return
    if args.no_parity and args.command != "parity":
        raise ExportError(f"--threshold {args.threshold[0]}: no parity run reads it with --no-parity")
    kinds = compared_kinds(manifest, args)
    for item in args.threshold:
        kind = item.partition("=")[0].rpartition(".")[0]
        if kind not in kinds:
            raise ExportError(f"--threshold {item}: {kind} is not exported, so the parity run never compares it "
                              f"(it compares: {', '.join(sorted(kinds)) or 'nothing'}); nothing was written")


def pull_url(args: argparse.Namespace) -> Remote | None:
    """A store URL's newest committed checkpoint (or --step), pulled into its local cache (args.path set to
    it); the run's Remote when the exports are to be written back next to it (the default export folder,
    a command that writes exports), checked first: an export already there is refused without --force."""
    from training.store.remote_run import pull_run

    store = None
    if args.out is None and args.command != "parity":
        from export.writeback import open_run

        store = open_run(args.path, args.force)
    args.path = pull_run(args.path, args.step, lambda m: print(m, file=sys.stderr))
    return store


def write_back_verified(store: Remote, out: Path, src: Source, args: argparse.Namespace) -> None:
    """Only exports that passed parity go back to the store: --no-parity keeps them local, and says so."""
    if args.no_parity:
        print(f"note: not uploaded to {store.url}: only exports that passed parity are written back "
              f"(drop --no-parity); they are in {out}", file=sys.stderr)
        return
    from export.writeback import write_back

    write_back(store, out, src.step or 0, lambda m: print(m))


def inputs_of(src: Source, args: argparse.Namespace) -> list[Input]:
    """What an export reads, for check_apart: the checkpoint, its run (whose own RUN/export the default
    --out is, so an --out inside it is fine outside checkpoints/), --texts and --imatrix's text."""
    run = src.run_dir
    return [Input("CHECKPOINT_DIR", src.path), Input("RUN_DIR", run, out_inside_ok=True),
            Input("RUN_DIR", run and run / layout.CHECKPOINTS), Input("--texts", args.texts),
            Input("--imatrix", None if args.imatrix == IMATRIX_DEFAULT_TEXT else args.imatrix)]


def run(args: argparse.Namespace) -> int:
    from export.model_card import write_card
    from export.parity.native_parity import parse_thresholds, run_parity

    if args.command == "verify":
        from export.verify import run_verify

        return run_verify(args, vars(build_parser().parse_args(["verify", "EXPORT_DIR"])))
    if (code := web_command(args, vars(build_parser().parse_args(["web", "RUN"])))) is not None:  # export.web.web_export
        return code
    check_options(args)
    thresholds = parse_thresholds(args.threshold)
    extra = read_texts(args.texts)
    store = pull_url(args) if isinstance(args.path, str) else None
    from export.lora_export import export_adapter_run  # an adapter run (sft.py --lora-rank) exports there

    if (adapter := export_adapter_run(args, gguf_types(args))) is not None:
        return adapter
    src = load_source(args.path, args.step)
    check_gates(src)
    out = args.out or default_out_dir(src)
    check_apart("--out", out, inputs_of(src, args), ExportError)
    if args.browser:  # Chromium, Playwright and RUN/export/web/ before anything runs (export.parity.browser_parity)
        check_browser_flag(args.command, out)
    if args.command == "parity":
        manifest = Manifest.read(out)
        check_threshold_kinds(manifest, args)
        if manifest.data["source"]["checkpoint"] != str(src.path.resolve()):
            print(f"note: {out} holds exports of {manifest.data['source']['checkpoint']}", file=sys.stderr)
            src = load_source(manifest.data["source"]["checkpoint"])
    else:
        manifest = check_out(src, out, args)
        check_threshold_kinds(manifest, args)
        manifest = write_exports(src, out, manifest, args)
    passed = True
    if args.command == "parity" or not args.no_parity:
        kw = {"n_new": args.new_tokens} if args.new_tokens else {}
        if args.arm:  # rows "llama.cpp aarch64 (emulated)"
            kw["extra_rows"] = arm_results
        kw["extra_rows"] = with_browser_rows(kw.get("extra_rows")) if args.browser else kw.get("extra_rows")
        report = run_parity(out, src, thresholds=thresholds, extra_texts=extra,
                            progress=lambda m: print(m, file=sys.stderr), **kw)
        print(report.table())
        print(f"wrote {out / layout.PARITY_JSON} and {out / layout.PARITY_MD}")
        passed = report.passed
        if not passed:
            why = "no backend was compared" if not report.results else "parity thresholds breached"
            print(f"error: {why} (see {layout.PARITY_MD})", file=sys.stderr)
    print(f"wrote {write_card(src, out, manifest)}")
    web_after_all(args, out)  # `all --web`, after the card (the site shows it)
    if store is not None and passed:
        write_back_verified(store, out, src, args)
    return 0 if passed else EXIT_PARITY


def main(argv: list[str] | None = None) -> int:
    from training.gates import GateError

    return run_main(build_parser(), argv, run, errors=(ValueError, OSError, GateError))


if __name__ == "__main__":
    sys.exit(main())
