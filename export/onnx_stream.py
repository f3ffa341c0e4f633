"""python -m export.onnx_stream RUN_DIR|CHECKPOINT_DIR [--out DIR] [--step N] [--force] [--int8] [--int4] [--no-check]

The ONNX export alone: export.onnx.onnx_export's streamed export into one folder (default RUN_DIR/export/onnx),
without the manifest, the card or the parity run that `python -m export onnx` adds. Kept as its own
command for the export benchmark (tests/benchmarks/bench_export.py), which measures the exporter's
time and peak RSS without parity in the same process.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from export.onnx.onnx_export import OnnxExportError, export_onnx
from serving.backends.onnxrt_backend import CONFIG_FILE
from training.runfiles import layout


def build_parser() -> argparse.ArgumentParser:
    from training.runfiles.cli_harness import ArgumentParser
    from training.runfiles.schema import NonNegInt, flag

    ap = ArgumentParser(prog="python -m export.onnx_stream", description=__doc__.split("\n\n")[1])
    ap.add_argument("path", type=Path)
    ap.add_argument("--out", type=Path, help="ONNX folder (default RUN_DIR/export/onnx)")
    ap.add_argument("--step", type=flag(NonNegInt))
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--int8", action="store_true")
    ap.add_argument("--int4", action="store_true")
    ap.add_argument("--no-check", action="store_true", help="skip the ONNX Runtime vs PyTorch check")
    ap.add_argument("--debug", action="store_true")
    return ap


def is_onnx_folder(folder: Path) -> bool:
    """New, empty, or marked by the onnx_config.json an export of ours writes: never a user's folder
    of unrelated files (decided from our marker, not from the names of the files we would write)."""
    return not folder.exists() or (folder / CONFIG_FILE).is_file() or (folder.is_dir() and not any(folder.iterdir()))


def main(argv: list[str] | None = None) -> int:
    from export.manifest import default_out_dir, load_source, made_folder
    from training.runfiles.cli_harness import run_main
    from training.runfiles.file_ops import Input, check_apart

    def run(args) -> None:
        if args.out is not None and args.out.exists() and not args.out.is_dir():
            raise OnnxExportError(f"--out {args.out}: exists and is not a folder")
        if args.out is not None and not args.force and not is_onnx_folder(args.out):
            raise OnnxExportError(f"--out {args.out}: holds files but no {CONFIG_FILE}, so it is not a prodip ONNX "
                                  "folder; use a new or empty folder, or --force to write into it (nothing was written)")
        src = load_source(args.path, args.step)
        out = args.out or default_out_dir(src) / layout.ONNX_DIR
        run_dir = src.run_dir  # never write where it reads (RUN/export/onnx is the run's own)
        check_apart("--out", out, [Input("CHECKPOINT_DIR", src.path), Input("RUN_DIR", run_dir, out_inside_ok=True),
                                   Input("RUN_DIR", run_dir and run_dir / layout.CHECKPOINTS)], OnnxExportError)
        t0 = time.perf_counter()
        with made_folder(out):  # a failed export leaves no empty --out behind
            paths = export_onnx(src, out, int8=args.int8, int4=args.int4, force=args.force, check=not args.no_check)
        for p in paths:
            print(f"wrote {p} ({p.stat().st_size / 2**20:.1f} MiB)")
        print(f"  in {time.perf_counter() - t0:.1f} s")

    return run_main(build_parser(), argv, run)


if __name__ == "__main__":
    raise SystemExit(main())
