"""llama.cpp backend (llama-cpp-python): any GGUF llama.cpp can run, its own tokenizer and sampler.

- prodip files (`python -m export gguf`: Llama architecture, our ChatML template) keep every prodip
  check: our special tokens must be single pieces, chats render through `training.text.chat_template`;
- any other GGUF (Qwen2, Gemma, ... as llama.cpp's convert_hf_to_gguf.py writes them) is "foreign":
  chats render through the file's own `tokenizer.chat_template` with llama-cpp-python's Jinja2 chat
  formatter, generation ends at the file's end-of-generation tokens; a file without a template falls
  back to plain text completion and says so (`chat_notice`, one `warning:` line at load);
- a file llama.cpp cannot load is one ServingError naming it, with llama.cpp's own reason;
- tokenize: llama.cpp's tokenizer reading the GGUF vocabulary, on normalize(text);
- logits: every position, decoded through llama.cpp's C API with a batch that asks for each row (so the
  context itself is built without `logits_all`, which would copy every token's logits into Python);
- generate: the prompt in batches of n_batch (logits of its last position only), then one token per
  step, each sampled by a llama.cpp sampler chain (penalties, then greedy, or top-k, top-p, temperature,
  seeded draw) inside llama.cpp: no logits cross into Python while generating (the batch, the sampler
  chain and the decode loop are serving.backends.llamacpp_decode's); a prompt that extends what the KV cache
  holds (a chat's next turn) decodes only its new tokens;
- one threading.Lock around everything that touches the context (logits, generate): a Llama object
  is never entered by two requests at once; a generate stream holds it until it ends or is closed.
For prodip files the KV cache is F32 (`kv_f32`): the default F16 cache alone moves logits by ~4e-3,
which would hide what parity measures for the F32 file. Foreign files get llama.cpp's F16 cache and at
most FOREIGN_MAX_CTX tokens of context unless asked (their trained context may be 128k tokens, whose
cache and logits would not fit in memory).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from serving.backend import CHAT_TUNED_KEY, SamplingParams, ServingError
from serving.backends.llamacpp_decode import AllLogitsBatch, decode_rows, decode_tokens, sampler_chain
from serving.backends.llamacpp_lora import BASE_ONLY, LoadedAdapters, LoraSpec, named_adapters
from training.text.chat_template import CHAT_TEMPLATE
from training.text.normalization import normalize
from training.text.tokenizer import EOS, IM_END

PRODIP_ARCH = "llama"
GGML_TYPE_F32 = 0
GGML_LOG_LEVEL_ERROR = 4  # ggml.h: NONE, DEBUG, INFO, WARN, ERROR, CONT (llama_cpp._logger predates DEBUG)
ARCH_KEY = "general.architecture"
FILE_TYPE_KEY = "general.file_type"
NAME_KEY = "general.name"
TEMPLATE_KEY = "tokenizer.chat_template"
FOREIGN_MAX_CTX = 4096  # default context for foreign files (llama.cpp's own default), when n_ctx is not given
_LOG_LOCK = threading.Lock()  # llama.cpp's log callback is process-wide: one load captures it at a time


@dataclass(frozen=True)
class GgufInfo:
    """What a GGUF says about itself, read with gguf-py before llama.cpp opens it."""

    arch: str | None
    file_type: int | None
    name: str | None
    chat_template: str | None
    context_length: int | None
    chat_tuned: bool | None = None  # CHAT_TUNED_KEY: prodip files written since issue 31 say it

    @property
    def type_name(self) -> str | None:
        """'F16', 'Q4_K_M', ... from general.file_type (llama.cpp's LLAMA_FTYPE names)."""
        import gguf

        if self.file_type is None:
            return None
        try:
            return gguf.LlamaFileType(self.file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            return f"type {self.file_type}"

    @property
    def prodip(self) -> bool:
        """Written by `python -m export gguf`: our architecture and our chat template, byte for byte."""
        return self.arch == PRODIP_ARCH and self.chat_template == CHAT_TEMPLATE


def read_gguf_info(path: Path) -> GgufInfo:
    """The few metadata keys serving needs, read with gguf-py, without loading the model."""
    import gguf

    try:
        r = gguf.GGUFReader(path)
    except Exception as e:  # gguf-py raises ValueError/struct errors on foreign files
        why = str(e)
    else:
        why = None
    if why is not None:  # raised here, not in `except`: the failed reader's frames (its memory map of
        raise ServingError(f"{path}: not a readable GGUF file ({why})")  # the file) must not ride along

    def value(key: str) -> object:
        f = r.fields.get(key)
        return f.contents() if f is not None else None

    arch = value(ARCH_KEY)
    ctx = value(f"{arch}.context_length") if isinstance(arch, str) else None
    ftype, name, template, tuned = value(FILE_TYPE_KEY), value(NAME_KEY), value(TEMPLATE_KEY), value(CHAT_TUNED_KEY)
    return GgufInfo(arch if isinstance(arch, str) else None, int(ftype) if isinstance(ftype, int) else None,
                    name if isinstance(name, str) else None, template if isinstance(template, str) else None,
                    int(ctx) if isinstance(ctx, int) else None, tuned if isinstance(tuned, bool) else None)


def gguf_architecture(path: Path) -> tuple[str | None, int | None]:
    """(general.architecture, general.file_type) read with gguf-py, without loading the model."""
    info = read_gguf_info(path)
    return info.arch, info.file_type


def open_llama(path: Path, arch: str | None, **kwargs: object):
    """llama_cpp.Llama(path, **kwargs); a file llama.cpp refuses is one ServingError naming the file
    and giving llama.cpp's own reason (its error log lines, captured here instead of printed)."""
    import llama_cpp
    from llama_cpp import Llama, _logger

    errors: list[str] = []

    @llama_cpp.llama_log_callback
    def capture(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        if level == GGML_LOG_LEVEL_ERROR:
            errors.append(text.decode("utf-8", errors="replace").strip())
        else:  # everything else goes where llama-cpp-python sends it (printed only when verbose)
            _logger.llama_log_callback(level, text, user_data)

    with _LOG_LOCK:
        llama_cpp.llama_log_set(capture, ctypes.c_void_p(0))
        try:
            return Llama(str(path), **kwargs)
        except ValueError as e:  # llama-cpp-python: "Failed to load model from file"
            why = next((x for x in errors if x), str(e))  # the first error line is the cause
        finally:
            llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
    # raised outside `except`, so the half-built Llama is not kept alive by the exception's context
    raise ServingError(f"{path}: llama.cpp cannot load this GGUF (architecture {arch!r}): {why}")


def _type_label(path: Path) -> str:
    """'Q4_K_M' from 'name-Q4_K_M.gguf' (file names carry the type), else the stem."""
    stem = path.stem
    return stem.rsplit("-", 1)[-1] if "-" in stem else stem


class LlamaCppBackend:
    def __init__(self, path: str | os.PathLike, n_ctx: int | None = None, threads: int | None = None,
                 kv_f32: bool | None = None, n_batch: int = 512, seed: int = 0, verbose: bool = False,
                 lora: LoraSpec | None = None, lora_scale: float = 1.0):
        """`n_ctx` None: the trained context (foreign files: at most FOREIGN_MAX_CTX); `kv_f32` None: an
        F32 KV cache for prodip files (parity), llama.cpp's F16 for others; `seed`: the sampling seed of
        requests that give none, until one does (then theirs, as llama-cpp-python's set_seed)."""
        self.path = Path(path)
        if not self.path.is_file():
            raise ServingError(f"GGUF not found: {self.path}")
        self.info = read_gguf_info(self.path)
        self.prodip = self.info.prodip
        self.chat_template = self.info.chat_template
        self.chat_tuned = self.info.chat_tuned
        if n_ctx is None and not self.prodip:
            n_ctx = min(self.info.context_length or FOREIGN_MAX_CTX, FOREIGN_MAX_CTX)
        if kv_f32 is None:
            kv_f32 = self.prodip
        kv = {"type_k": GGML_TYPE_F32, "type_v": GGML_TYPE_F32} if kv_f32 else {}
        self._lock = threading.Lock()
        self._seed = seed
        self._batch = None  # the all-logits batch (logits()), made on first use
        self._step = None  # the one-token batch of the decode loop, made on first use
        # LoRA GGUFs applied at run time (llama.cpp's --lora), each checked against the base first and loaded
        # once; the first is the default, generate(adapter=NAME) switches without reloading the base
        self.adapters, self._loras, self._active = named_adapters(self.path, lora, lora_scale), None, None
        self.adapter = next(iter(self.adapters), None)
        if self.adapter is not None and (tuned := self.adapters[self.adapter].chat_tuned) is not None:
            self.chat_tuned = tuned  # an SFT adapter on a base model
        self.llm = open_llama(self.path, self.info.arch, n_ctx=n_ctx or 0, n_threads=threads,
                              n_threads_batch=threads, n_batch=n_batch, logits_all=False, seed=seed,
                              verbose=verbose, **kv)
        # llama.cpp pads its context (to 256) but llama-cpp-python's token/logit buffers keep the asked size
        # (the trained context when n_ctx=0): past that they overflow, so that is the usable context
        self.n_ctx = min(self.llm.n_ctx(), self.llm.context_params.n_ctx)
        self.n_vocab = self.llm.n_vocab()
        self.base_name = f"llama.cpp-{_type_label(self.path)}"
        self.name = self.base_name + (f"+{self.adapter}" if self.adapter else "")
        self.chat_notice: str | None = None  # set when chats fall back to plain completion
        self._formatter = None  # a foreign file's chat template (llama-cpp-python's Jinja2ChatFormatter)
        try:
            if self.adapters:
                self._loras = LoadedAdapters(self.llm.model, self.path, self.adapters)
                self._use(None)
            if self.prodip:
                self.eos_ids = tuple(self._piece_id(p) for p in (EOS, IM_END))
            else:
                self._init_foreign()
        except BaseException:
            self.close()
            raise

    def _use(self, adapter: str | None) -> None:
        """Under the lock: `adapter` (None: the default, BASE_ONLY: none) set on the context; a KV cache
        computed under another one is dropped. An unknown name is a ServingError listing the known ones."""
        name = self.adapter if adapter is None else None if adapter == BASE_ONLY else adapter
        if name == self._active:
            return
        if name is not None and name not in self.adapters:
            raise ServingError(f"adapter {adapter!r} is not loaded; known: {', '.join([BASE_ONLY, *self.adapters])}")
        self._loras.use(self.llm.ctx, name)
        self._clear()
        self._active = name

    def _init_foreign(self) -> None:
        """End-of-generation ids from the file, and its chat template (or the plain-completion notice)."""
        import llama_cpp
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self.eos_ids = tuple(i for i in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i))
        if self.chat_template is None:
            self.chat_notice = (f"{self.path.name} has no chat template: chats are continued as plain text "
                                "(no roles), replies may not stop where a turn would")
            print(f"warning: {self.chat_notice}", file=sys.stderr)
            return

        def text(tok: int) -> str:
            return llama_cpp.llama_vocab_get_text(vocab, tok).decode("utf-8", errors="replace") if tok >= 0 else ""

        try:  # llama-cpp-python's own formatter: what its create_chat_completion renders
            self._formatter = Jinja2ChatFormatter(self.chat_template, eos_token=text(self.llm.token_eos()),
                                                  bos_token=text(self.llm.token_bos()))
        except Exception as e:  # jinja2.TemplateError
            raise ServingError(f"{self.path}: its chat template is not valid Jinja ({e})") from None

    def render_chat(self, messages: Sequence[dict]) -> tuple[str, tuple[str, ...]] | None:
        """A foreign file's prompt for `messages` through its own chat template, and its stop strings
        (None when the file has no template). prodip files render through `training.text.chat_template` instead."""
        if self._formatter is None:
            return None
        try:
            out = self._formatter(messages=list(messages))
        except Exception as e:  # the template's raise_exception() (e.g. roles must alternate), jinja errors
            raise ServingError(f"{self.path.name}: its chat template refused the conversation: {e}") from None
        stop = out.stop if isinstance(out.stop, list) else [out.stop] if out.stop else []
        return out.prompt, tuple(s for s in stop if s)

    def describe(self) -> dict:
        """What is loaded, for a UI: arch, size, quant type, context, prodip or foreign, template."""
        import llama_cpp

        return {"name": self.name, "file": self.path.name, "model_name": self.info.name, "arch": self.info.arch,
                "n_params": int(llama_cpp.llama_model_n_params(self.llm.model)) if self.llm else None,
                "quant": self.info.type_name, "context": self.n_ctx,
                "trained_context": self.info.context_length, "kind": "prodip" if self.prodip else "foreign",
                "prodip": self.prodip, "chat_template": self.chat_template is not None, "chat_tuned": self.chat_tuned,
                "chat_notice": self.chat_notice, "adapter": self.adapter,
                "adapters": {n: a.path.name for n, a in self.adapters.items()}}

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

    def detokenize_bytes(self, ids: Sequence[int]) -> bytes:
        """The raw bytes of `ids` (a byte-fallback token is its byte), for serving's UTF-8 stream decoder."""
        return self.llm.detokenize([int(i) for i in ids])

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

    # llama.cpp's C API: the context is entered only under self._lock ---------------------------------
    def _clear(self) -> None:
        """An empty KV cache (and llama-cpp-python's record of it)."""
        import llama_cpp

        self.llm.reset()
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.llm.ctx), -1, 0, -1)

    def _decode_all(self, ids: list[int], pos0: int) -> np.ndarray:
        """(len(ids), V) logits of `ids` placed at positions pos0.., in batches of n_batch, every row asked for."""
        if self._batch is None:
            self._batch = AllLogitsBatch(self.llm.n_batch)
        return decode_rows(self.llm.ctx, self._batch, ids, pos0, self.n_vocab, self.path.name)

    def logits(self, ids: Sequence[int], adapter: str | None = None) -> np.ndarray:
        """(T, V) fp32 logits for every position, the whole sequence evaluated in one batch (`adapter`: as
        generate's)."""
        ids = self._check(ids)
        with self._lock:
            self._use(adapter)
            self._clear()
            return self._decode_all(ids, 0)

    def logits_incremental(self, ids: Sequence[int], prefix: int = 0, adapter: str | None = None) -> np.ndarray:
        """The same logits decoded through the KV cache: `prefix` tokens in one batch, then one by one."""
        ids = self._check(ids)
        with self._lock:
            self._use(adapter)
            self._clear()
            rows = [self._decode_all(ids[:prefix], 0)] if prefix else []
            rows += [self._decode_all([t], i) for i, t in enumerate(ids[prefix:], prefix)]
            return np.concatenate(rows)

    def _prefill(self, ids: list[int]) -> None:
        """Decode the prompt. When the KV cache holds a strict prefix of it (a chat's earlier turns and
        reply), only the rest is decoded; otherwise the cache starts empty. Llama's record of the cache
        changes through its methods (reset, eval) and the decode loop's two attribute writes (input_ids,
        n_tokens), so a wrapper around `self.llm` sees every entry and must forward attribute writes."""
        held = self.llm.n_tokens
        if not (0 < held < len(ids) and np.array_equal(self.llm.input_ids[:held], ids[:held])):
            self._clear()
            held = 0
        self.llm.eval(ids[held:])

    def generate(self, ids: Sequence[int], params: SamplingParams, adapter: str | None = None) -> Iterator[int]:
        """Stream new token ids (llama.cpp's sampler), stopping at an end-of-sequence id; `adapter`: a
        loaded LoRA's name (None: the default, the first given; "base": none), set under the lock."""
        import llama_cpp

        ids = self._check(ids)
        room = self.n_ctx - len(ids)
        if room <= 0:
            raise ServingError(f"the prompt fills the whole context ({self.n_ctx} tokens)")
        limit = min(params.max_new_tokens, room)
        with self._lock:
            self._use(adapter)
            if params.seed is not None:
                self._seed = params.seed
            chain = sampler_chain(params, self.n_vocab, self._seed)
            try:
                self._prefill(ids)
                if self._step is None:
                    self._step = AllLogitsBatch(1)
                yield from decode_tokens(self.llm, chain, self._step, self.eos_ids, limit, self.path.name)
            finally:
                llama_cpp.llama_sampler_free(chain)

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            with self._lock:
                for batch in (self._batch, self._step):
                    if batch is not None:
                        batch.free()
                self._batch = self._step = None
                if self._loras is not None:
                    self._loras.free(llm.ctx)
                    self._loras = None
                llm.close()
            self.llm = None

    def __enter__(self) -> LlamaCppBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
