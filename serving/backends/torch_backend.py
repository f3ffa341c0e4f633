"""PyTorch backend: the training model (`training.model.decoder.Transformer`) in fp32, as a `Backend`.

The reference runtime. `TorchBackend(path)` serves a checkpoint (a RUN_DIR or one checkpoint folder);
`TorchBackend.from_model(model, tokenizer)` wraps a model already in memory (parity's fp32 reference
and its safetensors reload). The runner itself (tokenize, logits, logits_batch, logits_incremental) is
the base's `training.model.runner.TransformerRunner`, the one PyTorch runner evaluation also scores
through; generation here runs the one decode loop over the model's step (training.model.kv_decode),
sampling through serving.backends.sampled_decode like every Python backend.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from serving.backend import SamplingParams, ServingError
from serving.backends.sampled_decode import generate_ids
from training.checkpoint.checkpoint_io import TOKENIZER_FILE, CheckpointError, load_model, resolve
from training.model.decoder import Transformer
from training.model.kv_decode import transformer_step
from training.model.runner import TransformerRunner
from training.text.tokenizer import Tokenizer


def torch_row(row: torch.Tensor) -> np.ndarray:
    """A logits row as the fp32 numpy `sample_next` reads."""
    return row.float().cpu().numpy()


def set_threads(threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise ServingError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)  # process-wide, as llama.cpp's n_threads is per model


class TorchBackend(TransformerRunner):
    """The base's PyTorch runner (training.model.runner.TransformerRunner: tokenize, logits, batched
    logits, the KV-cached path) opened from a checkpoint, plus sampled generation."""

    name = "torch"
    error = ServingError

    def __init__(self, path: str | Path, device: str = "cpu", threads: int | None = None, step: int | None = None):
        set_threads(threads)
        # an adapter run (sft.py --lora-rank): its base with the adapter applied
        from training.checkpoint import adapter_io

        try:
            if adapter_io.is_adapter_run(path):
                model, _ = adapter_io.load_adapted(path, step, device=device)
                self.checkpoint, tok = None, Tokenizer.load(resolve(path, step) / TOKENIZER_FILE)
            else:
                model, self.checkpoint = load_model(path, step=step, device=device)
                tok = self.checkpoint.tokenizer
        except CheckpointError as e:
            raise ServingError(str(e)) from None
        super().__init__(model, tok, name=self.name)
        self.path: Path | None = Path(path)

    @classmethod
    def from_model(cls, model: Transformer, tokenizer: Tokenizer, *, name: str = "torch",
                   path: str | Path | None = None, threads: int | None = None) -> TorchBackend:
        """A backend over a model in memory (put in eval mode; its device is kept)."""
        if tokenizer.vocab_size != model.cfg.vocab_size:
            raise ServingError(f"tokenizer has {tokenizer.vocab_size} tokens, the model {model.cfg.vocab_size}")
        set_threads(threads)
        self = cls.__new__(cls)
        TransformerRunner.__init__(self, model, tokenizer, name=name)
        self.checkpoint = None
        self.path = Path(path) if path is not None else None
        return self

    @torch.inference_mode()
    def generate(self, ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        """Stream sampled ids; stops at an end-of-turn id, max_new_tokens or the end of the context.

        The end-of-turn id itself is not yielded. Stop strings are text-level and are applied by
        `serving.chat_session.stream_text`, which sees the decoded text.
        """
        ids = self.check_ids(ids)
        yield from generate_ids(transformer_step(self.model), ids, params, n_ctx=self.n_ctx, eos_ids=self.eos_ids,
                                to_numpy=torch_row)

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]
