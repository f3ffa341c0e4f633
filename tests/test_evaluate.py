"""Evaluation: bits per byte by hand, the twin gate, multiple choice, the CLIs, exported backends."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import fixtures_evaluate as fx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fixtures_evaluate import REPO, SHARED, TinyRun, corpus_lines

from training import evaluate as ev
from training.gates import GateResult
from training.model import ModelConfig
from training.text import normalize

# the fixtures (re-exported so pytest finds them here)
corpus_tokenizer, tiny_run, one_thread = fx.corpus_tokenizer, fx.tiny_run, fx.one_thread
pytestmark = pytest.mark.usefixtures("one_thread")

EVAL_DIR = SHARED / "eval"


class ByteProvider:
    """A hand-checkable provider: tokens are UTF-8 bytes; log p(t | anything) = -(t % 4 + 1) bits."""

    name = "bytes"
    n_ctx = 1 << 20
    bos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(normalize(text).encode("utf-8"))

    def token_logprobs(self, ids):
        return np.array([-(t % 4 + 1) * math.log(2) for t in ids[1:]])


# --- bits per byte by hand ------------------------------------------------------------------------


def test_bits_per_byte_by_hand_on_two_bytes_three_chars():
    # "aé": bytes 0x61 (97 % 4 = 1 -> 2 bits), 0xC3 (195 % 4 = 3 -> 4 bits), 0xA9 (169 % 4 = 1 -> 2 bits)
    stats = ev.evaluate_lm(ByteProvider(), [("en", "aé")], progress=False)[ev.ALL]
    assert (stats.tokens, stats.bytes, stats.chars) == (3, 3, 2)
    assert stats.bits_per_byte == pytest.approx(8 / 3)
    assert stats.bits_per_char == pytest.approx(4.0)
    assert stats.nll_per_token == pytest.approx(8 / 3 * math.log(2))
    assert stats.perplexity == pytest.approx(2 ** (8 / 3))


def test_bits_per_byte_covers_every_byte_by_language():
    text = "আমি ভাত খাই।\n১২৩\nI eat rice.\n\nঘরে যাই।\n"
    docs = ev.split_documents(text)
    assert "".join(d for _, d in docs) == normalize(text)
    assert [lang for lang, _ in docs] == ["bn", "en", "bn"]
    stats = ev.evaluate_lm(ByteProvider(), docs, progress=False)
    raw = normalize(text).encode("utf-8")
    assert stats[ev.ALL].bytes == stats[ev.ALL].tokens == len(raw)
    assert stats[ev.ALL].bits_per_byte == pytest.approx(sum(b % 4 + 1 for b in raw) / len(raw))
    assert stats["bn"].bytes + stats["en"].bytes == len(raw)
    assert stats["bn"].chars == len("আমি ভাত খাই।\n১২৩\n" + "ঘরে যাই।\n")


def test_split_documents_caps_size_and_keeps_text():
    text = "\n".join(["এক দুই তিন চার"] * 50 + ["one two three"] * 5)
    docs = ev.split_documents(text, max_chars=100)
    assert "".join(d for _, d in docs) == text
    assert all(len(d) <= 100 for _, d in docs)
    assert {lang for lang, _ in docs} == {"bn", "en"}


def test_bits_per_byte_equals_hand_computation_with_torch(corpus_tokenizer):
    """Real model + tokenizer: evaluate_lm equals -sum log_softmax / ln 2 / bytes computed here."""
    cfg = ModelConfig(vocab_size=corpus_tokenizer.vocab_size, d_model=64, n_layers=1, n_heads=2, n_kv_heads=1,
                      ffn_dim=128, max_seq_len=256)
    model = ev.make_twin(cfg, seed=3)
    doc = "আজ আকাশ পরিষ্কার। We walked home."
    ids = [corpus_tokenizer.bos_id, *corpus_tokenizer.encode(doc)]
    with torch.no_grad():
        lp = F.log_softmax(model(torch.tensor([ids]))[0].double(), -1)
    nll = -sum(float(lp[i - 1, ids[i]]) for i in range(1, len(ids)))  # first token after <s> included
    stats = ev.evaluate_lm(ev.TorchProvider(model, corpus_tokenizer), [("other", doc)], progress=False)[ev.ALL]
    assert stats.tokens == len(ids) - 1
    assert stats.bytes == len(doc.encode("utf-8"))
    assert stats.bits_per_byte == pytest.approx(nll / math.log(2) / len(doc.encode("utf-8")), rel=1e-5)
    assert stats.bits_per_char == pytest.approx(nll / math.log(2) / len(doc), rel=1e-5)


def test_windows_score_every_position_once():
    for n, n_ctx, stride in [(10, 16, None), (100, 16, 8), (101, 16, 15), (57, 8, 1)]:
        spans = ev.windows(list(range(n)), n_ctx, stride)
        scored: list[int] = []
        for s in spans:
            assert len(s.ids) <= n_ctx and s.start >= 1
            first = s.ids[0]  # ids are positions here
            scored += list(range(first + s.start, first + len(s.ids)))
        assert scored == list(range(1, n))
    with pytest.raises(ev.EvalError):
        ev.windows(list(range(40)), 16, 16)


def test_long_document_windowed_and_batching_is_invisible(corpus_tokenizer):
    cfg = ModelConfig(vocab_size=corpus_tokenizer.vocab_size, d_model=64, n_layers=1, n_heads=2, n_kv_heads=1,
                      ffn_dim=128, max_seq_len=32)
    model = ev.make_twin(cfg, seed=5)
    provider = ev.TorchProvider(model, corpus_tokenizer)
    doc = " ".join(corpus_lines()[:6])
    ids = [corpus_tokenizer.bos_id, *corpus_tokenizer.encode(doc)]
    assert len(ids) > 3 * cfg.max_seq_len
    stats = ev.evaluate_lm(provider, [("bn", doc)], stride=16, progress=False)[ev.ALL]
    assert stats.tokens == len(ids) - 1 and math.isfinite(stats.nll)
    # Right-padded batches give the same log-probs as one sequence at a time.
    seqs = [ids[:32], ids[5:20], ids[40:43]]
    batched = provider.token_logprobs_batch(seqs)
    for s, b in zip(seqs, batched):
        np.testing.assert_allclose(b, provider.token_logprobs(s), atol=1e-5)


# --- multiple choice ------------------------------------------------------------------------------


def test_mc_scorer_picks_hand_checked_answers():
    # " a": 0x20 -> 1 bit, 0x61 -> 2 bits: 3 bits over 2 bytes (1.5/byte)
    # " dddd": 1 + 4 * 1 = 5 bits over 5 bytes (1.0/byte)
    # " cc": 1 + 2 * 4 = 9 bits over 3 bytes (3.0/byte)
    items = [ev.MCItem(["Q:"] * 3, [ev._join("Q:", c) for c in ("a", "dddd", "cc")], gold=0),
             ev.MCItem(["Q:"] * 2, [ev._join("Q:", c) for c in ("cc", "dddd")], gold=1)]
    scores = ev.score_mc(ByteProvider(), items, progress=False)
    assert scores.loglik[0] == pytest.approx([-3 * math.log(2), -5 * math.log(2), -9 * math.log(2)])
    assert scores.predictions("acc") == [0, 1]
    assert scores.predictions("acc_norm_byte") == [1, 1]
    assert scores.predictions("acc_norm_char") == [1, 1]
    s = scores.summary()
    assert s["acc"]["correct"] == 2 and s["acc_norm_byte"]["correct"] == 1
    assert s["chance"] == pytest.approx((1 / 3 + 1 / 2) / 2)


def test_wilson_interval_known_values():
    lo, hi = ev.wilson_interval(8, 10)
    assert (lo, hi) == (pytest.approx(0.4902, abs=1e-4), pytest.approx(0.9433, abs=1e-4))
    lo, hi = ev.wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    assert all(math.isnan(x) for x in ev.wilson_interval(0, 0))


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\n", encoding="utf-8")
    return path


def test_formats_and_chance_for_2_4_5_way_sets(tmp_path):
    copa = _write_jsonl(tmp_path / "copa.jsonl", [{"query": "It rained, therefore", "choices": ["wet.", "dry."], "gold": 0}] * 3)
    wino = _write_jsonl(tmp_path / "wino.jsonl", [{"context_options": ["A so A", "A so B"], "continuation": "won.", "gold": 1}])
    hs = _write_jsonl(tmp_path / "hs.jsonl", [{"ctx": "He [title] runs", "endings": ["a", "b", "c", "d"], "label": "2"}])
    okapi5 = tmp_path / "okapi.json"
    okapi5.write_text(json.dumps([{"instruction": "প্রশ্ন?", "option_a": "ক", "option_b": "খ", "option_c": "গ",
                                   "option_d": "ঘ", "option_e": "ঙ", "answer": "E"}], ensure_ascii=False))
    okapi_mixed = tmp_path / "okapi_mixed.json"
    okapi_mixed.write_text(json.dumps([
        {"instruction": "q1", "option_a": "a", "option_b": "b", "option_c": "c", "option_d": "d", "answer": "B"},
        {"instruction": "q2", "option_a": "a", "option_b": "b", "option_c": "c", "option_d": "d", "option_e": "e",
         "answer": "A"}]))
    expect = {copa: ("llm-foundry", 0.5), wino: ("winogrande", 0.5), hs: ("hellaswag", 0.25),
              okapi5: ("okapi-arc", 0.2), okapi_mixed: ("okapi-arc", (0.25 + 0.2) / 2)}
    for path, (fmt, chance) in expect.items():
        got_fmt, items = ev.load_mc(path)
        assert got_fmt == fmt
        assert ev.chance_rate(items) == pytest.approx(chance)
        assert ev.score_mc(ByteProvider(), items, progress=False).summary()["chance"] == pytest.approx(chance)
    _, (w,) = ev.load_mc(wino)
    assert w.contexts == ["A so A", "A so B"] and w.continuations == [" won.", " won."] and w.gold == 1
    _, (h,) = ev.load_mc(hs)
    assert h.contexts[0] == "He. runs" and h.gold == 2
    _, (o,) = ev.load_mc(okapi5)
    assert o.contexts[0] == "Question: প্রশ্ন?\nAnswer:" and o.gold == 4 and o.continuations[4] == " ঙ"
    assert len(ev.load_mc(copa, limit=2)[1]) == 2


@pytest.mark.parametrize("content, message", [
    ('{"query": "q", "choices": ["a", "b"], "gold": 2}\n', "gold index 2 out of range"),
    ('{"foo": 1}\n', "unknown multiple-choice record"),
    ('{"query": "q", "choices": ["a", "b"], "gold": 0}\n{oops\n', ":2: invalid JSON"),
    ('[{"instruction": "q", "option_a": "a", "option_b": "b", "answer": "Z"}]', "answer must be a letter"),
])
def test_bad_mc_files_raise_one_line_errors(tmp_path, content, message):
    p = tmp_path / "bad.jsonl"
    p.write_text(content)
    with pytest.raises(ev.EvalError, match=message):
        ev.load_mc(p)


def test_shared_eval_files_parse_with_expected_chance():
    if not EVAL_DIR.is_dir():
        pytest.skip(f"shared data absent ({EVAL_DIR})")
    expect = {"arc_easy": 0.25, "copa": 0.5, "piqa": 0.5, "winogrande": 0.5, "hellaswag_val_1000": 0.25,
              "siqa": None, "commonsense_qa": None}
    for path in ev.expand_mc_paths([EVAL_DIR / "en_mc", EVAL_DIR / "bn_mc"]):
        fmt, items = ev.load_mc(path, limit=300)
        name = ev.mc_set_name(path)
        assert 0 < len(items) <= 300
        if expect.get(name) is not None:
            assert ev.chance_rate(items) == pytest.approx(expect[name]), name
        if fmt == "okapi-arc":  # mostly 4-way; a few 3- and 5-way items
            assert 0.24 <= ev.chance_rate(items) <= 0.26
            assert {it.n_choices for it in items} <= {3, 4, 5}


# --- the twin gate and a trained model ------------------------------------------------------------


def _heldout_windows(run: TinyRun, n_windows: int = 24, width: int = 65) -> torch.Tensor:
    ids: list[int] = []
    for s in run.heldout:
        ids += run.tokenizer.encode(s, bos=True, eos=True)
    n = min(n_windows, len(ids) // width)
    return torch.tensor(ids[: n * width]).view(n, width)


def test_twin_gate_fails_untrained_and_passes_trained(tiny_run):
    windows = _heldout_windows(tiny_run)
    untrained = ev.make_twin(tiny_run.cfg, seed=99)
    bad = ev.twin_gate(untrained, tiny_run.cfg, windows)
    good = ev.twin_gate(tiny_run.model, tiny_run.cfg, windows)
    assert isinstance(bad, GateResult) and bad.name == good.name == "twin"
    assert not bad.passed and "has not learned" in bad.detail
    assert good.passed, good.detail
    r = ev.nll_twin(tiny_run.model, tiny_run.cfg, windows)
    assert r.twin - r.model >= ev.TWIN_MARGIN
    assert r.twin == pytest.approx(math.log(tiny_run.cfg.vocab_size), abs=0.5)  # random init: near uniform
    # (inputs, targets) batches as WindowLoader.next_batch gives them score the same
    pairs = [(windows[i: i + 8, :-1], windows[i: i + 8, 1:]) for i in range(0, len(windows), 8)]
    r2 = ev.nll_twin(tiny_run.model, None, pairs)
    assert (r2.model, r2.twin, r2.tokens) == (pytest.approx(r.model, rel=1e-5), pytest.approx(r.twin, rel=1e-5), r.tokens)


def test_trained_model_picks_bangla_over_gibberish(tiny_run):
    lines = [s for s in tiny_run.heldout if len(s) > 40][:3]
    items = []
    for k, s in enumerate(lines):  # hand-checked: the real Bangla continuation, not Latin/digit noise
        ctx, cont = s[:20], s[20:40]
        wrong = ["zq xv kwj pfh qqz zx", "7@#9 ~~ ^^ 0x1F 0x2A", "QWRTY PLMKN ZXCVB"][: 1 + k]
        choices = wrong[:k] + [cont] + wrong[k:]
        items.append(ev.MCItem([ctx] * len(choices), [ev._join(ctx, c) for c in choices], gold=k))
    provider = ev.TorchProvider(tiny_run.model, tiny_run.tokenizer)
    scores = ev.score_mc(provider, items, progress=False)
    for kind in ev.SCORE_KINDS:
        assert scores.predictions(kind) == [0, 1, 2], kind
    assert scores.summary()["chance"] == pytest.approx((1 / 2 + 1 / 3 + 1 / 4) / 3)


def test_lm_metrics_trained_vs_twin(tiny_run):
    docs = ev.split_documents("\n".join(tiny_run.heldout[:60]))
    m = ev.evaluate_lm(ev.TorchProvider(tiny_run.model, tiny_run.tokenizer), docs, progress=False)
    t = ev.evaluate_lm(ev.TorchProvider(ev.make_twin(tiny_run.cfg), tiny_run.tokenizer), docs, progress=False)
    assert set(m) == {"bn", ev.ALL}
    assert m[ev.ALL].bits_per_byte < t[ev.ALL].bits_per_byte - 0.2
    assert m[ev.ALL].bytes == t[ev.ALL].bytes == sum(len(d.encode()) for _, d in docs)


# --- the CLI --------------------------------------------------------------------------------------


def test_cli_writes_reports_and_model_card(tiny_run, tmp_path, capsys):
    run = tiny_run.run_dir
    (run / "export").mkdir(exist_ok=True)
    card = run / "export" / "README.md"
    card.write_text("# tiny model\n\nSome card text.\n")
    mc = _write_jsonl(tmp_path / "llm-foundry__mini.jsonl", [
        {"query": tiny_run.heldout[i][:20], "choices": [tiny_run.heldout[i][20:40], "zq xv kwj pfh"], "gold": 0}
        for i in range(4)])
    args = [str(run), "--text", str(tiny_run.heldout_file), "--mc", str(mc), "--limit", "20", "--no-progress"]
    assert ev.main(args) == 0
    report = json.loads((run / "eval" / "eval.json").read_text())
    assert [m["name"] for m in report["models"]] == ["model", "twin"]
    assert report["gates"][0]["name"] == "twin" and report["gates"][0]["passed"]
    lm = report["models"][0]["lm"]
    assert lm["all"]["bits_per_byte"] < report["models"][1]["lm"]["all"]["bits_per_byte"]
    assert report["models"][0]["mc"]["mini"]["n"] == 4 and report["models"][0]["mc"]["mini"]["chance"] == 0.5
    assert report["step"] == 150
    assert (run / "eval" / "eval.png").stat().st_size > 1000
    assert "bits/byte" in (run / "eval" / "eval.md").read_text()
    text = card.read_text()
    assert text.startswith("# tiny model") and text.count("<!-- prodip:eval:begin -->") == 1
    # never overwritten without --force; with it, the card section is replaced, not duplicated
    capsys.readouterr()
    assert ev.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--force" in err and len(err.strip().splitlines()) == 1
    assert ev.main([*args, "--force", "--no-twin"]) == 0
    assert card.read_text().count("<!-- prodip:eval:begin -->") == 1
    assert [m["name"] for m in json.loads((run / "eval" / "eval.json").read_text())["models"]] == ["model"]


def test_cli_errors_are_one_line(tiny_run, tmp_path, capsys):
    run = str(tiny_run.run_dir)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nope": 1}\n')
    for args in ([run], [run, "--mc", str(bad)], [str(tmp_path / "missing"), "--text", str(tiny_run.heldout_file)],
                 [run, "--text", str(tmp_path / "none.txt")], [run, "--mc", str(bad), "--limit", "0"]):
        assert ev.main([*args, "--out", str(tmp_path / "o")]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err


def test_module_entry_point_reports_errors():
    r = subprocess.run([sys.executable, "-m", "training.evaluate", "/nonexistent/run", "--text", "x"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr


# --- exported files through serving backends ------------------------------------------------------


def _backend_or_skip(kind: str, path: Path):
    import serving

    try:
        return serving.load(path, kind)
    except ImportError as e:
        pytest.skip(f"serving backend {kind} not available yet: {e}")


def test_backend_provider_matches_torch_provider(tiny_run):
    """The torch serving backend, wrapped as a provider, scores like TorchProvider (same logits)."""
    from export.evaluate import BackendProvider

    backend = _backend_or_skip("torch", tiny_run.run_dir)
    try:
        bp = BackendProvider(backend, name="served")
        docs = ev.split_documents("\n".join(tiny_run.heldout[:10]))
        a = ev.evaluate_lm(bp, docs, progress=False)[ev.ALL]
        b = ev.evaluate_lm(ev.TorchProvider(tiny_run.model, tiny_run.tokenizer), docs, progress=False)[ev.ALL]
        assert a.tokens == b.tokens and a.bits_per_byte == pytest.approx(b.bits_per_byte, rel=1e-4)
    finally:
        backend.close()


def _exported(tiny_run: TinyRun, kind: str, tmp: Path) -> Path:
    """Export the tiny run with the export stage's own writers (fp32 ONNX, F16 GGUF)."""
    if kind == "onnx":
        from export.onnx import export_onnx

        return next(p for p in export_onnx(tiny_run.run_dir, tmp / "onnx") if p.suffix == ".onnx")
    from export.gguf import write_gguf
    from export.manifest import load_source

    return write_gguf(load_source(tiny_run.run_dir), tmp / "gguf" / "tiny-F16.gguf", "F16")


