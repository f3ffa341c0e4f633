"""llama.cpp backend (llama-cpp-python): GGUF files, llama.cpp's own tokenizer and sampler.

- tokenize: llama.cpp's SentencePiece tokenizer reading the GGUF vocabulary, on normalize(text);
- logits: every position (`logits_all=True`; llama-cpp-python 0.3.x fills `scores` only then);
- generate: llama.cpp's sampler chain (greedy when temperature == 0);
- one threading.Lock around everything that touches the context (logits, generate): a Llama object
  is never entered by two requests at once; a generate stream holds it until it ends or is closed.
The KV cache is F32 by default (`kv_f32`): the default F16 cache alone moves logits by ~4e-3,
which would hide what parity measures for the F32 file.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from serving.backend import SamplingParams, ServingError
from training.text import normalize
from training.tokenizer import EOS, IM_END

EXPECTED_ARCH = "llama"
GGML_TYPE_F32 = 0
ARCH_KEY = "general.architecture"
FILE_TYPE_KEY = "general.file_type"


def gguf_architecture(path: Path) -> tuple[str | None, int | None]:
    """(general.architecture, general.file_type) read with gguf-py, without loading the model."""
    import gguf

    try:
        r = gguf.GGUFReader(path)
    except Exception as e:  # gguf-py raises ValueError/struct errors on foreign files
        raise ServingError(f"{path}: not a readable GGUF file ({e})") from None
    arch = r.fields.get(ARCH_KEY)
    ftype = r.fields.get(FILE_TYPE_KEY)
    return (arch.contents() if arch else None, int(ftype.contents()) if ftype else None)


def _type_label(path: Path) -> str:
    """'Q4_K_M' from 'name-Q4_K_M.gguf' (file names carry the type), else the stem."""
    stem = path.stem
    return stem.rsplit("-", 1)[-1] if "-" in stem else stem


class LlamaCppBackend:
    def __init__(self, path: str | os.PathLike, n_ctx: int | None = None, threads: int | None = None,
                 kv_f32: bool = True, logits_all: bool = True, n_batch: int = 512, seed: int = 0,
                 verbose: bool = False):
        self.path = Path(path)
        if not self.path.is_file():
            raise ServingError(f"GGUF not found: {self.path}")
        arch, _ = gguf_architecture(self.path)
        if arch != EXPECTED_ARCH:
            raise ServingError(f"{self.path}: architecture {arch!r} is not {EXPECTED_ARCH!r}; "
                               "prodip serves Llama-architecture GGUF files written by `python -m export gguf`")
        from llama_cpp import Llama

        kv = {"type_k": GGML_TYPE_F32, "type_v": GGML_TYPE_F32} if kv_f32 else {}
        self._lock = threading.Lock()
        self.llm = Llama(str(self.path), n_ctx=n_ctx or 0, n_threads=threads, n_threads_batch=threads,
                         n_batch=n_batch, logits_all=logits_all, seed=seed, verbose=verbose, **kv)
        # llama.cpp pads its context (to 256) but llama-cpp-python's token/logit buffers keep the asked size
        # (the trained context when n_ctx=0): past that they overflow, so that is the usable context
        self.n_ctx = min(self.llm.n_ctx(), self.llm.context_params.n_ctx)
        self.n_vocab = self.llm.n_vocab()
        self.logits_all = logits_all
        self.name = f"llama.cpp-{_type_label(self.path)}"
        self.eos_ids = tuple(self._piece_id(p) for p in (EOS, IM_END))

    def _piece_id(self, piece: str) -> int:
        ids = self.llm.tokenize(piece.encode(), add_bos=False, special=True)
        if len(ids) != 1:
            raise ServingError(f"{self.path}: vocabulary lacks the special token {piece}")
        return ids[0]

    # tokenizer: reads only the vocabulary (never the context), so no lock: callers may tokenize and
    # detokenize while a generate() stream holds the lock
    def tokenize(self, text: str, *, bos: bool = True, allow_special: bool = False) -> list[int]:
        return self.llm.tokenize(normalize(text).encode("utf-8"), add_bos=bos, special=allow_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        # No lock: it reads only the vocabulary, and streaming decodes while generate() holds the lock.
        return self.llm.detokenize([int(i) for i in ids]).decode("utf-8", errors="replace")

    # model ----------------------------------------------------------------------------------------
    def _check(self, ids: Sequence[int]) -> list[int]:
        ids = [int(i) for i in ids]
        if not ids:
            raise ServingError("logits of an empty sequence")
        if len(ids) > self.n_ctx:
            raise ServingError(f"{len(ids)} tokens exceed the context of {self.n_ctx}")
        bad = [i for i in ids if not 0 <= i < self.n_vocab]
        if bad:
            raise ServingError(f"token id {bad[0]} outside the vocabulary (0..{self.n_vocab - 1})")
        return ids

    def _scores(self, n: int) -> np.ndarray:
        if not self.logits_all:
            raise ServingError("logits need LlamaCppBackend(..., logits_all=True)")
        return np.array(self.llm.scores[:n], dtype=np.float32)

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """(T, V) fp32 logits for every position, the whole sequence evaluated in one batch."""
        ids = self._check(ids)
        with self._lock:
            self.llm.reset()
            self.llm.eval(ids)
            return self._scores(len(ids))

    def logits_incremental(self, ids: Sequence[int], prefix: int = 0) -> np.ndarray:
        """The same logits decoded through the KV cache: `prefix` tokens in one batch, then one by one."""
        ids = self._check(ids)
        with self._lock:
            self.llm.reset()
            if prefix:
                self.llm.eval(ids[:prefix])
            for i in ids[prefix:]:
                self.llm.eval([i])
            return self._scores(len(ids))

    def generate(self, ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        """Stream new token ids (llama.cpp's sampler), stopping at an end-of-sequence id."""
        params.validate()
        ids = self._check(ids)
        room = self.n_ctx - len(ids)
        if room <= 0:
            raise ServingError(f"the prompt fills the whole context ({self.n_ctx} tokens)")
        with self._lock:
            if params.seed is not None:
                self.llm.set_seed(params.seed)
            stream = self.llm.generate(ids, top_k=params.top_k, top_p=params.top_p, min_p=0.0, temp=params.temperature,
                                       repeat_penalty=params.repetition_penalty, reset=True)
            try:
                for n, tok in enumerate(stream, 1):
                    if tok in self.eos_ids:
                        return
                    yield int(tok)
                    if n >= min(params.max_new_tokens, room):
                        return
            finally:
                stream.close()

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            with self._lock:
                llm.close()
            self.llm = None

    def __enter__(self) -> LlamaCppBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
