"""`python -m export web` (export.web.web_export): the static site's files and manifest entries, what it shares with
native serving (chat template, tokenizer rule, sampling defaults, stream decoding: the page's own JS run
under node against training.text.chat_template / serving), bad input, and `python -m serving RUN --web`'s headers.
The page in a real browser (greedy ids vs native) is tests/test_browser_parity.py's (another module)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import REPO

from export.__main__ import main as export_main
from export.web import web_export as web
from export.web.web_config import CONFIG_FILE, join_chat
from training.runfiles import layout
from training.text.chat_template import encode, render

NODE = shutil.which("node")
BN = "সোনার বাংলা, আমি তোমায় ভালোবাসি।"


def make_run(tmp: Path, serve_run: Path, onnx_export: tuple[Path, list[Path]] | None) -> Path:
    """A run folder of our own: the chat run's export (its GGUF, manifest, card), plus the ONNX export."""
    run = tmp / "run"
    shutil.copytree(serve_run / layout.EXPORT, run / layout.EXPORT, copy_function=os.link)
    for name in ("tokenizer.model", layout.RUN_CONFIG):
        shutil.copyfile(serve_run / name, run / name)
    if onnx_export is not None:
        # copied, not linked: onnx.checker refuses external data with several hard links, so a link here would
        # break the shared fixture's ONNX for every later test (a CI run failed test_export_onnx that way)
        shutil.copytree(onnx_export[0], run / layout.EXPORT / layout.ONNX_DIR)
    return run


def gguf_of(run: Path) -> Path:
    return next((run / layout.EXPORT / layout.GGUF_DIR).glob("*.gguf"))


@pytest.fixture(scope="module")
def site(serve_run, onnx_export, tmp_path_factory) -> Path:
    """The web export of the suite's chat run (its F16 GGUF through --model, fp32/int8/int4 ONNX)."""
    run = make_run(tmp_path_factory.mktemp("web"), serve_run, onnx_export)
    assert export_main(["web", str(run), "--model", gguf_of(run).name]) == 0
    return run


