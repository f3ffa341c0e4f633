"""Browser parity: the web export (RUN/export/web/, `python -m export web`) run in headless Chromium, each page
against the native runtime of the same file: wllama (llama.cpp in WebAssembly) against llama-cpp-python on the
GGUF, onnxruntime-web against ONNX Runtime on the ONNX file. Opt-in (`python -m export parity RUN --browser`):
it needs Chromium and Playwright, which the export itself never does.

Per page, on export.parity.native_parity's prompts, through the page's own hook `window.prodip` (docs/web.md):
- greedy ids: `generate(prompt, {temperature: 0, raw: true})` against the native backend's greedy ids on its
  own tokenization of the prompt; each continuation equal whole, or parting only at a near tie (the two ids'
  native log p within the row's bound: the kernels differ, the file does not);
- tokenizer ids: `tokenize(text)` against the native backend's `tokenize(text, bos=True)`, and the runtime's own
  prompt length where it reports one (wllama tokenizes the text itself);
- probabilities, as the runtime exposes them (export.parity.browser_page's probes): wllama's top log p of every greedy
  step against llama-cpp-python's (max |Δ log p|, top-1 agreement), onnxruntime-web's whole logits of every step
  against ONNX Runtime's (max |Δlogit|, mean KL(native || browser), top-1 agreement).
Every request the pages make is recorded; one that leaves 127.0.0.1 fails the row, and so does a row that
compared nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import numpy as np

from export.parity.browser_page import (
    ORT_PROBE_JS,
    TOP_K,
    WLLAMA_PROBE_JS,
    BrowserError,
    PageRun,
    chromium,
    foreign_requests,
    require_browser,
    run_page,
    serve_folder,
)
from training.model.logprobs import kl_rows, log_softmax
from training.runfiles.layout import MANIFEST, ONNX_DIR, WEB_DIR
from training.text.normalization import normalize

PAGES = {"wllama": "index.html", "onnxruntime-web": "onnx.html"}
NATIVE = {"wllama": ("llama.cpp", "llama-cpp-python"), "onnxruntime-web": ("onnx", "ONNX Runtime")}
# Bounds, from measurement on the suite's chat model (figures beside each; docs/web.md, "Browser parity"). The same
# file through the same runtime family differs only by its kernels: wllama's WebAssembly build against x86's AVX2
# one moves log p by up to 0.10 on a Q4_K_M file (activations quantized to 8 bits by different code paths) and
# 0.014 on F16; onnxruntime-web's fp32 logits are within 7.0e-5 of ONNX Runtime's (KL 4.1e-12), int8 0.073
# (dynamic quantization, KL 4.9e-6), int4 5.7e-3 (KL 4.9e-9). A greedy continuation may leave the native one only
# at a near tie: where the native log p of the two ids are within the row's max_abs bound.
LIMITS: dict[str, dict[str, float]] = {
    "wllama": {"max_abs": 0.25},  # measured 0.10 (Q4_K_M; near ties parted at gaps <= 0.039), 0.014 (F16)
    "onnxruntime-web-fp32": {"max_abs": 5e-4, "kl": 1e-9},  # measured 7.0e-5, 4.1e-12
    "onnxruntime-web-int8": {"max_abs": 0.3, "kl": 1e-4},  # measured 0.073, 4.9e-6
    "onnxruntime-web-int4": {"max_abs": 0.05, "kl": 1e-6},  # measured 5.7e-3, 4.9e-9
}


def web_pages(web: Path) -> list[str]:
    """The runtimes whose page the web export holds; BrowserError naming the command to run first."""
    found = [rt for rt, page in PAGES.items() if (web / page).is_file()]
    if not found:
        raise BrowserError(f"--browser: {web} holds no web export; run `python -m export web RUN` first")
    return found


# ------------------------------------------------------------------------------------------ native side
def model_of(web: Path, runtime: str, url: str) -> tuple[Path, Path, str]:
    """(the file the page runs, the file the native runtime opens, its label), from prodip-web.json (export.web.web_export):
    the GGUF (its first shard, which llama.cpp opens too), or the ONNX variant the page's ?model= picks (fp32 by
    default), opened natively in export/onnx/ (its config beside it), the same bytes by the manifest's sha256."""
    from export.web.web_config import CONFIG_FILE
    from training.runfiles.layout import read_json

    cfg = read_json(web / CONFIG_FILE, "web export config")
    if runtime == "wllama":
        page_file = web / cfg["gguf"]["shards"][0]
        return page_file, page_file, str(cfg["gguf"].get("type") or "gguf")
    variant = parse_qs(urlsplit(url).query).get("model", ["fp32"])[0]
    if variant not in cfg.get("onnx", {}):
        raise BrowserError(f"{url}: {web / CONFIG_FILE} lists no ONNX {variant}")
    page_file = web / cfg["onnx"][variant]["model"]
    native = web.parent / ONNX_DIR / page_file.name
    files = read_json(web.parent / MANIFEST, "export manifest")["files"]
    sums = [files.get(f.relative_to(web.parent).as_posix(), {}).get("sha256") for f in (page_file, native)]
    if None in sums or sums[0] != sums[1]:
        raise BrowserError(f"{page_file} is not {native} by {web.parent / MANIFEST}: re-run `python -m export web --force`")
    return page_file, native, variant


