"""transformers backend: the Hugging Face export (`export/hf/`) through `AutoModelForCausalLM` and
`AutoTokenizer`, as a `Backend`.

It exists so parity (and anyone checking the HF files) runs transformers exactly as a user would,
offline. transformers is a dev/test dependency, so it is imported only when this backend is built.
transformers does not apply NFC: text goes through `training.text.normalize` first, as in every backend.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from serving.backend import SamplingParams, ServingError, sample_next
from serving.torch_backend import set_threads
from training.text import normalize
from training.tokenizer import BYTE_PIECE, EOS, IM_END, piece_bytes


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

    @torch.inference_mode()
    def logits_incremental(self, ids: Sequence[int], prefix: int = 0) -> np.ndarray:
        """(T, V) through transformers' KV cache: `prefix` tokens in one pass, then one at a time."""
        x = self._check_ids(ids)
        rows, past, start = [], None, 0
        for end in range(min(max(prefix, 1), x.shape[1]), x.shape[1] + 1):
            out = self.model(x[:, start:end], past_key_values=past, use_cache=True)
            rows.append(out.logits[0])
            past, start = out.past_key_values, end
        return torch.cat(rows).float().numpy()

    @torch.inference_mode()
    def generate(self, ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        """Stream sampled ids (the shared `sample_next`); stops at an end-of-turn id (not yielded),
        max_new_tokens or the end of the context."""
        params.validate()
        x = self._check_ids(ids)
        history = [int(i) for i in ids]
        rng = np.random.default_rng(params.seed)
        past = None
        for _ in range(min(params.max_new_tokens, self.n_ctx - len(history))):
            out = self.model(x, past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = sample_next(out.logits[0, -1].float().numpy(), params, history, rng)
            if nxt in self.eos_ids:
                return
            history.append(nxt)
            yield nxt
            x = torch.tensor([[nxt]], dtype=torch.long)

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]
