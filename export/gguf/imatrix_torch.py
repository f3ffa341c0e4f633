"""The importance matrix computed from the PyTorch fp32 checkpoint itself (llama.cpp's llama-imatrix
is export.imatrix's other way): forward (and, for the "fisher" weighting, backward) hooks on every
nn.Linear collect each input column's squared activation over the calibration chunks, in
llama-imatrix's layout, so the same file format (export.gguf.imatrix_format) carries either.

    torch_importance(run, text)        {GGUF weight name: (in_sum2, counts)}
    torch_imatrix(run, text, out)      the same, written as an imatrix GGUF file
    add_head_importance(imatrix, ...)  a tied output head's entry added to a llama-imatrix file
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import gguf
import numpy as np

from export import ExportError
from export.gguf.imatrix_format import (
    CHUNK_COUNT_KEY,
    CHUNK_SIZE_KEY,
    DATASETS_KEY,
    DEFAULT_CHUNK_TOKENS,
    calibration_chunks,
    read_calibration,
    read_imatrix,
    write_imatrix,
)
from export.manifest import made_folder

if TYPE_CHECKING:
    import torch

WEIGHTINGS = ("activation", "fisher")  # torch_importance's statistics


class _Importance:
    """Per GGUF weight, the running sums torch_importance returns, fed by hooks on the model's
    nn.Linear layers: a forward pre-hook sees each layer's input; with `fisher`, a backward hook weighs
    each token by the squared norm of the loss gradient at the layer's output."""

    def __init__(self, fisher: bool):
        self.fisher = fisher
        self.sums: dict[str, torch.Tensor] = {}
        self.weight_sums: dict[str, float] = {}
        self._inputs: dict[str, torch.Tensor] = {}  # fisher: a layer's input, until its gradient arrives
        self._hooks: list = []

    def attach(self, model: torch.nn.Module, names: tuple[str, ...] | None) -> None:
        import torch

        from training.model.gguf_names import to_gguf

        tied = model.cfg.tie_embeddings
        for mod_name, mod in model.named_modules():
            if not isinstance(mod, torch.nn.Linear):
                continue
            g = "token_embd.weight" if mod_name == "output" and tied else to_gguf(mod_name + ".weight")
            if names is not None and g not in names:
                continue
            self._hooks.append(mod.register_forward_pre_hook(partial(self._keep_input, g)))
            if self.fisher:
                self._hooks.append(mod.register_full_backward_hook(partial(self._weigh, g)))

    def _keep_input(self, g: str, _m: torch.nn.Module, inputs: tuple) -> None:
        x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).double()
        if self.fisher:
            self._inputs[g] = x
        else:
            self.sums[g] = self.sums.get(g, 0) + (x * x).sum(0)

    def _weigh(self, g: str, _m: torch.nn.Module, _grad_in: tuple, grad_out: tuple) -> None:
        w = grad_out[0].detach().reshape(-1, grad_out[0].shape[-1]).double().square().sum(-1)
        x = self._inputs.pop(g)
        self.sums[g] = self.sums.get(g, 0) + (w[:, None] * x * x).sum(0)
        self.weight_sums[g] = self.weight_sums.get(g, 0.0) + float(w.sum())

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def result(self, n: float) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """{weight: (sums (1, width), token count (1, 1))} after `n` tokens."""
        sums = self.sums
        if self.fisher:  # rescale so the mean token weight is 1: magnitudes comparable with llama-imatrix's
            sums = {g: s * (n / self.weight_sums[g]) for g, s in sums.items()}
        return {g: (s.float().numpy()[None], np.array([[n]], np.float32)) for g, s in sums.items()}


def _pass_over(model: torch.nn.Module, chunks: list[list[int]], fisher: bool) -> None:
    """Every chunk through the model once (the hooks collect); with `fisher`, its loss backward too."""
    import torch

    for c in chunks:
        x = torch.tensor([c])
        if fisher:  # the summed next-token loss of the chunk (its last token has no target)
            logits = model(x)[0, :-1]
            torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").backward()
            model.zero_grad(set_to_none=True)
        else:
            with torch.inference_mode():
                model(x)


