"""Fixtures for `train.py --init-from` (tests/test_init_from.py, tests/test_init_from_downstream.py): tiny
random LlamaForCausalLM folders saved by transformers itself, with SentencePiece tokenizers trained here on the
shipped text, the data prepared with them, and one continued run on an extended vocabulary. Built once per
session (conftest registers this module); torch and transformers are imported inside, so collecting any
test stays cheap and a machine without transformers skips the tests that use them."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_train
from fixtures_tokenizer import write_subset

SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "max_position_embeddings": 256}
MODELS = {  # name -> what differs from SHAPE
    "tied_gqa": {"num_key_value_heads": 2, "tie_word_embeddings": True, "rope_theta": 500000.0, "rms_norm_eps": 1e-5},
    "untied_mha": {"num_key_value_heads": 4, "tie_word_embeddings": False, "rope_theta": 10000.0,
                   "rms_norm_eps": 1e-6},
}
TRAIN = ("--preset", "tiny", "--max-steps", "3", "--batch-size", "2", "--seq-len", "32", "--lr", "1e-3",
         "--warmup-steps", "1", "--eval-every", "0", "--log-every", "1")
ADD = 64  # pieces the extension asks for
EXT_STEPS = 40  # the extended run: enough steps that held-in bits/byte must drop (test_init_from_downstream)


def save_llama(folder: Path, tok, *, seed: int = 0, arch: str = "Llama", **over) -> Path:
    """A random model of `arch` saved by transformers, with `tok`'s tokenizer.model beside it."""
    import torch

    transformers = pytest.importorskip("transformers")
    kw = {"vocab_size": tok.vocab_size, **SHAPE, **MODELS["tied_gqa"], **over}
    config = getattr(transformers, f"{arch}Config")(bos_token_id=tok.bos_id,
                                                    eos_token_id=tok.eos_id, initializer_range=0.1, **kw)
    torch.manual_seed(seed)  # std 0.1, not 0.02: logits spread enough that a wrong weight shows
    getattr(transformers, f"{arch}ForCausalLM")(config).save_pretrained(folder)
    tok.save(folder / "tokenizer.model")
    return folder


def stock_tokenizer(lines: list[str], vocab_size: int, **over) -> bytes:
    """A tokenizer.model as Llama (2, TinyLlama) ships one: SentencePiece BPE, byte fallback, digits split, <unk>
    <s> </s> at 0 1 2, a dummy prefix, the identity normalizer without whitespace folding, no <pad> and no chat
    tokens. `over`: other trainer options (SentencePiece's defaults are nmt_nfkc and folded whitespace)."""
    import io

    import sentencepiece as spm

    buf = io.BytesIO()
    kw = {"normalization_rule_name": "identity", "remove_extra_whitespaces": False, "split_digits": True,
          "add_dummy_prefix": True, **over}
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size,
                                   model_type="bpe", byte_fallback=True, num_threads=1, minloglevel=2, **kw)
    return buf.getvalue()


def save_stock(folder: Path, work: dict, base: bytes, **over) -> Path:
    """save_llama with a stock tokenizer `base` (and the vocabulary its size gives)."""
    import sentencepiece as spm

    n = spm.SentencePieceProcessor(model_proto=base).get_piece_size()
    save_llama(folder, work["tok"], vocab_size=n, **over)
    (folder / "tokenizer.model").write_bytes(base)
    return folder


@pytest.fixture(scope="session")
def init_work(tmp_path_factory) -> dict:
    """The tokenizer, one HF folder per MODELS entry, and a data folder prepared with their tokenizer."""
    pytest.importorskip("transformers")
    from training.prepare import prepare
    from training.text.normalization import normalize
    from training.text.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("init_from")
    corpus = write_subset(root / "corpus", 60_000)
    lines = [normalize(ln) for f in sorted(corpus.rglob("*.txt")) for ln in f.read_text("utf-8").splitlines()
             if ln.strip()]
    tok = train_tokenizer(lines, 512, num_threads=1)
    folders = {name: save_llama(root / name, tok, **MODELS[name]) for name in MODELS}
    data = root / "data"
    prepare([corpus], data, tokenizer=folders["tied_gqa"] / "tokenizer.model", progress=False, workers=1,
            fertility_floor=1.0)  # a 512-piece tokenizer on little text: the gate's floor is for real ones
    return {"root": root, "tok": tok, "lines": lines, "data": data, **folders}


@pytest.fixture(scope="session")
def init_extended(init_work) -> dict:
    """A stock Llama model (vocabulary 400) whose tokenizer is extended by ADD Bangla pieces trained on the corpus,
    and the data prepared with the extended tokenizer."""
    from training.prepare import prepare
    from training.text import vocab_extend
    from training.text.normalization import detect_language
    from training.text.tokenizer import train_tokenizer

    work = init_work
    root = work["root"] / "ext"
    base = stock_tokenizer(work["lines"], 400)
    bn = [ln for ln in work["lines"] if detect_language(ln) == "bn"]
    trained = train_tokenizer(bn, 512, num_threads=1).proto
    ext, added = vocab_extend.extend(base, trained, ADD)
    (root / "tok").mkdir(parents=True)
    (root / "tok" / "tokenizer.model").write_bytes(ext)
    folder = save_stock(root / "stock", work, base, **MODELS["untied_mha"])
    prepare([work["root"] / "corpus"], root / "data", tokenizer=root / "tok" / "tokenizer.model", progress=False,
            workers=1, fertility_floor=1.0, skip_gates=["tokenizer.balance"])  # 64 Bangla pieces tilt a tiny vocab
    return {"base": base, "ext": ext, "added": added, "bn": bn, "folder": folder, "data": root / "data"}


@pytest.fixture(scope="session")
def init_extended_run(init_extended, tmp_path_factory) -> Path:
    """`train.py --init-from` the stock model onto the extended data: EXT_STEPS steps, one checkpoint at the end."""
    run = tmp_path_factory.mktemp("init_ext_run") / "run"
    run_train("--init-from", str(init_extended["folder"]), "--data", str(init_extended["data"]), "--out", str(run),
              "--preset", "tiny", "--max-steps", str(EXT_STEPS), "--batch-size", "2", "--seq-len", "32", "--lr", "3e-3",
              "--warmup-steps", "2", "--eval-every", "0", "--save-every", "0", "--log-every", "10",
              "--skip-gate", "tokenizer.balance")
    return run
