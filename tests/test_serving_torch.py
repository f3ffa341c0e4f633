"""TorchBackend, the shared chat/stream layer (serving.chat_session) and the `python -m serving` CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import unicodedata

import numpy as np
import preloaded
import pytest
import torch
from conftest import REPO
from fixtures_serve import (
    BN_QUESTION,
)

from serving import load
from serving.backend import SamplingParams, ServingError
from serving.backends.torch_backend import TorchBackend
from serving.chat_session import ChatSession, PromptTooLong, chat_stream, completion_stream, prepare_chat
from serving.text_stream import REPLACEMENT_CHAR, TextStream, _held_tail
from training.checkpoint.checkpoint_io import latest, load_model
from training.model.decoder import Transformer, preset
from training.text.chat_template import encode
from training.text.normalization import script_counts
from training.text.wellformed import wellformed


@pytest.fixture(scope="module")
def backend(serve_run) -> TorchBackend:  # noqa: F811
    b = load(serve_run, threads=1)
    yield b
    b.close()


def bangla_chars(text: str) -> int:
    return script_counts(text).get("bn", 0)


def test_load_picks_torch_for_a_run_and_a_checkpoint(serve_run, backend, tmp_path):  # noqa: F811
    assert isinstance(backend, TorchBackend) and backend.name == "torch"
    assert backend.n_ctx == 256
    assert backend.eos_ids == (backend.tokenizer.eos_id, backend.tokenizer.im_end_id)
    b2 = load(latest(serve_run))
    assert isinstance(b2, TorchBackend)
    with pytest.raises(ServingError, match="not found"):
        load(serve_run / "nope")
    with pytest.raises(ServingError, match="no complete checkpoint"):
        load(tmp_path)  # an empty folder is neither a run nor a checkpoint


def test_tokenize_normalizes_input(backend):
    nfc = "আমার বোন গৌরী খোঁজ নিল।"  # ো and ৌ are two code points before NFC
    nfd = unicodedata.normalize("NFD", nfc)
    assert nfd != nfc
    assert backend.tokenize(nfd) == backend.tokenize(nfc)
    ids = backend.tokenize(nfc)
    assert ids[0] == backend.tokenizer.bos_id
    assert backend.detokenize(ids[1:]) == nfc
    # user text cannot inject chat control tokens unless asked
    assert backend.tokenizer.im_start_id not in backend.tokenize("<|im_start|>user")
    assert backend.tokenize("<|im_start|>", bos=False, allow_special=True) == [backend.tokenizer.im_start_id]


def test_kv_cache_generation_matches_full_sequence_logits(backend):
    ids = backend.tokenize("আজ সকালে বাজারে গিয়ে")
    out = list(backend.generate(ids, SamplingParams.greedy(12)))
    assert out, "greedy generation produced nothing"
    seq = list(ids)
    for tok in out:  # each cached step must pick the argmax of the full-sequence forward
        assert int(np.argmax(backend.logits(seq)[-1])) == tok
        seq.append(tok)
    lg = backend.logits(ids)
    assert lg.shape == (len(ids), backend.model.cfg.vocab_size) and lg.dtype == np.float32


def test_sampling_is_seeded_and_bounded(backend):
    ids = backend.tokenize("একদিন এক রাজা")
    p = SamplingParams(max_new_tokens=20, temperature=1.0, top_k=50, top_p=0.95, seed=7)
    a, b = list(backend.generate(ids, p)), list(backend.generate(ids, p))
    assert a == b and 0 < len(a) <= 20
    # the end of the context stops generation too
    long_ids = ids + [ids[-1]] * (backend.n_ctx - len(ids) - 3)
    assert len(list(backend.generate(long_ids, SamplingParams(max_new_tokens=50, seed=0, temperature=1.0)))) <= 3


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2), dict(max_new_tokens=0),
                                 dict(repetition_penalty=0.0), dict(temperature=float("nan"))])
def test_invalid_sampling_parameters_are_refused(backend, bad):
    with pytest.raises(ServingError):
        list(backend.generate(backend.tokenize("হ্যালো"), SamplingParams(**bad)))


def test_input_errors(backend):
    with pytest.raises(ServingError, match="empty"):
        backend.logits([])
    with pytest.raises(ServingError, match="longer than the context"):
        backend.logits([5] * (backend.n_ctx + 1))
    with pytest.raises(ServingError, match="token ids"):
        backend.logits([1, 10**6])


def test_chat_stream_replies_in_bangla_and_text_equals_tokens(backend):
    params = SamplingParams(max_new_tokens=40, temperature=0.7, seed=3)
    prepared, stream = chat_stream(backend, [{"role": "user", "content": BN_QUESTION}], params)
    assert prepared.dropped == 0 and prepared.notice is None
    assert prepared.ids[0] == backend.tokenizer.bos_id and prepared.ids[-1] != backend.tokenizer.im_end_id
    pieces = list(stream)
    text = "".join(pieces)
    assert bangla_chars(text) > 0, f"reply is not Bangla: {text!r}"
    assert all(REPLACEMENT_CHAR not in p for p in pieces)
    # the streamed text is exactly the decoded token stream of the same seeded generation
    ids = list(backend.generate(prepared.ids, stream.params))
    assert text == backend.detokenize(ids)
    s = stream.stats
    assert s.completion_tokens == len(ids) and s.prompt_tokens == len(prepared.ids)
    assert s.finish_reason in ("stop", "length") and s.time_to_first_token_s is not None


def test_stop_strings_end_the_reply_and_are_never_shown(backend):
    params = SamplingParams(max_new_tokens=60, temperature=0.0, repetition_penalty=1.3)
    full = "".join(completion_stream(backend, "আমার সোনার বাংলা", params))
    assert len(full) >= 6, f"need a longer greedy continuation to cut: {full!r}"
    stop = full[len(full) // 2: len(full) // 2 + 3]
    cut = full.find(stop)
    stream = completion_stream(backend, "আমার সোনার বাংলা", SamplingParams(**{**params.__dict__, "stop": (stop,)}))
    pieces = list(stream)
    assert "".join(pieces) == full[:cut] == stream.text
    assert stream.stats.finish_reason == "stop"


def test_held_tail():
    assert _held_tail("abc<|im", ["<|im_end|>"]) == 4
    assert _held_tail("abc", ["<|im_end|>"]) == 0
    assert _held_tail("ab", ["bcd", "xab"]) == 1
    assert _held_tail("zxa", ["bcd", "xab"]) == 2
    assert _held_tail("a", []) == 0


def test_long_conversation_drops_oldest_turns_with_notice(backend):
    turn = "আমি আজ সকালে বাজারে গিয়েছিলাম এবং অনেক সবজি কিনেছি। " * 4
    msgs = [{"role": "system", "content": "তুমি একজন সহকারী।"}]
    for i in range(12):
        msgs += [{"role": "user", "content": f"{i} {turn}"}, {"role": "assistant", "content": turn}]
    msgs.append({"role": "user", "content": BN_QUESTION})
    params = SamplingParams(max_new_tokens=32)
    prepared = prepare_chat(backend, msgs, params)
    assert prepared.dropped > 0 and "dropped" in prepared.notice
    assert prepared.messages[0]["role"] == "system" and prepared.messages[-1]["content"] == BN_QUESTION
    assert len(prepared.ids) <= backend.n_ctx - 32
    kept_first_user = next(m["content"] for m in prepared.messages if m["role"] == "user")
    assert not kept_first_user.startswith("0 ")  # the oldest turn went first


def test_prompt_longer_than_context_is_a_clear_error(backend):
    huge = "বাংলা ভাষা " * 400
    with pytest.raises(PromptTooLong, match="context is 256 tokens"):
        chat_stream(backend, [{"role": "user", "content": huge}], SamplingParams())
    with pytest.raises(PromptTooLong, match="shorten"):
        completion_stream(backend, huge, SamplingParams())


def test_chat_session_keeps_turns(backend):
    session = ChatSession(backend, system="তুমি একজন সহকারী।")
    _, stream = session.ask(BN_QUESTION, SamplingParams(max_new_tokens=8, temperature=0.0))
    assert isinstance(stream, TextStream)
    reply = "".join(stream)
    session.commit(stream)
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant"]
    assert session.messages[-1]["content"] == reply
    session.reset()
    assert [m["role"] for m in session.messages] == ["system"]


def test_one_table_of_runtimes_and_aliases(serve_run, tmp_path):  # noqa: F811
    import serving

    assert serving.load is load  # where a newcomer looks for it
    assert {a: serving.runtime_name("x", a) for a in ("gguf", "llamacpp", "ort", "pytorch", "hf")} == {
        "gguf": "llama.cpp", "llamacpp": "llama.cpp", "ort": "onnx", "pytorch": "torch", "hf": "transformers"}
    assert serving.runtime_name(tmp_path / "m.gguf") == "llama.cpp"
    assert serving.runtime_name(tmp_path / "m.onnx") == "onnx"
    assert serving.runtime_name(serve_run) == "torch"
    (tmp_path / serving.HF_MARKER).write_text("{}")
    assert serving.runtime_name(tmp_path) == "transformers"
    with pytest.raises(ServingError, match="unknown backend 'tensorflow'; use llama.cpp, onnx, torch, transformers"):
        load(serve_run, backend="tensorflow")
    assert isinstance(load(serve_run, backend="pytorch"), TorchBackend)


def test_from_model_is_the_same_runner(serve_run, backend):  # noqa: F811
    """TorchBackend.from_model (parity's reference) and TorchBackend(path) are one runner."""
    model, ck = load_model(serve_run)
    b = TorchBackend.from_model(model, ck.tokenizer, name="reference")
    assert b.name == "reference" and backend.name == "torch" and b.n_ctx == backend.n_ctx
    ids = backend.tokenize(BN_QUESTION)
    assert np.array_equal(b.logits(ids), backend.logits(ids))
    greedy = SamplingParams.greedy(16)
    assert list(b.generate(ids, greedy)) == list(backend.generate(ids, greedy))
    for prefix in (0, 1, 5, len(ids)):  # the KV cache, from any split point, equals the full sequence
        assert np.abs(b.logits_incremental(ids, prefix=prefix) - b.logits(ids)).max() <= 1e-4
    with pytest.raises(ServingError, match=f"tokenizer has {ck.tokenizer.vocab_size} tokens, the model 512"):
        TorchBackend.from_model(Transformer(preset("tiny", vocab_size=512)), ck.tokenizer)


# ---------------------------------------------------------------------------------------------- CLI
def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return preloaded.run([sys.executable, "-m", "serving", *args], input=stdin, capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=120)


def reference_reply(run, question: str, max_tokens: int) -> str:
    """The greedy chat reply without serving's chat, stream or CLI layers: the checkpoint through
    TorchBackend.from_model (parity's reference), the prompt rendered by training.text.chat_template, the new tokens
    (up to the end of turn) decoded by the training tokenizer."""
    model, ck = load_model(run)
    ref = TorchBackend.from_model(model, ck.tokenizer, name="reference")
    ids = encode(ck.tokenizer, [{"role": "user", "content": question}]).ids
    return ck.tokenizer.decode(list(ref.generate(ids, SamplingParams.greedy(max_tokens))))


def assert_wellformed_bangla(text: str, min_clusters: int = 10) -> None:
    """The model's Bangla as a reader sees it (training.text.wellformed): every Bengali cluster valid, no byte
    sequence that is not UTF-8, and enough of it to mean something."""
    wf = wellformed(text)
    assert wf.clusters >= min_clusters and wf.share == 1.0 and wf.invalid_bytes == 0, (wf.to_dict(), text)


def test_cli_one_shot_and_interactive(serve_run):  # noqa: F811
    """The one-shot reply is the reference backend's greedy text, character for character, and well-formed
    Bangla; the interactive session answers both turns and clears the conversation on /reset."""
    p = run_cli(str(serve_run), "--prompt", BN_QUESTION, "--temperature", "0", "--max-tokens", "24", "--stats",
                "--threads", "1")
    assert p.returncode == 0, p.stderr
    want = reference_reply(serve_run, BN_QUESTION, 24)
    assert p.stdout == want + "\n" and "tok/s" in p.stderr, (p.stdout, want)
    assert_wellformed_bangla(p.stdout)
    p = run_cli(str(serve_run), "--temperature", "0", "--max-tokens", "8", stdin=f"{BN_QUESTION}\n/reset\nহ্যালো\n")
    assert p.returncode == 0, p.stderr
    assert "conversation cleared" in p.stderr and bangla_chars(p.stdout) > 0


def test_cli_errors_are_one_line(serve_run, tmp_path):  # noqa: F811
    p = run_cli(str(tmp_path / "missing"), "--prompt", "x")
    assert p.returncode == 2 and p.stderr.startswith("error: model not found") and "Traceback" not in p.stderr
    p = run_cli(str(serve_run), "--prompt", "x", "--top-p", "0")
    assert p.returncode == 2 and "--top-p" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    p = run_cli(str(serve_run), "--prompt", "বাংলা " * 600)
    assert p.returncode == 2 and "context" in p.stderr and "Traceback" not in p.stderr


def test_threads_are_applied(serve_run):  # noqa: F811
    before = torch.get_num_threads()
    try:
        TorchBackend(serve_run, threads=1)
        assert torch.get_num_threads() == 1
        with pytest.raises(ServingError, match="threads"):
            TorchBackend(serve_run, threads=0)
    finally:
        torch.set_num_threads(before)


def test_cli_base_model_completes_text_and_says_so(tiny_run):  # noqa: F811
    """A pretrained-only run (run.json kind "pretrain") continues the prompt, as --raw does, with one line
    saying why; --chat applies the chat template anyway, and then says nothing."""
    args = (str(tiny_run), "--prompt", "আমার সোনার বাংলা", "--temperature", "0", "--max-tokens", "12", "--threads", "1")
    plain, raw, chat = run_cli(*args), run_cli(*args, "--raw"), run_cli(*args, "--chat")
    assert plain.returncode == raw.returncode == chat.returncode == 0, plain.stderr + raw.stderr + chat.stderr
    notes = [ln for ln in plain.stderr.splitlines() if "base model" in ln]
    assert len(notes) == 1 and "--chat" in notes[0], plain.stderr
    assert plain.stdout == raw.stdout and "base model" not in raw.stderr + chat.stderr
    assert run_cli(*args, "--raw", "--chat").returncode == 2  # one or the other
