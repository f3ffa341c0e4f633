"""Evaluation: bits per byte by hand, the twin gate, multiple choice, the CLIs, exported backends.

Everything here runs on a fresh clone: the trained model is conftest's `tiny_run` (train.py on
training/assets/corpus), scored on the original held-out text and multiple-choice sets in
training/assets/eval. Only `test_shared_eval_files_*` reads ../shared/data (opt-in breadth).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import fixtures_evaluate as fx
import numpy as np
import preloaded
import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, shared_path
from fixtures_evaluate import EVAL_ASSETS, HELDOUT, MC_BN, MC_EN, TrainedRun, corpus_lines, heldout_lines

from training import evaluate as ev
from training.model.decoder import ModelConfig
from training.runfiles.gate_results import GateResult
from training.text.normalization import normalize

# the fixtures (re-exported so pytest finds them here)
corpus_tokenizer, trained, run_copy, one_thread = fx.corpus_tokenizer, fx.trained, fx.run_copy, fx.one_thread
pytestmark = pytest.mark.usefixtures("one_thread")


class ByteProvider:
    """A hand-checkable provider: tokens are UTF-8 bytes; log p(t | anything) = -(t % 4 + 1) bits."""

    name = "bytes"
    n_ctx = 1 << 20
    bos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(normalize(text).encode("utf-8"))

    def token_logprobs(self, ids):
        return np.array([-(t % 4 + 1) * math.log(2) for t in ids[1:]])


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\n", encoding="utf-8")
    return path


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


def test_text_from_jsonl_records_and_limit(tmp_path):
    """--text FILE.jsonl scores each record's "text" (records are document boundaries); --limit caps it."""
    texts = ["আমি ভাত খাই।", "I eat rice.", "ঘরে যাই।"]
    path = _write_jsonl(tmp_path / "held.jsonl", [{"text": texts[0]}, texts[1], {"text": texts[2], "id": 3}])
    docs = ev.read_text_docs([path])
    assert docs == [("bn", texts[0]), ("en", texts[1]), ("bn", texts[2])]
    assert ev.read_text_docs([path], limit_chars=len(texts[0]) + 3) == [("bn", texts[0]), ("en", "I e")]
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"text": "ok"}, {"txt": "no"}])
    with pytest.raises(ev.EvalError, match=r"bad\.jsonl:2: expected a string or an object with a string \"text\""):
        ev.read_text_docs([bad])
    assert ev.read_text_docs([HELDOUT], max_chars=10**6) == ev.split_documents(HELDOUT.read_text("utf-8"), 10**6)


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
    stats = ev.evaluate_lm(ev.RunnerScorer(ev.TransformerRunner(model, corpus_tokenizer)), [("other", doc)], progress=False)[ev.ALL]
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
    provider = ev.RunnerScorer(ev.TransformerRunner(model, corpus_tokenizer))
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


class TableRunner:
    """A hand-checkable Runner with no logits_batch: every position's logits are [0, ln 2, ln 5], so
    p = [1/8, 2/8, 5/8] whatever came before."""

    name, n_ctx, eos_ids = "table", 8, (2,)

    def tokenize(self, text, *, bos=True, allow_special=False):
        return [0] if bos else []

    def detokenize(self, ids):
        return ""

    def logits(self, ids):
        return np.tile(np.log([1.0, 2.0, 5.0], dtype=np.float32), (len(ids), 1))

    def logits_incremental(self, ids, prefix=0):
        return self.logits(ids)


