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
table is counted as unexplained.
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# target: (modules mutated, test files that claim to pin them)
TARGETS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "schema": (("training/schema.py",), ("tests/test_config_schema.py", "tests/test_schema_rules.py")),
    # the runtime gates: test_gates.py and test_hot_path.py reach the rest of runtime.py through training runs in
    # subprocesses, which mutmut cannot see: the oracle tests call it in-process
    "arbiter": (("training/gates/runtime.py",), ("tests/test_gradient_flow_arbiter.py", "tests/test_runtime_gates_oracles.py",
                                                 "tests/test_gates.py")),
    # parity: the oracle tests and test_parity.py's two tests that need no trained model (the rest train
    # and export: minutes per mutant)
    "parity": (("export/parity.py",), ("tests/test_parity_oracles.py", "tests/test_parity.py::test_kl_and_thresholds",
                                       "tests/test_parity.py::test_prompt_set_covers_the_hard_cases")),
    # the model pre-flight gates: oracle tests on a tiny model (test_gates.py prepares a corpus and trains)
    "gates": (("training/gates/model.py",), ("tests/test_gates_oracles.py",)),
    "gates-data": (("training/gates/data.py",), ("tests/test_data_gates_oracles.py",)),
    "gates-result": (("training/gates/result.py",), ("tests/test_gate_result_oracles.py",)),
    # the resume format: oracle tests on hand-built folders (test_crash_safety.py kills training 20 times and
    # test_safe_loading.py runs the CLI: minutes per mutant, so they are not in the selection)
    "resume": (("training/checkpoint_format.py",), ("tests/test_checkpoint_format_oracles.py",)),
    # the one JSON reader: its depth bound reached one level either side (json's own limit is ~1000 levels)
    "records": (("training/records.py",), ("tests/test_records.py", "tests/test_records_depth.py", "tests/test_records_oracles.py",
                                           "tests/test_boundaries_2.py::test_the_records_reader_names_depth_and_"
                                           "surrogates_with_the_line")),
    # the tokenizer's fertility and balance gates on hand-built counts (test_prepare.py trains tokenizers)
    "fertility": (("training/fertility.py",), ("tests/test_fertility_oracles.py",)),
    "wellformed": (("training/wellformed.py",), ("tests/test_wellformed.py", "tests/test_wellformed_oracles.py")),
    # every KL of the project (parity, evaluation, the ONNX checks)
    "logprobs": (("training/logprobs.py",), ("tests/test_logprobs_oracles.py",)),
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
     'export.hf lists hf/model.safetensors under format "hf" only, so the key is found with or without the format filter'),
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
    # training/fertility.py
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
    # training/wellformed.py
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
    # training/records.py
    ("read_log", 'value = loads(raw.decode("utf-8"))', 'value = loads(raw.decode("UTF-8"))',
     "codec names are case-insensitive"),
)
# Survivors that are not equivalent and are left, each with why (the same exact keys as EQUIVALENT): listed so
# that every survivor of a report is explained or stands out as new.
LEFT: tuple[tuple[str, str, str, str], ...] = ()
STATUS = {"killed": "killed", "survived": "survived", "timeout": "timeout", "no tests": "no tests",
          "suspicious": "suspicious", "skipped": "skipped", "segfault": "killed"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python tests/benchmarks/mutation.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", choices=sorted(TARGETS), required=True, help="which modules and their tests")
    p.add_argument("--out", type=Path, default=Path("mutation-report"), help="folder for mutation.json/.md")
    p.add_argument("--max-children", type=int, default=2, help="mutants run at once (default 2)")
    p.add_argument("--only", default="", help="run only the mutants whose name matches this glob "
                                              "(e.g. 'training.schema.x_one_of*')")
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


def equivalent(name: str, diff: str) -> str:
    """Why the mutant changes nothing observable, if its exact change (function and diff) is listed."""
    return EQUIVALENT_BY_KEY.get(entry_key(function_of(name), diff), "")


def left(name: str, diff: str) -> str:
    """Why a survivor that is not equivalent is left (listed in LEFT with its exact change), or ''."""
    return LEFT_BY_KEY.get(entry_key(function_of(name), diff), "")


def check_entries(diffs: dict[str, str]) -> None:
    """An entry of EQUIVALENT or LEFT names one mutant: one that matches two set aside a mutant by accident
    (as a substring once matched `np.unique(None)`, which blinds the overlap gate)."""
    seen: dict[tuple[str, str], list[str]] = {}
    for n, d in diffs.items():
        key = entry_key(function_of(n), d)
        if key in EQUIVALENT_BY_KEY or key in LEFT_BY_KEY:
            seen.setdefault(key, []).append(n)
    twice = {k: v for k, v in seen.items() if len(v) > 1}
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
        run = mutmut(work, "run", "--max-children", str(args.max_children), *([args.only] if args.only else []))
        statuses = results(work)
        if args.only:
            statuses = {n: s for n, s in statuses.items() if fnmatch.fnmatch(n, args.only)}
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
