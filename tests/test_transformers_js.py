"""transformers.js opens our ONNX export as it is (#44, item 5): the pinned @huggingface/transformers
(export/site/node_modules, installed by scripts/setup.sh) under Node, pointed at the suite's
RUN/export/onnx with nothing copied or renamed, gives training's tokenizer ids and the greedy ids of
our ONNX Runtime backend, with the export's own generation_config.json. And one repetition penalty
everywhere: serving's default is what every export writes, and greedy decoding is never penalised.

Node and npm are part of the dev setup (CI has both): a missing one fails, naming the script to run."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO

from serving.backend import SamplingParams, ServingError

RUNNER = Path(__file__).with_name("transformers_js_run.mjs")
PACKAGE = REPO / "export" / "site" / "node_modules" / "@huggingface" / "transformers"
ENTRY = PACKAGE / "dist" / "transformers.node.mjs"
VERSION = "4.3.2"  # export/site/package.json pins it
NEW_TOKENS = 24
# Greedy prompts: Bangla and English; on the suite's model three run the full 24 tokens (two repeat
# a token, where a repetition penalty would show) and two end at </s> after 6-7 tokens.
GENERATE = ["আমার সোনার বাংলা", "আমি ভাত খাই এবং", "The quick brown fox", "Dhaka is the capital of",
            "Hello, my name is"]
# Tokenizer-only prompts: what training.text.normalization.normalize changes (CRLF, a BOM, a nukta written apart),
# digits in both scripts, an emoji (byte fallback), runs of spaces and a tab.
TOKENIZE = ["ঢাকা ও কলকাতা: 2024 সালে ৩৫% মানুষ — Bangla and English, mixed!",
            "য\u09bc নুকতা আলাদা করে লেখা\r\nআর CRLF", "\ufeffবিওএম দিয়ে শুরু", "emoji 😀 and tabs\tand  two  spaces"]


def node(*args: str, timeout: int = 120) -> str:
    """`node ARGS` in the repo; its stdout. No Node or no installed package: a failure naming the setup."""
    if shutil.which("node") is None or not ENTRY.is_file():
        pytest.fail(f"node or {PACKAGE.relative_to(REPO)} is missing: run scripts/setup.sh --dev "
                    "(it installs export/site's pinned npm packages)")
    p = subprocess.run(["node", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


@pytest.fixture(scope="module")
def tjs(onnx_export) -> dict:
    """The runner's answer for every prompt (one Node process: loading transformers.js is most of it)."""
    out, _ = onnx_export
    request = json.dumps({"prompts": GENERATE + TOKENIZE, "new_tokens": NEW_TOKENS})
    return json.loads(node(str(RUNNER), str(out), request).strip().splitlines()[-1])


@pytest.fixture(scope="module")
def ort(onnx_export):
    from serving.backends.onnxrt_backend import OnnxBackend

    out, _ = onnx_export
    return OnnxBackend(out, threads=1)


def test_transformers_js_tokenizes_as_training(tjs, onnx_run):
    from training.runfiles import layout
    from training.text.tokenizer import Tokenizer

    assert tjs["version"] == VERSION and tjs["model_type"] == "llama"
    tok = Tokenizer.load(onnx_run / layout.TOKENIZER)  # the run's own, as training encodes
    for prompt, ids in zip(GENERATE + TOKENIZE, tjs["ids"], strict=True):
        assert ids == tok.encode(prompt, bos=True), prompt


def test_greedy_ids_equal_onnx_runtime(tjs, ort):
    """transformers.js with `do_sample: false` and the export's generation_config.json against serving's
    ONNX backend (SamplingParams.greedy): the same ids, and the same stop. transformers.js returns the
    end-of-turn id it stopped at; our backend ends the stream before it."""
    compared = 0
    for prompt, got in zip(GENERATE, tjs["generated"], strict=False):
        ref = list(ort.generate(ort.tokenize(prompt), SamplingParams.greedy(NEW_TOKENS)))
        if len(ref) < NEW_TOKENS:
            assert got[:-1] == ref and got[-1] in ort.eos_ids, prompt
        else:
            assert got == ref, prompt
        compared += len(ref)
    assert compared >= 3 * NEW_TOKENS  # measured: 85 tokens (3 full runs + 7 + 6); nothing compared fails


