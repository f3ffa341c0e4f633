"""Evaluate exported files (GGUF through llama.cpp, ONNX through onnxruntime) with training's metrics.

    python -m export.evaluate FILE [FILE ...] [--reference RUN_OR_CHECKPOINT] [--text FILE ...] [--mc FILE ...]

Each FILE is opened with `serving.load` (so any backend serving knows: .gguf, .onnx, a run folder),
a `training.model.runner.Runner`, wrapped by the evaluator's one adapter `training.evaluate.RunnerScorer`
(`training.model.logprobs.log_softmax` of the backend's logits, batched where the backend batches) and scored exactly as `python -m training.evaluate` scores checkpoints: NLL/token, bits per
byte and per character by language, multiple-choice accuracy. With --reference the PyTorch checkpoint
(a `serving.backends.torch_backend.TorchBackend`) is scored too and every file gets deltas against it, so
quantization loss reads as a bits-per-byte and accuracy delta. Writes eval.json, eval.md, eval.png
(RUN/export/eval by default) and a section of RUN/export/README.md when it exists.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import serving
from serving.backends.llamacpp_backend import read_gguf_info
from serving.backends.torch_backend import TorchBackend
from serving.flags import backend_name
from training.evaluate import (
    OUTPUT_FILES,
    EvalError,
    RunnerScorer,
    add_common_args,
    build_request,
    check_common_args,
    evaluate_model,
    make_report,
    read_inputs,
    render_markdown,
    update_card,
    write_outputs,
)
from training.runfiles.cli_harness import ArgumentParser, run_main
from training.runfiles.file_ops import Input, check_apart
from training.runfiles.layout import CARD, EXPORT
from training.runfiles.schema import PositiveInt, flag
from training.store.urls import local_text

CARD_MARKER = "eval-export"  # a card section of its own, beside training.evaluate's
REFERENCE_NAME = "torch (reference)"


def trained_context(path: Path) -> int | None:
    """`<arch>.context_length` of a GGUF file (None for other files): the context the model was trained
    with, which llama.cpp may round up (to 256) although positions beyond it were never trained. Read by
    serving's one GGUF metadata reader, so a damaged file is its one line (ServingError), not a traceback."""
    if path.suffix != ".gguf":
        return None
    return read_gguf_info(path).context_length


def load_kwargs(path: Path, backend: str | None, n_ctx: int | None, threads: int | None) -> dict:
    """serving.load keyword arguments: every backend takes threads; llama.cpp also n_ctx."""
    kw: dict = {}
    if n_ctx and serving.runtime_name(path, backend) == "llama.cpp":
        kw["n_ctx"] = n_ctx
    if threads:
        kw["threads"] = threads
    return kw


def default_out(files: Sequence[Path]) -> tuple[Path, Path | None]:
    """(output folder, model card or None): RUN/export/eval and RUN/export/README.md for files under an export folder."""
    first = files[0].resolve()
    for parent in [first, *first.parents]:
        if parent.name == EXPORT and parent.is_dir():
            return parent / "eval", parent / CARD
    return (first if first.is_dir() else first.parent) / "eval", None


def run_cli(args: argparse.Namespace) -> int:
    check_common_args(args)
    files = [Path(f) for f in args.files]
    missing = [f for f in files if not f.exists()]
    if missing:
        raise EvalError(f"model file not found: {missing[0]}")
    if args.reference and not Path(args.reference).exists():
        raise EvalError(f"--reference not found: {args.reference}")
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise EvalError(f"--out {args.out}: exists and is not a folder")
    if args.n_ctx:  # a context beyond the trained one is refused by value, not silently cut to it
        for f in files:
            trained = trained_context(f)
            if trained and args.n_ctx > trained:
                raise EvalError(f"--n-ctx {args.n_ctx}: beyond the context {f} was trained with ({trained} tokens)")
    req = build_request(args.text, args.mc, limit=args.limit, max_doc_chars=args.max_doc_chars, stride=args.stride)
    out_dir, card = default_out(files)
    out_dir = Path(args.out) if args.out else out_dir
    check_apart("--out", out_dir, [*(Input("FILE", f) for f in files), *read_inputs(args),
                                   Input("--reference", args.reference, out_inside_ok=True)], EvalError)
    if (out_dir / OUTPUT_FILES[0]).exists() and not args.force:
        raise EvalError(f"{out_dir / OUTPUT_FILES[0]} already exists; pass --force to overwrite or --out DIR")
    progress = not args.no_progress
    models: list[dict] = []
    if args.reference:
        ref = TorchBackend(args.reference, threads=args.threads)
        try:
            models.append(evaluate_model(RunnerScorer(ref, name=REFERENCE_NAME), req, progress=progress))
        finally:
            ref.close()
        models[-1]["path"] = str(ref.checkpoint.path)
    names: set[str] = {m["name"] for m in models}
    for f in files:
        trained = trained_context(f)
        n_ctx = min(c for c in (args.n_ctx, trained) if c) if (args.n_ctx or trained) else None
        backend = serving.load(f, args.backend, **load_kwargs(f, args.backend, n_ctx, args.threads))
        try:
            if args.n_ctx and args.n_ctx > backend.n_ctx:  # an ONNX model's context is known once it is open
                raise EvalError(f"--n-ctx {args.n_ctx}: beyond the context of {f} ({backend.n_ctx} tokens)")
            name = f.name if f.name not in names else str(f)
            names.add(name)
            provider = RunnerScorer(backend, name=name, n_ctx=min(n_ctx or backend.n_ctx, backend.n_ctx))
            result = evaluate_model(provider, req, progress=progress)
            result.update(path=str(f), backend=backend.name)
            models.append(result)
        finally:
            backend.close()
    reference = REFERENCE_NAME if args.reference else models[0]["name"]
    report = make_report("export", ", ".join(map(str, files)), models, req,
                         reference=reference if len(models) > 1 else None)
    written = write_outputs(report, out_dir, force=args.force)
    if card is not None and card.is_file() and not args.out:
        update_card(card, render_markdown(report).replace("## Evaluation", "## Evaluation of the exported files", 1),
                    marker=CARD_MARKER, force=args.force)
        written.append(card)
    print(render_markdown(report))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python -m export.evaluate", description=(
        "Score exported models (GGUF via llama.cpp, ONNX via onnxruntime) with the same metrics as "
        "training.evaluate; with --reference, deltas against the PyTorch checkpoint."))
    ap.add_argument("files", nargs="+", metavar="FILE", type=local_text, help=".gguf / .onnx files (or folders serving.load accepts)")
    ap.add_argument("--reference", default=None, metavar="RUN_OR_CHECKPOINT", type=local_text,
                    help="also score this PyTorch checkpoint and report each file's delta against it")
    ap.add_argument("--backend", default=None, type=backend_name, metavar="BACKEND",
                    help=f"force a serving backend: {', '.join(serving.RUNTIMES)} (default: from the file)")
    ap.add_argument("--n-ctx", type=flag(PositiveInt), default=None,
                    help="scoring context (default: the model's trained context)")
    ap.add_argument("--threads", type=flag(PositiveInt), default=None,
                    help="CPU threads per backend (1 is fastest on a busy machine: llama.cpp threads spin)")
    add_common_args(ap)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(build_parser(), argv, run_cli)  # EvalError, ServingError, ... are ValueErrors


if __name__ == "__main__":
    sys.exit(main())
