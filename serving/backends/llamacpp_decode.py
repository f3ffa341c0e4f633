"""llama.cpp's C API as serving.backends.llamacpp_backend's LlamaCppBackend drives it, under the backend's lock:

- `AllLogitsBatch`: a llama_batch made once and refilled (every position's logits asked for);
- `sampler_chain`: the sampler stages llama-cpp-python's Llama.generate builds, so seeded draws match;
- `decode_rows`: logits of a run of tokens, in batches of the batch's size;
- `decode_tokens`: the per-token loop (one sample, one decode call), no logits crossing into Python.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import numpy as np

from serving.backend import PENALTY_LAST_N, SamplingParams, ServingError

MIN_KEEP = 1  # candidates top-p always keeps


class AllLogitsBatch:
    """A llama_batch of up to `size` tokens of sequence 0 that asks for every position's logits."""

    def __init__(self, size: int):
        import llama_cpp

        self.size = size
        self.batch = llama_cpp.llama_batch_init(size, 0, 1)
        for i in range(size):
            self.batch.n_seq_id[i] = 1
            self.batch.seq_id[i][0] = 0
            self.batch.logits[i] = 1
        self._token, self._pos = self.batch.token, self.batch.pos  # the pointers, fetched once

    def fill(self, ids: list[int], pos0: int):
        n = len(ids)
        tokens, positions = np.asarray(ids, dtype=np.int32), np.arange(pos0, pos0 + n, dtype=np.int32)
        ctypes.memmove(self.batch.token, tokens.ctypes.data, tokens.nbytes)  # both arrays alive here
        ctypes.memmove(self.batch.pos, positions.ctypes.data, positions.nbytes)
        self.batch.n_tokens = n
        return self.batch

    def one(self, token: int, pos: int):
        """The batch holding one token at `pos`: the decode loop's per-token step, two stores."""
        self._token[0], self._pos[0] = token, pos
        self.batch.n_tokens = 1
        return self.batch

    def free(self) -> None:
        import llama_cpp

        llama_cpp.llama_batch_free(self.batch)


def sampler_chain(params: SamplingParams, n_vocab: int, seed: int):
    """A llama.cpp sampler chain for `params`: the stages llama-cpp-python's Llama.generate builds
    (its typical-p 1.0 and min-p 0.0 stages do nothing and are left out), so seeded draws are the same.
    The caller frees it (llama_sampler_free)."""
    import llama_cpp

    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    stages = [llama_cpp.llama_sampler_init_penalties(n_vocab, PENALTY_LAST_N, params.repetition_penalty,
                                                     0.0, 0.0)]
    if params.temperature == 0:
        stages.append(llama_cpp.llama_sampler_init_greedy())
    else:
        stages += [llama_cpp.llama_sampler_init_top_k(params.top_k),
                   llama_cpp.llama_sampler_init_top_p(params.top_p, MIN_KEEP),
                   llama_cpp.llama_sampler_init_temp(params.temperature),
                   llama_cpp.llama_sampler_init_dist(seed)]
    for stage in stages:
        llama_cpp.llama_sampler_chain_add(chain, stage)  # the chain owns (and frees) its stages
    return chain


def decode_rows(ctx, batch: AllLogitsBatch, ids: list[int], pos0: int, n_vocab: int, name: str) -> np.ndarray:
    """(len(ids), V) logits of `ids` placed at positions pos0.., in batches of batch.size, every row asked for."""
    import llama_cpp

    rows = []
    for i in range(0, len(ids), batch.size):
        chunk = ids[i:i + batch.size]
        rc = llama_cpp.llama_decode(ctx, batch.fill(chunk, pos0 + i))
        if rc != 0:
            raise ServingError(f"{name}: llama_decode returned {rc}")
        out = llama_cpp.llama_get_logits(ctx)
        rows.append(np.ctypeslib.as_array(out, shape=(len(chunk), n_vocab)).copy())
    return np.concatenate(rows)


def decode_tokens(llm, chain, step: AllLogitsBatch, eos_ids: tuple[int, ...], limit: int, name: str
                  ) -> Iterator[int]:
    """Up to `limit` new tokens after the prefilled prompt, ending at an id in `eos_ids`.

    Per token: one sample and one decode call into llama.cpp, through `step` (a one-token batch made
    once). Not Llama.eval: its per-call Python (a cache trim, a batch refill, ctypes field lookups)
    cost ~10% of a small Q4_K_M model's decode (callgrind, docs/serving.md). llama-cpp-python's
    record of the cache (input_ids, n_tokens), which the next request's prefix reuse reads, is kept
    here as Llama.eval keeps it."""
    import llama_cpp

    ctx, one = llm.ctx, step.one
    sample, decode = llama_cpp.llama_sampler_sample, llama_cpp.llama_decode
    for n in range(1, limit + 1):
        tok = sample(chain, ctx, -1)
        if tok in eos_ids:
            return
        yield tok
        if n == limit:
            return
        pos = llm.n_tokens
        rc = decode(ctx, one(tok, pos))
        if rc != 0:
            raise ServingError(f"{name}: llama_decode returned {rc}")
        llm.input_ids[pos] = tok
        llm.n_tokens = pos + 1
