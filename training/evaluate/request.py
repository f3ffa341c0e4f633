"""What to score (text documents and multiple-choice sets, read once) and one model scored on it."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from training.evaluate.generate import GEN_TOKENS, Generator, generate_wellformed
from training.evaluate.mc import MCItem, expand_mc_paths, load_mc, mc_set_name, score_mc
from training.evaluate.providers import EvalError, LogProbProvider
from training.evaluate.text_scores import ALL, MAX_DOC_CHARS, evaluate_lm, read_text_docs


@dataclass
class EvalRequest:
    docs: list[tuple[str, str]] = field(default_factory=list)
    text_files: list[str] = field(default_factory=list)
    mc_sets: list[tuple[str, str, str, list[MCItem]]] = field(default_factory=list)  # (name, path, format, items)
    stride: int | None = None
    prompts: list[str] = field(default_factory=list)  # answered greedily, scored for well-formedness
    gen_tokens: int = GEN_TOKENS
    chat: bool = True  # prompts go through the chat template (else: plain text to continue)


def build_request(texts: Sequence[str | Path], mc: Sequence[str | Path], *, limit: int | None = None,
                  max_doc_chars: int = MAX_DOC_CHARS, stride: int | None = None, prompts: Sequence[str] = (),
                  gen_tokens: int = GEN_TOKENS, chat: bool = True) -> EvalRequest:
    if not texts and not mc and not prompts:
        raise EvalError("nothing to evaluate: give --text FILE and/or --mc FILE")
    req = EvalRequest(stride=stride, prompts=list(prompts) if gen_tokens > 0 else [], gen_tokens=gen_tokens,
                      chat=chat)
    if texts:
        req.text_files = [str(t) for t in texts]
        # --limit N bounds text too: the first N documents' worth is read (N * max_doc_chars characters).
        req.docs = read_text_docs(texts, max_doc_chars, limit * max_doc_chars if limit else None)
        if limit:
            req.docs = req.docs[:limit]
    names: Counter[str] = Counter()
    for p in expand_mc_paths(mc):
        fmt, items = load_mc(p, limit)
        name = mc_set_name(p)
        names[name] += 1
        if names[name] > 1:
            name = f"{name}#{names[name]}"
        req.mc_sets.append((name, str(p), fmt, items))
    return req


def evaluate_model(provider: LogProbProvider, req: EvalRequest, *, mc: bool = True, progress: bool = True) -> dict:
    """{"name", "n_ctx", "lm": {language: stats}, "mc": {set: summary}, "seconds"} for one provider,
    plus "wellformed" (generate.generate_wellformed) when there are prompts and the provider generates."""
    t0 = time.perf_counter()
    out: dict = {"name": provider.name, "n_ctx": provider.n_ctx, "lm": {}, "mc": {}}
    if req.docs:
        stats = evaluate_lm(provider, req.docs, stride=req.stride, progress=progress)
        out["lm"] = {lang: st.to_dict() for lang, st in sorted(stats.items(), key=lambda kv: (kv[0] == ALL, kv[0]))}
    if mc:
        for name, _, _, items in req.mc_sets:
            out["mc"][name] = score_mc(provider, items, desc=name, progress=progress).summary()
    if req.prompts and isinstance(provider, Generator):
        out["wellformed"] = generate_wellformed(provider, req.prompts, max_new_tokens=req.gen_tokens, chat=req.chat)
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out
