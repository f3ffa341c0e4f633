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
    "arbiter": (("training/gates/runtime.py",), ("tests/test_gradient_flow_arbiter.py", "tests/test_gates.py")),
    "parity": (("export/parity.py",), ("tests/test_parity.py",)),
    "resume": (("training/checkpoint_format.py",), ("tests/test_crash_safety.py", "tests/test_safe_loading.py")),
}
# what the copy needs besides the mutated modules: every package, the tests and what they read
COPY = ("training", "serving", "export", "demo", "tests", "docs", "scripts", "README.md", "pyproject.toml")
# (function, text in the mutated line, why no test can tell the mutant from the original)
EQUIVALENT: tuple[tuple[str, str, str], ...] = (
    ("read_toml", 'encoding="UTF-8"', "codec names are case-insensitive"),
    ("read_toml", "encoding=None", "the locale's encoding, UTF-8 wherever the tests run (a non-UTF-8 "
                                   "locale cannot be set up from inside a test process)"),
    ("first_problem", "include_url=True", "the url field of pydantic's error is never read"),
    ("suggest", "n=2", "only the nearest match (near[0]) is used"),
    ("suggest", "list(choices), cutoff=0.6)", "n=1 dropped: difflib's default n=3 still puts the nearest first"),
    ("suggest", "list(choices), n=1, )", "cutoff=0.6 dropped: it is difflib's default"),
    ("_adapter", "_ADAPTERS", "a cache: every type the tests use is cached before mutmut forks the mutant's process"),
    ("_adapter", "TypeAdapter(None)", "a cache: every type the tests use is cached before mutmut forks the mutant's "
                                      "process"),
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
    return subprocess.run([*cmd, *args], cwd=work, capture_output=True, text=True, timeout=timeout)


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
    func = name.rsplit(".", 1)[-1].removeprefix("x_").split("__mutmut_")[0]
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