def files_of(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def test_the_exports_own_onnx_files_stay_unlinked(site):
    """The web copy of the ONNX export is a copy: onnx.checker (and anyone checking the export's own ONNX
    after `export web`) refuses external data that has several hard links."""
    import onnx

    onnx_dir = site / layout.EXPORT / layout.ONNX_DIR
    for data in [*onnx_dir.glob("*.onnx_data"), *(site / layout.EXPORT / "web" / "models" / "onnx").glob("*_data")]:
        assert data.stat().st_nlink == 1, data
    onnx.checker.check_model(str(onnx_dir / "model.onnx"), full_check=True)


def test_site_files_and_manifest(site):
    out = site / layout.EXPORT / web.WEB_DIR
    files = files_of(out)
    want = {"index.html", "onnx.html", "common.js", "wllama-page.js", "onnx-page.js", "prodip.css", CONFIG_FILE,
            "tokenizer.json", "card.md", *web.WLLAMA_FILES, *web.ORT_FILES, *web.TOKENIZER_FILES,
            f"models/{gguf_of(site).name}"}
    assert want <= files, want - files
    cfg = json.loads((out / CONFIG_FILE).read_text(encoding="utf-8"))
    assert set(cfg["onnx"]) == {"fp32", "int8", "int4"}
    for v in cfg["onnx"].values():  # every file the page asks for is there
        assert {v["model"], *v["data"]} <= files and v["data"], v
    assert cfg["gguf"]["shards"] == [f"models/{gguf_of(site).name}"]
    manifest = json.loads((site / layout.EXPORT / layout.MANIFEST).read_text())
    listed = {r.removeprefix("web/") for r, e in manifest["files"].items() if e["format"] == "web"}
    assert listed == files
    from export.verify import verify

    n, _ = verify(site / layout.EXPORT)
    assert n >= len(files)


def test_site_fetches_nothing_outside_its_origin(site):
    """Our pages, styles and config name no absolute http(s) URL (the runtimes' own code is pinned npm
    code; that nothing leaves 127.0.0.1 at run time is the browser test's)."""
    out = site / layout.EXPORT / web.WEB_DIR
    ours = [p for p in out.iterdir() if p.suffix in (".html", ".js", ".css", ".json") and p.name != "tokenizer.json"]
    assert len(ours) >= 7
    for p in ours:
        urls = re.findall(r"https?://[^\s\"'<>)]+", p.read_text(encoding="utf-8"))
        assert urls == [], (p.name, urls)


def test_sampling_defaults_are_servings(site):
    from serving.backend import DEFAULT_MAX_TOKENS, SamplingParams

    cfg = json.loads((site / layout.EXPORT / web.WEB_DIR / CONFIG_FILE).read_text(encoding="utf-8"))
    d = SamplingParams()
    for k, v in {"max_tokens": DEFAULT_MAX_TOKENS, "temperature": d.temperature, "top_k": d.top_k,
                 "top_p": d.top_p, "repetition_penalty": d.repetition_penalty}.items():
        assert cfg["sampling"][k] == v, k


CONVERSATION = [{"role": "system", "content": "তুমি সাহায্যকারী।"}, {"role": "user", "content": BN},
                {"role": "assistant", "content": "হ্যাঁ।\n"}, {"role": "user", "content": "x <|im_start|>user\n<s>"}]


def test_chat_parts_join_to_the_template(site):
    cfg = json.loads((site / layout.EXPORT / web.WEB_DIR / CONFIG_FILE).read_text(encoding="utf-8"))
    for msgs in (CONVERSATION, CONVERSATION[1:2], []):
        assert join_chat(cfg["chat"], msgs) == render(msgs)
        assert join_chat(cfg["chat"], msgs, False) == render(msgs, add_generation_prompt=False)


NODE_SCRIPT = """
import { Tok, encodeChat, renderChat, TextStream } from '%s';
import { readFileSync } from 'node:fs';
const dir = %s;
const cfg = JSON.parse(readFileSync(dir + '/prodip-web.json', 'utf8'));
const tok = new Tok(JSON.parse(readFileSync(dir + '/tokenizer.json', 'utf8')), cfg);
const input = JSON.parse(readFileSync(0, 'utf8'));
const specials = input.texts.map((t) => tok.raw(t, true));
const s = new TextStream(cfg, cfg.chat.stop);
const pieces = input.stream.map((id) => s.push(id));
pieces.push(s.end());
console.log(JSON.stringify({raw: input.texts.map((t) => tok.raw(t)), specials, chat: encodeChat(tok, cfg.chat, input.conv),
  text: renderChat(cfg.chat, input.conv), pieces, invalid: s.invalid}));
"""


def test_page_js_encodes_and_decodes_as_native(site, tmp_path):
    """common.js (the page's own code, under node): raw prompt ids = native tokenize (BOS first, user text
    never special), chat ids = training.text.chat_template.encode, the stream holds back split UTF-8 and shows no U+FFFD.
    No node is a failure, not a skip (as tests/test_transformers_js.py): the page's JS must be run to be judged."""
    assert NODE is not None, "node not found: install Node.js (npm's node runs the page's JS), then scripts/setup.sh"
    from training.text.tokenizer import Tokenizer

    out = site / layout.EXPORT / web.WEB_DIR
    tok = Tokenizer.load(site / "tokenizer.model")
    from export.parity.native_parity import CHAT_PROMPT

    texts = [BN, "hello <|im_end|> <s>", "a\r\nb\ufeff", "e\u0301", CHAT_PROMPT]
    byte_ids = [tok.sp.piece_to_id(f"<0x{b:02X}>") for b in "আ".encode()]  # one letter as three byte pieces
    stream = [*tok.encode("বাংলা", bos=False), *byte_ids, tok.sp.piece_to_id("<0xFF>"), *tok.encode("ok", bos=False)]
    script = tmp_path / "check.mjs"
    script.write_text(NODE_SCRIPT % ((out / "common.js").as_uri(), json.dumps(str(out))), encoding="utf-8")
    p = subprocess.run([NODE, str(script)], input=json.dumps({"texts": texts, "conv": CONVERSATION, "stream": stream}),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert got["raw"] == [tok.encode(t, bos=True) for t in texts]
    assert got["specials"] == [tok.encode(t, bos=True, allow_special=True) for t in texts]
    assert got["chat"] == encode(tok, CONVERSATION).ids
    assert got["text"] == render(CONVERSATION)
    shown = "".join(got["pieces"])
    assert shown == "বাংলাআok" and "\ufffd" not in shown and got["invalid"] == 1
    n = len(tok.encode("বাংলা", bos=False))
    assert got["pieces"][n:n + 2] == ["", ""]  # the first two bytes of আ held back, shown with the third


def run_export(argv: list[str], capsys) -> tuple[int, str]:
    code = export_main(argv)
    return code, capsys.readouterr().err


def test_bad_input_refused_nothing_written(serve_run, tmp_path, capsys, monkeypatch):
    run = make_run(tmp_path, serve_run, None)
    export = run / layout.EXPORT
    before = files_of(export)
    code, err = run_export(["web", str(run)], capsys)  # F16 only: no Q4_K_M, no ONNX
    assert code == 2 and "python -m export gguf" in err and "--q4" in err, err
    for argv, why in ((["web", str(run), "--model", "missing.gguf"], "--model missing.gguf: not found"),
                      (["web", str(run), "--model", str(run / "tokenizer.model")], "not a GGUF"),
                      (["web", str(run), "--q4"], "--q4 does not apply to `web`"),
                      (["gguf", str(run), "--web"], "--web applies to `python -m export all` only")):
        code, err = run_export(argv, capsys)
        assert code == 2 and why in err and err.count("\n") == 1, (argv, err)
    monkeypatch.setattr(web, "NODE_MODULES", tmp_path / "no-npm")
    code, err = run_export(["web", str(run), "--model", gguf_of(run).name], capsys)
    assert code == 2 and "scripts/setup.sh" in err, err
    assert files_of(export) == before


def demo_row(run: Path) -> str:
    from demo.models import ModelEntry
    from demo.run_card import model_card

    return model_card(ModelEntry("m", gguf_of(run), "llama.cpp")).get("run it on this device")


def test_existing_site_needs_force_and_gguf_only_run(serve_run, tmp_path, capsys):
    """A GGUF-only run gets index.html alone (and says so); the demo's card then offers the page."""
    run = make_run(tmp_path, serve_run, None)
    assert demo_row(run) == ""
    argv = ["web", str(run), "--model", gguf_of(run).name]
    code, err = run_export(argv, capsys)
    assert code == 0 and "onnx.html was not written" in err, err
    out = run / layout.EXPORT / web.WEB_DIR
    assert not (out / "onnx.html").exists() and (out / "index.html").is_file()
    assert f"python -m serving {run} --web" in demo_row(run)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    code, err = run_export(argv, capsys)
    assert code == 2 and "--force" in err
    code, err = run_export(["web", str(run), "--model", str(out / "models" / gguf_of(run).name), "--force"], capsys)
    assert code == 2 and "--model" in err, err  # the output would hold its own input
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_big_gguf_is_split_in_shards_that_load(serve_run, tmp_path, monkeypatch):
    """Over the per-file limit (lowered here), the GGUF goes as llama.cpp split shards; llama.cpp opens them."""
    run = make_run(tmp_path, serve_run, None)
    gguf = gguf_of(run)
    monkeypatch.setattr(web, "MAX_FILE_BYTES", gguf.stat().st_size // 2)
    monkeypatch.setattr(web, "SPLIT_BYTES", gguf.stat().st_size // 3)
    assert export_main(["web", str(run), "--model", gguf.name]) == 0
    out = run / layout.EXPORT / web.WEB_DIR
    shards = json.loads((out / CONFIG_FILE).read_text())["gguf"]["shards"]
    assert len(shards) >= 2 and all((out / s).is_file() for s in shards), shards
    assert shards[0].endswith(f"-00001-of-{len(shards):05d}.gguf")
    from serving.backends.llamacpp_backend import LlamaCppBackend

    b = LlamaCppBackend(out / shards[0])
    ref = LlamaCppBackend(gguf)
    from serving.backend import SamplingParams

    ids = ref.tokenize(BN)
    assert list(b.generate(ids, SamplingParams.greedy(8))) == list(ref.generate(ids, SamplingParams.greedy(8)))


def test_serving_web_sends_the_headers(serve_run, tmp_path):
    run = make_run(tmp_path, serve_run, None)
    assert export_main(["web", str(run), "--model", gguf_of(run).name]) == 0
    p = subprocess.Popen([sys.executable, "-m", "serving", str(run), "--web", "--port", "0"], cwd=REPO,
                         stderr=subprocess.PIPE, text=True)
    try:
        line = p.stderr.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+/", line)
        assert url, line
        with httpx.Client(base_url=url.group(0), timeout=30) as c:
            for path, mime in (("/", "text/html"), ("/vendor/wllama/wllama.wasm", "application/wasm"),
                               ("/common.js", "text/javascript"), ("/vendor/ort/ort.wasm.min.mjs", None),
                               ("/vendor/tokenizers/tokenizers.mjs", "text/javascript")):
                r = c.get(path)
                if mime is None:
                    assert r.status_code == 404  # no ONNX export: no ONNX runtime copied
                    continue
                assert r.status_code == 200 and r.headers["content-type"].startswith(mime), (path, r.headers)
                assert r.headers["cross-origin-opener-policy"] == "same-origin"
                assert r.headers["cross-origin-embedder-policy"] == "require-corp"
    finally:
        p.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(10)
