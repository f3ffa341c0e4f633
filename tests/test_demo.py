"""The Gradio Bangla chat demo, driven through gradio_client against a real server on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import sys
import threading

import preloaded
import pytest
from conftest import REPO
from fixtures_serve import BN_QUESTION
from test_serving_torch import assert_wellformed_bangla, reference_reply

from demo.app import (
    DEFAULT_HOST,
    DemoError,
    build_app,
    default_model,
    discover_models,
    history_to_messages,
    launch,
)
from demo.models import QUICKSTART_CHAT, QUICKSTART_RUN, quickstart_gguf_dir
from serving import load
from serving.backend import SamplingParams
from training.text.normalization import script_counts

LOCK_PROBE_S = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bn(text: str) -> int:
    return script_counts(text).get("bn", 0)


@pytest.fixture(scope="module")
def demo(serve_run, serve_gguf):  # noqa: F811
    entries = discover_models(serve_run)
    app, pool = build_app(entries, threads=1)
    url = launch(app, host=DEFAULT_HOST, port=free_port(), block=False, quiet=True)
    assert url.startswith("http://127.0.0.1:")
    yield url, entries
    app.close()
    pool.close()


def client_for(url: str):
    from gradio_client import Client

    return Client(url, verbose=False, download_files=False)


def ask(url: str, label: str, message: str, history: list | None = None, max_tokens: int = 24, seed: int = 5,
        greedy: bool = False):
    """Submit one chat message (sampled with `seed`, or greedy: temperature 0, no penalty); returns (every
    streamed update, the final update)."""
    sampling = (0.0, 0, 1.0, 1.0) if greedy else (0.8, 40, 0.95, 1.1)
    job = client_for(url).submit(message, history or [], label, max_tokens, *sampling, seed, api_name="/chat")
    final = job.result(timeout=120)
    return job.outputs(), final


def last_reply(update) -> str:
    _, chat, _ = update
    assert chat[-1]["role"] == "assistant"
    return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in
                   (chat[-1]["content"] if isinstance(chat[-1]["content"], list) else [chat[-1]["content"]]))


def check_streamed_bangla_reply(url: str, label: str) -> None:
    updates, final = ask(url, label, BN_QUESTION)
    box, chat, status = final
    assert box == ""  # the textbox is cleared for the next message
    assert [m["role"] for m in chat] == ["user", "assistant"]
    reply = last_reply(final)
    assert bn(reply) > 0, f"{label}: reply is not Bangla: {reply!r}"
    runtime = label.split(" · ")[0]  # "llama.cpp · x-F16.gguf" is answered by llama.cpp-F16
    assert "টোকেন/সেকেন্ড" in status and f"answered by) {runtime}" in status, status
    partial = [last_reply(u) for u in updates if u[1]]
    assert len({p for p in partial if p}) >= 2, f"{label}: reply was not streamed: {partial}"
    assert all(reply.startswith(p) for p in partial if p not in ("", "…"))


def test_discovers_checkpoint_and_exports(demo, serve_gguf, serve_run):  # noqa: F811
    _, entries = demo
    kinds = [e.backend for e in entries]
    assert kinds[0] == "torch" and "llama.cpp" in kinds
    # from a file under RUN/export/gguf the run is found (training.runfiles.layout.run_dir_of): its checkpoint too
    from_gguf = discover_models(serve_gguf)
    assert from_gguf[0].path == serve_gguf
    assert [e.path.resolve() for e in from_gguf if e.backend == "torch"] == [serve_run.resolve()]


def test_torch_reply_is_streamed_bangla(demo):
    url, entries = demo
    check_streamed_bangla_reply(url, entries[0].label)


def test_llamacpp_reply_is_streamed_bangla(demo, serve_gguf):  # noqa: F811
    # A llama.cpp backend must let its tokenizer be used while generate() is suspended mid-stream
    # (the streaming layer decodes every new token); probe that first rather than hang the demo.
    b = load(serve_gguf, threads=1)
    gen = b.generate(b.tokenize("আমি"), SamplingParams(max_new_tokens=2, seed=0))
    first = next(gen, None)
    done = threading.Event()
    if first is not None:
        threading.Thread(target=lambda: (b.detokenize([first]), done.set()), daemon=True).start()
        if not done.wait(LOCK_PROBE_S):
            pytest.fail("LlamaCppBackend.detokenize blocks while a generate() stream is open "
                        "(it takes the lock generate holds); serving/backends/llamacpp_backend.py must not lock detokenize")
    gen.close()
    b.close()
    url, entries = demo
    label = next(e.label for e in entries if e.backend == "llama.cpp")
    check_streamed_bangla_reply(url, label)


def test_conversation_history_is_used(demo):
    url, entries = demo
    _, first = ask(url, entries[0].label, BN_QUESTION, max_tokens=8)
    history = first[1]
    assert history_to_messages(history)[0] == {"role": "user", "content": BN_QUESTION}
    _, second = ask(url, entries[0].label, "আর চিনি?", history=history, max_tokens=8)
    assert [m["role"] for m in second[1]] == ["user", "assistant", "user", "assistant"]


def test_over_long_prompt_is_a_clear_message(demo):
    from gradio_client.exceptions import AppError

    url, entries = demo
    with pytest.raises(AppError, match="প্রসঙ্গসীমার"):
        ask(url, entries[0].label, "বাংলা ভাষা " * 300)
    with pytest.raises(AppError, match="খুব লম্বা"):
        ask(url, entries[0].label, "ক" * 5000)


def test_dropped_turns_are_announced(demo):
    url, entries = demo
    turn = "আমি আজ সকালে বাজারে গিয়েছিলাম এবং অনেক সবজি কিনেছি। " * 3
    history = []
    for _ in range(8):
        part = [{"type": "text", "text": turn}]  # Gradio 6's message format
        history += [{"role": "user", "content": part}, {"role": "assistant", "content": part}]
    _, final = ask(url, entries[0].label, BN_QUESTION, history=history, max_tokens=8)
    assert "বাদ দেওয়া হয়েছে" in final[2]


def test_missing_model_and_default_lookup(tmp_path, serve_run, monkeypatch):  # noqa: F811
    with pytest.raises(DemoError, match="model not found"):
        discover_models(tmp_path / "nope.gguf")
    monkeypatch.delenv("PRODIP_HOME", raising=False)
    with pytest.raises(DemoError, match="quickstart"):
        default_model(tmp_path)
    # the quickstart run's checkpoint, then its Q4_K_M GGUF (preferred), also through $PRODIP_HOME
    home = tmp_path / "home"
    qs = home / QUICKSTART_RUN / QUICKSTART_CHAT  # demo.quickstart's chat-tuned run
    qs.parent.mkdir(parents=True)
    os.symlink(serve_run, qs)
    monkeypatch.setenv("PRODIP_HOME", str(home))
    assert default_model(tmp_path).resolve() == serve_run.resolve()
    gguf_dir = quickstart_gguf_dir(home / QUICKSTART_RUN)
    assert gguf_dir == qs / "export" / "gguf"  # the path docs/serving.md and the README give
    gguf_dir.mkdir(parents=True, exist_ok=True)
    (gguf_dir / "chat-Q4_K_M.gguf").write_bytes(b"")
    try:
        assert default_model(tmp_path) == gguf_dir / "chat-Q4_K_M.gguf"
    finally:
        (gguf_dir / "chat-Q4_K_M.gguf").unlink()


def test_cli_without_a_model_says_run_the_quickstart(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PRODIP_HOME"}
    env["PYTHONPATH"] = str(REPO)
    p = preloaded.run([sys.executable, "-m", "demo"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2
    assert p.stderr.startswith("error: ") and "quickstart" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_cli_defaults_are_private():
    from demo.__main__ import build_parser

    args = build_parser().parse_args([])
    assert args.host == "127.0.0.1" and args.share is False


# ------------------------------------------------------------------------------------------- model card
def card_entry(pool, backend_kind: str):
    return next(e for e in pool.entries.values() if e.backend == backend_kind)


def test_model_card_reads_the_run(serve_run, serve_gguf, tmp_path):  # noqa: F811
    """Every number on the card is the one in the run's files: checkpoint config and state, log.jsonl,
    gates.json, eval.json (a real `python -m training.evaluate`), parity.json (a real parity run)."""
    import shutil

    from demo.models import entry_for
    from demo.run_card import NOT_MEASURED, model_card
    from export.manifest import load_source
    from export.parity.native_parity import run_parity
    from training.checkpoint.checkpoint_io import latest
    from training.evaluate.evaluate_cli import main as evaluate_main
    from training.gates import GateReport
    from training.model.decoder import ModelConfig, count_params
    from training.runfiles import layout

    run = tmp_path / "run"  # a copy: this test writes eval and parity results into it
    shutil.copytree(serve_run, run, ignore=shutil.ignore_patterns("parity.*", "eval"))
    gguf = run / layout.EXPORT / layout.GGUF_DIR / serve_gguf.name
    ck = latest(run)
    cfg = ModelConfig.from_dict(layout.read_json(ck / layout.MODEL_CONFIG))
    state = layout.read_json(ck / layout.STATE)
    b = load(gguf, threads=1)
    try:
        card = model_card(entry_for(gguf), b)
        assert card.prodip
        assert f"{count_params(cfg) / 1e6:.2f} M parameters" in card.get("size")
        assert f"{state['tokens']:,} (chat fine-tuning" in card.get("tokens trained")
        assert "pretraining" in card.get("tokens trained")  # the SFT run's base run is followed
        assert GateReport.load(run / layout.GATES).summary() in card.get("training gates")
        assert "validation split" in card.get("held-out bits/byte") and NOT_MEASURED in card.get("held-out bits/byte")
        assert card.get("parity vs fp32") == NOT_MEASURED

        # real evaluation and parity results appear, with their numbers
        text = tmp_path / "held_out.txt"
        text.write_text(clip_corpus(), encoding="utf-8")
        assert evaluate_main([str(run), "--text", str(text), "--gen-tokens", "0", "--no-progress", "--device", "cpu"]) == 0
        rep = layout.read_json(run / "eval" / "eval.json")
        model_bpb, twin_bpb = (m["lm"]["all"]["bits_per_byte"] for m in rep["models"])
        report = run_parity(run / layout.EXPORT, load_source(run), n_new=4, backends=[b])  # this file only
        card = model_card(entry_for(gguf), b)
        assert card.get("held-out bits/byte").startswith(f"{model_bpb:.3f} vs random-init twin {twin_bpb:.3f}")
        mine = next(r for r in report.results if r["file"].endswith(gguf.name))
        assert card.get("parity vs fp32").startswith("pass" if mine["passed"] else "FAIL")
        assert f"top-1 agreement {mine['top1']:.1%}" in card.get("parity vs fp32")
    finally:
        b.close()

    # broken or missing files read "not measured" / "unreadable", never an exception
    (run / layout.GATES).write_text("{", encoding="utf-8")
    (run / layout.LOG).write_text('{"step": 1, "val_bpb": 2.5}\n{"step": 2, "val_bpb": ', encoding="utf-8")  # crashed
    (run / "eval" / "eval.json").unlink()
    (run / layout.EXPORT / layout.PARITY_JSON).write_text("[]", encoding="utf-8")
    card = model_card(entry_for(gguf))
    assert "unreadable" in card.get("training gates") and card.get("parity vs fp32") == NOT_MEASURED
    assert card.get("held-out bits/byte").startswith("2.500 (validation split")  # what the log holds before the cut
    lone = tmp_path / "lone.gguf"  # a GGUF outside any run
    shutil.copy(gguf, lone)
    card = model_card(entry_for(lone))
    assert all(card.get(k) == NOT_MEASURED for k in ("size", "tokens trained", "held-out bits/byte",
                                                      "training gates", "parity vs fp32"))


def clip_corpus(n: int = 3) -> str:
    from fixtures_serve import bangla_paragraphs

    return "\n\n".join(bangla_paragraphs()[-n:])


def test_a_foreign_gguf_in_the_demo(foreign_ggufs):  # noqa: F811
    """A GGUF prodip did not write: its card says foreign (no prodip checks claimed), and the tokenizer
    tab shows its own tokenizer's pieces."""
    from demo.app import ModelPool, card_markdown, make_tokenize
    from demo.run_card import model_card
    from training.text.normalization import normalize

    entries = discover_models(foreign_ggufs.qwen2)
    pool = ModelPool(entries, threads=1)
    try:
        label = entries[0].label
        md = card_markdown(pool, label)
        card = model_card(entries[0], pool.get(label)[0])
        text = "আমার সোনার বাংলা, hello"
        spans, _ = make_tokenize(pool)(text, label)
    finally:
        pool.close()
    assert not card.prodip and "**foreign**" in md and "do not apply" in md
    assert card.get("arch") == "qwen2"
    assert "parity vs fp32" not in dict(card.rows)  # prodip's checks are not claimed for it
    assert "".join(t for t, _ in spans).strip() == normalize(text)  # its tokenizer adds a dummy-prefix space