def test_runner_scorer_gives_log_probs_of_any_runner():
    """The one adapter: a Runner's logits -> log p(ids[i] | ids[:i]) (float64 log-softmax), by hand;
    a runner without logits_batch is scored one sequence per call; a serving Backend is a Runner."""
    from serving.backend import Backend
    from serving.backends.torch_backend import TorchBackend
    from training.model.runner import Runner, RunnerError

    runner = TableRunner()
    assert isinstance(runner, Runner) and not isinstance(runner, Backend)  # no generate/close: not served
    scorer = ev.RunnerScorer(runner)
    assert (scorer.bos_id, scorer.max_batch_tokens) == (0, 0)
    lp = scorer.token_logprobs([0, 2, 1, 0])
    np.testing.assert_allclose(lp, np.log([5 / 8, 2 / 8, 1 / 8]), rtol=1e-7)  # the logits are fp32 ln 2, ln 5: measured 2.3e-8
    assert [len(x) for x in scorer.token_logprobs_batch([[0, 1], [0, 1, 2]])] == [1, 2]
    with pytest.raises(ev.EvalError, match="lengths"):
        scorer.token_logprobs([0] * 9)  # n_ctx is 8
    assert issubclass(TorchBackend, ev.TransformerRunner)  # one PyTorch runner, served and scored
    with pytest.raises(RunnerError, match="empty"):
        ev.TransformerRunner(ev.make_twin(ModelConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=1,
                                                      n_kv_heads=1, ffn_dim=8, max_seq_len=4)),
                             SimpleTokenizer()).logits([])


class SimpleTokenizer:
    bos_id, eos_id, im_end_id = 1, 2, 3

    def encode(self, text, *, bos=False, allow_special=False):
        return [1] if bos else []

    def decode(self, ids):
        return ""


# --- multiple choice ------------------------------------------------------------------------------


def test_mc_scorer_picks_hand_checked_answers():
    # " a": 0x20 -> 1 bit, 0x61 -> 2 bits: 3 bits over 2 bytes (1.5/byte)
    # " dddd": 1 + 4 * 1 = 5 bits over 5 bytes (1.0/byte)
    # " cc": 1 + 2 * 4 = 9 bits over 3 bytes (3.0/byte)
    items = [ev.MCItem(["Q:"] * 3, [ev.join_choice("Q:", c) for c in ("a", "dddd", "cc")], gold=0),
             ev.MCItem(["Q:"] * 2, [ev.join_choice("Q:", c) for c in ("cc", "dddd")], gold=1)]
    scores = ev.score_mc(ByteProvider(), items, progress=False)
    assert scores.loglik[0] == pytest.approx([-3 * math.log(2), -5 * math.log(2), -9 * math.log(2)])
    assert scores.predictions("acc") == [0, 1]
    assert scores.predictions("acc_norm_byte") == [1, 1]
    assert scores.predictions("acc_norm_char") == [1, 1]
    s = scores.summary()
    assert s["acc"]["correct"] == 2 and s["acc_norm_byte"]["correct"] == 1
    assert s["chance"] == pytest.approx((1 / 3 + 1 / 2) / 2)
    with pytest.raises(ev.EvalError, match="unknown score kind"):
        scores.predictions("acc_norm_token")


def test_wilson_interval_known_values():
    lo, hi = ev.wilson_interval(8, 10)
    assert (lo, hi) == (pytest.approx(0.4902, abs=1e-4), pytest.approx(0.9433, abs=1e-4))
    lo, hi = ev.wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    assert all(math.isnan(x) for x in ev.wilson_interval(0, 0))


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
    ('{"query": "q", "choices": ["a", "b"], "gold": 2}\n', r"bad\.jsonl:1: gold index 2 out of range"),
    ('{"foo": 1}\n', r"bad\.jsonl:1: unknown multiple-choice record"),
    ('{"query": "q", "choices": ["a", "b"], "gold": 0}\n\n{oops\n', r"bad\.jsonl:3: invalid JSON"),
    ('[{"instruction": "q", "option_a": "a", "option_b": "b", "answer": "Z"}]', "answer must be a letter"),
    ('[\n {"query": "q", "choices": ["a", "b"], "gold": 0},\n {"query": "q", "choices": ["a"], "gold": 0}\n]',
     r"bad\.jsonl:3: needs at least 2 choices"),
    ('{"query": "q", "choices": 5, "gold": 0}\n', r"bad\.jsonl:1: 'choices' must be a list of strings"),
    ("\n\n", r"bad\.jsonl: no multiple-choice items"),
])
def test_bad_mc_files_raise_one_line_errors(tmp_path, content, message):
    p = tmp_path / "bad.jsonl"
    p.write_text(content, encoding="utf-8")
    with pytest.raises(ev.EvalError, match=message) as e:
        ev.load_mc(p)
    assert "\n" not in str(e.value)