def native_side(path: Path, runtime: str, prompts: Sequence[str], n_new: int) -> list[dict]:
    """The native backend on `path`, per prompt: its tokens, its greedy ids (as many new tokens as fit the
    context, at most n_new) and the logits of every step (prompt + ids, as the page's runtime computes them:
    llama.cpp through its KV cache one token at a time, ONNX in one pass)."""
    import serving
    from serving.backend import SamplingParams

    b = serving.load(path, NATIVE[runtime][0], threads=1)
    try:
        out = []
        for text in prompts:
            tokens = b.tokenize(text, bos=True)
            n = max(0, min(n_new, b.n_ctx - len(tokens)))
            ids = [int(t) for t in b.generate(tokens, SamplingParams.greedy(n))] if n else []
            seq = (tokens + ids)[:b.n_ctx]
            full = (b.logits_incremental(seq, prefix=len(tokens)) if runtime == "wllama" else b.logits(seq))
            out.append({"tokens": tokens, "n": n, "ids": ids, "eos": tuple(b.eos_ids), "logits": np.asarray(full[len(tokens) - 1:], np.float64)})
        return out
    finally:
        b.close()


def probe_for(runtime: str, label: str, prompts: Sequence[str], native: Sequence[dict]) -> tuple[str, list]:
    """The probe (JS, argument) of `runtime`'s page: wllama's on each prompt text, ONNX's on prompt + native ids."""
    if runtime == "wllama":
        # the text as native serving tokenizes it (normalized): the probe measures the kernels, not the page's input
        return WLLAMA_PROBE_JS, [[[normalize(t), nat["n"]] for t, nat in zip(prompts, native, strict=True)], list(TOP_K)]
    return ORT_PROBE_JS, [label, [[nat["tokens"] + nat["ids"], len(nat["tokens"])] for nat in native]]


# ------------------------------------------------------------------------------------------ comparison
def wllama_probs(native: Sequence[dict], probe: Sequence[list]) -> dict:
    """wllama's top-TOP_K log p of each greedy step against llama-cpp-python's log p of the same ids, on the
    steps whose history is the native one (a step after a different id compares another prefix)."""
    diffs, agree, n = [], 0, 0
    for nat, steps in zip(native, probe, strict=True):
        if steps is None:  # even the top 1 was a byte token wllama cannot report
            continue
        rows = log_softmax(nat["logits"])
        for j, (_, top) in enumerate(steps[:len(rows)]):
            if [c for c, _ in steps[:j]] != nat["ids"][:j]:
                break
            ids = np.array([int(i) for i, _ in top])
            diffs.append(float(np.abs(rows[j][ids] - np.array([float(v) for _, v in top])).max()))
            agree += int(ids[0] == int(rows[j].argmax()))
            n += 1
    return {"max_abs": max(diffs) if diffs else None, "kl": None, "top1": agree / n if n else None,
            "prob_steps": n, "prob_measure": f"max |Δ log p| over wllama's top {TOP_K[0]} ids of each greedy step",
            "prob_unread": sum(steps is None for steps in probe)}


def ort_probs(native: Sequence[dict], probe: Sequence[list]) -> dict:
    """onnxruntime-web's logits of every step (prompt + native greedy ids in one pass) against ONNX Runtime's."""
    diffs, kls, agree, n = [], [], 0, 0
    for nat, flat in zip(native, probe, strict=True):
        ref = nat["logits"]
        got = np.asarray(flat, np.float64).reshape(ref.shape)
        diffs.append(float(np.abs(got - ref).max()))
        kls.append(kl_rows(ref, got))
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        n += len(ref)
    return {"max_abs": max(diffs) if diffs else None, "kl": float(np.concatenate(kls).mean()) if kls else None,
            "top1": agree / n if n else None, "prob_steps": n,
            "prob_measure": "max |Δlogit| and mean KL(native || browser) over the whole vocabulary, every step"}