def test_card_over_http(demo):
    url, entries = demo
    c = client_for(url)
    for e in entries[:2]:
        md = c.predict(e.label, api_name="/card")
        assert e.label in md and "tokens trained" in md and "held-out bits/byte" in md


# ----------------------------------------------------------------------------------- see the difference
def test_compare_finds_the_first_different_token(tiny_run, serve_run):  # noqa: F811
    """The pretrained model and its chat fine-tune, greedy on one prompt: the reported divergence is
    where their own greedy token streams (asked again through the Backend) first differ."""
    from demo.app import ModelPool, make_compare
    from demo.compare import FIRST_DIFF, SAME
    from demo.models import entry_for
    from serving.chat_session import prepare_chat

    a, b = entry_for(tiny_run), entry_for(serve_run)
    a = type(a)("base · " + a.label, a.path, a.backend)  # both are "torch · step_…": distinct labels
    pool = ModelPool([a, b], threads=1)
    try:
        summary, hl_a, hl_b = make_compare(pool)(BN_QUESTION, a.label, b.label, 24, "chat")
        streams = []
        for e in (a, b):
            backend, _ = pool.get(e.label)
            ids = prepare_chat(backend, [{"role": "user", "content": BN_QUESTION}], SamplingParams.greedy(24)).ids
            streams.append(list(backend.generate(ids, SamplingParams.greedy(24))))
    finally:
        pool.close()
    k = next(i for i, (x, y) in enumerate(zip(*streams)) if x != y)  # they differ: one is chat-tuned
    assert f"first difference at generated token {k} " in summary
    assert (FIRST_DIFF in [lab for _, lab in hl_a]) and (FIRST_DIFF in [lab for _, lab in hl_b])
    same_a = "".join(t for t, lab in hl_a if lab == SAME)
    assert same_a == "".join(t for t, lab in hl_b if lab == SAME)


