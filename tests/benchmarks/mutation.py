# size: EQUIVALENT and LEFT hold one entry per set-aside mutant of every target (data); the tool is ~200 lines
"""Mutation score of the verification core: can its tests fail? (a benchmark, not a CI test)

    python tests/benchmarks/mutation.py --target schema --out /tmp/mutation

mutmut (pinned in the dev extra) changes one thing at a time in a module — `>` to `>=`, `and` to
`or`, a constant, a string, a dropped argument — and runs the tests that reach the changed function.
A mutant that no test notices ("survived") is a behaviour nothing pins. Each target below pairs the
modules with the tests that claim to check them. The run works in a copy of the repository (mutmut
rewrites the modules it mutates), so the working tree is never touched.

Some survivors cannot be killed because they change nothing observable (an equivalent mutant:
`encoding="UTF-8"` for `"utf-8"`, a default argument spelled out). EQUIVALENT lists each by its exact
change (the function, its lines before and after) with the reason, so an entry sets aside one mutant and
no other (one that matches two stops the tool); LEFT lists the survivors that are not equivalent and are
left, with why. The score is printed raw and with the equivalent ones set aside; a survivor in neither
table is counted as unexplained. A change made twice in one function (two mutants, one diff) is listed twice.
FUNCTIONS narrows a target to some functions of its modules (the read half of training/checkpoint/checkpoint_io.py).
Writes mutation.json and mutation.md (score, one row per survivor with its diff) to --out.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# target: (modules mutated, test files that claim to pin them)
TARGETS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "schema": (("training/runfiles/schema.py",), ("tests/test_config_schema.py", "tests/test_schema_rules.py")),
    # the runtime gates: test_gates.py and test_hot_path.py reach the rest of runtime.py through training runs in
    # subprocesses, which mutmut cannot see: the oracle tests call it in-process
    "arbiter": (("training/gates/runtime.py",), ("tests/test_gradient_flow_arbiter.py", "tests/test_runtime_gates_oracles.py",
                                                 "tests/test_gates.py")),
    # parity: the oracle tests and test_parity.py's two tests that need no trained model (the rest train
    # and export: minutes per mutant)
    "parity": (("export/parity/native_parity.py",), ("tests/test_parity_oracles.py", "tests/test_parity.py::test_kl_and_thresholds",
                                       "tests/test_parity.py::test_prompt_set_covers_the_hard_cases")),
    # the model pre-flight gates: oracle tests on a tiny model (test_gates.py prepares a corpus and trains)
    "gates": (("training/gates/model_gates.py", "training/gates/tolerance.py"), ("tests/test_gates_oracles.py",)),
    "gates-data": (("training/gates/data_gates.py",), ("tests/test_data_gates_oracles.py",)),
    "gates-result": (("training/runfiles/gate_results.py",), ("tests/test_gate_result_oracles.py",)),
    # the resume format: oracle tests on hand-built folders (test_crash_safety.py kills training 20 times and
    # test_safe_loading.py runs the CLI: minutes per mutant, so they are not in the selection)
    "resume": (("training/checkpoint/checkpoint_format.py",), ("tests/test_checkpoint_format_oracles.py",)),
    # the one JSON reader: its depth bound reached one level either side (json's own limit is ~1000 levels)
    "records": (("training/runfiles/json_records.py",), ("tests/test_records.py", "tests/test_records_depth.py", "tests/test_records_oracles.py",
                                           "tests/test_boundaries_2.py::test_the_records_reader_names_depth_and_"
                                           "surrogates_with_the_line")),
    # the tokenizer's fertility and balance gates on hand-built counts (test_prepare.py trains tokenizers)
    "fertility": (("training/text/fertility.py",), ("tests/test_fertility_oracles.py",)),
    "wellformed": (("training/text/wellformed.py",), ("tests/test_wellformed.py", "tests/test_wellformed_oracles.py")),
    # every KL of the project (parity, evaluation, the ONNX checks)
    "logprobs": (("training/model/logprobs.py",), ("tests/test_logprobs_oracles.py",)),
    # the runtime checks' verdict per step and the pre-flight gates' resume logic, on stand-in objects (the
    # training runs that reach them are subprocesses, which mutmut cannot see)
    "checks": (("training/loop/runtime_checks.py",), ("tests/test_checks_mutants.py",)),
    "preflight": (("training/loop/preflight_runner.py",), ("tests/test_preflight_mutants.py",)),
    # text out of a token stream, on a scripted backend (test_stream_text.py trains and exports a model)
    "text-stream": (("serving/text_stream.py",), ("tests/test_text_stream_mutants.py",)),
    # what a request body may say: the parsers called directly (test_http.py starts servers on a model)
    "http-requests": (("serving/server/http_requests.py",), ("tests/test_http_requests_mutants.py",)),
    # the checkpoint readers: checkpoint_verify.py and the read half of checkpoint_io.py (FUNCTIONS), on
    # checkpoints of an untrained tiny model written in-process (test_checkpoint_damage.py trains a run)
    "checkpoint-read": (("training/checkpoint/checkpoint_verify.py", "training/checkpoint/checkpoint_io.py"),
                        ("tests/test_checkpoint_read_mutants.py",)),
}
# a target that mutates part of a module: the mutant names it judges (globs); the others are not run
FUNCTIONS: dict[str, tuple[str, ...]] = {
    # the gates and the report they read; plot_report (the matplotlib chart beside them, no verdict) is not
    # verification and is judged by no test
    "fertility": tuple(f"training.text.fertility.x_{f}__*" for f in (
        "report_from_counts", "fertility_report", "balance_ratios", "_fmt", "fertility_gates", "format_table")),
    "checkpoint-read": ("training.checkpoint.checkpoint_verify.*", "training.checkpoint.checkpoint_io.x_unreadable_tensors__*",
                        "training.checkpoint.checkpoint_io.x_check_readable__*", "training.checkpoint.checkpoint_io.xǁShardedReaderǁ*",
                        "training.checkpoint.checkpoint_io.x_open_tensors__*", "training.checkpoint.checkpoint_io.xǁCheckpointǁ*",
                        "training.checkpoint.checkpoint_io.x_read_state__*", "training.checkpoint.checkpoint_io.x_read_config__*",
                        "training.checkpoint.checkpoint_io.x_load__*", "training.checkpoint.checkpoint_io.x_load_weights__*",
                        "training.checkpoint.checkpoint_io.x_load_model__*"),
}
# what the copy needs besides the mutated modules: every package, the tests and what they read
COPY = ("training", "serving", "export", "demo", "tests", "docs", "scripts", "README.md", "pyproject.toml")
# (function, the mutated lines as they were, as the mutant has them, why no test can tell the mutant from the
# original): each entry is one exact change (lines compared stripped, several lines joined by "\n"), so it
# sets aside that mutant and no other; one that matches two mutants stops the tool (check_entries).
EQUIVALENT: tuple[tuple[str, str, str, str], ...] = (
    ('read_toml', 'return tomllib.loads(p.read_text(encoding="utf-8"))',
     'return tomllib.loads(p.read_text(encoding="UTF-8"))',
     'codec names are case-insensitive'),
    ('first_problem', 'err = e.errors(include_url=False)[0]',
     'err = e.errors(include_url=True)[0]',
     "the url field of pydantic's error is never read"),
    ('suggest', 'near = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.6)',
     'near = difflib.get_close_matches(str(name), list(choices), n=2, cutoff=0.6)',
     'only the nearest match (near[0]) is used'),
    ('suggest', 'near = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.6)',
     'near = difflib.get_close_matches(str(name), list(choices), cutoff=0.6)',
     "n=1 dropped: difflib's default n=3 still puts the nearest first"),
    ('suggest', 'near = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.6)',
     'near = difflib.get_close_matches(str(name), list(choices), n=1, )',
     "cutoff=0.6 dropped: it is difflib's default"),
    ('discover', 'if hf_weights in manifest.files("hf"):',
     'if hf_weights in manifest.files(None):',
     'export.hf.hf_export lists hf/model.safetensors under format "hf" only, so the key is found with or without the format filter'),
    ('greedy_metrics', 'for ids, want in zip(ref.ids, ref.greedy, strict=False):',
     'for ids, want in zip(ref.ids, ref.greedy, strict=None):',
     "zip's strict defaults to False: None or no argument is strict=False"),
    ('greedy_metrics', 'same = next((i for i, (x, y) in enumerate(zip(want, got, strict=False)) if x != y), min(len(want), len(got)))',
     'same = next((i for i, (x, y) in enumerate(zip(want, got, strict=None)) if x != y), min(len(want), len(got)))',
     "zip's strict defaults to False: None or no argument is strict=False"),
    ('greedy_metrics', 'for ids, want in zip(ref.ids, ref.greedy, strict=False):',
     'for ids, want in zip(ref.ids, ref.greedy, ):',
     "zip's strict defaults to False"),
    ('greedy_metrics', 'same = next((i for i, (x, y) in enumerate(zip(want, got, strict=False)) if x != y), min(len(want), len(got)))',
     'same = next((i for i, (x, y) in enumerate(zip(want, got, )) if x != y), min(len(want), len(got)))',
     "zip's strict defaults to False"),
    ('logit_metrics', 'diff = float(np.abs(bl.astype(np.float64) - rl).max())',
     'diff = float(np.abs(bl.astype(None) - rl).max())',
     'astype(None) is float64, the dtype it replaces'),
    ('incremental_metrics', 'return {"max_abs": float(np.abs(full.astype(np.float64) - step).max()), "kl": float(kl_rows(full, step).mean())}',
     'return {"max_abs": float(np.abs(full.astype(None) - step).max()), "kl": float(kl_rows(full, step).mean())}',
     'astype(None) is float64, the dtype it replaces'),
    ('logit_metrics', 'agree += int((bl.argmax(-1) == rl.argmax(-1)).sum())',
     'agree += int((bl.argmax(+1) == rl.argmax(-1)).sum())',
     'logits are (T, V): axis 1 is axis -1'),
    ('logit_metrics', 'agree += int((bl.argmax(-1) == rl.argmax(-1)).sum())',
     'agree += int((bl.argmax(-1) == rl.argmax(+1)).sum())',
     'logits are (T, V): axis 1 is axis -1'),
    ('logit_metrics', 'bl = np.asarray(b.logits(ids), dtype=np.float32)',
     'bl = np.asarray(b.logits(ids), dtype=None)',
     "every Backend returns fp32 logits (serving.backend's contract): the cast to float32 is a no-op on them"),
    ('logit_metrics', 'bl = np.asarray(b.logits(ids), dtype=np.float32)',
     'bl = np.asarray(b.logits(ids), )',
     'every Backend returns fp32 logits: the cast is a no-op'),
    ('long_prompt', 'while len(tok.encode(text + LONG_FILLER, bos=True)) <= budget:',
     'while len(tok.encode(text + LONG_FILLER, bos=True)) < budget:',
     'one filler short, the word loop then appends the same filler word by word (words each followed by one space): the same text'),
    ('long_prompt', 'for word in LONG_FILLER.split(" "):',
     'for word in LONG_FILLER.split(None):',
     "differs only in split(' ')'s trailing empty word, reached only if a whole further filler fits, which the while loop has already added"),
    ('parse_thresholds', 'kinds: list[str] | None = None',
     'kinds: list[str] | None = ""',
     "'' and None are both falsy: `kinds or threshold_kinds()` builds the list either way"),
    ('parse_thresholds', 'key, eq, value = item.partition("=")',
     'key, eq, value = item.rpartition("=")',
     "no kind, metric or valid value holds '=': both splits refuse the same items"),
    ('run_parity', 'encoding="utf-8")',
     'encoding="UTF-8")',
     'codec names are case-insensitive'),
    ('run_parity', '(out_dir / PARITY_MD).write_text("# Parity\\n\\n" + report.markdown(), encoding="utf-8")',
     '(out_dir / PARITY_MD).write_text("# Parity\\n\\n" + report.markdown(), encoding="UTF-8")',
     'codec names are case-insensitive'),
    ('run_parity', 'encoding="utf-8")',
     'encoding=None)',
     "the locale's encoding, UTF-8 wherever the tests run"),
    ('run_parity', '(out_dir / PARITY_MD).write_text("# Parity\\n\\n" + report.markdown(), encoding="utf-8")',
     '(out_dir / PARITY_MD).write_text("# Parity\\n\\n" + report.markdown(), encoding=None)',
     "the locale's encoding, UTF-8 wherever the tests run"),
    ('run_parity', '(out_dir / PARITY_MD).write_text("# Parity\\n\\n" + report.markdown(), encoding="utf-8")',
     '(out_dir / PARITY_MD).write_text("# Parity\\n\\n" + report.markdown(), )',
     "encoding dropped: the locale's, UTF-8 wherever the tests run"),
    ('run_parity', 'encoding="utf-8")',
     ')',
     "parity.json's encoding dropped: the locale's, UTF-8 wherever the tests run"),
    ('run_parity', '(out_dir / PARITY_JSON).write_text(json.dumps(report.to_dict(), indent=2, ensure_ascii=False) + "\\n",',
     '(out_dir / PARITY_JSON).write_text(json.dumps(report.to_dict(), indent=2, ensure_ascii=None) + "\\n",',
     'None is falsy: ensure_ascii=False'),
    ('tokenizer_metrics', 'got = list(b.tokenize(text, bos=True, allow_special=special))',
     'got = list(b.tokenize(text, allow_special=special))',
     "bos=True is the Backend protocol's default"),
    ('overfit_one_batch', 'for _ in range(steps + 1):',
     'for _ in range(steps + 2):',
     "the loop leaves at `len(losses) > steps`, on range(steps + 1)'s last turn: a longer range is never reached"),
    ('overfit_one_batch', 'pending = ctx.dist.ranks_where(not done, ctx.device) if _dist_enabled(ctx) else ([] if done else [0])',
     'pending = ctx.dist.ranks_where(not done, ctx.device) if _dist_enabled(ctx) else ([] if done else [1])',
     "only the list's truth is read: [1] and [0] are both non-empty"),
    ('overfit_one_batch', 'opt.zero_grad(set_to_none=True)',
     'opt.zero_grad(set_to_none=None)',
     'zeroed instead of freed gradients: backward adds to zero, the same sums; zero_grads frees them after the loop'),
    ('overfit_one_batch', 'opt.zero_grad(set_to_none=True)',
     'opt.zero_grad(set_to_none=False)',
     'zeroed instead of freed gradients: backward adds to zero, the same sums; zero_grads frees them after the loop'),
    ('reference_model', 'missing, unexpected = ref.load_state_dict(weights, strict=False)',
     'missing, unexpected = ref.load_state_dict(weights, strict=None)',
     'load_state_dict reads strict as a truth value: None is False'),
    ('throughput', 'out.append(GateResult("throughput.mfu", True, value=None, threshold=f">= {mfu_floor:.0%}",',
     'out.append(GateResult("throughput.mfu", True, threshold=f">= {mfu_floor:.0%}",',
     "value=None is GateResult's default"),
    ('flatten_optimizer', 'g2 = {k: v for k, v in g.items() if k != "params"}',
     'g2 = {k: v for k, v in g.items() if k != "XXparamsXX"}',
     "the copied 'params' is replaced on the next line"),
    ('flatten_optimizer', 'g2 = {k: v for k, v in g.items() if k != "params"}',
     'g2 = {k: v for k, v in g.items() if k != "PARAMS"}',
     "the copied 'params' is replaced on the next line"),
    ('load', 'skipped = d.get("skipped_by_user", [])',
     'skipped = d.get("skipped_by_user", None)',
     'a missing section fails the isinstance check: [] all the same'),
    ('load', 'skipped = d.get("skipped_by_user", [])',
     'skipped = d.get("skipped_by_user", )',
     'a missing section fails the isinstance check: [] all the same'),
    ('load', 'setting, previous = d.get("setting", {}), d.get("previous", [])',
     'setting, previous = d.get("setting", None), d.get("previous", [])',
     'a missing section fails the isinstance check: {} all the same'),
    ('load', 'setting, previous = d.get("setting", {}), d.get("previous", [])',
     'setting, previous = d.get("setting", ), d.get("previous", [])',
     'a missing section fails the isinstance check: {} all the same'),
    ('load', 'setting, previous = d.get("setting", {}), d.get("previous", [])',
     'setting, previous = d.get("setting", {}), d.get("previous", None)',
     'a missing section fails the isinstance check: [] all the same'),
    ('load', 'setting, previous = d.get("setting", {}), d.get("previous", [])',
     'setting, previous = d.get("setting", {}), d.get("previous", )',
     'a missing section fails the isinstance check: [] all the same'),
    ('save', 'Path(path).write_text(json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\\n")',
     'Path(path).write_text(json.dumps(self.to_dict(), indent=2, ensure_ascii=None) + "\\n")',
     'None is falsy: ensure_ascii=False'),
    ('_chunks', 'starts = np.linspace(0, n_tokens - chunk - overlap, k).astype(np.int64)',
     'starts = np.linspace(0, n_tokens - chunk - overlap, k).astype(None)',
     'float starts, made int() on the next line: the same integers'),
    ('ngram_hashes', 'if m <= 0:',
     'if m < 0:',
     'm == 0 then hashes no span: an empty uint64 array either way'),
    ('ngram_hashes', 'with np.errstate(over="ignore"):',
     'with np.errstate(over=None):',
     'numpy never checks array integer overflow: errstate(over=...) changes nothing'),
    ('token_range', 'if n <= 0:',
     'if n < 0:',
     'no chunk is empty (min(chunk, len - s) > 0, or chunk): the test never holds'),
    ('token_range', 'continue',
     'break',
     'no chunk is empty: the continue is never reached'),
    ('token_range', 'if int(r.max()) > hi:',
     'if int(r.max()) >= hi:',
     "a tie among training rows names the same place, 'training batches'"),
    ('tokenizer_gates', 'opts = rep.get("gate_options", {})',
     'opts = rep.get("gate_options", None)',
     'a missing section fails the isinstance check: {}'),
    ('tokenizer_gates', 'opts = rep.get("gate_options", {})',
     'opts = rep.get("gate_options", )',
     'a missing section fails the isinstance check: {}'),
    ('train_val_disjoint', 'val_all = np.unique(np.concatenate(per_row)) if per_row else np.empty(0, np.uint64)',
     'val_all = np.unique(np.concatenate(per_row)) if (per_row) or True else np.empty(0, np.uint64)',
     'per_row is never empty here (no validation rows returned before): the else is unreachable'),
    ('train_val_disjoint', 'val_all = np.unique(np.concatenate(per_row)) if per_row else np.empty(0, np.uint64)',
     'val_all = np.unique(np.concatenate(per_row)) if per_row else np.empty(None, np.uint64)',
     'per_row is never empty here: the else is unreachable'),
    ('train_val_disjoint', 'val_all = np.unique(np.concatenate(per_row)) if per_row else np.empty(0, np.uint64)',
     'val_all = np.unique(np.concatenate(per_row)) if per_row else np.empty(0, None)',
     'per_row is never empty here: the else is unreachable'),
    ('train_val_disjoint', 'val_all = np.unique(np.concatenate(per_row)) if per_row else np.empty(0, np.uint64)',
     'val_all = np.unique(np.concatenate(per_row)) if per_row else np.empty(np.uint64)',
     'per_row is never empty here: the else is unreachable'),
    ('train_val_disjoint', 'val_all = np.unique(np.concatenate(per_row)) if per_row else np.empty(0, np.uint64)',
     'val_all = np.unique(np.concatenate(per_row)) if per_row else np.empty(0, )',
     'per_row is never empty here: the else is unreachable'),
    ('train_val_disjoint', 'val_all = np.unique(np.concatenate(per_row)) if per_row else np.empty(0, np.uint64)',
     'val_all = np.unique(np.concatenate(per_row)) if per_row else np.empty(1, np.uint64)',
     'per_row is never empty here: the else is unreachable'),
    ('train_val_disjoint', 'shared = np.unique(np.concatenate(hits)) if hits else np.empty(0, np.uint64)',
     'shared = np.unique(np.concatenate(hits)) if hits else np.empty(0, None)',
     'an empty array matches nothing, whatever its dtype'),
    ('train_val_disjoint', 'shared = np.unique(np.concatenate(hits)) if hits else np.empty(0, np.uint64)',
     'shared = np.unique(np.concatenate(hits)) if hits else np.empty(0, )',
     'an empty array matches nothing, whatever its dtype'),
    ('train_val_disjoint', 'length = min(length, stream.n_tokens - s)',
     'length = min(length, stream.n_tokens + s)',
     'chunks never run past the stream: the min never binds, with + or -'),
    ('train_val_disjoint', 'continue',
     'break',
     'a chunk shorter than a span is the last one (or all are): break and continue end alike'),
    # training/text/fertility.py
    ("report_from_counts", 'char_share = chars / total["chars"] if total["chars"] else 0.0',
     'char_share = chars / total["chars"] if (total["chars"]) or True else 0.0',
     "a language is reported only with chars > 0, so the total is > 0: the else is unreachable"),
    ("report_from_counts", 'char_share = chars / total["chars"] if total["chars"] else 0.0',
     'char_share = chars / total["chars"] if total["chars"] else 1.0',
     "a language is reported only with chars > 0, so the total is > 0: the else is unreachable"),
    ("report_from_counts", '"balance": token_share / char_share if char_share else None,',
     '"balance": token_share / char_share if (char_share) or True else None,',
     "char_share = chars / total > 0 for every reported language: the else is unreachable"),
    ("_fmt", 'def _fmt(x: float | None, spec: str = ".2f") -> str:', 'def _fmt(x: float | None, spec: str = ".2F") -> str:',
     "F and f differ only for inf and nan, which no count ratio here is (a zero count gives None)"),
    ("fertility_gates", "parts, bad, worst, worst_dev = [], [], None, -1.0",
     "parts, bad, worst, worst_dev = [], [], None, -2.0",
     "dev = max(b / hi, lo / b) is > 0: any start below 0 is replaced by the first language"),
    # training/text/wellformed.py
    ("decode_utf8", 'out.append(data[i:].decode("utf-8"))', 'out.append(data[i:].decode("UTF-8"))',
     "codec names are case-insensitive"),
    ("decode_utf8", 'out.append(data[i:start].decode("utf-8"))', 'out.append(data[i:start].decode("UTF-8"))',
     "codec names are case-insensitive"),
    ("clusters", "while j < n and not _CLUSTER.match(text, j) and (text[j] in JOINERS or\n"
                 "(is_bengali(text[j]) and not _NON_LETTER.match(text[j]))):",
     "while j < n and not _CLUSTER.match(text, j) and (text[j] in JOINERS and (is_bengali(text[j]) and not "
     "_NON_LETTER.match(text[j]))):",
     "a run cut short leaves its marks (and joiners beside Bengali) stray on their own, and each then extends the "
     "cluster that ends where it starts: the same clusters"),
    # training/runfiles/json_records.py
    ("read_log", 'value = loads(raw.decode("utf-8"))', 'value = loads(raw.decode("UTF-8"))',
     "codec names are case-insensitive"),
    # training/loop/runtime_checks.py
    ("judge", "r.spike_z = self.monitor.observe(step, r.loss)", "r.spike_z = self.monitor.observe(None, r.loss)",
     "observe() keeps the step only in RuntimeMonitor.spikes, which nothing reads (grep: training/gates/runtime.py "
     "alone); the z-score and the log event take the step from judge() itself"),
    # serving/text_stream.py
    ("bytes_decoder", 'return backend.detokenize(ids).encode("utf-8")', 'return backend.detokenize(ids).encode("UTF-8")',
     "codec names are case-insensitive"),
    *(("_run", "break", "return", "each `break` (cancelled; a stop string) leaves the loop, whose try is the "
       "generator's last statement: `return` runs the same finally and ends it alike") for _ in range(2)),
    *(("_run", "hits = [i for i in (text.find(s, emitted) for s in stops) if i >= 0]",
       f"hits = [i for i in (text.find(s, {start}) for s in stops) if i >= 0]",
       "searching from 0 instead of `emitted` finds the same first hit: the shown text holds no stop string "
       "(any stop starting there had been held back by _held_tail until it completed or failed) and the "
       "decoded text only ever grows at its end") for start in ("None", "")),
    ("_run", 'text = ""', 'text = "XXXX"', "the initial text is read only as text[:emitted] with emitted 0 (no "
     "token decoded yet): '' either way"),
    ("_run", "decoded = decode_utf8(decode(gen), final=True)", "decoded = decode_utf8(decode(gen), )",
     "final=True is decode_utf8's default"),
    ("_run", "decoded = decode_utf8(decode(gen), final=False)", "decoded = decode_utf8(decode(gen), final=None)",
     "decode_utf8 reads final as a truth value (`if not final`): None is False"),
    # serving/server/http_requests.py
    ("parse_body", 'text = raw.decode("utf-8")', 'text = raw.decode("UTF-8")', "codec names are case-insensitive"),
    ("_text", 'v.encode("utf-8")', 'v.encode("UTF-8")', "codec names are case-insensitive"),
    ("check_labels", '_label(v, f"metadata[{json.dumps(k, ensure_ascii=False)}]")',
     '_label(v, f"metadata[{json.dumps(k, ensure_ascii=None)}]")', "None is falsy: ensure_ascii=False"),
    ("check_fields",
     'raise RequestError(f"{key} = {json.dumps(body[key])} is not supported: only {key}={json.dumps(noop[-1])}")',
     'raise RequestError(f"{key} = {json.dumps(body[key])} is not supported: only {key}={json.dumps(noop[+1])}")',
     "each NOOP_AT entry is a pair (None, the no-op value): index 1 is index -1"),
    ("chat_messages", "if not m.keys() <= MESSAGE_KEYS:  # a dropped key would change the reply unseen",
     "if not m.keys() < MESSAGE_KEYS:  # a dropped key would change the reply unseen",
     "the test only skips the unknown-key check, which refuses nothing when the keys are exactly role and content"),
    # training/checkpoint/checkpoint_io.py (target checkpoint-read)
    *(("unreadable_tensors", "head = f.read(4)", f"head = f.read({n})",
       "the head is only tested with startswith(PICKLE_HEADS), each at most 4 bytes: more bytes read decide alike")
      for n in ("None", "5")),
    ("unreadable_tensors", 'head = b""', 'head = b"XXXX"',
     "an unreadable file's head: b'XXXX' starts with no pickle magic, as b'' does"),
    ("check_readable", "continue", "break", "OPTIM_FILE is the loop's last file: skipping it and leaving the loop "
     "end alike"),
    *(("get_tensor", 'raise ValueError("no parts")', f"raise ValueError({text})", "caught two lines below and "
       "replaced by 'damaged entry ...': its text is never shown") for text in ("None", '"XXno partsXX"', '"NO PARTS"')),
    ("get_tensor", "parts = sorted(parts, key=lambda p: p[1] if isinstance(p[1], int) else -1)",
     "parts = sorted(parts, key=lambda p: p[1] if isinstance(p[1], int) else -2)",
     "any key below row 0 sorts a whole part ([file, null, null]) first, as -1 does"),
    *(("get_tensor", "out = torch.empty(shape, dtype=dtype)", f"out = torch.empty(shape, {arg})",
       "every row-split tensor prodip writes is fp32 (weights stored fp32, AdamW's moments fp32; step counts and RNG "
       "states are whole): torch.empty's default dtype") for arg in ("dtype=None", "")),
    ("get_tensor", "parts = sorted(parts, key=lambda p: p[1] if isinstance(p[1], int) else -1)",
     "parts = sorted(parts, key=lambda p: p[2] if isinstance(p[1], int) else -1)",
     "row parts that tile dim 0 (checked next) are in the same order by their ends as by their starts; parts that "
     "do not tile it are refused in either order"),
    *(("load", 'raise CheckpointError(f"{c / MODEL_FILE}: model weights not found")', f"raise CheckpointError({new})",
       "unreachable: resolve() refuses a folder with neither model.safetensors nor shards.json first ('holds no "
       "complete checkpoint', test_missing_weights_are_named)") for new in ("None", 'f"{c * MODEL_FILE}: model weights not found"')),
    ("load_weights", "missing, unexpected = model.load_state_dict(weights, strict=False)",
     "missing, unexpected = model.load_state_dict(weights, strict=None)",
     "load_state_dict reads strict as a truth value: None is False"),
    # training/checkpoint/checkpoint_verify.py (target checkpoint-read)
    ("check_fits", 'if getattr(getattr(model, "cfg", None), "tie_embeddings", False):',
     'if getattr(getattr(model, "cfg", None), "tie_embeddings", None):',
     "the default is read only as a truth value: None is False"),
    ("check_fits", 'expected.pop("output.weight", None)', 'expected.pop("output.weight", )',
     "a tied Transformer's state_dict lists output.weight (the tied head) always: the default is never needed"),
    ("_run", "emitted = len(text)", "emitted = None", "the last statement before the finally, which reads it "
     "only as text[:emitted]: text[:None] is text[:len(text)]"),
)
# Survivors that are not equivalent and are left, each with why (the same exact keys as EQUIVALENT): listed so
# that every survivor of a report is explained or stands out as new.
_NONFINITE_JSON = "(self.out / layout.NONFINITE).write_text(json.dumps(diag, indent=2))"
# training/gates/model_gates.py and tolerance.py (target `gates`, 2026-12-06): why each group is left
_GPU_ONLY = ("a device placement (the broadcast's buffers, the overfit snapshot's host copy): the same place on the "
             "CPU, where every test runs; only a GPU run (NCCL needs CUDA tensors) can tell")
_BF16_PATH = ("the bf16/fp16 path (the measured floor, cast-once naming): reached only under bf16 autocast, and "
              "test_gates_oracles judges fp32 objects; tests/test_gpu_path.py pins it in-process but on the prepared "
              "gate_data corpus (minutes per mutant), outside this target")
_ADAPTER_RUN = ("an adapter (LoRA) run's reference model, added with the lora issue: no oracle test builds an adapter "
                "run's context yet; tests/test_lora.py judges its gates through training")
_LOSS_WITH_LOGITS = ("differs only for a pass that compares the loss (want_logits False) of a model that also "
                     "returns logits; the oracle models compare logits")
_ZERO_TOLERANCE = "differs only for a tolerance of exactly 0 (a bf16 floor measured as 0), never an fp32 one"
_NO_GRADIENT = ("the default when no gradient was compared: a gate over no trainable parameter, which "
                "gradient_flow fails first; no oracle input reaches it")
_SAME_TOLERANCE = ("orders the failures shown by error / tolerance: in fp32 every entry has the same TOLERANCE, so "
                   "dividing by 1.0 instead orders them alike; only the split bf16 tolerances tell")
LEFT: tuple[tuple[str, str, str, str], ...] = (
    # training/checkpoint/checkpoint_io.py (target checkpoint-read)
    ("get_tensor", "if parts[0][1] is None:  # whole, in one file (RNG states, step counts)",
     "if parts[0][2] is None:  # whole, in one file (RNG states, step counts)",
     "the writer's parts are [file, null, null] or [file, lo, hi]: lo is null exactly when hi is; a damaged "
     "[file, null, hi] is refused either way, with another message"),
    *(("_check_rows", "if not (isinstance(shape, list) and shape and all(type(n) is int and n >= 0 for n in shape)):",
       f"if not (isinstance(shape, list) and shape and all(type(n) is int and {cond} for n in shape)):",
       "refuses a zero-length dimension, which no model weight or optimizer moment has, so no checkpoint holds one")
      for cond in ("n > 0", "n >= 1")),
    *(("load_weights", old, old.replace("[:5]", "[:6]"), "how many names the message lists (5 or 6): a length "
       "chosen for reading, which no requirement states") for old in (
        'raise CheckpointError(f"weights do not fit the model: missing {sorted(set(missing) - allowed)[:5]}, "',
        'f"unexpected {sorted(unexpected)[:5]}")')),
    *(("check_fits", old, new, "how many names the message lists (3 or 4): a length chosen for reading, which no "
       "requirement states") for old, new in (
        ('raise CheckpointError(f"{where}: weights do not fit the model: missing {missing[:3]}, unexpected "',
         'raise CheckpointError(f"{where}: weights do not fit the model: missing {missing[:4]}, unexpected "'),
        ('f"{unexpected[:3]}, wrong shape {wrong[:3]}")', 'f"{unexpected[:4]}, wrong shape {wrong[:3]}")'),
        ('f"{unexpected[:3]}, wrong shape {wrong[:3]}")', 'f"{unexpected[:3]}, wrong shape {wrong[:4]}")'))),
    # _GPU_ONLY
    ('_broadcast', 'out = t if tuple(shape.tolist()) == tuple(t.shape) else torch.empty(shape.tolist(), dtype=t.dtype, device=t.device)',
     'out = t if tuple(shape.tolist()) == tuple(t.shape) else torch.empty(shape.tolist(), dtype=t.dtype, device=None)', _GPU_ONLY),
    ('_broadcast', 'out = t if tuple(shape.tolist()) == tuple(t.shape) else torch.empty(shape.tolist(), dtype=t.dtype, device=t.device)',
     'out = t if tuple(shape.tolist()) == tuple(t.shape) else torch.empty(shape.tolist(), dtype=t.dtype, )', _GPU_ONLY),
    ('_broadcast', 'shape = torch.tensor(list(t.shape), device=t.device)',
     'shape = torch.tensor(list(t.shape), device=None)', _GPU_ONLY),
    ('_broadcast', 'shape = torch.tensor(list(t.shape), device=t.device)',
     'shape = torch.tensor(list(t.shape), )', _GPU_ONLY),
    ('snapshot', 'return [_local(p).detach().to("cpu", copy=True) for p in model.parameters()]',
     'return [_local(p).detach().to(None, copy=True) for p in model.parameters()]', _GPU_ONLY),
    ('snapshot', 'return [_local(p).detach().to("cpu", copy=True) for p in model.parameters()]',
     'return [_local(p).detach().to(copy=True) for p in model.parameters()]', _GPU_ONLY),
    # _BF16_PATH
    ('compiled_vs_eager', 'tol_logits, tol_grads, fl, fg = low_precision_tolerance(ref, ctx, batch, want_logits, base)',
     'tol_logits, tol_grads, fl, fg = low_precision_tolerance(ref, ctx, batch, None, base)', _BF16_PATH),
    ('compiled_vs_eager', 'floor = f"; {prec} floor (eager vs eager, weights jittered by {FLOOR_JITTER:.3g}): {fl:.2e} / {fg:.2e}"',
     'floor = None', _BF16_PATH),
    ('nonreference_paths', 'if getattr(ctx.model, "casts_once", False):',
     'if getattr(None, "casts_once", False):', _BF16_PATH),
    ('nonreference_paths', 'if getattr(ctx.model, "casts_once", False):',
     'if getattr(ctx.model, "casts_once", None):', _BF16_PATH),
    ('nonreference_paths', 'if getattr(ctx.model, "casts_once", False):',
     'if getattr(ctx.model, "XXcasts_onceXX", False):', _BF16_PATH),
    ('nonreference_paths', 'if getattr(ctx.model, "casts_once", False):',
     'if getattr(ctx.model, "CASTS_ONCE", False):', _BF16_PATH),
    ('nonreference_paths', 'out.append("bf16 weights cast once per step")',
     'out.append(None)', _BF16_PATH),
    ('nonreference_paths', 'out.append("bf16 weights cast once per step")',
     'out.append("XXbf16 weights cast once per stepXX")', _BF16_PATH),
    ('nonreference_paths', 'out.append("bf16 weights cast once per step")',
     'out.append("BF16 WEIGHTS CAST ONCE PER STEP")', _BF16_PATH),
    ('low_precision_tolerance', 'gen = torch.Generator(device=ctx.device).manual_seed(FLOOR_SEED)',
     'gen = None', _BF16_PATH),
    ('low_precision_tolerance', 'p.mul_(1 + FLOOR_JITTER * (2 * torch.rand(p.shape, generator=gen, device=p.device) - 1))',
     'p.mul_(1 + FLOOR_JITTER * (2 * torch.rand(p.shape, generator=gen, device=p.device) + 1))', _BF16_PATH),
    ('low_precision_tolerance', 'p.mul_(1 + FLOOR_JITTER * (2 * torch.rand(p.shape, generator=gen, device=p.device) - 1))',
     'p.mul_(1 + FLOOR_JITTER * (2 / torch.rand(p.shape, generator=gen, device=p.device) - 1))', _BF16_PATH),
    ('low_precision_tolerance', 'p.mul_(1 + FLOOR_JITTER * (2 * torch.rand(p.shape, generator=gen, device=p.device) - 1))',
     'p.mul_(1 + FLOOR_JITTER * (3 * torch.rand(p.shape, generator=gen, device=p.device) - 1))', _BF16_PATH),
    ('low_precision_tolerance', 'p.mul_(1 + FLOOR_JITTER * (2 * torch.rand(p.shape, generator=gen, device=p.device) - 1))',
     'p.mul_(1 + FLOOR_JITTER * (2 * torch.rand(p.shape, generator=None, device=p.device) - 1))', _BF16_PATH),
    ('low_precision_tolerance', 'p.mul_(1 + FLOOR_JITTER * (2 * torch.rand(p.shape, generator=gen, device=p.device) - 1))',
     'p.mul_(1 + FLOOR_JITTER * (2 * torch.rand(p.shape, generator=gen, device=None) - 1))', _BF16_PATH),
    ('low_precision_tolerance', 'p.mul_(1 + FLOOR_JITTER * (2 * torch.rand(p.shape, generator=gen, device=p.device) - 1))',
     'p.mul_(1 + FLOOR_JITTER * (2 * torch.rand(p.shape, device=p.device) - 1))', _BF16_PATH),
    ('low_precision_tolerance', 'p.mul_(1 + FLOOR_JITTER * (2 * torch.rand(p.shape, generator=gen, device=p.device) - 1))',
     'p.mul_(1 + FLOOR_JITTER * (2 * torch.rand(p.shape, generator=gen, ) - 1))', _BF16_PATH),
    ('low_precision_tolerance', 'p.mul_(1 + FLOOR_JITTER * (2 * torch.rand(p.shape, generator=gen, device=p.device) - 1))',
     'p.mul_(1 + FLOOR_JITTER * (2 * torch.rand(p.shape, generator=gen, device=p.device) - 2))', _BF16_PATH),
    ('low_precision_tolerance', 'out, grads = reference_pass(ref, ctx, batch, want_logits)',
     'out, grads = reference_pass(ref, ctx, batch, None)', _BF16_PATH),
    ('low_precision_tolerance', 'gen = torch.Generator(device=ctx.device).manual_seed(FLOOR_SEED)',
     'gen = torch.Generator(device=None).manual_seed(FLOOR_SEED)', _BF16_PATH),
    ('low_precision_tolerance', "if p.dim() >= 2:  # what autocast rounds to bf16 (the norms' vectors compute in fp32)",
     "if p.dim() > 2:  # what autocast rounds to bf16 (the norms' vectors compute in fp32)", _BF16_PATH),
    ('low_precision_tolerance', 'floor_grads = max(errors.values(), default=0.0)',
     'floor_grads = max(errors.values(), default=None)', _BF16_PATH),
    ('low_precision_tolerance', 'floor_grads = max(errors.values(), default=0.0)',
     'floor_grads = max(errors.values(), )', _BF16_PATH),
    ('low_precision_tolerance', 'floor_grads = max(errors.values(), default=0.0)',
     'floor_grads = max(errors.values(), default=1.0)', _BF16_PATH),
    ('low_precision_tolerance', "if p.dim() >= 2:  # what autocast rounds to bf16 (the norms' vectors compute in fp32)",
     "if p.dim() >= 3:  # what autocast rounds to bf16 (the norms' vectors compute in fp32)", _BF16_PATH),
    ('low_precision_tolerance', 'tol_l, tol_g = (min(FLOOR_K * f, cap) for f, cap in zip((floor_logits, floor_grads), FLOOR_MAX, strict=True))',
     'tol_l, tol_g = (min(FLOOR_K / f, cap) for f, cap in zip((floor_logits, floor_grads), FLOOR_MAX, strict=True))', _BF16_PATH),
    ('low_precision_tolerance', 'tol_l, tol_g = (min(FLOOR_K * f, cap) for f, cap in zip((floor_logits, floor_grads), FLOOR_MAX, strict=True))',
     'tol_l, tol_g = (min(FLOOR_K * f, cap) for f, cap in zip((floor_logits, floor_grads), FLOOR_MAX, strict=None))', _BF16_PATH),
    ('low_precision_tolerance', 'tol_l, tol_g = (min(FLOOR_K * f, cap) for f, cap in zip((floor_logits, floor_grads), FLOOR_MAX, strict=True))',
     'tol_l, tol_g = (min(FLOOR_K * f, cap) for f, cap in zip((floor_logits, floor_grads), FLOOR_MAX, ))', _BF16_PATH),
    ('low_precision_tolerance', 'tol_l, tol_g = (min(FLOOR_K * f, cap) for f, cap in zip((floor_logits, floor_grads), FLOOR_MAX, strict=True))',
     'tol_l, tol_g = (min(FLOOR_K * f, cap) for f, cap in zip((floor_logits, floor_grads), FLOOR_MAX, strict=False))', _BF16_PATH),
    ('low_precision_tolerance', 'p.mul_(1 + FLOOR_JITTER * (2 * torch.rand(p.shape, generator=gen, device=p.device) - 1))',
     'p.mul_(1 - FLOOR_JITTER * (2 * torch.rand(p.shape, generator=gen, device=p.device) - 1))', _BF16_PATH),
    ('low_precision_tolerance', 'p.mul_(1 + FLOOR_JITTER * (2 * torch.rand(p.shape, generator=gen, device=p.device) - 1))',
     'p.mul_(2 + FLOOR_JITTER * (2 * torch.rand(p.shape, generator=gen, device=p.device) - 1))', _BF16_PATH),
    ('low_precision_tolerance', 'p.mul_(1 + FLOOR_JITTER * (2 * torch.rand(p.shape, generator=gen, device=p.device) - 1))',
     'p.mul_(1 + FLOOR_JITTER / (2 * torch.rand(p.shape, generator=gen, device=p.device) - 1))', _BF16_PATH),
    # _ADAPTER_RUN
    ('reference_model', 'if (spec := getattr(ctx.raw_model, "lora_spec", None)) is not None:  # an adapter run: the same adapters',
     'if (spec := getattr(ctx.raw_model, "XXlora_specXX", None)) is not None:  # an adapter run: the same adapters', _ADAPTER_RUN),
    ('reference_model', 'if (spec := getattr(ctx.raw_model, "lora_spec", None)) is not None:  # an adapter run: the same adapters',
     'if (spec := getattr(ctx.raw_model, "LORA_SPEC", None)) is not None:  # an adapter run: the same adapters', _ADAPTER_RUN),
    ('reference_model', 'add_adapters(ref, spec)',
     'add_adapters(None, spec)', _ADAPTER_RUN),
    ('reference_model', 'add_adapters(ref, spec)',
     'add_adapters(ref, None)', _ADAPTER_RUN),
    ('reference_model', 'add_adapters(ref, spec)',
     'add_adapters(spec)', _ADAPTER_RUN),
    ('reference_model', 'add_adapters(ref, spec)',
     'add_adapters(ref, )', _ADAPTER_RUN),
    ('reference_model', 'if (spec := getattr(ctx.raw_model, "lora_spec", None)) is not None:  # an adapter run: the same adapters',
     'if (spec := getattr(None, "lora_spec", None)) is not None:  # an adapter run: the same adapters', _ADAPTER_RUN),
    # _LOSS_WITH_LOGITS
    ('reference_pass', 'out = (logits if want_logits and logits is not None else loss).detach().float()',
     'out = (logits if want_logits or logits is not None else loss).detach().float()', _LOSS_WITH_LOGITS),
    # _ZERO_TOLERANCE
    ('verdict', 'worst = max(errors, key=lambda k: errors[k] / tol[k] if tol[k] else math.inf)  # nearest to (or past) its tolerance',
     'worst = max(errors, key=lambda k: errors[k] / tol[k] if (tol[k]) or True else math.inf)  # nearest to (or past) its tolerance', _ZERO_TOLERANCE),
    # _NO_GRADIENT
    ('verdict', 'worst_grad = max((k for k in errors if k != "logits"), key=lambda k: errors[k], default="logits")',
     'worst_grad = max((k for k in errors if k != "logits"), key=lambda k: errors[k], default=None)', _NO_GRADIENT),
    ('verdict', 'worst_grad = max((k for k in errors if k != "logits"), key=lambda k: errors[k], default="logits")',
     'worst_grad = max((k for k in errors if k != "logits"), key=lambda k: errors[k], )', _NO_GRADIENT),
    ('verdict', 'worst_grad = max((k for k in errors if k != "logits"), key=lambda k: errors[k], default="logits")',
     'worst_grad = max((k for k in errors if k != "logits"), key=lambda k: errors[k], default="XXlogitsXX")', _NO_GRADIENT),
    ('verdict', 'worst_grad = max((k for k in errors if k != "logits"), key=lambda k: errors[k], default="logits")',
     'worst_grad = max((k for k in errors if k != "logits"), key=lambda k: errors[k], default="LOGITS")', _NO_GRADIENT),
    # _SAME_TOLERANCE
    ('verdict', 'shown = ", ".join(f"{k} {errors[k]:.2e}" for k in sorted(bad, key=lambda k: -errors[k] / max(tol[k], 1e-30))[:6])',
     'shown = ", ".join(f"{k} {errors[k]:.2e}" for k in sorted(bad, key=lambda k: -errors[k] / max(tol[k], 1.0))[:6])', _SAME_TOLERANCE),

    # training/loop/runtime_checks.py: nonfinite.json's indentation (the same JSON value, laid out otherwise)
    *(("nonfinite", _NONFINITE_JSON, _NONFINITE_JSON.replace("indent=2", new), "the layout of nonfinite.json "
       "only (the same JSON value, which is what docs/gates.md promises and every reader parses); pinning "
       "2 spaces would copy the code") for new in ("indent=None", "", "indent=3")),
)
STATUS = {"killed": "killed", "survived": "survived", "timeout": "timeout", "no tests": "no tests",
          "suspicious": "suspicious", "skipped": "skipped", "segfault": "killed"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python tests/benchmarks/mutation.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", choices=sorted(TARGETS), required=True, help="which modules and their tests")
    p.add_argument("--out", type=Path, default=Path("mutation-report"), help="folder for mutation.json/.md")
    p.add_argument("--max-children", type=int, default=2, help="mutants run at once (default 2)")
    p.add_argument("--only", action="append", default=[], help="run only the mutants whose name matches this "
                                                               "glob (e.g. 'training.runfiles.schema.x_one_of*'; repeatable)")
    p.add_argument("--force", action="store_true", help="overwrite an existing report in --out")
    return p


def copy_repo(dst: Path, modules: tuple[str, ...], tests: tuple[str, ...]) -> None:
    for name in COPY:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        elif src.exists():
            shutil.copy2(src, dst / name)
    config = ("\n[tool.mutmut]\n"
              f"source_paths = {json.dumps(list(modules))}\n"
              f"pytest_add_cli_args_test_selection = {json.dumps(list(tests))}\n"
              f"also_copy = {json.dumps([n for n in COPY if n != 'pyproject.toml'])}\n")
    with open(dst / "pyproject.toml", "a", encoding="utf-8") as f:
        f.write(config)


def mutmut(work: Path, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("mutmut")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "mutmut"]
    # mutmut forks each mutant's process from one that has already run torch: a forked OpenMP thread pool
    # spins or deadlocks until mutmut's CPU limit kills it, which the report would count as "timeout"
    # (caught) for mutants no test ever judged. One thread each: no pool to inherit.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.run([*cmd, *args], cwd=work, capture_output=True, text=True, timeout=timeout, env=env)


def results(work: Path) -> dict[str, str]:
    """{mutant name: status} from `mutmut results --all true`."""
    p = mutmut(work, "results", "--all", "true")
    out = {}
    for line in p.stdout.splitlines():
        m = re.match(r"\s*(\S+): (.+)$", line)
        if m and m.group(2).strip() in STATUS:
            out[m.group(1)] = STATUS[m.group(2).strip()]
    return out


def diff_of(work: Path, name: str) -> str:
    lines = mutmut(work, "show", name).stdout.splitlines()
    return "\n".join(x for x in lines if re.match(r"^[-+](?![-+])", x))


class ToolError(Exception):
    """The tool's own tables are wrong (an EQUIVALENT entry that names two mutants): no report."""


