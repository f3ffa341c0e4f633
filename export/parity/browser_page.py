"""Driving the web export's pages (export.web.web_export) in headless Chromium for export.parity.browser_parity and the serving
benchmark: Chromium and Playwright found (or one line naming what to install), the folder served on 127.0.0.1
with the cross-origin isolation headers wasm threads need, one page opened, every request it makes recorded,
the `window.prodip` hook called (docs/web.md), and the probes that read the probabilities the hook does not
give from the runtime the page runs (its vendored files, the model file prodip-web.json names)."""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import shutil
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from export import ExportError

CHROMIUM_ENV = "PRODIP_CHROMIUM"  # another Chromium binary than Debian's
CHROMIUM_PATHS = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
INSTALL_HINT = ("install Chromium and Playwright (Debian: apt-get install chromium; "
                "pip install 'prodip[dev]', which brings playwright)")
LOAD_TIMEOUT_MS = 120_000  # the page fetches and compiles its runtime's .wasm and the model
ISOLATION_HEADERS = {"Cross-Origin-Opener-Policy": "same-origin", "Cross-Origin-Embedder-Policy": "require-corp",
                     "Cross-Origin-Resource-Policy": "same-origin"}


# wllama's top log-probabilities per step: 20, else fewer. wllama 3.13.0 cannot return the log p of a byte token
# (an incomplete UTF-8 piece such as <0xE0>): its worker's message decoding throws ("Invalid typed array length")
TOP_K = (20, 5, 1)
# One prompt through the page's hook: its tokenizer's ids, then a greedy raw continuation.
RUN_PROMPT_JS = """async ([text, n]) => {
  const p = window.prodip;
  const tokens = Array.from(await p.tokenize(text));
  const g = await p.generate(text, { max_tokens: n, temperature: 0, raw: true });
  return { tokens, ids: Array.from(g.ids, Number), text: g.text, tokens_per_s: g.tokens_per_s,
           prompt_tokens: g.prompt_tokens ?? null };
}"""
READY_JS = "async () => { await window.prodip.ready; return JSON.parse(JSON.stringify(window.prodip.info ?? {})); }"
# The probabilities, from the runtime the page runs (its vendored files, the file the page names), as the page
# hook gives none. wllama: a second instance on the same GGUF, greedy with the top TOP_K log-probabilities of
# every step (llama-server's completion logprobs: ids and log p). onnxruntime-web: a second session on the same
# .onnx, each prompt + the native greedy ids in one pass from an empty cache, the logits of every step.
WLLAMA_PROBE_JS = """async ([items, ks]) => {
  const url = (p) => new URL(p, location.href).href;
  const cfg = await (await fetch(url('prodip-web.json'))).json();
  const { Wllama } = await import(url('vendor/wllama/index.js'));
  const open = async () => {
    const w = new Wllama({ default: url('vendor/wllama/wllama.wasm') }, { suppressNativeLog: true });
    await w.loadModelFromUrl(url(cfg.gguf.shards[0]), { n_threads: 1, n_gpu_layers: 0, n_ctx: cfg.n_ctx,
                                                        n_parallel: 1, useCache: false });
    return w;
  };
  let w = await open();
  const out = [];
  for (const [text, n] of items) {
    let steps = null;
    for (const k of ks) {  // a byte token among the top k breaks wllama's message decoding: fewer, on a new instance
      try {
        const r = await w.createCompletion({ prompt: text, max_tokens: n, temperature: 0, top_k: 0, top_p: 1,
                                             min_p: 0, repeat_penalty: 1, logprobs: k, cache_prompt: false });
        steps = (r.choices[0].logprobs?.content || []).map((c) => [c.id, c.top_logprobs.map((t) => [t.id, t.logprob])]);
        break;
      } catch (e) {
        await w.exit().catch(() => {});
        w = await open();
      }
    }
    out.push(steps);
  }
  await w.exit();
  return out;
}"""
ORT_PROBE_JS = """async ([variant, seqs]) => {
  const url = (p) => new URL(p, location.href).href;
  const cfg = await (await fetch(url('prodip-web.json'))).json();
  const ort = await import(url('vendor/ort/ort.wasm.min.mjs'));
  const files = cfg.onnx[variant];
  const s = await ort.InferenceSession.create(url(files.model), { executionProviders: ['wasm'],
    graphOptimizationLevel: 'all', externalData: files.data.map((d) => ({ path: d.split('/').pop(), data: url(d) })) });
  const { n_layers: L, n_kv_heads: kv, head_dim: hd, vocab_size: V } = cfg.onnx_shape;
  const i64 = (a) => BigInt64Array.from(a, (v) => BigInt(v));
  const out = [];
  for (const [ids, first] of seqs) {
    const t = ids.length;
    const feed = { input_ids: new ort.Tensor('int64', i64(ids), [1, t]),
                   attention_mask: new ort.Tensor('int64', new BigInt64Array(t).fill(1n), [1, t]),
                   position_ids: new ort.Tensor('int64', i64(ids.map((_, k) => k)), [1, t]) };
    for (let i = 0; i < L; i++) for (const x of ['key', 'value'])
      feed[`past_key_values.${i}.${x}`] = new ort.Tensor('float32', new Float32Array(0), [1, kv, 0, hd]);
    const r = await s.run(feed, ['logits']);
    out.push(Array.from(r.logits.data.subarray((first - 1) * V, t * V)));
  }
  await s.release();
  return out;
}"""