def test_shipped_mc_sets_parse_with_exact_chance():
    """The original sets in training/assets/eval: 18 four-way + 6 three-way Bangla items, 16 four-way +
    8 two-way English ones; every gold index in range; a folder expands to both files."""
    assert ev.expand_mc_paths([EVAL_ASSETS]) == [MC_BN, MC_EN]
    for path, ways, chance in [(MC_BN, {"3": 6, "4": 18}, (18 / 4 + 6 / 3) / 24), (MC_EN, {"2": 8, "4": 16}, 1 / 3)]:
        fmt, items = ev.load_mc(path)
        assert fmt == "llm-foundry" and len(items) == 24
        assert ev.chance_rate(items) == pytest.approx(chance)
        summary = ev.score_mc(ByteProvider(), items, progress=False).summary()
        assert summary["ways"] == ways and summary["n"] == 24
        assert all(it.continuations[it.gold].startswith(" ") for it in items)
    assert ev.mc_set_name(MC_BN) == "prodip_mc_bn"


def test_shared_eval_files_parse_with_expected_chance():
    """Opt-in breadth: the real benchmark files in ../shared/data/eval (skipped when absent, required
    under CI). The same on training/assets: test_shipped_mc_sets_parse_with_exact_chance."""
    eval_dir = shared_path("eval")
    expect = {"arc_easy": 0.25, "copa": 0.5, "piqa": 0.5, "winogrande": 0.5, "hellaswag_val_1000": 0.25,
              "siqa": None, "commonsense_qa": None}
    for path in ev.expand_mc_paths([eval_dir / "en_mc", eval_dir / "bn_mc"]):
        fmt, items = ev.load_mc(path, limit=300)
        name = ev.mc_set_name(path)
        assert 0 < len(items) <= 300
        if expect.get(name) is not None:
            assert ev.chance_rate(items) == pytest.approx(expect[name]), name
        if fmt == "okapi-arc":  # mostly 4-way; a few 3- and 5-way items
            assert 0.24 <= ev.chance_rate(items) <= 0.26
            assert {it.n_choices for it in items} <= {3, 4, 5}


# --- the twin gate and a trained model ------------------------------------------------------------