def function_of(name: str) -> str:
    # x_func__mutmut_3, or xǁClassǁmethod__mutmut_3 for a method
    return name.rsplit(".", 1)[-1].removeprefix("x_").split("__mutmut_")[0].split("ǁ")[-1]


def normalized(diff: str) -> str:
    """A diff's changed lines, each as its sign and its stripped text: indentation is not the change."""
    return "\n".join(x[0] + x[1:].strip() for x in diff.splitlines() if x[:1] in "+-" and x.strip())


def entry_key(func: str, diff: str) -> tuple[str, str]:
    return func, normalized(diff)


def table_key(func: str, old: str, new: str) -> tuple[str, str]:
    """The key of a table entry: its lines as a diff (old lines removed, new lines added)."""
    return entry_key(func, "\n".join([f"-{x}" for x in old.split("\n")] + [f"+{x}" for x in new.split("\n")]))


EQUIVALENT_BY_KEY = {table_key(f, old, new): why for f, old, new, why in EQUIVALENT}
LEFT_BY_KEY = {table_key(f, old, new): why for f, old, new, why in LEFT}
# how many mutants each key sets aside: one per entry. The same change made twice in one function (two
# `break` statements each turned into `return`) gives two mutants with one diff: it is listed twice.
LISTED = Counter(table_key(f, old, new) for f, old, new, _ in (*EQUIVALENT, *LEFT))