def tie_gap(nat: dict, got: list[int]) -> float | None:
    """Where the page's greedy ids leave the native ones: the native log p of the native choice minus that of the
    page's (an end of sequence where one stopped); None where they never part."""
    want = nat["ids"]
    j = next((i for i, (x, y) in enumerate(zip(want, got, strict=False)) if x != y), min(len(want), len(got)))
    if want == got or j >= len(nat["logits"]):
        return None
    lp = log_softmax(nat["logits"][j])
    pick = lambda ids, j: lp[ids[j]] if j < len(ids) else max(lp[e] for e in nat["eos"])  # noqa: E731
    return float(pick(want, j) - pick(got, j))


def id_metrics(native: Sequence[dict], page: Sequence[dict], prompts: Sequence[str], tie: float) -> dict:
    """Greedy ids (leading equal tokens, whole continuations equal, those parting only at a near tie, within
    `tie` nats) and tokenizer ids (the hook's, and the runtime's own prompt length where it reports one)."""
    match = total = equal = ties = tok_equal = 0
    mismatches: list[dict] = []
    for text, nat, got in zip(prompts, native, page, strict=True):
        want, ids = nat["ids"], got["ids"]
        match += next((i for i, (x, y) in enumerate(zip(want, ids, strict=False)) if x != y), min(len(want), len(ids)))
        total += len(want)
        equal += int(ids == want)
        gap = tie_gap(nat, ids)
        ties += int(gap is not None and gap <= tie)
        same_tokens = got["tokens"] == nat["tokens"] and got.get("prompt_tokens") in (None, len(nat["tokens"]))
        tok_equal += int(same_tokens)
        if (ids != want or not same_tokens) and len(mismatches) < 4:
            mismatches.append({"text": text[:60], "want": want[:12], "got": ids[:12], "tie_gap": gap,
                               "tokens_want": nat["tokens"][:12], "tokens_got": got["tokens"][:12],
                               "runtime_prompt_tokens": got.get("prompt_tokens"), "native_prompt_tokens": len(nat["tokens"])})
    return {"greedy_match": match, "greedy_total": total, "greedy_equal": equal, "greedy_ties": ties,
            "greedy_prompts": len(prompts), "tokenizer_equal": tok_equal, "tokenizer_total": len(prompts),
            "mismatches": mismatches}


def judge(m: dict, limits: dict[str, float], foreign: Sequence[str]) -> list[str]:
    """Why a row fails: any difference in ids, a probability bound breached, a request off the origin, or
    nothing compared at all (no greedy token, no probability)."""
    out = []
    if not m["greedy_total"]:
        out.append("no greedy token compared")
    if m["greedy_equal"] + m["greedy_ties"] != m["greedy_prompts"]:
        out.append(f"greedy ids differ on {m['greedy_prompts'] - m['greedy_equal'] - m['greedy_ties']} of "
                   f"{m['greedy_prompts']} prompts (not at a near tie)")
    if m["tokenizer_equal"] != m["tokenizer_total"]:
        out.append(f"tokenizer ids differ on {m['tokenizer_total'] - m['tokenizer_equal']} of {m['tokenizer_total']} texts")
    if not m["prob_steps"]:
        out.append("no probability compared")
    for metric, limit in limits.items():
        v = m.get(metric)
        if v is not None and not v <= limit:  # `not <=`: a NaN fails
            out.append(f"{metric} {v:.3g} not <= {limit:g}")
    if foreign:
        out.append(f"{len(foreign)} request(s) left the page's origin, e.g. {foreign[0]}")
    return out


def make_row(rt: str, label: str, run: PageRun, native: list[dict], prompts: Sequence[str], file: Path) -> dict:
    """One parity row (export.parity.native_parity's row keys) for one page; the reference is the native runtime."""
    probs = wllama_probs(native, run.probe) if rt == "wllama" else ort_probs(native, run.probe)
    limits = LIMITS.get(f"{rt}-{label}", LIMITS.get(rt, {}))
    m = {**id_metrics(native, run.results, prompts, limits.get("max_abs", 0.0)), **probs}
    foreign = foreign_requests(run.requests)
    failures = judge(m, limits, foreign)
    speeds = [r["tokens_per_s"] for r in run.results if isinstance(r.get("tokens_per_s"), (int, float))]
    name = f"browser {rt} {label}"
    summary = (f"{name}: reference {NATIVE[rt][1]} on the same file ({file.name}), not PyTorch; greedy ids equal on "
               f"{m['greedy_equal']} of {m['greedy_prompts']} prompts, {m['greedy_ties']} more parting at a near tie "
               f"(native log p gap <= {limits.get('max_abs', 0):g}); {m['prob_measure']} "
               f"({m['prob_steps']} steps); {len(run.requests)} requests, all to the page's origin"
               + ("" if not foreign else f" except {len(foreign)}"))
    return {"name": name, "kind": f"browser-{rt}-{label}", "file": str(file), "reference": NATIVE[rt][1],
            "page": run.url, "info": run.info, **m, "requests": len(run.requests), "foreign_requests": foreign,
            "page_errors": run.errors[:3], "tokens_per_s": float(np.median(speeds)) if speeds else None,
            "thresholds": limits, "summary": summary, "notes": [], "passed": not failures, "failures": failures}


