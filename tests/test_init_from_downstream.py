"""After `train.py --init-from`, on a run whose tokenizer extends the base's (fixtures_init_from: a stock Llama
tokenizer of 400 pieces + prodip's 3 special tokens + 64 Bangla pieces, EXT_STEPS steps of continued training):

- `python -m training.evaluate RUN` judges the run against its base: held-out bits/byte of the base (its own
  tokenizer), the extended-but-untrained model and the continued model side by side;
- `train.py --plan --init-from` plans the imported model's shape, not the preset's;
- every export (HF, GGUF F16/Q8_0, ONNX) of the run passes parity;
- SFT starts from the run and the PyTorch backend chats with the result."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers  # noqa: F401  (a dev dependency: absent, this module fails, never skips)
from fixtures_export import shipped_texts
from fixtures_init_from import EXT_STEPS, SHAPE

LN2 = 0.6931471805599453


def _jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": ln}, ensure_ascii=False) + "\n" for ln in lines), encoding="utf-8")
    return path


def _evaluate(run: Path, out: Path, *args: str) -> int:
    from training.evaluate import main

    return main([str(run), "--out", str(out), "--no-progress", "--gen-tokens", "0", "--no-twin", "--force", *args])


def _oracle_bits_per_byte(folder: Path, base_proto: bytes, lines: list[str]) -> float:
    """The base's bits/byte by its definition, with transformers' own model and the base's own tokenizer:
    sum over lines of -log2 p(ids[1:] | <s> ...) over the UTF-8 bytes of the lines (each line under 256 tokens)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=base_proto)
    ref = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    nll = 0.0
    with torch.no_grad():
        for ln in lines:
            ids = torch.tensor([[sp.bos_id(), *sp.encode(ln)]])
            lp = torch.log_softmax(ref(ids).logits[0, :-1].double(), -1)
            nll -= lp.gather(-1, ids[0, 1:, None]).sum().item()
    return nll / LN2 / sum(len(ln.encode("utf-8")) for ln in lines)


def test_evaluate_judges_the_run_against_its_base(init_work, init_extended, init_extended_run, tmp_path):
    """English lines whose extended ids are the base's (no new piece): the extended-untrained model scores as the
    base does; held-in Bangla (new pieces): the continued model beats the extended-untrained one."""
    import sentencepiece as spm

    from training.text.normalization import detect_language
    from training.text.tokenizer import Tokenizer

    base = spm.SentencePieceProcessor(model_proto=init_extended["base"])
    n = base.get_piece_size()
    ext = Tokenizer(init_extended["ext"])
    plain = [ln for ln in init_work["lines"] if detect_language(ln) == "en" and ext.encode(ln) == base.encode(ln)
             and len(base.encode(ln)) < SHAPE["max_position_embeddings"]][:40]
    held_in = [ln for ln in init_extended["bn"] if max(ext.encode(ln)) >= n][:40]
    assert len(plain) == 40 and len(held_in) == 40
    texts = [_jsonl(tmp_path / "plain_en.jsonl", plain), _jsonl(tmp_path / "held_in_bn.jsonl", held_in)]
    assert _evaluate(init_extended_run, tmp_path / "eval", "--text", *map(str, texts)) == 0
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    comp = report["init_from"]  # the run's run.json records init_from: the comparison runs by itself
    assert comp["extended"] and comp["base_vocab"] == n and comp["vocab"] == ext.vocab_size
    assert Path(comp["folder"]) == init_extended["folder"]
    en, bn = comp["bits_per_byte"]["en"], comp["bits_per_byte"]["bn"]
    assert set(en) == set(bn) == {"base", "extended-untrained", "model"}
    assert {m["name"] for m in report["models"]} == {"base", "extended-untrained", "model"}
    # (a) is the base by definition: transformers' model, the base's tokenizer, the same bytes (fp32 logits; rel 1e-6)
    assert en["base"] == pytest.approx(_oracle_bits_per_byte(init_extended["folder"], init_extended["base"], plain),
                                       rel=1e-6)
    # (b) on text with no new piece: the same ids and the same logits over the base vocabulary, so never better
    # than the base (the new rows only add to the softmax's denominator), and close to it: measured base 8.082,
    # extended-untrained 8.242 bits/byte (+2.0%; 0.127 nat/token, the 67 new rows' share of the softmax)
    assert en["base"] <= en["extended-untrained"] <= 1.03 * en["base"]
    # (c) EXT_STEPS steps on the corpus this text is from: measured extended-untrained 2.380, continued 1.829
    # bits/byte (0.77x; the base with its own tokenizer: 3.418)
    assert bn["model"] < 0.9 * bn["extended-untrained"], (EXT_STEPS, bn)
    md = (tmp_path / "eval" / "eval.md").read_text()
    assert "# Against the base" in md
    assert md.count("| base | extended-untrained | model | Δ model − base |") == 1