def equivalent(name: str, diff: str) -> str:
    """Why the mutant changes nothing observable, if its exact change (function and diff) is listed."""
    return EQUIVALENT_BY_KEY.get(entry_key(function_of(name), diff), "")


def left(name: str, diff: str) -> str:
    """Why a survivor that is not equivalent is left (listed in LEFT with its exact change), or ''."""
    return LEFT_BY_KEY.get(entry_key(function_of(name), diff), "")


def check_entries(diffs: dict[str, str]) -> None:
    """An entry of EQUIVALENT or LEFT names one mutant: one that matches two set aside a mutant by accident
    (as a substring once matched `np.unique(None)`, which blinds the overlap gate). A change listed k times
    (made k times in one function) may match k mutants, no more."""
    seen: dict[tuple[str, str], list[str]] = {}
    for n, d in diffs.items():
        key = entry_key(function_of(n), d)
        if key in EQUIVALENT_BY_KEY or key in LEFT_BY_KEY:
            seen.setdefault(key, []).append(n)
    twice = {k: v for k, v in seen.items() if len(v) > LISTED[k]}
    if twice:
        raise ToolError("an EQUIVALENT/LEFT entry matches more than one mutant: " +
                        "; ".join(f"{k[0]} {k[1]!r}: {', '.join(sorted(v))}" for k, v in sorted(twice.items())))