def test_one_repetition_penalty_and_greedy_is_not_penalised(tjs, onnx_export, onnx_run):
    """Serving's default (SamplingParams) is what generation_config.json of both exports and GenAI's config
    carry, and it is 1.0: HF generate and transformers.js apply a penalty in greedy decoding too."""
    from export.hf.hf_export import generation_config
    from export.manifest import load_source
    from export.onnx.genai import genai_config
    from serving.backends.onnxrt_backend import read_config
    from serving.server.http_requests import sampling_from_body

    out, _ = onnx_export
    default = SamplingParams().repetition_penalty
    written = json.loads((out / "generation_config.json").read_text(encoding="utf-8"))
    assert written == generation_config(load_source(onnx_run))  # the HF export writes the same file
    assert written["repetition_penalty"] == default == 1.0
    assert tjs["generation_config"]["repetition_penalty"] == 1.0  # as transformers.js read it
    assert genai_config(read_config(out), "model.onnx")["search"]["repetition_penalty"] == default
    assert sampling_from_body({"temperature": 0}, 64).repetition_penalty == 1.0  # a greedy HTTP request


def doc_snippet() -> str:
    """The ```js block of docs/onnx.md's transformers.js section."""
    text = (REPO / "docs" / "onnx.md").read_text(encoding="utf-8")
    section = text[text.index("### transformers.js"):]
    m = re.search(r"^```js\n(.*?)^```", section, re.S | re.M)
    assert m, "docs/onnx.md: the transformers.js section has no ```js block"
    return m.group(1)


def test_the_documented_usage_runs(onnx_export, ort, tmp_path):
    """docs/onnx.md's block, as written, with RUN/export/ the suite's export and the package imported from
    export/site: it prints the prompt and its greedy continuation, as our backend decodes them."""
    out, _ = onnx_export
    code = doc_snippet()
    for placeholder in ("'@huggingface/transformers'", "'RUN/export/'", "from_pretrained('onnx'"):
        assert placeholder in code, placeholder
    code = (code.replace("'@huggingface/transformers'", json.dumps(ENTRY.as_uri()))
            .replace("'RUN/export/'", json.dumps(str(out.parent) + "/"))
            .replace("from_pretrained('onnx'", f"from_pretrained({json.dumps(out.name)}"))
    script = tmp_path / "doc.mjs"
    script.write_text(code, encoding="utf-8")
    prompt = re.search(r"tokenizer\('([^']+)'\)", code).group(1)
    n = int(re.search(r"max_new_tokens: (\d+)", code).group(1))
    ids = ort.tokenize(prompt)
    want = ort.detokenize(ids + list(ort.generate(ids, SamplingParams.greedy(n))))
    assert node(str(script)).strip() == want.strip()


def test_an_export_with_the_old_data_name_still_serves_and_verifies(onnx_export, onnx_run, ort, tmp_path):
    """An export written before the rename (weights in model.onnx.data, so named inside model.onnx):
    served with the same greedy ids, verified against its manifest, its data counted as the model's own
    file, linked into GenAI's folder."""
    import onnx

    from export.manifest import Manifest, load_source
    from export.onnx.genai import write_genai_files
    from export.verify import verify
    from serving import load
    from serving.backends.onnxrt_backend import CONFIG_FILE, TOKENIZER_FILE
    from serving.export_files import check_before_load, files_read_by, read

    out, _ = onnx_export
    old = tmp_path / "export" / "onnx"
    old.mkdir(parents=True)
    for name in (TOKENIZER_FILE, CONFIG_FILE, "model-int8.onnx", "model-int8.onnx_data"):
        shutil.copy2(out / name, old / name)
    proto = onnx.load(str(out / "model.onnx"), load_external_data=False)
    for t in proto.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                assert e.value == "model.onnx_data"
                e.value = "model.onnx.data"
    onnx.save(proto, str(old / "model.onnx"))
    shutil.copy2(out / "model.onnx_data", old / "model.onnx.data")

    src = load_source(onnx_run)
    man = Manifest.open(old.parent, src, force=False)
    for p in sorted(old.iterdir()):
        man.add(p, "onnx", p.suffix.lstrip("."))
    man.save()
    assert verify(old.parent)[0] == 6
    m = read(old.parent)
    assert files_read_by(m, old / "model.onnx") == [
        "onnx/model.onnx", "onnx/model.onnx.data", "onnx/onnx_config.json", "onnx/tokenizer.model"]

    ids = ort.tokenize(GENERATE[2])
    backend = load(old / "model.onnx", threads=1)  # checked against the manifest first
    assert list(backend.generate(ids, SamplingParams.greedy(8))) == list(ort.generate(ids, SamplingParams.greedy(8)))

    linked = write_genai_files(old, src)
    assert (old / "genai" / "fp32" / "model.onnx.data").samefile(old / "model.onnx.data")
    assert old / "genai" / "fp32" / "model.onnx.data" in linked

    data = old / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(ServingError, match="model.onnx.data"):
        check_before_load(old / "model.onnx")
