"""`python -m training.evaluate RUN_OR_CHECKPOINT [--text FILE ...] [--mc FILE_OR_DIR ...] [--limit N]`

Scores a checkpoint and its random-init twin (bits per byte, multiple choice, and the well-formedness
of greedy answers to --prompts, the demo's examples by default); writes eval.json, eval.md and eval.png (RUN/eval by
default) and, for a run, a section of the model card RUN/export/README.md when that file exists.
A run started with `train.py --init-from` is also judged against its base (training.evaluate.against_base: the
base's and the extended-but-untrained model's bits per byte beside the model's; --base, --no-base).
`add_common_args`/`check_common_args` are shared with `python -m export.evaluate`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import torch
from pydantic import Field

from training.checkpoint.checkpoint_io import load_model
from training.evaluate.against_base import CONTINUED, AgainstBase, base_spec
from training.evaluate.eval_report import (
    OUTPUT_FILES,
    make_report,
    render_markdown,
    update_card,
    write_outputs,
)
from training.evaluate.generate import GEN_TOKENS, PROMPTS, read_prompts
from training.evaluate.providers import EvalError, RunnerScorer
from training.evaluate.request import build_request, evaluate_model
from training.evaluate.text_scores import ALL, MAX_DOC_CHARS
from training.evaluate.twin import TWIN_MARGIN, TWIN_SEED, make_twin, twin_result
from training.model.runner import TransformerRunner
from training.prepare.decontam import status_for
from training.runfiles import layout
from training.runfiles.cli_harness import ArgumentParser, run_main
from training.runfiles.file_ops import Input, check_apart
from training.runfiles.gate_results import GateResult
from training.runfiles.schema import NonNegFloat, NonNegInt, PositiveInt, Seed, check, flag
from training.store.urls import local_text
from training.train_config import Device

EVAL_DIR = layout.EVAL_DIR  # RUN/eval holds a checkpoint's OUTPUT_FILES
PROMPT_FORMATS = ("auto", "chat", "plain")  # auto: chat for an SFT run, plain text otherwise
MAX_GEN_TOKENS = 1 << 16  # refused at parse time; the model's own context is checked once it is read
GenTokens = Annotated[int, Field(ge=0, le=MAX_GEN_TOKENS)]


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """Options shared with `python -m export.evaluate`."""
    ap.add_argument("--text", nargs="+", default=[], metavar="FILE", type=local_text,
                    help='UTF-8 text files for bits per byte (.json/.jsonl: records with a "text" field)')
    ap.add_argument("--mc", nargs="+", default=[], metavar="FILE", type=local_text,
                    help="multiple-choice files (llm-foundry JSONL, Winogrande, HellaSwag, Okapi ARC) or folders of them")
    ap.add_argument("--limit", type=flag(PositiveInt), default=None, metavar="N",
                    help="at most N items per multiple-choice file and N text documents")
    ap.add_argument("--out", default=None, metavar="DIR", type=local_text, help="where eval.json/eval.md/eval.png go")
    ap.add_argument("--force", action="store_true", help="overwrite earlier results and the card section")
    ap.add_argument("--max-doc-chars", type=flag(PositiveInt), default=MAX_DOC_CHARS, help="document size for text scoring")
    ap.add_argument("--stride", type=flag(PositiveInt), default=None, help="window stride for long documents (default n_ctx/2)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")


def check_common_args(args: argparse.Namespace) -> None:
    if args.limit is not None and args.limit < 1:
        raise EvalError(f"--limit must be >= 1, got {args.limit}")
    if args.max_doc_chars < 1:
        raise EvalError(f"--max-doc-chars must be >= 1, got {args.max_doc_chars}")


def read_inputs(args: argparse.Namespace) -> list[Input]:
    """The --text and --mc files, which --out must not be, hold or lie in (training.runfiles.file_ops.check_apart)."""
    return [*(Input("--text", t) for t in args.text), *(Input("--mc", m) for m in args.mc)]


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python -m training.evaluate", description=(
        "Evaluate a trained checkpoint: NLL/token, bits per byte and per character by language, beside the "
        "random-init twin, multiple-choice accuracy, and the Bengali well-formedness of greedy answers."))
    ap.add_argument("path", type=local_text, help="a run folder (its newest checkpoint) or a checkpoint folder")
    ap.add_argument("--step", type=flag(NonNegInt), default=None, help="a specific checkpoint step of the run")
    add_common_args(ap)
    ap.add_argument("--device", default=None, help="torch device: auto, cpu, cuda, cuda:N or mps (default: cuda if available, else cpu)")
    ap.add_argument("--no-twin", action="store_true", help="skip the random-init twin")
    ap.add_argument("--twin-mc", action="store_true", help="also score multiple choice with the twin")
    ap.add_argument("--twin-seed", type=flag(Seed), default=TWIN_SEED)
    ap.add_argument("--margin", type=flag(NonNegFloat), default=TWIN_MARGIN, help="twin gate margin, nats/token")
    ap.add_argument("--prompts", default=None, metavar="FILE", type=local_text,
                    help="prompts (one per line) answered greedily and scored for Bengali well-formedness "
                         "(default with --text/--mc: training/assets/chat/prompts_bn.txt, the demo's examples)")
    ap.add_argument("--gen-tokens", type=flag(GenTokens), default=GEN_TOKENS, metavar="N",
                    help=f"new tokens per answer, fewer than the model's context (at most {MAX_GEN_TOKENS}); "
                         "0 skips generation")
    ap.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="auto",
                    help="chat template or plain continuation (auto: chat for an SFT run)")
    ap.add_argument("--fail-on-gate", action="store_true", help="exit 1 when the twin gate fails")
    ap.add_argument("--base", default=None, metavar="FOLDER", type=local_text,
                    help="the Hugging Face folder the run started from (default: run.json's init_from); its "
                         "bits/byte, and the extended-but-untrained model's, go beside the model's (docs/init_from.md)")
    ap.add_argument("--no-base", action="store_true", help="skip the comparison with an --init-from run's base")
    return ap


def decontamination_of(run_dir: Path | None, eval_paths: Sequence[str]) -> dict[str, str]:
    """Per eval file: was it checked against this run's pretraining data (training.prepare's report)?
    A contaminated score looks like success, so the report says it beside every score."""
    report = layout.pretraining_data_report(run_dir) if run_dir is not None else None
    if report is None:
        return {str(p): "unknown (no data report for this run)" for p in eval_paths}
    return {str(p): status_for(report, p) for p in eval_paths}


def eval_files(req) -> list[str]:
    """Every file scored: the --text files and each multiple-choice file (folders expanded)."""
    return [*map(str, req.text_files), *(str(path) for _, path, _, _ in req.mc_sets)]


def prompt_format(choice: str, run_dir: Path | None) -> bool:
    """True for the chat template: asked for, or (auto) the checkpoint belongs to an SFT run."""
    if choice != "auto":
        return choice == "chat"
    run_cfg = layout.read_run_config(run_dir) if run_dir is not None else None
    return bool(run_cfg) and run_cfg.get("kind") == "sft"


def check_places(args: argparse.Namespace) -> None:
    """Names and places before any file is read: --device, an --out that is a file, the model path
    when nothing else would be read first (so the first error names what is wrong)."""
    if args.device is not None:
        check(Device, args.device, "--device")
    if args.base and args.no_base:
        raise EvalError("--base and --no-base: give one")
    if args.base and not Path(args.base).is_dir():  # named before anything else is read
        raise EvalError(f"--base {args.base}: no such folder")
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        raise EvalError(f"--out {args.out} is a file, not a folder")
    if not (args.text or args.mc or args.prompts is not None) and not Path(args.path).exists():
        raise EvalError(f"not found: {args.path}")


def run_cli(args: argparse.Namespace) -> int:
    check_common_args(args)
    check_places(args)
    wanted = args.prompts is not None or args.text or args.mc
    prompts = read_prompts(args.prompts or PROMPTS) if wanted and args.gen_tokens > 0 else []
    run_dir = layout.run_dir_of(args.path)
    run_cfg = layout.read_run_config(run_dir) if run_dir is not None else None
    req = build_request(args.text, args.mc, limit=args.limit, max_doc_chars=args.max_doc_chars, stride=args.stride,
                        prompts=prompts, gen_tokens=args.gen_tokens, chat=prompt_format(args.prompt_format, run_dir))
    device = args.device if args.device not in (None, "auto") else ("cuda" if torch.cuda.is_available() else "cpu")
    model, ck = load_model(Path(args.path), args.step, device=device)
    if prompts and args.gen_tokens >= ck.config.max_seq_len:  # else silently cut at the context's end
        raise EvalError(f"--gen-tokens {args.gen_tokens}: the model's context is {ck.config.max_seq_len} tokens, "
                        "the prompt included; give fewer")
    out_dir = Path(args.out) if args.out else (run_dir / EVAL_DIR if run_dir else None)
    if out_dir is None:
        raise EvalError(f"{args.path} is a checkpoint outside a run folder; pass --out DIR")
    model_inputs = [Input("RUN_OR_CHECKPOINT", args.path, not layout.is_checkpoint_dir(Path(args.path))),
                    Input("RUN_OR_CHECKPOINT", run_dir, True),  # RUN/eval, the default, is inside it
                    Input("RUN_OR_CHECKPOINT", run_dir and run_dir / layout.CHECKPOINTS)]
    check_apart("--out", out_dir, [*read_inputs(args), *model_inputs, Input("--prompts", args.prompts),
                                   Input("--base", args.base)], EvalError)
    if (out_dir / OUTPUT_FILES[0]).exists() and not args.force:  # fail before minutes of scoring
        raise EvalError(f"{out_dir / OUTPUT_FILES[0]} already exists; pass --force to overwrite or --out DIR")
    spec = None if args.no_base else base_spec(run_cfg, args.base, run_dir and layout.run_config_path(run_dir))
    data = str(((run_cfg or {}).get("train") or {}).get("data") or "of the run")
    against = AgainstBase(spec, ck.tokenizer, data) if spec and req.docs else None  # checked before any scoring
    progress = not args.no_progress
    models = [evaluate_model(RunnerScorer(TransformerRunner(model, ck.tokenizer, name=CONTINUED)), req, progress=progress)]
    gates: list[GateResult] = []
    if not args.no_twin and req.docs:
        twin = RunnerScorer(TransformerRunner(make_twin(ck.config, args.twin_seed, device), ck.tokenizer, name="twin"))
        models.append(evaluate_model(twin, req, mc=args.twin_mc, progress=progress))
        m, t = models[0]["lm"][ALL], models[1]["lm"][ALL]
        gates.append(twin_result(m["nll_per_token"], t["nll_per_token"], m["tokens"], margin=args.margin,
                                 seed=args.twin_seed, what="text"))
    extra = {"step": ck.state.get("step"), "twin_seed": args.twin_seed,
             "decontamination": decontamination_of(run_dir, eval_files(req))}
    if against is not None:
        models += against.score(req, device, progress=progress)
        extra["init_from"] = against.summary(models)
    report = make_report("checkpoint", str(ck.path), models, req, gates=gates,
                         reference=CONTINUED if len(models) > 1 else None, extra=extra)
    written = write_outputs(report, out_dir, force=args.force)
    card = run_dir / layout.EXPORT / layout.CARD if run_dir else None
    if card is not None and card.is_file():
        update_card(card, render_markdown(report), force=args.force)
        written.append(card)
    print(render_markdown(report))
    print("wrote " + ", ".join(str(p) for p in written))
    return 1 if args.fail_on_gate and any(not g.passed for g in gates) else 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(build_parser(), argv, run_cli)  # EvalError, CheckpointError, ... are ValueErrors