def test_a_run_on_the_bases_own_tokenizer_compares_with_the_base_alone(init_work, tmp_path):
    """Without an extension the extended-untrained model would be the base itself: only the base is scored, and
    its bits/byte is the definition's (transformers' model on the folder's tokenizer)."""
    from training.evaluate.against_base import AgainstBase
    from training.evaluate.request import build_request

    tok, folder = init_work["tok"], init_work["tied_gqa"]
    lines = [ln for ln in init_work["lines"] if len(tok.encode(ln)) < SHAPE["max_position_embeddings"]][:20]
    against = AgainstBase(str(folder), tok, str(init_work["data"]))
    assert not against.extended
    models = against.score(build_request([_jsonl(tmp_path / "t.jsonl", lines)], []), "cpu", progress=False)
    assert [m["name"] for m in models] == ["base"]
    want = _oracle_bits_per_byte(folder, tok.proto, lines)
    assert models[0]["lm"]["all"]["bits_per_byte"] == pytest.approx(want, rel=1e-6)
    assert set(against.summary(models)["bits_per_byte"]["all"]) == {"base"}


def test_evaluate_base_flags(init_work, init_extended, init_extended_run, tmp_path, capsys):
    """--no-base skips the comparison; a recorded folder that is gone, a --base that is not there or is another
    model, is one error line naming the flag or the tokenizer; --base and --no-base together are refused."""
    text = str(_jsonl(tmp_path / "t.jsonl", init_extended["bn"][:3]))
    assert _evaluate(init_extended_run, tmp_path / "a", "--text", text, "--no-base") == 0
    report = json.loads((tmp_path / "a" / "eval.json").read_text())
    assert "init_from" not in report and [m["name"] for m in report["models"]] == ["model"]
    capsys.readouterr()
    moved = tmp_path / "moved"
    shutil.copytree(init_extended_run, moved, ignore=shutil.ignore_patterns("export", "eval"))
    cfg = json.loads((moved / "run.json").read_text())
    cfg["train"]["init_from"] = str(tmp_path / "gone")
    (moved / "run.json").write_text(json.dumps(cfg))
    for args, what in ((["--text", text], "pass --base FOLDER"), (["--text", text, "--base", str(tmp_path / "nope")],
                                                                   "--base"),
                       (["--text", text, "--base", str(init_extended["folder"]), "--no-base"], "give one"),
                       (["--text", text, "--base", str(init_work["tied_gqa"])], "prepared with another tokenizer")):
        assert _evaluate(moved, tmp_path / "b", *args) == 2
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and err[0].startswith("error:") and what in err[0], err
    assert not (tmp_path / "b").exists()
    assert _evaluate(moved, tmp_path / "c", "--text", text, "--base", str(init_extended["folder"])) == 0


def test_plan_uses_the_imported_shape(init_work, init_extended, tmp_path, capsys):
    """`--plan --init-from`: the parameters are the HF model's (transformers counts them) plus the extension's
    rows, not the preset's; its max_position_embeddings bounds --seq-len; nothing is written."""
    from training import run_plan as P
    from training.model.decoder import count_params, preset
    from training.train import build_parser, main, resolve

    def argv(folder: Path, data: Path, *extra: str) -> list[str]:
        return ["--init-from", str(folder), "--data", str(data), "--out", str(tmp_path / "run"), "--preset", "tiny",
                "--max-steps", "100", "--seq-len", "128", "--plan", "--gpu", "H100", *extra]

    tied = transformers.LlamaForCausalLM.from_pretrained(init_work["tied_gqa"]).num_parameters()
    r = P.plan(resolve(build_parser().parse_args(argv(init_work["tied_gqa"], init_work["data"])), 1),
               gpu="H100", print_=lambda *a: None)
    assert r["params"] == tied != count_params(preset("tiny"))
    stock = transformers.LlamaForCausalLM.from_pretrained(init_extended["folder"]).num_parameters()
    grown = (pieces(init_extended["ext"]) - pieces(init_extended["base"])) * SHAPE["hidden_size"] * 2
    assert main(argv(init_extended["folder"], init_extended["data"])) == 0  # untied: embedding and head grow
    out = capsys.readouterr().out
    assert f"plan: --init-from {init_extended['folder']}, {(stock + grown) / 1e6:,.1f} M parameters" in out
    r = P.plan(resolve(build_parser().parse_args(argv(init_extended["folder"], init_extended["data"])), 1),
               gpu="H100", print_=lambda *a: None)
    assert r["params"] == stock + grown and r["vocab_size"] == pieces(init_extended["ext"])
    assert main(argv(init_work["tied_gqa"], init_work["data"], "--seq-len", "512")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"max_seq_len {SHAPE['max_position_embeddings']}" in err
    assert not (tmp_path / "run").exists()


def pieces(proto: bytes) -> int:
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_proto=proto).get_piece_size()


