"""`train.py --init-from`: an open LlamaForCausalLM in Hugging Face layout as a run's starting point.

The models are tiny random LlamaForCausalLM saved by transformers itself (tied and untied head, GQA and
MHA, a non-default rope_theta and rms_norm_eps) with a SentencePiece tokenizer trained here on the
shipped text; the data is prepared with that tokenizer.model (`training.prepare --tokenizer`), as
docs/init_from.md says. Import parity, a short continued run that saves a normal checkpoint, its HF
export loaded back by transformers, and every refusal (one `error:` line, no --out folder)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import preloaded
import pytest
import torch
import transformers  # a dev dependency: absent, this module fails, never skips
from conftest import REPO, run_train
from fixtures_init_from import ADD, MODELS, SHAPE, TRAIN, save_llama, save_stock, stock_tokenizer

PARITY_TOL = 1e-4  # the bound (fp32, max |logit difference|); measured: 0.0 on CPU (the same ops in the same order)


@pytest.fixture(scope="module")
def work(init_work) -> dict:
    return init_work  # fixtures_init_from's session fixture, shared with tests/test_init_from_downstream.py


@pytest.fixture(scope="module")
def extended(init_extended) -> dict:
    return init_extended


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits if hasattr(model, "config") else model.eval()(ids)


@pytest.mark.parametrize("name", list(MODELS))
def test_import_matches_transformers(work, name):
    from training.model import hf_import
    from training.model.decoder import Transformer

    folder, over = work[name], MODELS[name]
    imp = hf_import.open_folder(str(folder), work["tok"], str(work["data"]))
    c = imp.model_cfg
    assert (c.n_kv_heads, c.tie_embeddings, c.rope_theta, c.norm_eps, c.max_seq_len, c.d_model, c.n_layers) == (
        over["num_key_value_heads"], over["tie_word_embeddings"], over["rope_theta"], over["rms_norm_eps"],
        SHAPE["max_position_embeddings"], SHAPE["hidden_size"], SHAPE["num_hidden_layers"])
    ids = torch.randint(0, work["tok"].vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    ref = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want = _logits(ref, ids)
    model = Transformer(c)
    before = (_logits(model, ids) - want).abs().max().item()
    hf_import.load_weights(model, imp)
    diff = (_logits(model, ids) - want).abs().max().item()
    assert diff <= PARITY_TOL, f"{name}: max |logit difference| {diff:.3g}"  # measured 0.0 for both models
    assert before > 100 * PARITY_TOL  # the comparison has teeth: a random prodip model is far off (measured 5.1, 4.8)
    assert (model.output.weight is model.tok_embeddings.weight) == over["tie_word_embeddings"]


def test_sharded_weights_with_an_index(work, tmp_path):
    from training.model import hf_import
    from training.model.decoder import Transformer

    folder = save_llama(tmp_path / "sharded", work["tok"], seed=3, **MODELS["untied_mha"])
    ref = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    shutil.rmtree(folder)
    ref.save_pretrained(folder, max_shard_size="100KB")
    work["tok"].save(folder / "tokenizer.model")
    assert (folder / hf_import.INDEX).is_file() and len(list(folder.glob("*.safetensors"))) > 1
    imp = hf_import.open_folder(str(folder), work["tok"], str(work["data"]))
    model = Transformer(imp.model_cfg)
    hf_import.load_weights(model, imp)
    ids = torch.tensor([work["tok"].encode(work["lines"][5])[:40]])
    assert (_logits(model, ids) - _logits(ref, ids)).abs().max().item() <= PARITY_TOL  # measured 0.0


def test_continued_run_saves_a_checkpoint_that_exports_to_transformers(work):
    """docs/init_from.md's commands: train 3 steps from the HF folder, then `python -m export safetensors RUN`."""
    from export.__main__ import main as export_main
    from training.checkpoint.checkpoint_io import load_model

    run = work["root"] / "run"
    cmd = ("--init-from", str(work["tied_gqa"]), "--data", str(work["data"]), "--out", str(run), *TRAIN)
    p = run_train(*cmd, "--stop-at", "2")
    assert "normalization:" in p.stdout and "fertility of the imported tokenizer" in p.stdout
    assert "initialized from" in p.stdout
    p = run_train(*cmd)  # the same command resumes its own checkpoint: no second import over it
    assert "resumed from" in p.stdout and "initialized from" not in p.stdout
    gates = json.loads((run / "gates.json").read_text())
    parity = next(r for r in gates["results"] if r["name"] == "init.parity")
    assert gates["passed"] and parity["passed"] and parity["value"] <= PARITY_TOL
    assert json.loads((run / "run.json").read_text())["train"]["init_from"] == str(work["tied_gqa"])
    model, _ = load_model(run)  # a normal prodip checkpoint
    assert export_main(["safetensors", str(run), "--no-parity"]) == 0
    exported = transformers.LlamaForCausalLM.from_pretrained(run / "export" / "hf", dtype=torch.float32).eval()
    base = transformers.LlamaForCausalLM.from_pretrained(work["tied_gqa"], dtype=torch.float32).eval()
    ids = torch.tensor([work["tok"].encode(work["lines"][3])[:48]])
    ours = _logits(model, ids)
    assert (_logits(exported, ids) - ours).abs().max().item() <= PARITY_TOL  # measured 0.0
    assert (_logits(base, ids) - ours).abs().max().item() > 10 * PARITY_TOL  # 3 steps moved it (measured 0.70)