def test_compare_torch_and_gguf_over_http(demo):
    url, entries = demo
    torch = next(e.label for e in entries if e.backend == "torch")
    gguf = next(e.label for e in entries if e.backend == "llama.cpp")
    summary, out_a, out_b = client_for(url).predict(BN_QUESTION, torch, gguf, 16, "chat", api_name="/compare")
    text_a = "".join(s["token"] for s in out_a)
    assert bn(text_a) > 0 and ("identical" in summary or "first difference" in summary)
    if "identical" in summary:  # F16 of a tiny model usually matches fp32 greedily; then both texts agree
        assert text_a == "".join(s["token"] for s in out_b)
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match="empty"):
        client_for(url).predict("  ", torch, gguf, 16, "chat", api_name="/compare")


def test_first_divergence_rules():
    from demo.compare import first_divergence

    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # one model stopped early: that is a difference too


# --------------------------------------------------------------------------------------------- tokenizer
def test_tokenizer_tab_over_http(demo, serve_run):  # noqa: F811
    from training.text.normalization import normalize
    from training.text.tokenizer import Tokenizer

    url, entries = demo
    text = "আমার সোনার বাংলা, আমি তোমায় ভালোবাসি। Hello! 😀"  # the emoji goes through byte fallback
    spans, table = client_for(url).predict(text, entries[0].label, api_name="/tokenize")
    tok = Tokenizer.load(serve_run / "tokenizer.model")
    ids = tok.encode(text)
    assert "".join(s["token"] for s in spans) == normalize(text)
    assert len({s["class_or_confidence"] for s in spans}) > 1  # neighbours differ in colour
    norm = normalize(text)
    assert f"| {len(ids)} | {len(norm) / len(ids):.2f} |" in table
    assert f"| {len(norm.encode())} | {len(norm) / len(norm.encode()):.2f} |" in table  # the byte-level bound
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match="খুব লম্বা"):
        client_for(url).predict("ক" * 50_000, entries[0].label, api_name="/tokenize")