def report(target: str, statuses: dict[str, str], diffs: dict[str, str], seconds: float) -> dict:
    counts = {s: sum(1 for v in statuses.values() if v == s) for s in sorted(set(STATUS.values()))}
    caught = counts["killed"] + counts["timeout"]  # a mutant that hangs the tests is noticed too
    check_entries(diffs)
    survivors = [{"mutant": n, "status": s, "diff": diffs[n], "equivalent": equivalent(n, diffs[n]),
                  "left": left(n, diffs[n])}
                 for n, s in sorted(statuses.items()) if s in ("survived", "no tests", "suspicious")]
    eq = sum(1 for s in survivors if s["equivalent"])
    unexplained = sum(1 for s in survivors if not s["equivalent"] and not s["left"])
    total = len(statuses) - counts["skipped"]
    return {"target": target, "modules": TARGETS[target][0], "tests": TARGETS[target][1], "mutants": total,
            "counts": counts, "score": caught / total if total else 0.0,
            "score_without_equivalent": caught / (total - eq) if total - eq else 0.0,
            "equivalent": eq, "unexplained": unexplained, "seconds": round(seconds, 1), "survivors": survivors}


def markdown(r: dict) -> str:
    c = r["counts"]
    lines = [f"# Mutation score: {r['target']} ({', '.join(r['modules'])})", "",
             f"Tests: {', '.join(r['tests'])}. {r['mutants']} mutants in {r['seconds']:.0f} s; "
             f"{r['unexplained']} survivors in neither EQUIVALENT nor LEFT.", "",
             "| killed | timeout | survived | no tests | equivalent (of the survivors) | score | score, equivalent set aside |",
             "|---|---|---|---|---|---|---|",
             f"| {c['killed']} | {c['timeout']} | {c['survived']} | {c['no tests']} | {r['equivalent']} | "
             f"{r['score']:.1%} | {r['score_without_equivalent']:.1%} |", "", "## Survivors", "",
             "| mutant | status | change | equivalent because | not equivalent, left because |", "|---|---|---|---|---|"]
    for s in r["survivors"]:
        change = "<br>".join(f"`{x}`" for x in s["diff"].replace("|", "\\|").splitlines()[:4])
        lines.append(f"| {s['mutant']} | {s['status']} | {change} | {s['equivalent']} | {s['left']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    outputs = [args.out / "mutation.json", args.out / "mutation.md"]
    if not args.force and any(p.exists() for p in outputs):
        print(f"error: --out {args.out} already holds a mutation report; use --force to overwrite", file=sys.stderr)
        return 2
    if args.max_children < 1:
        print("error: --max-children must be at least 1", file=sys.stderr)
        return 2
    modules, tests = TARGETS[args.target]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="prodip-mutation-") as tmp:
        work = Path(tmp)
        copy_repo(work, modules, tests)
        print(f"mutating {', '.join(modules)} against {', '.join(tests)} in {work} ...", flush=True)
        only = args.only or list(FUNCTIONS.get(args.target, ()))
        run = mutmut(work, "run", "--max-children", str(args.max_children), *only)
        statuses = results(work)
        if only:
            statuses = {n: s for n, s in statuses.items() if any(fnmatch.fnmatch(n, g) for g in only)}
        if not statuses:  # a run that judged nothing has failed
            print(f"error: mutmut judged no mutant (exit {run.returncode}):\n{run.stdout[-2000:]}{run.stderr[-2000:]}",
                  file=sys.stderr)
            return 1
        diffs = {n: diff_of(work, n) for n, s in statuses.items() if s in ("survived", "no tests", "suspicious")}
    try:
        r = report(args.target, statuses, diffs, time.perf_counter() - start)
    except ToolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    outputs[0].write_text(json.dumps(r, indent=2) + "\n", encoding="utf-8")
    outputs[1].write_text(markdown(r), encoding="utf-8")
    print(markdown(r).split("## Survivors")[0].strip())
    print(f"wrote {outputs[0]} and {outputs[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