def _refused(work, tmp_path, folder: str | Path, what: str, data: Path | None = None) -> str:
    out = tmp_path / "out"
    p = preloaded.run([sys.executable, str(REPO / "training" / "train.py"), "--init-from", str(folder), "--data",
                        str(data or work["data"]), "--out", str(out), *TRAIN], capture_output=True, text=True,
                       cwd=REPO)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and "Warning" not in ln]
    assert p.returncode != 0, p.stdout[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error:") and what in lines[0], p.stderr[-2000:]
    assert not out.exists()  # nothing written
    return lines[0]


def test_not_a_model_folder(work, tmp_path):
    (tmp_path / "empty").mkdir()
    _refused(work, tmp_path, tmp_path / "empty", "no config.json")
    _refused(work, tmp_path, tmp_path / "nope", "no such folder")


def test_hub_id_offline_says_download_first(work, tmp_path):
    _refused(work, tmp_path, "someone/some-llama", "download the folder first")


def test_unsupported_architecture(work, tmp_path):
    qwen = save_llama(tmp_path / "qwen2", work["tok"], arch="Qwen2")
    _refused(work, tmp_path, qwen, "Qwen2ForCausalLM")


def test_config_field_we_cannot_honour(work, tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    llama3 = save_llama(tmp_path / "llama3", work["tok"], rope_parameters=rope)
    _refused(work, tmp_path, llama3, "rope_type 'llama3'")
    biased = save_llama(tmp_path / "bias", work["tok"], attention_bias=True)
    _refused(work, tmp_path, biased, "attention_bias")
    odd = tmp_path / "odd"
    shutil.copytree(work["tied_gqa"], odd)
    cfg = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**cfg, "sliding_window": 64}))
    _refused(work, tmp_path, odd, "'sliding_window'")