class BrowserError(ExportError):
    pass


# ------------------------------------------------------------------------------------ what is needed
def find_chromium() -> Path | None:
    env = os.environ.get(CHROMIUM_ENV)
    for cand in ([env] if env else [*CHROMIUM_PATHS, shutil.which("chromium") or ""]):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return Path(cand)
    return None


def require_browser() -> Path:
    """Chromium's path, once Playwright imports; BrowserError naming what to install otherwise."""
    from importlib.util import find_spec

    if find_spec("playwright") is None:
        raise BrowserError(f"--browser: the Python package playwright is not installed; {INSTALL_HINT}")
    chromium = find_chromium()
    if chromium is None:
        where = os.environ.get(CHROMIUM_ENV) or " or ".join(CHROMIUM_PATHS)
        raise BrowserError(f"--browser: no Chromium at {where}; {INSTALL_HINT}")
    return chromium


# ------------------------------------------------------------------------------------------ serving
class _Handler(http.server.SimpleHTTPRequestHandler):
    """Static files with the cross-origin isolation headers wasm threads need (as `python -m serving --web`)."""

    def end_headers(self) -> None:
        for k, v in ISOLATION_HEADERS.items():
            self.send_header(k, v)
        super().end_headers()

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
        pass


@contextlib.contextmanager
def serve_folder(folder: Path) -> Iterator[str]:
    """`folder` served on 127.0.0.1 (a free port) in a thread; yields its base URL."""
    handler = functools.partial(_Handler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def chromium(executable: Path | None = None) -> Iterator[object]:
    """One headless Chromium (a Playwright Browser) for every page of a session."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(executable or require_browser()), args=CHROMIUM_ARGS,
                                    headless=True)
        try:
            yield browser
        finally:
            browser.close()


# ------------------------------------------------------------------------------------------ the page
@dataclass
class PageRun:
    """What one page gave: its info, each prompt's result, the probe's output, every URL it requested."""

    url: str
    info: dict
    results: list[dict]
    probe: list
    requests: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def run_page(browser, url: str, items: Sequence[tuple[str, int]], probe: tuple[str, list],
             requests: list[str] | None = None) -> PageRun:
    """Open `url` in a fresh context, wait for window.prodip.ready, run each (prompt, new tokens) through the
    hook, then the probe (JS, its argument). `requests` collects every URL requested (a test's, across pages)."""
    context = browser.new_context()
    seen: list[str] = [] if requests is None else requests
    context.on("request", lambda r: seen.append(r.url))
    errors: list[str] = []
    try:
        page = context.new_page()
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url, wait_until="domcontentloaded", timeout=LOAD_TIMEOUT_MS)
        page.wait_for_function("() => window.prodip !== undefined", timeout=LOAD_TIMEOUT_MS)
        info = page.evaluate(READY_JS)
        results = [page.evaluate(RUN_PROMPT_JS, [text, n]) for text, n in items]
        probed = page.evaluate(*probe)
    except Exception as e:  # Playwright's errors: the page failed, named with what it logged
        raise BrowserError(f"{url}: {str(e).splitlines()[0]}{'; page errors: ' + errors[0] if errors else ''}") from None
    finally:
        context.close()
    return PageRun(url, info, results, probed, seen, errors)


def foreign_requests(urls: Sequence[str], host: str = "127.0.0.1") -> list[str]:
    """The requested URLs whose host is not `host` (data: and blob: URLs stay in the page)."""
    return [u for u in urls if urlsplit(u).scheme not in ("data", "blob") and urlsplit(u).hostname != host]
