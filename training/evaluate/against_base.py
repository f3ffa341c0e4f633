"""Judged against the base: a run started with `train.py --init-from FOLDER` beside the model it started from.

On the same documents, in bits per byte (tokenizer-independent: every model's NLL is divided by the same UTF-8
bytes of the same normalized text, so models with different tokenizers compare fairly), three models:

    base                the folder's model with its own tokenizer.model (a stock Llama one too, which
                        prodip's Tokenizer refuses for training: no <pad>, a dummy prefix)
    extended-untrained  the base's weights in the run's vocabulary at step 0, built by the very code
                        `train.py --init-from` runs (hf_import.inspect_folder + load_weights: new rows from
                        the base's own embeddings); only when the run's tokenizer extends the base's (with
                        the base's tokenizer it is the base itself, by the import parity gate)
    model               the checkpoint evaluated (the continued model)

Language modelling only: multiple-choice scoring encodes a continuation apart from its context, which a
dummy-prefix tokenizer spells differently, and generation needs prodip's chat tokens.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from training.evaluate.providers import EvalError, RunnerScorer
from training.evaluate.request import EvalRequest, evaluate_model
from training.model import hf_import
from training.model.decoder import Transformer
from training.model.runner import TransformerRunner
from training.text.normalization import normalize
from training.text.tokenizer import ForeignSentencePiece, Tokenizer

BASE, EXTENDED, CONTINUED = "base", "extended-untrained", "model"  # model names in eval.json


class BaseText:
    """The base's own tokenizer.model as TransformerRunner reads a tokenizer (encode, decode, bos_id)."""

    def __init__(self, proto: bytes, where: str):
        self.sp = ForeignSentencePiece(proto, where)
        self.bos_id = self.sp.bos_id
        if self.bos_id < 0:
            raise EvalError(f"{where}: the base tokenizer has no <s>: its documents cannot be scored as <s> + text")
        self.eos_id = self.sp.sp.eos_id()  # -1 where the model has none: nothing then ends a turn

    def encode(self, text: str, *, bos: bool = False, allow_special: bool = False) -> list[int]:
        ids = self.sp.encode(normalize(text))  # the same normalized text the bytes are counted on
        return [self.bos_id, *ids] if bos else ids

    def decode(self, ids) -> str:
        return self.sp.sp.decode([int(i) for i in ids])


def base_spec(run_cfg: dict | None, given: str | None, run_json: Path | None) -> str | None:
    """The folder to compare with: --base, else the run's recorded init_from; None: no comparison."""
    spec = given or str(((run_cfg or {}).get("train") or {}).get("init_from") or "")
    if not spec or Path(spec).is_dir() or hf_import.HUB_ID.fullmatch(spec):
        return spec or None  # a hub id: hf_import.resolve downloads it where the hub is reachable
    if given:
        raise EvalError(f"--base {spec}: no such folder")
    raise EvalError(f"{run_json} records init_from {spec}, which is not a folder here: pass --base FOLDER "
                    "(the model the run started from) or --no-base")


class AgainstBase:
    """The base folder checked against the run's tokenizer when opened (before any scoring), scored later."""

    def __init__(self, spec: str, tokenizer: Tokenizer, data: str):
        try:
            self.folder = hf_import.resolve(spec)
            self.imp = hf_import.inspect_folder(self.folder, tokenizer, data)  # the run's tokenizer: its --data's
        except hf_import.InitFromError as e:
            raise EvalError(f"comparing with the base the run started from: {e}") from None
        self.extended = self.imp.base_vocab < self.imp.model_cfg.vocab_size

    def base_model(self) -> Transformer:
        """The folder's model over its own vocabulary, weights checked as the import checks them."""
        cfg = dataclasses.replace(self.imp.model_cfg, vocab_size=self.imp.base_vocab)
        model = Transformer(cfg)
        hf_import.load_weights(model, dataclasses.replace(self.imp, model_cfg=cfg))
        return model

    def extended_model(self) -> Transformer:
        """What train.py --init-from starts step 1 from: the base imported into the run's vocabulary."""
        model = Transformer(self.imp.model_cfg)
        hf_import.load_weights(model, self.imp)
        return model

    def score(self, req: EvalRequest, device: str, *, progress: bool = True) -> list[dict]:
        """evaluate_model's results (language modelling only) of the base and, for an extension, the
        extended-untrained model; one model in memory at a time."""
        lm_only = dataclasses.replace(req, prompts=[])
        text = BaseText(self.imp.base_proto, str(self.folder))
        base = RunnerScorer(TransformerRunner(self.base_model().to(device), text, name=BASE, eos_ids=(text.eos_id,)))
        out = [evaluate_model(base, lm_only, mc=False, progress=progress)]
        del base
        if self.extended:
            ext = RunnerScorer(TransformerRunner(self.extended_model().to(device), self.imp.tokenizer, name=EXTENDED))
            out.append(evaluate_model(ext, lm_only, mc=False, progress=progress))
        return out

    def summary(self, models: list[dict]) -> dict:
        """eval.json's "init_from": the folder, the vocabularies, and bits/byte per language side by side."""
        named = {m["name"]: m for m in models}
        by = {n: named[n] for n in (BASE, EXTENDED, CONTINUED) if n in named}  # the order they come in a run
        langs = dict.fromkeys(lang for m in by.values() for lang in m["lm"])
        return {"folder": str(self.folder), "base_vocab": self.imp.base_vocab, "vocab": self.imp.model_cfg.vocab_size,
                "extended": self.extended,
                "bits_per_byte": {lang: {n: m["lm"][lang]["bits_per_byte"] for n, m in by.items() if lang in m["lm"]}
                                  for lang in langs}}
