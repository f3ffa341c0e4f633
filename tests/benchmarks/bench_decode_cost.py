"""Benchmark: CPU instructions per generated token, our Python llama.cpp path beside raw llama-bench.

    python tests/benchmarks/bench_decode_cost.py MODEL.gguf [--prompt-tokens 128] [--gen-tokens 128]

Wall-clock tokens/s on a shared 2-core machine moves by +-20 % within minutes, which is wider than
the 0.9x target bench_serving.py checks. Instructions are deterministic: each side runs under
valgrind's callgrind twice, generating 1 and 1 + N tokens after the same prompt depth, and the
difference / N is what one more token costs, with start-up, model load and prompt cancelled out.
Both sides run the same llama.cpp source (the binding's shared libraries, the tools' static build),
one thread, F16 KV cache, flash attention off, as bench_serving.py sets them; so the ratio is the
cost of our Python loop and the binding. Needs valgrind and llama-bench
(`bash scripts/build_llama_tools.sh`); ~3 minutes on a `small` model (callgrind is ~50x slower).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
for _p in (REPO, Path(__file__).resolve().parent):  # the repo's packages and bench_serving beside this file
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from bench_serving import llama_bench_args, prompts  # noqa: E402

COLLECTED = re.compile(r"Collected : (\d+)")
TIMEOUT_S = 1800


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="a GGUF file (`python -m export gguf` writes them)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="depth at which tokens are generated")
    ap.add_argument("--gen-tokens", type=int, default=128, help="N: tokens whose cost is measured")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)  # child mode: generate this many tokens
    return ap


def callgrind(cmd: list[str]) -> int:
    """Instructions the command executed (all threads), as callgrind counts them."""
    with tempfile.TemporaryDirectory() as td:
        p = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={td}/cg.out", *cmd],
                           capture_output=True, text=True, timeout=TIMEOUT_S)
    m = COLLECTED.search(p.stderr)
    if p.returncode != 0 or m is None:
        raise SystemExit(f"error: {' '.join(cmd[:2])} failed under callgrind: {p.stderr.strip().splitlines()[-1:]}")
    return int(m.group(1))


def ours_generate(model: Path, prompt_tokens: int, n: int) -> None:
    """Child: our serving path (serving.load, as bench_serving's llama.cpp row) generating n tokens."""
    from serving import load
    from serving.backend import SamplingParams

    b = load(model, backend="llama.cpp", threads=1, kv_f32=False)
    ids = prompts(b.tokenize, prompt_tokens, b.n_ctx, n, 1)[0]
    got = sum(1 for _ in b.generate(ids, SamplingParams.greedy(n)))
    if got != n:
        raise SystemExit(f"error: generated {got} of {n} tokens (an end token came first)")
    b.close()


def per_token(run, n: int) -> float:
    return (run(1 + n) - run(1)) / n


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.child is not None:
        ours_generate(a.model, a.prompt_tokens, a.child)
        return 0
    from export import ExportError
    from export.gguf.llama_tools import tool_path

    if not a.model.is_file():
        raise SystemExit(f"error: model not found: {a.model}")
    if shutil.which("valgrind") is None:
        raise SystemExit("error: valgrind not found (apt-get install valgrind): this benchmark counts instructions with it")
    try:
        bench = [str(tool_path("llama-bench")), *llama_bench_args(a.model, 1)]
    except ExportError as e:
        raise SystemExit(f"error: {e}") from None

    def raw(n: int) -> int:
        return callgrind([*bench, "-r", "1", "-p", "0", "-d", str(a.prompt_tokens), "-n", str(n)])

    def ours(n: int) -> int:
        return callgrind([sys.executable, __file__, str(a.model), "--prompt-tokens", str(a.prompt_tokens),
                          "--child", str(n)])

    rows = {"llama-bench (llama.cpp)": per_token(raw, a.gen_tokens),
            "llama-cpp-python (prodip)": per_token(ours, a.gen_tokens)}
    base = rows["llama-bench (llama.cpp)"]
    print(f"{a.model.name}: instructions per generated token at depth {a.prompt_tokens}, 1 thread "
          f"(callgrind, {a.gen_tokens} tokens)\n")
    print("| runner | instructions / token | speed vs llama-bench |\n|---|---:|---:|")
    for name, v in rows.items():
        print(f"| {name} | {v / 1e6:.3f} M | {base / v:.3f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