def test_every_export_of_an_extended_run_passes_parity(init_extended_run, tmp_path):
    """`python -m export all RUN --f16 --q8 --texts SHIPPED`: HF safetensors (+ tokenizer.json), ONNX and GGUF
    F16/Q8_0 of the extended-vocabulary run, each compared with the PyTorch checkpoint by the parity run (exit 0:
    no threshold breached), tokenizer identity on every line of text that ships (the Llama base's dummy prefix
    included: tokenizer.json had none before, 0 of 12 texts matched)."""
    from export.__main__ import main as export_main

    texts = tmp_path / "shipped.txt"
    lines = [t for t in shipped_texts() if "\n" not in t]
    texts.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "export"
    assert export_main(["all", str(init_extended_run), "--out", str(out), "--f16", "--q8", "--texts", str(texts)]) == 0
    parity = json.loads((out / "parity.json").read_text())
    backends = {b["name"]: b for b in parity["backends"]}
    assert {"transformers", "llama.cpp-F16", "llama.cpp-Q8_0", "onnx-fp32"} <= set(backends), sorted(backends)
    assert parity["passed"] and parity["extra_texts"] == len(lines) > 1000
    for name, b in backends.items():
        assert b["passed"] and b["tokenizer_equal"] == b["tokenizer_total"] > len(lines), (name, b["failures"])
    # and back: transformers decodes the ids to the text, without the dummy prefix's space
    hf = transformers.AutoTokenizer.from_pretrained(out / "hf", local_files_only=True)
    for text in lines[:50]:
        assert hf.decode(hf(text)["input_ids"], skip_special_tokens=True) == text


def test_sft_and_serving_take_an_extended_run_as_any_other(init_extended_run, tmp_path, capsys):
    """Item 5 of [init]: SFT starts from the --init-from run (its extended vocabulary and the chat template's
    special tokens, which the extended tokenizer carries), and the PyTorch backend chats with the result."""
    from fixtures_reliability import call_main

    from serving import load
    from serving.backend import SamplingParams
    from serving.chat_session import chat_stream
    from training.checkpoint import checkpoint_io as ckpt
    from training.text.tokenizer import IM_END, IM_START

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"প্রশ্ন {i}?"},
                                                      {"role": "assistant", "content": f"উত্তর {i}।"}]},
                                        ensure_ascii=False) + "\n" for i in range(24)), encoding="utf-8")
    sft = tmp_path / "sft"
    rc, out, err = call_main("training.sft", ["--init", str(init_extended_run), "--data", str(chats), "--out", str(sft),
                                              "--seq-len", "128", "--batch-size", "2", "--max-steps", "2",
                                              "--eval-every", "0", "--device", "cpu", "--skip-gate", "throughput",
                                              "--skip-gate", "tokenizer.balance"], capsys)
    assert rc == 0, out[-2000:] + err[-2000:]
    base, tuned = ckpt.load(init_extended_run), ckpt.load(sft)
    assert tuned.config.to_dict() == base.config.to_dict()  # the extended shape, unchanged by SFT
    assert tuned.tokenizer.sha256 == base.tokenizer.sha256
    assert any(not torch.equal(v, base.weights[k]) for k, v in tuned.weights.items())  # it trained
    prepared, stream = chat_stream(load(sft, "pytorch"), [{"role": "user", "content": "প্রশ্ন 3?"}],
                                   SamplingParams(max_new_tokens=8, temperature=0.0))
    assert prepared.fallback is None  # the chat template applies: the run was tuned for chat
    marks = {tuned.tokenizer.special_ids[IM_START], tuned.tokenizer.special_ids[IM_END]}
    assert marks <= set(prepared.ids)  # each a single special id of the extended vocabulary
    text = "".join(stream)
    assert stream.stats.completion_tokens <= 8 and stream.stats.finish_reason in ("stop", "length"), text
