"""Base + adapter pairs of one loaded backend, for the HTTP server's /v1/models and `"adapter"` field and the
demo's model picker: which pairs there are (`Pairs.of`), and a Backend view of one pair (`Pairs.view`) that
generates through the one loaded base with that adapter set per generation: no pair loads anything.

- llama.cpp (`python -m serving BASE.gguf --lora NAME=A.gguf --lora NAME2=B.gguf`): the base alone (adapter
  "base") and each adapter on it; the default (what a request naming none gets) is the first --lora. The
  adapter is set on the llama.cpp context under the backend's lock, at the start of each generation
  (serving.backends.llamacpp_backend: LlamaCppBackend.generate(adapter=...)), so two pairs never mix within a generation.
- PyTorch (`python -m serving ADAPTER_RUN`): the one pair of the run, named by its folder; its base alone
  and several adapters on one base are llama.cpp's only (the adapted model holds its adapter in its weights'
  modules: another pair would be another model in memory).
- Any other backend: no pairs (`Pairs.of` gives None), as before.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from serving.backend import Backend, SamplingParams, ServingError
from serving.backends.llamacpp_lora import BASE_ONLY


class AdapterView:
    """`backend` serving the pair of `adapter` (BASE_ONLY: the base alone); anything else is the backend's."""

    def __init__(self, backend: Backend, pair_id: str, adapter: str, chat_tuned: bool | None, switch: bool):
        self._backend, self._adapter, self._switch = backend, adapter, switch
        self.name, self.chat_tuned = pair_id, chat_tuned

    def __getattr__(self, key: str):  # n_ctx, eos_ids, tokenize, detokenize(_bytes), prodip, path, ...
        return getattr(self._backend, key)

    def _kw(self) -> dict:
        return {"adapter": self._adapter} if self._switch else {}

    def generate(self, ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        return self._backend.generate(ids, params, **self._kw())

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        return self._backend.logits(ids, **self._kw())

    def logits_incremental(self, ids: Sequence[int], prefix: int = 0) -> np.ndarray:
        return self._backend.logits_incremental(ids, prefix, **self._kw())

    def close(self) -> None:
        """A view owns nothing: the backend is closed by whoever loaded it."""


@dataclass(frozen=True)
class Pair:
    id: str  # "llama.cpp-F16+chat": the base's name, "+", the adapter's
    adapter: str  # its name (BASE_ONLY for the base alone), what a request's "adapter" field says
    base_file: str
    adapter_file: str | None
    chat_tuned: bool | None


@dataclass(frozen=True)
class Pairs:
    """The pairs one backend serves, the default first among them by `default`."""

    base_id: str
    default: str  # the adapter a request naming none gets
    pairs: dict[str, Pair] = field(default_factory=dict)
    switch: bool = True  # llama.cpp: the adapter is set per generation; PyTorch: the model holds its one adapter

    @classmethod
    def of(cls, backend: Backend) -> Pairs | None:
        """The pairs of `backend`, or None when it serves no adapter."""
        adapters = getattr(backend, "adapters", None)
        if adapters:  # llama.cpp: LlamaCppBackend.adapters, NAME -> serving.backends.llamacpp_lora.Adapter
            base, own = backend.base_name, getattr(backend.info, "chat_tuned", None)
            pairs = {BASE_ONLY: Pair(base, BASE_ONLY, backend.path.name, None, own)}
            for name, a in adapters.items():
                pairs[name] = Pair(f"{base}+{name}", name, backend.path.name, a.path.name,
                                   own if a.chat_tuned is None else a.chat_tuned)
            return cls(base, backend.adapter, pairs)
        path = getattr(backend, "path", None)  # PyTorch (by name: importing torch here would load it for nothing)
        if type(backend).__name__ != "TorchBackend" or path is None:
            return None
        from serving.chat_session import chat_tuned
        from training.checkpoint.adapter_io import is_adapter_run
        from training.runfiles import layout

        if not is_adapter_run(path):
            return None
        run = layout.run_dir_of(path) or Path(path)
        pair = Pair(f"{backend.name}+{run.name}", run.name, "the base checkpoint the adapter names", str(path),
                    chat_tuned(backend, path))
        return cls(backend.name, run.name, {run.name: pair}, switch=False)

    def check(self, name: str) -> str:
        """`name` if it is one of the pairs' adapters; else a ServingError naming the field and the known names."""
        if name not in self.pairs:
            raise ServingError(f"adapter {name!r} is not served here; known: {', '.join(self.pairs)}")
        return name

    def view(self, backend: Backend, name: str | None) -> Backend:
        """`backend` answering as the pair of `name` (None: the default)."""
        p = self.pairs[self.check(self.default if name is None else name)]
        return AdapterView(backend, p.id, p.adapter, p.chat_tuned, self.switch)

    def listing(self) -> list[dict]:
        """/v1/models's `prodip` part of each pair: the base file, the adapter's name and file, the default."""
        return [{"id": p.id, "adapter": p.adapter, "base": p.base_file, "adapter_file": p.adapter_file,
                 "default": p.adapter == self.default, "chat_tuned": p.chat_tuned} for p in self.pairs.values()]