# --------------------------------------------------------------------------------------------- bad input
def test_empty_and_huge_messages_are_clear(demo):
    from gradio_client.exceptions import AppError

    url, entries = demo
    with pytest.raises(AppError, match="empty"):
        ask(url, entries[0].label, "   ")
    with pytest.raises(AppError, match="খুব লম্বা"):
        ask(url, entries[0].label, "ক" * 50_000)


def test_closed_stream_frees_the_model(serve_run):  # noqa: F811
    """Gradio closes a reply's generator when its tab goes away: the generation stops and the model's
    lock is free at once (not at garbage collection), so the next user is served."""
    from demo.app import ModelPool, make_respond

    entries = discover_models(serve_run)[:1]
    pool = ModelPool(entries, threads=1)
    try:
        respond = make_respond(pool)
        label = entries[0].label
        gen = respond(BN_QUESTION, [], label, 200, 0.0, 0, 1.0, 1.0, 0)
        next(gen), next(gen)  # the "writing…" update, then the first piece: generation is running
        _, lock = pool.get(label)
        assert lock.locked()
        gen.close()  # what gradio.utils.SyncToAsyncIterator.aclose does for a closed tab
        assert not lock.locked()
        *_, final = respond(BN_QUESTION, [], label, 8, 0.0, 0, 1.0, 1.0, 0)  # greedy: the reference's reply
        assert final[1][-1]["content"] == reference_reply(serve_run, BN_QUESTION, 8)
        assert_wellformed_bangla(final[1][-1]["content"], min_clusters=3)
    finally:
        pool.close()