def torch_importance(run: Path, text: Path, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                     names: tuple[str, ...] | None = None, weighting: str = "activation",
                     ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The importance matrix computed from the PyTorch fp32 checkpoint itself, in llama-imatrix's
    layout: {GGUF weight name: (sum over calibration tokens of each input column's squared
    activation (1, width), token count (1, 1))}, over the chunks llama-imatrix would use.

    It covers what llama-imatrix cannot: with tied embeddings the output head is `token_embd.weight`,
    which llama-imatrix skips by name (it collects only `blk.*` and `output.weight`), so llama-quantize
    picks the head's Q6_K scales blind; the head's input is the final norm's output. `names` keeps
    only those GGUF weights (None: all).

    weighting "activation" is llama-imatrix's statistic, E[x_j^2]. "fisher" weighs each token by the
    squared norm of the loss gradient at the weight's output, E[|g_t|^2 x_tj^2] / E[|g_t|^2]: the
    diagonal of the weight's empirical Fisher summed over output rows, i.e. the second-order term of
    the loss change a rounding error causes (tokens whose output barely matters count less)."""
    from training.checkpoint.checkpoint_io import load_model

    if weighting not in WEIGHTINGS:
        raise ExportError(f"unknown importance weighting {weighting!r}; choose from {', '.join(WEIGHTINGS)}")
    model, ck = load_model(run)
    body = read_calibration(Path(text))
    ids = ck.tokenizer.encode(body, bos=True)
    chunks = calibration_chunks(ids, ck.tokenizer.bos_id, min(chunk_tokens, model.cfg.max_seq_len))
    if not chunks:
        raise ExportError(f"{text}: calibration text is {len(ids)} tokens, shorter than one chunk ({chunk_tokens})")
    importance = _Importance(weighting == "fisher")
    importance.attach(model, names)
    try:
        _pass_over(model, chunks, importance.fisher)
    finally:
        importance.detach()
    return importance.result(float(len(chunks) * len(chunks[0])))


def add_head_importance(imatrix: Path, run: Path, text: Path, *,
                        chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> bool:
    """Add the tied output head's entry (token_embd.weight, from the PyTorch model: see
    torch_importance) to a llama-imatrix file, in place; False when the model has an untied head
    (llama-imatrix --process-output already covers `output.weight`)."""
    entries = read_imatrix(imatrix)
    head = torch_importance(run, text, chunk_tokens=chunk_tokens, names=("token_embd.weight",))
    if not head:
        return False
    r = gguf.GGUFReader(imatrix)
    datasets = list(r.fields[DATASETS_KEY].contents())
    count = int(r.fields[CHUNK_COUNT_KEY].contents())
    size = int(r.fields[CHUNK_SIZE_KEY].contents())
    tmp = imatrix.with_name(f".{imatrix.name}.tmp")
    try:
        write_imatrix({**entries, **head}, tmp, datasets=datasets, chunk_count=count, chunk_size=size)
        os.replace(tmp, imatrix)
    finally:
        tmp.unlink(missing_ok=True)
    return True


def torch_imatrix(run: Path, text: Path, out: Path, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                  weighting: str = "activation", head: bool = False, force: bool = False) -> Path:
    """torch_importance over `text`, written to `out` in llama-imatrix's GGUF format. With `head` the
    tied output head (token_embd.weight) gets an entry too; off by default, as llama-imatrix: on the
    suite's model it raised the Q4_K_M KL to 1.13x plain's (tests/test_imatrix.py)."""
    out = Path(out)
    if out.exists() and not force:
        raise ExportError(f"{out} exists; use --force to overwrite")
    entries = torch_importance(run, text, chunk_tokens=chunk_tokens, weighting=weighting)
    if not head:
        entries.pop("token_embd.weight", None)
    n_chunks = int(next(iter(entries.values()))[1][0, 0]) // chunk_tokens
    tmp = out.with_name(f".{out.name}.tmp")
    with made_folder(out.parent):  # a failed write leaves no empty folder behind
        try:
            write_imatrix(entries, tmp, datasets=[Path(text).name], chunk_count=n_chunks, chunk_size=chunk_tokens)
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
    return out