def _heldout_windows(run: TrainedRun, n_windows: int = 16, width: int = 65) -> torch.Tensor:
    ids: list[int] = []
    for s in heldout_lines():
        ids += run.tokenizer.encode(s, bos=True, eos=True)
    n = min(n_windows, len(ids) // width)
    assert n >= 8, f"only {len(ids)} held-out tokens"
    return torch.tensor(ids[: n * width]).view(n, width)


def test_twin_gate_fails_untrained_and_passes_trained(trained):
    windows = _heldout_windows(trained)
    untrained = ev.make_twin(trained.cfg, seed=99)
    bad = ev.twin_gate(untrained, trained.cfg, windows)
    good = ev.twin_gate(trained.model, trained.cfg, windows)
    assert isinstance(bad, GateResult) and bad.name == good.name == "twin"
    assert not bad.passed and "has not learned" in bad.detail
    assert good.passed, good.detail
    r = ev.nll_twin(trained.model, trained.cfg, windows)
    assert r.twin - r.model >= ev.TWIN_MARGIN
    assert r.twin == pytest.approx(math.log(trained.cfg.vocab_size), abs=0.5)  # random init: near uniform
    # (inputs, targets) batches as WindowLoader.next_batch gives them, and uint16 arrays, score the same
    pairs = [(windows[i: i + 8, :-1], windows[i: i + 8, 1:]) for i in range(0, len(windows), 8)]
    for other in (pairs, windows.numpy().astype(np.uint16)):
        r2 = ev.nll_twin(trained.model, None, other)
        assert (r2.model, r2.twin, r2.tokens) == (pytest.approx(r.model, rel=1e-5), pytest.approx(r.twin, rel=1e-5),
                                                  r.tokens)


def test_trained_model_picks_bangla_over_gibberish(trained):
    lines = [s for s in heldout_lines() if len(s) > 40][:3]
    items = []
    for k, s in enumerate(lines):  # hand-checked: the real Bangla continuation, not Latin/digit noise
        ctx, cont = s[:20], s[20:40]
        wrong = ["zq xv kwj pfh qqz zx", "7@#9 ~~ ^^ 0x1F 0x2A", "QWRTY PLMKN ZXCVB"][: 1 + k]
        choices = wrong[:k] + [cont] + wrong[k:]
        items.append(ev.MCItem([ctx] * len(choices), [ev.join_choice(ctx, c) for c in choices], gold=k))
    provider = ev.RunnerScorer(ev.TransformerRunner(trained.model, trained.tokenizer))
    scores = ev.score_mc(provider, items, progress=False)
    for kind in ev.SCORE_KINDS:
        assert scores.predictions(kind) == [0, 1, 2], kind
    assert scores.summary()["chance"] == pytest.approx((1 / 2 + 1 / 3 + 1 / 4) / 3)


def test_lm_metrics_trained_vs_twin(trained):
    docs = ev.read_text_docs([HELDOUT])
    m = ev.evaluate_lm(ev.RunnerScorer(ev.TransformerRunner(trained.model, trained.tokenizer)), docs, progress=False)
    t = ev.evaluate_lm(ev.RunnerScorer(ev.TransformerRunner(ev.make_twin(trained.cfg), trained.tokenizer)), docs, progress=False)
    assert set(m) == {"bn", "en", ev.ALL}
    assert m[ev.ALL].bytes == t[ev.ALL].bytes == len(normalize(HELDOUT.read_text("utf-8")).encode("utf-8"))
    assert m["bn"].bytes + m["en"].bytes == m[ev.ALL].bytes
    for lang in ("bn", ev.ALL):
        assert m[lang].bits_per_byte < t[lang].bits_per_byte - 0.2, lang


# --- well-formedness of generated text ------------------------------------------------------------


def test_greedy_equals_argmax_without_cache_and_stops_at_end_of_turn(trained):
    """The KV-cache greedy loop picks, at every step, the argmax of a full forward pass over the prefix."""
    provider = ev.RunnerScorer(ev.TransformerRunner(trained.model, trained.tokenizer))
    ids = provider.prompt_ids("আজকের আবহাওয়া কেমন?", chat=False)
    assert ids[0] == trained.tokenizer.bos_id
    out = provider.greedy(ids, 24)
    seq = list(ids)
    with torch.no_grad():
        for _ in range(24):
            nxt = int(trained.model(torch.tensor([seq]))[0, -1].argmax())
            if nxt in (trained.tokenizer.eos_id, trained.tokenizer.im_end_id):
                break
            seq.append(nxt)
    assert out == seq[len(ids):] and out
    chat_ids = provider.prompt_ids("নমস্কার", chat=True)
    assert trained.tokenizer.decode(chat_ids, keep_special=True).endswith("<|im_start|>assistant\n")


def test_generate_wellformed_scores_the_answers(trained):
    from training.text.wellformed import wellformed

    provider = ev.RunnerScorer(ev.TransformerRunner(trained.model, trained.tokenizer))
    prompts = ev.read_prompts(ev.PROMPTS)[:3]
    r = ev.generate_wellformed(provider, prompts, max_new_tokens=16, chat=False)
    answers = [provider.decode(provider.greedy(provider.prompt_ids(p, chat=False), 16)) for p in prompts]
    assert [s["text"] for s in r["samples"]] == answers  # greedy: the same answers again
    w = wellformed(answers)
    assert (r["clusters"], r["share"], r["prompts"]) == (w.clusters, w.share, 3) and w.clusters > 0
    assert r["examples"] == [c for c, _ in w.invalid.most_common()][:len(r["examples"])]


def test_read_prompts_errors(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n", encoding="utf-8")
    for path, words in ((empty, "no prompts"), (tmp_path / "missing.txt", "not found")):
        with pytest.raises(ev.EvalError, match=words):
            ev.read_prompts(path)


# --- the CLI --------------------------------------------------------------------------------------


def test_cli_writes_reports_and_model_card(trained, run_copy, capsys):
    run = run_copy
    (run / "export").mkdir(exist_ok=True)
    card = run / "export" / "README.md"
    card.write_text("# tiny model\n\nSome card text.\n")
    args = [str(run), "--text", str(HELDOUT), "--mc", str(EVAL_ASSETS), "--limit", "30", "--no-progress"]
    assert ev.main(args) == 0
    report = json.loads((run / "eval" / "eval.json").read_text())
    assert report["prodip_eval"] == 1 and report["kind"] == "checkpoint"
    assert [m["name"] for m in report["models"]] == ["model", "twin"]
    assert report["gates"][0]["name"] == "twin" and report["gates"][0]["passed"]
    model, twin = report["models"]
    assert model["lm"]["all"]["bits_per_byte"] < twin["lm"]["all"]["bits_per_byte"]
    assert twin["delta_vs"] == "model" and twin["delta"]["bits_per_byte"]["all"] > 0
    assert set(model["mc"]) == {"prodip_mc_bn", "prodip_mc_en"} and twin["mc"] == {}
    assert report["mc_files"]["prodip_mc_bn"] == {"path": str(MC_BN), "format": "llm-foundry"}
    for name, chance in (("prodip_mc_bn", 6.5 / 24), ("prodip_mc_en", 1 / 3)):
        s = model["mc"][name]
        assert s["n"] == 24 and s["chance"] == pytest.approx(chance)
        lo, hi = s["acc"]["ci95"]
        assert lo <= s["acc"]["value"] <= hi and (lo, hi) == pytest.approx(ev.wilson_interval(s["acc"]["correct"], 24))
    assert report["step"] == trained.step
    # the run's data (prepared from training/assets) was decontaminated against every shipped eval set
    assert report["decontamination"] == {str(HELDOUT): "decontaminated", str(MC_BN): "decontaminated",
                                         str(MC_EN): "decontaminated"}
    assert "| decontaminated |" in (run / "eval" / "eval.md").read_text()
    assert (run / "eval" / "eval.png").stat().st_size > 1000
    assert "bits/byte" in (run / "eval" / "eval.md").read_text()
    # greedy answers to the shipped prompts (plain continuation: tiny_run is a pretraining run), scored
    wf = model["wellformed"]
    assert wf["prompts"] == len(ev.read_prompts(ev.PROMPTS)) and not wf["chat"] and twin["wellformed"]["prompts"] == 8
    assert wf["clusters"] > 0 and wf["invalid"] == wf["clusters"] - round(wf["share"] * wf["clusters"])
    assert "Well-formedness of generated text" in (run / "eval" / "eval.md").read_text()
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
    assert ev.main([*args, "--force", "--no-twin", "--gen-tokens", "0"]) == 0
    assert "wellformed" not in json.loads((run / "eval" / "eval.json").read_text())["models"][0]


def test_cli_gate_fails_for_an_untrained_checkpoint(trained, tmp_path):
    """--fail-on-gate exits 1 when the checkpoint is no better than its twin (here: the twin itself)."""
    from training.checkpoint.checkpoint_io import save, weights_for_save

    twin = ev.make_twin(trained.cfg, seed=0)
    run = tmp_path / "untrained"
    save(run, 1, weights=weights_for_save(twin.state_dict(), trained.cfg), cfg=trained.cfg,
         tokenizer=trained.tokenizer, state={"tokens": 0})
    args = [str(run), "--text", str(HELDOUT), "--no-progress", "--fail-on-gate", "--out", str(tmp_path / "o")]
    assert ev.main(args) == 1
    gate = json.loads((tmp_path / "o" / "eval.json").read_text())["gates"][0]
    assert not gate["passed"] and "has not learned" in gate["detail"]


def test_cli_errors_are_one_line(trained, tmp_path, capsys):
    run = str(trained.run_dir)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nope": 1}\n')
    for args in ([run], [run, "--mc", str(bad)], [str(tmp_path / "missing"), "--text", str(HELDOUT)],
                 [run, "--text", str(tmp_path / "none.txt")], [run, "--text", str(HELDOUT), "--prompts",
                                                               str(tmp_path / "none.txt")]):
        assert ev.main([*args, "--out", str(tmp_path / "o")]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    # numbers are range-checked while parsing (training.runfiles.schema types): one error line naming the flag
    for flag, value in (("--limit", "0"), ("--margin", "-1"), ("--twin-seed", str(10**30)), ("--gen-tokens", "-1"),
                        ("--max-doc-chars", "0"), ("--stride", "nan"), ("--step", "1e3"), ("--device", "gpu")):
        assert ev.main([run, "--text", str(HELDOUT), flag, value, "--out", str(tmp_path / "o")]) == 2, flag
        err = capsys.readouterr().err
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and flag in err, err
    assert not (tmp_path / "o").exists()


def test_module_entry_point(run_copy):
    """`python -m training.evaluate RUN --text FILE --mc FILE` as docs/eval.md shows it, and its errors."""
    r = preloaded.run([sys.executable, "-m", "training.evaluate", "/nonexistent/run", "--text", "x"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr
    r = preloaded.run([sys.executable, "-m", "training.evaluate", str(run_copy), "--text", str(HELDOUT),
                        "--mc", str(MC_EN), "--no-progress"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "| twin | pass |" in r.stdout and "wrote " in r.stdout
    report = json.loads((run_copy / "eval" / "eval.json").read_text())
    assert report["models"][0]["mc"]["prodip_mc_en"]["n"] == 24


# --- exported files through serving backends ------------------------------------------------------


def _backend_or_skip(kind: str, path: Path):
    import serving

    try:
        return serving.load(path, kind)
    except ImportError as e:
        pytest.skip(f"serving backend {kind} not available yet: {e}")


def test_served_backend_scores_like_the_in_process_runner(trained):
    """The torch serving backend is the base's TransformerRunner opened from the run folder: scored
    through the one adapter, RunnerScorer, it gives the in-process runner's numbers (same weights, same
    float64 log-softmax path; measured equal to the last bit here)."""
    backend = _backend_or_skip("torch", trained.run_dir)
    try:
        bp = ev.RunnerScorer(backend, name="served")
        docs = ev.split_documents("\n".join(heldout_lines()[:10]))
        a = ev.evaluate_lm(bp, docs, progress=False)[ev.ALL]
        b = ev.evaluate_lm(ev.RunnerScorer(ev.TransformerRunner(trained.model, trained.tokenizer)), docs,
                           progress=False)[ev.ALL]
        assert a.tokens == b.tokens and a.bits_per_byte == pytest.approx(b.bits_per_byte, rel=1e-4)
    finally:
        backend.close()


def _exported(run: TrainedRun, kind: str, tmp: Path) -> Path:
    """Export the tiny run with the export stage's own writers (fp32 ONNX, F16 GGUF)."""
    if kind == "onnx":
        from export.onnx.onnx_export import export_onnx

        return next(p for p in export_onnx(run.run_dir, tmp / "onnx") if p.suffix == ".onnx")
    from export.gguf.gguf_export import write_gguf
    from export.manifest import load_source

    return write_gguf(load_source(run.run_dir), tmp / "gguf" / "tiny-F16.gguf", "F16")


@pytest.mark.parametrize("kind", ["onnx", "gguf"])
def test_export_cli_scores_exported_file_with_deltas(trained, tmp_path, kind):
    from export.evaluate import main as export_main

    path = _exported(trained, kind, tmp_path)
    _backend_or_skip("onnx" if kind == "onnx" else "llama.cpp", path).close()
    out = tmp_path / "eval"
    assert export_main([str(path), "--reference", str(trained.run_dir), "--text", str(HELDOUT),
                        "--mc", str(MC_BN), "--limit", "3", "--out", str(out), "--no-progress", "--threads", "1"]) == 0
    report = json.loads((out / "eval.json").read_text())
    ref, exp = report["models"]
    assert ref["name"] == "torch (reference)" and exp["delta_vs"] == ref["name"]
    assert ref["lm"]["all"]["bytes"] == exp["lm"]["all"]["bytes"]
    assert exp["mc"]["prodip_mc_bn"]["n"] == 3 and "prodip_mc_bn" in exp["delta"]["acc"]
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
