"""Mutation score of the verification core: can its tests fail? (a benchmark, not a CI test)

    python tests/benchmarks/mutation.py --target schema --out /tmp/mutation

mutmut (pinned in the dev extra) changes one thing at a time in a module — `>` to `>=`, `and` to
`or`, a constant, a string, a dropped argument — and runs the tests that reach the changed function.
A mutant that no test notices ("survived") is a behaviour nothing pins. Each target below pairs the
modules with the tests that claim to check them. The run works in a copy of the repository (mutmut
rewrites the modules it mutates), so the working tree is never touched.

Some survivors cannot be killed because they change nothing observable (an equivalent mutant:
`encoding="UTF-8"` for `"utf-8"`, a default argument spelled out). EQUIVALENT lists each by the text
of its mutated line with the reason; the score is printed raw and with those set aside.
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
}
# what the copy needs besides the mutated modules: every package, the tests and what they read
COPY = ("training", "serving", "export", "demo", "tests", "docs", "scripts", "README.md", "pyproject.toml")
# (function, text in the mutated line, why no test can tell the mutant from the original)
EQUIVALENT: tuple[tuple[str, str, str], ...] = (
    ("read_toml", 'encoding="UTF-8"', "codec names are case-insensitive"),
    ("first_problem", "include_url=True", "the url field of pydantic's error is never read"),
    ("suggest", "n=2", "only the nearest match (near[0]) is used"),
    ("suggest", "list(choices), cutoff=0.6)", "n=1 dropped: difflib's default n=3 still puts the nearest first"),
    ("suggest", "list(choices), n=1, )", "cutoff=0.6 dropped: it is difflib's default"),
    # export/parity.py
    ("discover", "manifest.files(None)", "export.hf lists hf/model.safetensors under format \"hf\" only, so the key "
                                         "is found with or without the format filter"),
    ("greedy_metrics", "strict=None", "zip's strict defaults to False: None or no argument is strict=False"),
    ("greedy_metrics", "zip(ref.ids, ref.greedy, )", "zip's strict defaults to False"),
    ("greedy_metrics", "zip(want, got, )", "zip's strict defaults to False"),
    ("logit_metrics", "astype(None)", "astype(None) is float64, the dtype it replaces"),
    ("incremental_metrics", "astype(None)", "astype(None) is float64, the dtype it replaces"),
    ("logit_metrics", "argmax(+1)", "logits are (T, V): axis 1 is axis -1"),
    ("logit_metrics", "dtype=None", "every Backend returns fp32 logits (serving.backend's contract): the cast to "
                                    "float32 is a no-op on them"),
    ("logit_metrics", "np.asarray(b.logits(ids), )", "every Backend returns fp32 logits: the cast is a no-op"),
    ("long_prompt", "bos=True)) < budget", "one filler short, the word loop then appends the same filler word by word "
                                           "(words each followed by one space): the same text"),
    ("long_prompt", "split(None)", "differs only in split(' ')'s trailing empty word, reached only if a whole further "
                                   "filler fits, which the while loop has already added"),
    ("parse_thresholds", 'kinds: list[str] | None = ""', "'' and None are both falsy: `kinds or threshold_kinds()` "
                                                         "builds the list either way"),
    ("parse_thresholds", 'item.rpartition("=")', "no kind, metric or valid value holds '=': both splits refuse "
                                                 "the same items"),
    ("run_parity", 'encoding="UTF-8"', "codec names are case-insensitive"),
    ("run_parity", "encoding=None", "the locale's encoding, UTF-8 wherever the tests run"),
    ("run_parity", "report.markdown(), )", "encoding dropped: the locale's, UTF-8 wherever the tests run"),
    ("run_parity", "+" + " " * 43 + ")", "parity.json's encoding dropped: the locale's, UTF-8 wherever the tests run"),
    ("run_parity", "ensure_ascii=None", "None is falsy: ensure_ascii=False"),
    ("threshold_kinds", "SAFETENSORS", "'safetensors' is already a key of DEFAULT_THRESHOLDS in the same set"),
    ("threshold_kinds", "XXsafetensorsXX", "'safetensors' is already a key of DEFAULT_THRESHOLDS in the same set"),
    ("threshold_kinds", "TRANSFORMERS", "'transformers' is already a key of DEFAULT_THRESHOLDS in the same set"),
    ("threshold_kinds", "XXtransformersXX", "'transformers' is already a key of DEFAULT_THRESHOLDS in the same set"),
    ("tokenizer_metrics", "b.tokenize(text, allow_special=special)", "bos=True is the Backend protocol's default"),
    # training/gates/model.py
    ("compiled_vs_eager", 'key=lambda k: errors[k], default=None)', "max's default is used only with no gradient at "
                                                                     "all, and then loss.backward() has already raised"),
    ("compiled_vs_eager", "key=lambda k: errors[k], )", "max's default is used only with no gradient at all, and then "
                                                         "loss.backward() has already raised"),
    ("compiled_vs_eager", 'default="XXlogitsXX"', "max's default is used only with no gradient at all, and then "
                                                  "loss.backward() has already raised"),
    ("compiled_vs_eager", 'default="LOGITS"', "max's default is used only with no gradient at all, and then "
                                              "loss.backward() has already raised"),
    ("overfit_one_batch", "range(steps + 2)", "the loop leaves at `len(losses) > steps`, on range(steps + 1)'s last "
                                              "turn: a longer range is never reached"),
    ("overfit_one_batch", "([] if done else [1])", "only the list's truth is read: [1] and [0] are both non-empty"),
    ("overfit_one_batch", "set_to_none=None", "zeroed instead of freed gradients: backward adds to zero, the same "
                                              "sums; zero_grads frees them after the loop"),
    ("overfit_one_batch", "set_to_none=False", "zeroed instead of freed gradients: backward adds to zero, the same "
                                               "sums; zero_grads frees them after the loop"),
    ("reference_model", "strict=None", "load_state_dict reads strict as a truth value: None is False"),
    ("throughput", 'GateResult("throughput.mfu", True, threshold=', "value=None is GateResult's default"),
    # training/checkpoint_format.py
    ("flatten_optimizer", 'if k != "XXparamsXX"}', "the copied 'params' is replaced on the next line"),
    ("flatten_optimizer", 'if k != "PARAMS"}', "the copied 'params' is replaced on the next line"),
    # training/gates/result.py
    ("load", 'd.get("skipped_by_user", None)', "a missing section fails the isinstance check: [] all the same"),
    ("load", 'd.get("skipped_by_user", )', "a missing section fails the isinstance check: [] all the same"),
    ("load", 'd.get("setting", None)', "a missing section fails the isinstance check: {} all the same"),
    ("load", 'd.get("setting", )', "a missing section fails the isinstance check: {} all the same"),
    ("load", 'd.get("previous", None)', "a missing section fails the isinstance check: [] all the same"),
    ("load", 'd.get("previous", )', "a missing section fails the isinstance check: [] all the same"),
    ("save", "ensure_ascii=None", "None is falsy: ensure_ascii=False"),
    # training/gates/data.py
    ("_chunks", "astype(None)", "float starts, made int() on the next line: the same integers"),
    ("ngram_hashes", "if m < 0:", "m == 0 then hashes no span: an empty uint64 array either way"),
    ("ngram_hashes", "over=None", "numpy never checks array integer overflow: errstate(over=...) changes nothing"),
    ("token_range", "if n < 0:", "no chunk is empty (min(chunk, len - s) > 0, or chunk): the test never holds"),
    ("token_range", "                    break", "no chunk is empty: the continue is never reached"),
    ("token_range", "if int(r.max()) >= hi:", "a tie among training rows names the same place, 'training batches'"),
    ("tokenizer_gates", 'rep.get("gate_options", None)', "a missing section fails the isinstance check: {}"),
    ("tokenizer_gates", 'rep.get("gate_options", )', "a missing section fails the isinstance check: {}"),
    ("train_val_disjoint", "if (per_row) or True else", "per_row is never empty here (no validation rows "
                                                        "returned before): the else is unreachable"),
    ("train_val_disjoint", "if per_row else np.empty(", "per_row is never empty here: the else is unreachable"),
    ("train_val_disjoint", "np.empty(0, None)", "an empty array matches nothing, whatever its dtype"),
    ("train_val_disjoint", "if hits else np.empty(0, )", "an empty array matches nothing, whatever its dtype"),
    ("train_val_disjoint", "min(length, stream.n_tokens + s)", "chunks never run past the stream: the min never "
                                                               "binds, with + or -"),
    ("train_val_disjoint", "                break", "a chunk shorter than a span is the last one (or all are): "
                                                   "break and continue end alike"),
)
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


def equivalent(name: str, diff: str) -> str:
    # x_func__mutmut_3, or xǁClassǁmethod__mutmut_3 for a method
    func = name.rsplit(".", 1)[-1].removeprefix("x_").split("__mutmut_")[0].split("ǁ")[-1]
    added = "\n".join(x for x in diff.splitlines() if x.startswith("+"))
    return next((why for f, text, why in EQUIVALENT if f == func and text in added), "")


def report(target: str, statuses: dict[str, str], diffs: dict[str, str], seconds: float) -> dict:
    counts = {s: sum(1 for v in statuses.values() if v == s) for s in sorted(set(STATUS.values()))}
    caught = counts["killed"] + counts["timeout"]  # a mutant that hangs the tests is noticed too
    survivors = [{"mutant": n, "status": s, "diff": diffs[n], "equivalent": equivalent(n, diffs[n])}
                 for n, s in sorted(statuses.items()) if s in ("survived", "no tests", "suspicious")]
    eq = sum(1 for s in survivors if s["equivalent"])
    total = len(statuses) - counts["skipped"]
    return {"target": target, "modules": TARGETS[target][0], "tests": TARGETS[target][1], "mutants": total,
            "counts": counts, "score": caught / total if total else 0.0,
            "score_without_equivalent": caught / (total - eq) if total - eq else 0.0,
            "equivalent": eq, "seconds": round(seconds, 1), "survivors": survivors}


def markdown(r: dict) -> str:
    c = r["counts"]
    lines = [f"# Mutation score: {r['target']} ({', '.join(r['modules'])})", "",
             f"Tests: {', '.join(r['tests'])}. {r['mutants']} mutants in {r['seconds']:.0f} s.", "",
             "| killed | timeout | survived | no tests | equivalent (of the survivors) | score | score, equivalent set aside |",
             "|---|---|---|---|---|---|---|",
             f"| {c['killed']} | {c['timeout']} | {c['survived']} | {c['no tests']} | {r['equivalent']} | "
             f"{r['score']:.1%} | {r['score_without_equivalent']:.1%} |", "", "## Survivors", "",
             "| mutant | status | change | equivalent because |", "|---|---|---|---|"]
    for s in r["survivors"]:
        change = "<br>".join(f"`{x}`" for x in s["diff"].replace("|", "\\|").splitlines()[:4])
        lines.append(f"| {s['mutant']} | {s['status']} | {change} | {s['equivalent']} |")
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
    r = report(args.target, statuses, diffs, time.perf_counter() - start)
    args.out.mkdir(parents=True, exist_ok=True)
    outputs[0].write_text(json.dumps(r, indent=2) + "\n", encoding="utf-8")
    outputs[1].write_text(markdown(r), encoding="utf-8")
    print(markdown(r).split("## Survivors")[0].strip())
    print(f"wrote {outputs[0]} and {outputs[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