@pytest.mark.parametrize("kind", ["onnx", "gguf"])
def test_export_cli_scores_exported_file_with_deltas(tiny_run, tmp_path, kind):
    from export.evaluate import main as export_main

    path = _exported(tiny_run, kind, tmp_path)
    _backend_or_skip("onnx" if kind == "onnx" else "llama.cpp", path).close()
    out = tmp_path / "eval"
    assert export_main([str(path), "--reference", str(tiny_run.run_dir), "--text", str(tiny_run.heldout_file),
                        "--limit", "3", "--out", str(out), "--no-progress", "--threads", "1"]) == 0
    report = json.loads((out / "eval.json").read_text())
    ref, exp = report["models"]
    assert ref["name"] == "torch (reference)" and exp["delta_vs"] == ref["name"]
    assert ref["lm"]["all"]["bytes"] == exp["lm"]["all"]["bytes"]
    # an fp32/F16 export loses (almost) nothing: the bits-per-byte delta is tiny
    assert abs(exp["delta"]["bits_per_byte"]["all"]) < 0.05


def test_export_cli_errors_and_backend_arguments(tmp_path, capsys):
    from export.evaluate import load_kwargs
    from export.evaluate import main as export_main

    assert export_main([str(tmp_path / "missing.gguf"), "--text", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "missing.gguf" in err and len(err.strip().splitlines()) == 1
    assert export_main([str(tmp_path), "--threads", "0", "--text", "x"]) == 2
    assert "--threads" in capsys.readouterr().err
    assert load_kwargs(Path("m.gguf"), None, 128, 1) == {"n_ctx": 128, "threads": 1}
    assert load_kwargs(Path("model.onnx"), None, 128, 2) == {"threads": 2}
    assert load_kwargs(Path("run"), "llama.cpp", None, None) == {}
