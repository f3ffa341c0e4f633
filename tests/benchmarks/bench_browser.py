"""The browser rows of tests/benchmarks/bench_serving.py: the web export's pages (RUN/export/web, `python -m
export web`) in headless Chromium, timed through their own hook `window.prodip.generate` on the bench's prompt.

- wllama (llama.cpp in WebAssembly) on the web export's GGUF, at 1 thread and at --threads: the page is
  served with COOP/COEP (export.parity.browser_parity.serve_folder), so it is cross-origin isolated and wasm threads run;
  each row records what the page reports (threads, crossOriginIsolated);
- onnxruntime-web on each ONNX variant the export holds (fp32/int8/int4, `onnx.html?model=...`).
Generation tok/s is the page's own figure (new tokens after the first over the time between them, as ours);
the page ends a reply at end of turn (its hook has no switch for it), so a short reply shows "stopped after N".
Each measurement is its own child process with its own server and Chromium (bench_serving's run_child).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

RUNNERS = {"wllama": "wllama (browser)", "ort-web": "onnxruntime-web (browser)"}
TARGET_WLLAMA = 0.5  # wllama at 1 thread >= 0.5x native llama.cpp tok/s on the same Q4_K_M (issue #44)
GENERATE_JS = """async ([text, n]) => {
  await window.prodip.ready;
  const g = await window.prodip.generate(text, { max_tokens: n, temperature: 0, raw: true });
  return { n: g.ids.length, tokens_per_s: g.tokens_per_s, seconds: g.seconds, prompt_tokens: g.prompt_tokens };
}"""


def browser_formats(run: Path, gguf_types: tuple[str, ...]) -> list[dict]:
    """A row per page of RUN/export/web: wllama's GGUF, onnxruntime-web's ONNX variants; `path` is the page
    (with its ?model= query) and `same_as` the native row of the same file (its size and quality)."""
    web = run / "export" / "web"
    cfg_file = web / "prodip-web.json"
    if not cfg_file.is_file():
        return []
    cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    out = []
    gtype = cfg["gguf"].get("type")
    if (web / "index.html").is_file() and gtype in gguf_types:
        size = sum((web / s).stat().st_size for s in cfg["gguf"]["shards"])
        out.append({"label": f"GGUF {gtype}", "runner": "wllama", "path": web / "index.html", "bytes": size,
                    "same_as": f"GGUF {gtype}"})
    for variant, files in (cfg.get("onnx") or {}).items():
        size = sum((web / f).stat().st_size for f in [files["model"], *files["data"]])
        out.append({"label": f"ONNX {variant}", "runner": "ort-web", "path": web / f"onnx.html?model={variant}",
                    "bytes": size, "same_as": f"ONNX {variant}"})
    return out


def prompt_text(run: Path, prompt_tokens: int, text: str) -> str:
    """The bench's prompt as text of about `prompt_tokens` tokens (the page takes text; our tokenizer's ids,
    decoded)."""
    from training.text.tokenizer import Tokenizer

    tok = Tokenizer.load(next(p for p in (run / "tokenizer.model", *run.glob("checkpoints/*/tokenizer.model"))
                              if p.is_file()))
    while len(tok.encode(text, bos=True)) < prompt_tokens + 1:
        text += text
    return tok.decode(tok.encode(text, bos=False)[:prompt_tokens - 1])


def measure_browser(page: Path, threads: int, prompt: str, gen_tokens: int, repetitions: int) -> dict:
    """One page (child process): served on 127.0.0.1 with COOP/COEP, opened in a fresh Chromium with ?threads=N,
    a full-length warm-up, then `repetitions` greedy generations of `gen_tokens`."""
    from export.parity.browser_parity import chromium, serve_folder

    web, name = page.parent, page.name
    query = ("&" if "?" in name else "?") + f"threads={threads}"
    with serve_folder(web) as base, chromium() as browser:
        p = browser.new_context().new_page()
        t0 = time.perf_counter()
        p.goto(base + name + query, wait_until="domcontentloaded", timeout=300_000)
        p.wait_for_function("() => window.prodip !== undefined", timeout=300_000)
        info = p.evaluate("async () => { await window.prodip.ready; return window.prodip.info; }")
        load_s = time.perf_counter() - t0
        # warm-up as long as a measured run: V8 compiles hot wasm functions with TurboFan in the background (dynamic
        # tiering), so after a short warm-up the first measured tokens may still run baseline (Liftoff) code
        p.evaluate(GENERATE_JS, [prompt, gen_tokens])
        runs = [p.evaluate(GENERATE_JS, [prompt, gen_tokens]) for _ in range(repetitions)]
    tps = [r["tokens_per_s"] for r in runs if r["n"] > 1]
    ttft = [r["seconds"] - (r["n"] - 1) / r["tokens_per_s"] for r in runs if r["n"] > 1 and r["tokens_per_s"]]
    return {"load_s": load_s, "ttft_s": statistics.fmean(ttft) if ttft else None,
            "gen_tps": statistics.fmean(tps) if tps else None, "gen_tps_runs": tps, "n_gen": min(r["n"] for r in runs),
            "prompt_tokens": runs[0].get("prompt_tokens"), "threads_used": info.get("threads"),
            "cross_origin_isolated": info.get("cross_origin_isolated")}


def browser_verdicts(rows: list[dict], threads: int) -> list[str]:
    """wllama against native llama.cpp on the same file (llama-bench where it ran, else our llama.cpp row), and
    each browser row's threads as the page reported them."""
    def speed(label: str, runner: str, n: int) -> float | None:
        return next((r["results"].get(n, {}).get("gen_tps") for r in rows if r["label"] == label and r["runner"] == runner), None)

    out = []
    for r in rows:
        if r["runner"] not in RUNNERS:
            continue
        for n in sorted({1, threads}):
            res = r["results"].get(n, {})
            if res.get("threads_used") is not None and res["threads_used"] != n:
                out.append(f"{r['label']} {RUNNERS[r['runner']]}: asked for {n} threads, the page ran "
                           f"{res['threads_used']} (crossOriginIsolated {res.get('cross_origin_isolated')}).")
        if r["runner"] == "wllama":
            mine = speed(r["label"], "wllama", 1)
            native = speed(r["label"], "llama-bench", 1) or speed(r["label"], "llama.cpp", 1)
            if mine and native:
                x = mine / native
                out.append(f"{r['label']}, 1 thread: wllama {mine:.1f} tok/s = {x:.2f}x native llama.cpp {native:.1f} "
                           f"({1000 / mine - 1000 / native:+.2f} ms per token; "
                           f"{'meets' if x >= TARGET_WLLAMA else 'misses'} the >= {TARGET_WLLAMA}x target).")
    return out
