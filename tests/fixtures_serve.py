"""Shared fixtures for the serving / HTTP / demo tests: a tiny Bangla chat model made by the real CLIs.

The suite's pretrained run (conftest `tiny_run`: training/train.py on training/assets/corpus) is
fine-tuned by training/sft.py on a few questions, each answered by a Bangla paragraph of the shipped
corpus, until it has memorized them: greedy replies to these questions are those paragraphs, reliably
Bangla and long enough to arrive in several streamed pieces. Everything comes from training/assets,
so these tests never skip for missing data.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import preloaded
import pytest
from conftest import CHAT_SET, CORPUS, REPO, built_once

from training.text.normalization import normalize

STEPS = int(os.environ.get("PRODIP_TEST_SERVE_STEPS", "40"))  # assistant-token loss ~0.04 by then
LR = 3e-3
SEQ = 128  # rows of one conversation each; the longest is ~90 tokens (context stays 256)

# The questions the tests ask. Each gets a long Bangla answer (a corpus paragraph) that the model memorizes.
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


def bangla_paragraphs() -> list[str]:
    lines = [normalize(x.strip()) for f in sorted(CORPUS.glob("bn_*.txt"))
             for x in f.read_text(encoding="utf-8").splitlines()]
    return [x for x in lines if len(x) > 2 * ANSWER_CHARS]


def write_chats(path: Path) -> Path:
    """The questions with their answers (split "train"), and one shipped conversation held out (split
    "test"), so no memorized question lands in SFT's validation split."""
    paragraphs = bangla_paragraphs()
    records = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": clip(paragraphs[i])}],
                "split": "train"} for i, q in enumerate(QUESTIONS)]
    held_out = json.loads(CHAT_SET.read_text(encoding="utf-8").splitlines()[0])
    records.append({"messages": held_out["messages"], "split": "test"})
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def run_sft(*args: str) -> None:
    """`python training/sft.py ARGS` in a subprocess, as a user runs it."""
    p = preloaded.run([sys.executable, str(REPO / "training" / "sft.py"), *args], capture_output=True, text=True,
                       cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "2"})
    if p.returncode != 0:
        raise AssertionError(f"sft.py failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")


def build_chat_run(tiny_run: Path, root: Path) -> tuple[Path, Path]:
    """(RUN_DIR, its F16 GGUF): the tiny Bangla chat model SFT-trained from `tiny_run`, exported once."""
    out = root / "run"
    run_sft("--init", str(tiny_run), "--data", str(write_chats(root / "chats.jsonl")), "--out", str(out),
            "--max-steps", str(STEPS), "--batch-size", str(len(QUESTIONS)), "--seq-len", str(SEQ), "--lr", str(LR),
            "--warmup-steps", "5",
            "--eval-every", str(STEPS), "--save-every", str(STEPS), "--log-every", str(STEPS))
    return out, try_export_gguf(out)


@pytest.fixture(scope="session")
def chat_run(tiny_run, tmp_path_factory) -> tuple[Path, Path]:
    """Built once with its GGUF inside (RUN/export/gguf/), so the folder is read-only afterwards."""
    return built_once(tmp_path_factory, "serve", lambda root: build_chat_run(tiny_run, root))


@pytest.fixture(scope="session")
def serve_run(chat_run) -> Path:
    """A RUN_DIR holding the tiny Bangla chat model, its F16 GGUF exported (read it; copy it to write)."""
    return chat_run[0]


def try_export_gguf(run_dir: Path, types: tuple[str, ...] = ("F16",)) -> Path:
    """The run exported to GGUF through export.gguf.gguf_export (RUN/export/gguf/)."""
    from export.gguf.gguf_export import export_gguf
    from export.manifest import Manifest, default_out_dir, load_source

    src = load_source(run_dir)
    out = default_out_dir(src)
    manifest = Manifest.open(out, src, force=True)
    paths = export_gguf(src, out, list(types), manifest, force=True)
    manifest.save()
    return paths[0]


@pytest.fixture(scope="session")
def serve_gguf(chat_run) -> Path:
    return chat_run[1]


@pytest.fixture(scope="module")
def client():
    """An HTTP app (FastAPI's TestClient) over a real random-init one-layer model: for bodies that are
    refused before generation. A server exception answers 500, which every caller's status check fails."""
    from fastapi.testclient import TestClient

    from serving.backends.torch_backend import TorchBackend
    from serving.server.http_app import ServerConfig, create_app
    from training.model.decoder import Transformer, preset
    from training.text.tokenizer import train_tokenizer

    lines = [normalize(x) for f in sorted(CORPUS.glob("*.txt")) for x in f.read_text(encoding="utf-8").splitlines()
             if x.strip()]
    tok = train_tokenizer(lines, 600, num_threads=1)
    cfg = preset("tiny", vocab_size=tok.vocab_size, n_layers=1, d_model=64, n_heads=2, n_kv_heads=1, ffn_dim=128,
                 max_seq_len=64)
    backend = TorchBackend.from_model(Transformer(cfg), tok, threads=1)
    with TestClient(create_app(backend, ServerConfig(model_id="t", max_tokens_cap=8)), raise_server_exceptions=False) as c:
        yield c
    backend.close()