# ------------------------------------------------------------------------------------------ orchestration
def page_urls(base: str, web: Path, onnx_kinds: Sequence[str] = ()) -> list[tuple[str, str]]:
    """(runtime, URL) of every page the web export holds: wllama's, onnxruntime-web's for its default file and
    each other ONNX variant asked for (`?model=int8`)."""
    out = []
    for rt in web_pages(web):
        out.append((rt, base + PAGES[rt]))
        if rt == "onnxruntime-web":
            out += [(rt, f"{base}{PAGES[rt]}?model={k}") for k in onnx_kinds if k != "fp32"]
    return out


def page_row(browser, url: str, rt: str, web: Path, prompts: Sequence[str], n_new: int,
             requests: list[str] | None = None) -> dict:
    """One page's row. The native side runs first, so each prompt asks the page for as many new tokens as the
    native context has room for (the long prompt: fewer than n_new)."""
    path, native_path, label = model_of(web, rt, url)
    native_all = native_side(native_path, rt, prompts, n_new)
    kept = [(p, nat) for p, nat in zip(prompts, native_all, strict=True) if nat["n"]]  # a prompt filling the context
    texts, native = [p for p, _ in kept], [nat for _, nat in kept]
    run = run_page(browser, url, [(p, nat["n"]) for p, nat in kept], probe_for(rt, label, texts, native), requests)
    if str(run.info.get("model")) != path.name:
        raise BrowserError(f"{url}: the page runs {run.info.get('model')!r}, its config names {path.name}")
    return make_row(rt, label, run, native, texts, path)


def browser_rows(web: Path, prompts: Sequence[str], n_new: int, *, browser=None, base_url: str | None = None,
                 onnx_kinds: Sequence[str] = (), progress: Callable[[str], None] | None = None,
                 requests: list[str] | None = None) -> list[dict]:
    """One row per page of `web`, each against the native runtime of the file it ran. Serves `web` itself
    and starts its own Chromium unless given `base_url` / `browser` (a test's one session)."""
    with contextlib.ExitStack() as stack:
        base = base_url or stack.enter_context(serve_folder(web))
        browser = browser or stack.enter_context(chromium())
        rows = []
        for rt, url in page_urls(base, web, onnx_kinds):
            if progress:
                progress(f"parity: browser {rt} ({url})")
            rows.append(page_row(browser, url, rt, web, prompts, n_new, requests))
        return rows


def parity_rows(src, out_dir: Path, ref, thresholds, progress: Callable[[str], None] | None = None) -> list[dict]:
    """export.parity.native_parity's extra_rows hook: every page of out_dir/web/ (every ONNX variant it holds) on the
    reference's prompts and continuation length."""
    from export.web.web_config import CONFIG_FILE
    from training.runfiles.layout import read_json

    web = out_dir / WEB_DIR
    web_pages(web)
    kinds = list(read_json(web / CONFIG_FILE, "web export config").get("onnx") or {})
    return browser_rows(web, ref.prompts, ref.n_new, onnx_kinds=kinds, progress=progress)


def add_browser_flag(group) -> None:
    group.add_argument("--browser", action="store_true", help="parity only: also run RUN/export/web/'s pages (python -m "
                       "export web) in headless Chromium against the native runtime of the same file (needs chromium "
                       "+ playwright)")


def check_browser_flag(command: str, export_dir: Path) -> None:
    """`--browser` before anything runs: only with `parity`, Chromium + Playwright installed, a web export there."""
    if command != "parity":
        raise BrowserError(f"--browser: only with `python -m export parity RUN --browser` (not `{command}`): "
                           "run `python -m export web RUN` first, then parity")
    require_browser()
    web_pages(export_dir / WEB_DIR)


def with_browser_rows(other: Callable | None) -> Callable:
    """export.parity.native_parity's extra_rows hook: `other`'s rows (another opt-in's), then the browser rows."""
    def rows(src, out_dir: Path, ref, thresholds, progress=None) -> list[dict]:
        first = other(src, out_dir, ref, thresholds, progress) if other is not None else []
        return first + parity_rows(src, out_dir, ref, thresholds, progress)

    return rows
