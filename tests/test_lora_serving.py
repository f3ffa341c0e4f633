"""Several LoRA adapters on one llama.cpp base, switched per generation without reloading the base: the
backend (serving.backends.llamacpp_backend + serving.backends.llamacpp_lora), the HTTP server's /v1/models and "adapter" field
(serving.lora_pairs, serving.server.http_requests), `python -m serving BASE.gguf --lora NAME=A.gguf --lora ...`,
and the demo's picker and card (demo.models, demo.app, demo.run_card).

Fixture: two adapters trained 6 steps each on the tiny base (different seeds and learning rates, the serving
fixtures' chat set), exported once with the base's F16 GGUF (export gguf --no-parity; test_lora holds the parity)."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import built_once
from fixtures_serve import QUESTIONS, write_chats

from serving.backend import SamplingParams

STEPS = 6
FAST = ["--skip-gate", "throughput", "--skip-gate", "overfit_one_batch", "--skip-gate", "compiled_vs_eager"]
PROMPT = "আমার সোনার বাংলা"
GREEDY = {"temperature": 0, "top_k": 0, "top_p": 1, "repetition_penalty": 1, "max_tokens": 8}


def train_and_export(tiny_run: Path, root: Path) -> tuple[Path, Path, Path, Path]:
    """(base F16 GGUF, adapter A GGUF, adapter B GGUF, adapter A's run folder)."""
    from export.__main__ import main as export_main
    from training import sft

    chats = write_chats(root / "chats.jsonl")
    files = []
    for name, extra in (("a", ["--seed", "1"]), ("b", ["--seed", "7", "--lr", "1e-2"])):
        argv = ["--init", str(tiny_run), "--data", str(chats), "--out", str(root / name), "--max-steps", str(STEPS),
                "--batch-size", str(len(QUESTIONS)), "--seq-len", "128", "--lr", "3e-3", "--warmup-steps", "2",
                "--eval-every", "0", "--save-every", str(STEPS), "--log-every", str(STEPS), "--device", "cpu",
                "--lora-rank", "4", *FAST, *extra]
        assert sft.main(argv) == 0
        assert export_main(["gguf", str(root / name), "--f16", "--out", str(root / f"x{name}"), "--no-parity"]) == 0
        files.append(next((root / f"x{name}" / "gguf").glob("*-lora-F32.gguf")))
    return next((root / "xa" / "gguf").glob("*-F16.gguf")), files[0], files[1], root / "a"


@pytest.fixture(scope="module")
def loras(tiny_run, tmp_path_factory) -> tuple[Path, Path, Path, Path]:
    return built_once(tmp_path_factory, "lora_serving", lambda root: train_and_export(tiny_run, root))


@pytest.fixture
def opens(monkeypatch) -> list[Path]:
    """Every llama.cpp model load of the test (serving.backends.llamacpp_backend.open_llama), by path: the reload detector."""
    import serving.backends.llamacpp_backend as cpp

    seen: list[Path] = []
    real = cpp.open_llama

    def counting(path, *a, **kw):
        seen.append(Path(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(cpp, "open_llama", counting)
    return seen


def model_ptr(backend) -> int:
    return ctypes.cast(backend.llm.model, ctypes.c_void_p).value


def test_adapters_switch_per_generation_on_one_base_load(loras, opens):
    from serving.backends.llamacpp_backend import LlamaCppBackend

    base, a, b, _ = loras
    cpp = LlamaCppBackend(base, lora={"a": a, "b": b}, threads=1)
    try:
        llm, ptr = cpp.llm, model_ptr(cpp)
        ids = cpp.tokenize(PROMPT)
        rows = {k: cpp.logits(ids, adapter=k) for k in ("a", "b", "base")}
        again = cpp.logits(ids, adapter="a")
        greedy = {k: list(cpp.generate(ids, SamplingParams.greedy(8), adapter=k)) for k in ("b", "a", "b")}
        assert opens == [base] and cpp.llm is llm and model_ptr(cpp) == ptr  # switched 7 times, loaded once
        # each pair answers otherwise: measured max |logit| gaps a-b 2.5, a-base 1.3, b-base 1.2 (6 steps of training)
        for x, y in (("a", "b"), ("a", "base"), ("b", "base")):
            assert np.abs(rows[x] - rows[y]).max() > 0.1, (x, y)
        assert np.array_equal(again, rows["a"])  # the same adapter twice: the same logits, bit for bit
        assert greedy["b"] == list(cpp.generate(ids, SamplingParams.greedy(8), adapter="b"))
        assert np.array_equal(cpp.logits(ids), rows["a"])  # no adapter named: the default, the first given
        # switching is what loading that adapter alone gives (measured: identical), and "base" is the plain base;
        # a chat's next turn under another adapter must not reuse the KV cache the first one computed
        reply = list(cpp.generate(ids, SamplingParams.greedy(4), adapter="a"))
        longer = ids + reply + cpp.tokenize(PROMPT, bos=False)
        switched = list(cpp.generate(longer, SamplingParams.greedy(8), adapter="b"))
    finally:
        cpp.close()
    with LlamaCppBackend(base, lora=b, threads=1) as solo, LlamaCppBackend(base, threads=1) as plain:
        assert np.array_equal(solo.logits(ids), rows["b"]) and np.array_equal(plain.logits(ids), rows["base"])
        assert list(solo.generate(longer, SamplingParams.greedy(8))) == switched
        assert solo.name.endswith("+" + b.stem) and solo.adapter == b.stem  # a bare path: named by its stem


def test_one_scale_for_every_adapter(loras):
    """--lora-scale is every adapter's strength: at 0 each pair is the base alone (llama.cpp drops a 0 scale)."""
    from serving.backends.llamacpp_backend import LlamaCppBackend

    base, a, b, _ = loras
    with LlamaCppBackend(base, lora={"a": a, "b": b}, lora_scale=0.0, threads=1) as cpp:
        ids = cpp.tokenize(PROMPT)
        plain = cpp.logits(ids, adapter="base")
        assert np.array_equal(cpp.logits(ids, adapter="a"), plain) and np.array_equal(cpp.logits(ids, adapter="b"), plain)
        assert {x.scale for x in cpp.adapters.values()} == {0.0}


def test_http_lists_the_pairs_and_the_adapter_field_picks_one(loras, opens):
    from fastapi.testclient import TestClient

    from serving.backends.llamacpp_backend import LlamaCppBackend
    from serving.chat_session import completion_stream
    from serving.lora_pairs import Pairs
    from serving.server.http_app import ServerConfig, create_app

    base, a, b, _ = loras
    cpp = LlamaCppBackend(base, lora={"a": a, "b": b}, threads=1)
    try:
        with TestClient(create_app(cpp, ServerConfig(model_id=cpp.name)), raise_server_exceptions=False) as c:
            listed = c.get("/v1/models").json()["data"]
            assert [m["id"] for m in listed] == ["llama.cpp-F16", "llama.cpp-F16+a", "llama.cpp-F16+b"]
            assert [(m["prodip"]["adapter"], m["prodip"]["adapter_file"], m["prodip"]["default"]) for m in listed] == [
                ("base", None, False), ("a", a.name, True), ("b", b.name, False)]
            assert {m["prodip"]["base"] for m in listed} == {base.name}
            texts = {}
            for name in ("b", "a", "base", None):
                body = {"prompt": PROMPT, **GREEDY, **({"adapter": name} if name else {})}
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                texts[name] = r.json()["choices"][0]["text"]
                assert r.json()["model"] == ("llama.cpp-F16+a" if name is None else listed[["base", "a", "b"].index(name)]["id"])
            params = SamplingParams.greedy(8)
            pairs = Pairs.of(cpp)
            for name in ("a", "b", "base"):  # each answer is what that pair answers, through the one base
                assert texts[name] == "".join(completion_stream(pairs.view(cpp, name), PROMPT, params)), name
            assert texts[None] == texts["a"] and texts["b"] != texts["a"]
            for bad, needle in [("zzz", 'adapter "zzz" is not served here; known: base, a, b'),
                                (3, "adapter must be one adapter's name (a string), one of: base, a, b"),
                                (["a", "b"], "adapter must be one adapter's name"), ("", 'adapter "" is not served'),
                                ({"name": "a"}, "adapter must be")]:
                for route, extra in (("/v1/completions", {"prompt": PROMPT}),
                                     ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
                    r = c.post(route, json={**extra, "adapter": bad})
                    assert r.status_code == 400 and needle in r.json()["error"]["message"], (bad, r.text)
        assert opens == [base]  # 4 pairs answered, 10 requests refused: one load
    finally:
        cpp.close()


def test_a_server_without_adapters_refuses_the_field(client):
    r = client.post("/v1/completions", json={"prompt": "x", "adapter": "a"})
    assert r.status_code == 400 and "serves no LoRA adapter" in r.json()["error"]["message"], r.text
    assert len(client.get("/v1/models").json()["data"]) == 1


def test_an_adapter_run_served_through_pytorch_lists_its_one_pair(loras):
    from fastapi.testclient import TestClient

    from serving.backends.torch_backend import TorchBackend
    from serving.server.http_app import ServerConfig, create_app

    run = loras[3]
    torch_b = TorchBackend(run, threads=1)
    with TestClient(create_app(torch_b, ServerConfig(model_id=torch_b.name)), raise_server_exceptions=False) as c:
        (listed,) = c.get("/v1/models").json()["data"]
        assert listed["id"] == f"torch+{run.name}" and listed["prodip"]["adapter"] == run.name
        ok = c.post("/v1/completions", json={"prompt": PROMPT, **GREEDY, "adapter": run.name})
        assert ok.status_code == 200 and ok.json()["model"] == f"torch+{run.name}", ok.text
        r = c.post("/v1/completions", json={"prompt": PROMPT, "adapter": "base"})  # the base alone: llama.cpp's only
        assert r.status_code == 400 and f"known: {run.name}" in r.json()["error"]["message"], r.text


def test_lora_flags_name_each_adapter_and_refuse_what_is_ambiguous(loras, tmp_path, capsys):
    import gguf

    from serving.__main__ import main as serve_main

    base, a, b, _ = loras
    assert serve_main([str(base), "--lora", f"a={a}", "--lora", f"b={b}", "--lora-scale", "0.5", "--raw",
                       "--prompt", PROMPT, "--max-tokens", "2"]) == 0
    capsys.readouterr()
    wrong = tmp_path / "wrong-lora.gguf"  # an adapter for a base of d_model 512
    w = gguf.GGUFWriter(str(wrong), "llama")
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_tensor("blk.0.attn_q.weight.lora_a", np.zeros((4, 512), np.float32))
    w.add_tensor("blk.0.attn_q.weight.lora_b", np.zeros((256, 4), np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    copy = tmp_path / a.name  # the same stem as `a`: two bare paths would share a name
    shutil.copy(a, copy)
    for argv, needle in [(["--lora", f"a={a}", "--lora", f"a={b}"], "the adapter name 'a' is given twice"),
                         (["--lora", str(a), "--lora", str(copy)], f"the adapter name '{a.stem}' is given twice"),
                         (["--lora", f"base={a}"], "'base': an adapter name is reserved for the base alone"),
                         (["--lora", f"a b={a}"], "an adapter name must be 1-64 letters"),
                         (["--lora", f"a={a}", "--lora", f"w={wrong}"], "does not fit"),
                         (["--lora", f"a={tmp_path / 'none.gguf'}"], "not found")]:
        assert serve_main([str(base), *argv, "--prompt", "x"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and needle in err and err.count("\n") == 1, err
        if needle == "does not fit":  # both files named
            assert str(wrong) in err and str(base) in err, err


def test_the_demo_offers_each_pair_on_one_loaded_base_and_its_card_names_both(loras, opens):
    from demo.app import ModelPool
    from demo.models import DemoError, discover_models, entry_for, with_adapters
    from demo.run_card import model_card

    base, a, _, _ = loras
    entries = discover_models(base)  # export --out's folder: the base GGUF and the adapter beside it
    assert [(e.path, e.adapter) for e in entries] == [(base, None), (base, a)]
    pool = ModelPool(entries, threads=1)
    try:
        (plain, lock1), (pair, lock2) = pool.get(entries[0].label), pool.get(entries[1].label)
        assert lock1 is lock2 and opens == [base]  # one base, one lock, loaded once for both
        ids = plain.tokenize(PROMPT)
        assert np.abs(plain.logits(ids) - pair.logits(ids)).max() > 0.1  # measured 1.3 (see above)
        assert pool.chat_tuned(entries[1].label) is True and pool.chat_tuned(entries[0].label) is False
        card = model_card(entries[1], pair).markdown()
        assert base.name in card and a.name in card and "LoRA adapter" in card, card
    finally:
        pool.close()
    with pytest.raises(DemoError, match="is a LoRA adapter, not a model"):  # an adapter alone is no model
        with_adapters([entry_for(a)])