def test_bpe_only_tokenizer(work, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = tmp_path / "bpe"
    shutil.copytree(work["tied_gqa"], bpe)
    (bpe / "tokenizer.model").unlink()
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel()
    t.train_from_iterator(work["lines"][:200], trainers.BpeTrainer(vocab_size=300))
    t.save(str(bpe / "tokenizer.json"))
    _refused(work, tmp_path, bpe, "byte-level BPE")


def test_corrupt_safetensors(work, tmp_path):
    bad = tmp_path / "corrupt"
    shutil.copytree(work["tied_gqa"], bad)
    w = bad / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    _refused(work, tmp_path, bad, "not a readable safetensors file")


def test_data_prepared_with_another_tokenizer(work, tmp_path):
    from training.text.tokenizer import train_tokenizer

    other_tok = train_tokenizer(work["lines"], 400, num_threads=1)
    other = save_llama(tmp_path / "other", other_tok)
    _refused(work, tmp_path, other, "prepared with another tokenizer")


def test_without_transformers_the_import_says_how_to_install_it(monkeypatch):
    from training.model import hf_import

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails as if not installed
    with pytest.raises(hf_import.InitFromError, match=r"pip install 'prodip\[init\]'"):
        hf_import.require_transformers()


def test_a_tokenizer_without_prodips_special_tokens(work, tmp_path):
    """A stock Llama tokenizer.model (no <pad>, no chat tokens) over data of another tokenizer: refused naming them."""
    folder = save_stock(tmp_path / "stock", work, stock_tokenizer(work["lines"], 512))
    _refused(work, tmp_path, folder, "lacks prodip's special tokens ['<pad>', '<|im_start|>', '<|im_end|>']")


# ------------------------------------------------------------------------------------ vocabulary extension
def test_extension_keeps_every_base_id_and_adds_the_pieces(extended):
    import sentencepiece as spm

    from training.text.tokenizer import CHAT_SPECIALS, PAD, Tokenizer

    base, ext = (spm.SentencePieceProcessor(model_proto=extended[k]) for k in ("base", "ext"))
    n = base.get_piece_size()
    assert [ext.id_to_piece(i) for i in range(n)] == [base.id_to_piece(i) for i in range(n)]
    assert extended["added"] == ADD and ext.get_piece_size() == n + len(CHAT_SPECIALS) + 1 + ADD
    tok = Tokenizer(extended["ext"])  # now holds prodip's special tokens
    assert tok.pad_id >= n and ext.id_to_piece(tok.pad_id) == PAD
    text = "\n".join(extended["bn"][:200])
    before, after = len(base.encode(text)), len(ext.encode(text))
    assert after < 0.8 * before  # Bangla fertility improves: measured 19,890 -> 13,868 tokens on 20,833 characters


def test_extended_import_keeps_old_logits_and_initializes_new_rows_from_the_base(work, extended):
    import sentencepiece as spm

    from training.data.loaders import read_meta
    from training.model import hf_import
    from training.model.decoder import Transformer
    from training.text.tokenizer import Tokenizer

    tok = Tokenizer.load(extended["data"] / "tokenizer.model")
    assert read_meta(extended["data"])["tokenizer_sha256"] == tok.sha256
    imp = hf_import.open_folder(str(extended["folder"]), tok, str(extended["data"]))
    base = spm.SentencePieceProcessor(model_proto=extended["base"])
    n = base.get_piece_size()
    assert (imp.base_vocab, imp.model_cfg.vocab_size) == (n, tok.vocab_size)
    model = Transformer(imp.model_cfg)
    hf_import.load_weights(model, imp)
    ref = transformers.LlamaForCausalLM.from_pretrained(extended["folder"], dtype=torch.float32).eval()
    emb, head = ref.model.embed_tokens.weight.detach(), ref.lm_head.weight.detach()
    assert torch.equal(model.tok_embeddings.weight[:n], emb) and torch.equal(model.output.weight[:n], head)
    word = next(i for i in range(tok.vocab_size - 1, n, -1) if tok.id_to_piece(i).startswith("\u2581"))
    spelled = base.encode(tok.id_to_piece(word)[1:])  # its text in the base tokenizer (the dummy prefix gives the ▁)
    assert torch.allclose(model.tok_embeddings.weight[word], emb[spelled].mean(0), atol=1e-6)
    assert torch.allclose(model.output.weight[word], head[spelled].mean(0), atol=1e-6)
    assert torch.allclose(model.tok_embeddings.weight[tok.pad_id], emb.mean(0), atol=1e-6)  # control: all rows
    ids = torch.tensor([[i for i in tok.encode(work["lines"][-1]) if i < n][:48]])  # text using no new piece
    diff = (_logits(model, ids)[..., :n] - _logits(ref, ids)).abs().max().item()
    assert diff <= PARITY_TOL  # measured 0.0


def test_continued_run_on_an_extended_vocabulary(init_extended_run):
    run = init_extended_run  # fixtures_init_from: trained once, exported and evaluated in test_init_from_downstream
    gate = next(r for r in json.loads((run / "gates.json").read_text())["results"] if r["name"] == "init.parity")
    assert gate["passed"] and gate["value"] <= PARITY_TOL and "over the base's" in gate["detail"]


def test_prepare_extend_tokenizer_command(work, tmp_path, capsys):
    """`python -m training.prepare --extend-tokenizer BASE --add-pieces N`: the base's ids kept, the report holds
    the fertility before and after; the two flags only together, and not with --tokenizer."""
    import sentencepiece as spm

    from training.prepare.prepare_cli import main
    from training.text.tokenizer import Tokenizer

    (tmp_path / "base.model").write_bytes(stock_tokenizer(work["lines"], 400))
    # SentencePiece's defaults: NFKC (drops ZWJ/ZWNJ) and folded whitespace, which llama.cpp would not repeat
    (tmp_path / "nfkc.model").write_bytes(stock_tokenizer(work["lines"], 400, normalization_rule_name="nmt_nfkc",
                                                          remove_extra_whitespaces=True))
    common = ["--input", str(work["root"] / "corpus"), "--workers", "1", "--fertility-floor", "1",
              "--skip-gate", "tokenizer.balance"]
    for bad, what in ((["--add-pieces", "8"], "go together"),
                      (["--extend-tokenizer", str(tmp_path / "base.model"), "--add-pieces", "8", "--tokenizer",
                        str(work["tied_gqa"] / "tokenizer.model")], "drop --tokenizer"),
                      (["--extend-tokenizer", str(tmp_path / "nope.model"), "--add-pieces", "8"], "not found"),
                      (["--extend-tokenizer", str(tmp_path / "nfkc.model"), "--add-pieces", "8"],
                       "normalization rule 'nmt_nfkc' (normalizer_spec) cannot be carried")):
        assert main([*common, *bad, "--out", str(tmp_path / "bad")]) != 0
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and err[0].startswith("error:") and what in err[0], err
        assert not (tmp_path / "bad").exists()
    data = tmp_path / "data"
    assert main([*common, "--extend-tokenizer", str(tmp_path / "base.model"), "--add-pieces", "32",
                 "--out", str(data)]) == 0
    assert "new pieces appended" in capsys.readouterr().out
    base = spm.SentencePieceProcessor(model_file=str(tmp_path / "base.model"))
    tok = Tokenizer.load(data / "tokenizer.model")
    n = base.get_piece_size()
    assert [tok.id_to_piece(i) for i in range(n)] == [base.id_to_piece(i) for i in range(n)]
    assert n + 3 < tok.vocab_size <= n + 3 + 32  # prodip's 3 special tokens, then at most 32 new pieces
    report = json.loads((data / "report.json").read_text())
    before, after = report["fertility_before_extension"], report["fertility"]
    assert before["tokenizer_sha256"] != after["tokenizer_sha256"]
    assert after["total"]["tokens"] < before["total"]["tokens"]  # the same held-out text in fewer tokens
