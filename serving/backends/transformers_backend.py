"""transformers backend: the Hugging Face export (`export/hf/`) through `AutoModelForCausalLM` and
`AutoTokenizer`, as a `Backend`.

It exists so parity (and anyone checking the HF files) runs transformers exactly as a user would,
offline. transformers is a dev/test dependency, so it is imported only when this backend is built.
transformers does not apply NFC: text goes through `training.text.normalization.normalize` first, as in every backend.
Generation and `logits_incremental` run the one decode loop (training.model.decode_loop) over `_step`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from serving.backend import SamplingParams, ServingError
from serving.backends.sampled_decode import generate_ids
from serving.backends.torch_backend import set_threads, torch_row
from training.model.decode_loop import feed
from training.text.normalization import normalize
from training.text.tokenizer import BYTE_PIECE, EOS, IM_END, piece_bytes


class TransformersBackend:
    name = "transformers"

    def __init__(self, path: str | Path, threads: int | None = None):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        # transformers 5 renames past_key_values; the old name still works in 4.x and 5.x
        warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
        set_threads(threads)
        self.path = Path(path)
        try:
            self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32,
                                                              local_files_only=True).eval()
            self.hf_tokenizer = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ServingError(f"{self.path}: transformers cannot load it ({str(e).splitlines()[0]})") from None
        self.n_ctx = int(self.model.config.max_position_embeddings)
        self.vocab_size = int(self.model.config.vocab_size)
        self.bos_id = int(self.hf_tokenizer.bos_token_id)
        self.eos_ids = tuple(int(self.hf_tokenizer.convert_tokens_to_ids(t)) for t in (EOS, IM_END))

    def tokenize(self, text: str, *, bos: bool = True, allow_special: bool = False) -> list[int]:
        ids = self.hf_tokenizer(normalize(text), add_special_tokens=False,
                                split_special_tokens=not allow_special)["input_ids"]
        return [self.bos_id, *ids] if bos else list(ids)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.hf_tokenizer.decode([int(i) for i in ids])

    def detokenize_bytes(self, ids: Sequence[int]) -> bytes:
        """Raw bytes from the pieces (decode() would write U+FFFD for a lone byte-fallback token)."""
        special = set(self.hf_tokenizer.all_special_ids)
        pieces = self.hf_tokenizer.convert_ids_to_tokens([int(i) for i in ids if int(i) not in special])
        return b"".join(piece_bytes(p, "byte" if BYTE_PIECE.fullmatch(p) else "normal") for p in pieces)

    def _check_ids(self, ids: Sequence[int]) -> torch.Tensor:
        if len(ids) == 0:
            raise ServingError("empty input: give at least one token")
        if len(ids) > self.n_ctx:
            raise ServingError(f"input is {len(ids)} tokens, longer than the context ({self.n_ctx})")
        t = torch.tensor([[int(i) for i in ids]], dtype=torch.long)
        if int(t.min()) < 0 or int(t.max()) >= self.vocab_size:
            raise ServingError(f"token ids must be in [0, {self.vocab_size})")
        return t

    @torch.inference_mode()
    def logits(self, ids: Sequence[int]) -> np.ndarray:
        return self.model(self._check_ids(ids), use_cache=False).logits[0].float().numpy()

    def _step(self, ids: list[int], start: int, past: Any) -> tuple[torch.Tensor, Any]:
        """The decode loop's step: transformers places `ids` after its cache (`start` is its length)."""
        out = self.model(torch.tensor([ids], dtype=torch.long), past_key_values=past, use_cache=True)
        return out.logits[0], out.past_key_values

    @torch.inference_mode()
    def logits_incremental(self, ids: Sequence[int], prefix: int = 0) -> np.ndarray:
        """(T, V) through transformers' KV cache: `prefix` tokens in one pass, then one at a time."""
        self._check_ids(ids)
        return torch.cat(feed(self._step, ids, prefix)).float().numpy()

    @torch.inference_mode()
    def generate(self, ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        """Stream sampled ids (serving.backends.sampled_decode, as every Python backend); stops at an
        end-of-turn id (not yielded), max_new_tokens or the end of the context."""
        self._check_ids(ids)
        yield from generate_ids(self._step, ids, params, n_ctx=self.n_ctx, eos_ids=self.eos_ids, to_numpy=torch_row)

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]
