"""Shared fixtures for the serving / HTTP / demo tests: a tiny Bangla chat model trained for real.

The corpus is the Bangla text bundled with the package (training/assets/corpus), so these tests
never skip for missing data. The model is the "tiny" preset, trained for a few dozen AdamW steps on
a few memorized Bangla answers, enough to answer every test in Bangla.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch

from training import checkpoint
from training.chat import encode as chat_encode
from training.model import Transformer, preset
from training.text import normalize
from training.tokenizer import train_tokenizer

CORPUS = Path(__file__).resolve().parents[1] / "training" / "assets" / "corpus"
VOCAB = 1024
STEPS = int(os.environ.get("PRODIP_TEST_SERVE_STEPS", "50"))
LR = 3e-3
SEED = 0


def bangla_lines() -> list[str]:
    lines = []
    for f in sorted(CORPUS.glob("bn_*.txt")):
        lines += [normalize(x.strip()) for x in f.read_text(encoding="utf-8").splitlines() if x.strip()]
    return lines


# The questions the tests ask. Each gets a long Bangla answer (a corpus paragraph) that the model
# memorizes, so replies are reliably Bangla and long enough to arrive in several streamed pieces.
BN_QUESTION = "ভাই, ডিমের হালি কত?"  # the question most tests ask
QUESTIONS = (
    BN_QUESTION,
    "আপনি কেমন আছেন?",
    "হ্যালো",
    "আর চিনি?",
    "একটি ছোট গল্প বলো।",
    "আজকের আবহাওয়া কেমন?",
)
RAW_PROMPT = "আমার সোনার বাংলা"  # the plain-completion tests continue this
ANSWER_CHARS = 160


def clip(text: str, n: int = ANSWER_CHARS) -> str:
    return text[:n].rsplit(" ", 1)[0]


def training_sequences(tok, lines: list[str]) -> list[tuple[list[int], list[int]]]:
    """(ids, loss mask) per sequence: chat turns (loss on the answer) and plain text (loss on all)."""
    paragraphs = [x for x in lines if len(x) > 2 * ANSWER_CHARS]
    seqs = []
    for i, q in enumerate(QUESTIONS):
        a = clip(paragraphs[i])
        enc = chat_encode(tok, [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                          add_generation_prompt=False)
        seqs.append((enc.ids, enc.assistant_mask))
    for p in paragraphs[len(QUESTIONS):len(QUESTIONS) + 2]:
        ids = tok.encode(f"{RAW_PROMPT}, {clip(p)}", bos=True, eos=True)
        seqs.append((ids, [1] * len(ids)))
    return seqs


def build_tiny_run(run_dir: Path, steps: int = STEPS) -> Path:
    torch.manual_seed(SEED)
    lines = bangla_lines()
    tok = train_tokenizer(lines, VOCAB, num_threads=1)
    cfg = preset("tiny", vocab_size=tok.vocab_size, max_seq_len=256)
    seqs = training_sequences(tok, lines)
    width = max(len(ids) for ids, _ in seqs)
    x = torch.full((len(seqs), width), tok.pad_id, dtype=torch.long)
    m = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, (ids, mask) in enumerate(seqs):
        x[r, :len(ids)] = torch.tensor(ids)
        m[r, :len(ids)] = torch.tensor(mask)
    inputs, targets, loss_mask = x[:, :-1], x[:, 1:], m[:, 1:]
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        _, loss = model(inputs, targets, loss_mask=loss_mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    checkpoint.save(run_dir, steps, weights=checkpoint.weights_for_save(model.state_dict(), cfg), cfg=cfg,
                    tokenizer=tok, state={"final_loss": loss.item()})
    return run_dir


def _cache_key() -> str:
    """Changes whenever this recipe, the step count, torch or the lead's training code changes."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    for f in ("model.py", "tokenizer.py", "checkpoint.py", "chat.py", "text.py"):
        h.update((CORPUS.parents[1] / f).read_bytes())
    h.update(f"{STEPS}|{torch.__version__}".encode())
    return h.hexdigest()[:16]


@pytest.fixture(scope="session")
def serve_run(request, tmp_path_factory) -> Path:
    """A RUN_DIR holding one checkpoint of a tiny Bangla chat model (a fresh copy per session).

    Training costs ~10-40 s on a shared 2-core machine, so the trained run is kept in pytest's own
    cache (.pytest_cache), keyed by everything it depends on; `pytest --cache-clear` retrains."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("serve") / "run"
    cache = getattr(request.config, "cache", None)  # absent under `-p no:cacheprovider`
    if cache is None:
        return build_tiny_run(out)
    cached = cache.mkdir(f"prodip-serve-run-{_cache_key()}") / "run"
    if checkpoint.latest(cached) is None:
        shutil.rmtree(cached, ignore_errors=True)
        build_tiny_run(cached)
    shutil.copytree(cached, out)
    return out


def try_export_gguf(run_dir: Path, types: tuple[str, ...] = ("F16",)) -> Path | None:
    """The tiny run exported to GGUF through export.gguf (RUN/export/gguf/), or None while that
    module is absent."""
    try:
        from export.gguf import export_gguf
        from export.manifest import Manifest, default_out_dir, load_source
    except ImportError:
        return None
    src = load_source(run_dir)
    out = default_out_dir(src)
    manifest = Manifest.open(out, src, force=True)
    paths = export_gguf(src, out, list(types), manifest, force=True)
    manifest.save()
    return paths[0]


@pytest.fixture(scope="session")
def serve_gguf(serve_run) -> Path | None:
    return try_export_gguf(serve_run)