def test_cancelled_client_leaves_the_demo_serving(demo):
    url, entries = demo
    c = client_for(url)
    job = c.submit(BN_QUESTION, [], entries[0].label, 1024, 1.5, 0, 1.0, 1.0, 3, api_name="/chat")
    import time

    t0 = time.time()
    while not job.outputs() and time.time() - t0 < 60:
        time.sleep(0.02)
    job.cancel()
    _, final = ask(url, entries[0].label, BN_QUESTION, max_tokens=8, greedy=True)  # another user, same model
    assert last_reply(final) == reference_reply(entries[0].path, BN_QUESTION, 8)  # whole, as if never shared
    assert_wellformed_bangla(last_reply(final), min_clusters=3)


def test_cli_bad_host_busy_port_and_numbers(serve_run, capsys):  # noqa: F811
    from demo.__main__ import main

    assert main(["--model", str(serve_run), "--host", "nosuchhost.invalid", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --host") and "nosuchhost.invalid" in err and len(err.strip().splitlines()) == 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        assert main(["--model", str(serve_run), "--port", str(busy)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "--port" in err and f"port {busy} is already in use" in err
    for flag, value in (("--port", "70000"), ("--port", "-1"), ("--threads", "0"), ("--threads", "x"),
                        ("--modle", "x")):
        assert main(["--model", str(serve_run), flag, value]) == 2
        err = capsys.readouterr().err  # one line, as every prodip CLI: no usage block before it (issue 28)
        assert err.startswith("error: ") and flag in err and len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------------------------- which model, and how (issue 31)
def test_default_is_the_smallest_on_device_file_that_passed_parity(serve_run, tmp_path):  # noqa: F811
    """In a run folder: passed GGUFs (smallest first), passed ONNX, the checkpoint, then files whose parity
    failed or was never measured. File sizes and parity verdicts are the run's own files, as on disk."""
    import json
    import shutil

    from training.runfiles import layout

    run = tmp_path / "run"
    shutil.copytree(serve_run, run, ignore=shutil.ignore_patterns("export"))
    gguf, onnx = run / layout.EXPORT / layout.GGUF_DIR, run / layout.EXPORT / layout.ONNX_DIR
    gguf.mkdir(parents=True)
    onnx.mkdir(parents=True)
    sizes = {gguf / "run-F16.gguf": 4000, gguf / "run-Q8_0.gguf": 2000, gguf / "run-Q4_K_M.gguf": 1000,
             onnx / "model-int4.onnx": 500, onnx / "model.onnx": 3000}
    for f, n in sizes.items():
        f.write_bytes(b"\0" * n)
    verdicts = {"run-F16.gguf": True, "run-Q8_0.gguf": False, "run-Q4_K_M.gguf": True, "model.onnx": True}
    (run / layout.EXPORT / layout.PARITY_JSON).write_text(json.dumps({"backends": [
        {"file": str(f), "passed": verdicts[f.name]} for f in sizes if f.name in verdicts]}))
    names = [e.path.name for e in discover_models(run)]
    # the int4 ONNX is the smallest file, but parity never measured it: after the checkpoint
    assert names == ["run-Q4_K_M.gguf", "run-F16.gguf", "model.onnx", run.name, "run-Q8_0.gguf", "model-int4.onnx"]
    assert [e.path.name for e in discover_models(gguf / "run-F16.gguf")][0] == "run-F16.gguf"  # a file named: first


def test_a_base_model_completes_text_and_says_so(tiny_run, serve_run):  # noqa: F811
    """tiny_run is pretrained only (run.json kind "pretrain"): the demo continues the text instead of wrapping it
    in a chat template the model never saw, says so, and the card says which kind of model it is."""
    from demo.app import BASE_NOTICE, ModelPool, make_respond
    from demo.models import entry_for
    from demo.run_card import MODEL_TYPE, model_card
    from serving.chat_session import completion_stream

    base, chat = entry_for(tiny_run), entry_for(serve_run)
    base = type(base)("base · " + base.label, base.path, base.backend)
    pool = ModelPool([base, chat], threads=1)
    try:
        assert (pool.chat_tuned(base.label), pool.chat_tuned(chat.label)) == (False, True)
        *_, final = make_respond(pool)(BN_QUESTION, [], base.label, 12, 0.0, 0, 1.0, 1.0, 0)
        backend, _ = pool.get(base.label)
        expected = "".join(completion_stream(backend, BN_QUESTION, SamplingParams.greedy(12)))
        assert final[1][-1]["content"] in (expected, "…") and final[2].startswith(BASE_NOTICE)
        assert model_card(base, backend).get("model type") == MODEL_TYPE[False]
        assert model_card(chat, pool.get(chat.label)[0]).get("model type") == MODEL_TYPE[True]
        *_, final = make_respond(pool)(BN_QUESTION, [], chat.label, 4, 0.0, 0, 1.0, 1.0, 0)
        assert BASE_NOTICE not in final[2]
    finally:
        pool.close()
