"""Evaluation: bits per byte, the random-init twin and multiple choice, over a log-probability provider.

Per-token NLL depends on the tokenizer (the very thing the fertility trap changes), so every language
modelling number also comes as bits per byte and per character of the normalized text. The metric
code knows no runtime: it takes a `LogProbProvider`, which `RunnerScorer` makes of any runner (the
base's `training.model.runner.Runner`: PyTorch here as `TransformerRunner`; GGUF/ONNX as the
`serving.Backend` export.evaluate opens), so quantization loss shows up as a bits-per-byte delta.

    providers.py        LogProbProvider, RunnerScorer (any Runner's logits -> log-probs), EvalError
    text_scores.py      windows, span scoring, LMStats (bits per byte/char), documents by language
    twin.py             the random-init twin and its gate
    against_base.py     an --init-from run against its base: the base and the extended-untrained model, bits/byte
    mc.py               multiple-choice formats, scoring, Wilson interval, chance
    generate.py         greedy answers to prompts, scored for Bengali well-formedness (training.text.wellformed)
    request.py          what to score, and one model scored on it
    eval_report.py      eval.json / eval.md / eval.png and the model-card section
    evaluate_cli.py     python -m training.evaluate
"""

from training.evaluate.eval_report import (
    OUTPUT_FILES,
    add_deltas,
    make_report,
    render_chart,
    render_markdown,
    update_card,
    write_outputs,
)
from training.evaluate.evaluate_cli import add_common_args, build_parser, check_common_args, main, read_inputs
from training.evaluate.generate import GEN_TOKENS, PROMPTS, Generator, generate_wellformed, read_prompts
from training.evaluate.mc import (
    SCORE_KINDS,
    MCItem,
    MCScores,
    chance_rate,
    expand_mc_paths,
    join_choice,
    load_mc,
    mc_set_name,
    parse_mc_record,
    score_mc,
    wilson_interval,
)
from training.evaluate.providers import EvalError, LogProbProvider, RunnerScorer
from training.evaluate.request import EvalRequest, build_request, evaluate_model
from training.evaluate.text_scores import (
    ALL,
    LMStats,
    Span,
    evaluate_lm,
    read_text_docs,
    score_spans,
    split_documents,
    windows,
)
from training.evaluate.twin import (
    TWIN_MARGIN,
    TWIN_SEED,
    TwinNLL,
    make_twin,
    nll_twin,
    twin_gate,
    twin_result,
)
from training.model.runner import TransformerRunner

__all__ = [
    "ALL", "GEN_TOKENS", "OUTPUT_FILES", "PROMPTS", "SCORE_KINDS", "TWIN_MARGIN", "TWIN_SEED",
    "EvalError", "EvalRequest", "Generator", "generate_wellformed", "read_prompts", "LMStats", "LogProbProvider", "MCItem", "MCScores", "RunnerScorer", "Span", "TransformerRunner", "TwinNLL",
    "add_common_args", "add_deltas", "build_parser", "build_request", "chance_rate", "check_common_args",
    "evaluate_lm", "evaluate_model", "expand_mc_paths", "join_choice", "load_mc", "main", "make_report", "make_twin",
    "mc_set_name", "nll_twin", "parse_mc_record", "read_inputs", "read_text_docs", "render_chart", "render_markdown", "score_mc",
    "score_spans", "split_documents", "twin_gate", "twin_result", "update_card", "wilson_interval", "windows",
    "write_outputs",
]
