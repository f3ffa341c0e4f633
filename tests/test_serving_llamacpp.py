"""serving.backends.llamacpp_backend's own decoding loop (llama.cpp's C API: batched prompt, sampler chain inside
llama.cpp, no logits copied to Python while generating) against llama-cpp-python's high-level
`Llama.generate`, the loop the backend used before: the same tokens, greedy and seeded sampling, on
the suite's trained tiny model exported to GGUF; logits through the KV cache equal the one-batch
logits; a chat's next turn reuses the cache and still gives the fresh-cache tokens."""

from __future__ import annotations

import numpy as np
import pytest

from serving.backend import PENALTY_LAST_N, SamplingParams
from serving.backends.llamacpp_backend import GGML_TYPE_F32, LlamaCppBackend

PROMPT = "আমাদের গ্রামের পাশ দিয়ে একটি ছোট নদী বয়ে গেছে। বর্ষায় নদী ভরে ওঠে,"
N_NEW = 24
LOGITS_TOL = 1e-3  # one batch vs one token at a time: llama.cpp's kernels differ by batch shape
SAMPLINGS = (
    SamplingParams.greedy(N_NEW),
    SamplingParams(max_new_tokens=N_NEW, temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=1.5),
    SamplingParams(max_new_tokens=N_NEW, temperature=0.8, seed=7),
    SamplingParams(max_new_tokens=N_NEW, temperature=1.5, top_k=0, top_p=0.9, repetition_penalty=1.3, seed=3),
)


def _gguf(out, t: str):
    return next((out / "gguf").glob(f"*-{t}.gguf"))


def _reference(path, params: SamplingParams, ids: list[int], eos: tuple[int, ...]) -> list[int]:
    """llama-cpp-python's own loop (Llama.generate), on a context made like the backend's."""
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=0, n_threads=1, n_threads_batch=1, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32,
                seed=params.seed or 0, last_n_tokens_size=PENALTY_LAST_N, verbose=False)
    try:
        out = []
        for tok in llm.generate(ids, top_k=params.top_k, top_p=params.top_p, min_p=0.0, temp=params.temperature,
                                repeat_penalty=params.repetition_penalty):
            if tok in eos or len(out) == params.max_new_tokens:
                break
            out.append(tok)
        return out
    finally:
        llm.close()


@pytest.mark.parametrize("quant", ["F16", "Q4_K_M"])
def test_same_tokens_as_llama_cpp_python_generate(exported, quant):  # noqa: F811
    path = _gguf(exported, quant)
    with LlamaCppBackend(path, threads=1) as b:
        ids = b.tokenize(PROMPT)
        for params in SAMPLINGS:
            ours = list(b.generate(ids, params))
            assert ours == list(b.generate(ids, params)), params  # seeded sampling is reproducible
            assert ours and ours == _reference(path, params, ids, b.eos_ids), params


def test_greedy_tokens_are_the_argmax_of_logits(exported):  # noqa: F811
    with LlamaCppBackend(_gguf(exported, "F16"), threads=1) as b:
        ids = b.tokenize(PROMPT)
        new = list(b.generate(ids, SamplingParams.greedy(8)))
        full = b.logits(ids + new)
        assert full.shape == (len(ids) + len(new), b.n_vocab) and full.dtype == np.float32
        assert full[len(ids) - 1:-1].argmax(-1).tolist() == new
        inc = b.logits_incremental(ids + new, prefix=len(ids))
        assert np.abs(inc - full).max() < LOGITS_TOL
        assert list(b.generate(ids, SamplingParams.greedy(8))) == new  # logits() left a usable cache


def test_next_turn_reuses_the_cache_and_gives_fresh_tokens(exported):  # noqa: F811
    path = _gguf(exported, "F16")
    with LlamaCppBackend(path, threads=1) as b, LlamaCppBackend(path, threads=1) as fresh:
        ids = b.tokenize(PROMPT)
        first = list(b.generate(ids, SamplingParams.greedy(8)))
        held = b.llm.n_tokens  # the prompt and the new tokens (the last one too if an end token followed it)
        assert held in (len(ids) + len(first) - 1, len(ids) + len(first))
        turn = ids + first + b.tokenize(" আর", bos=False)
        decoded: list[int] = []
        real_eval = b.llm.eval
        b.llm.eval = lambda toks: (decoded.append(len(toks)), real_eval(toks))[1]  # records, then decodes
        again = list(b.generate(turn, SamplingParams.greedy(8)))
        assert decoded[0] == len(turn) - held  # only the new part of the prompt was decoded
        assert again == list(fresh.generate(turn, SamplingParams.greedy(8)))
        # a prompt that is not an extension (a shorter one, another text) starts from an empty cache
        assert list(b.generate(ids, SamplingParams.greedy(8))) == first


def test_a_stream_closed_early_leaves_the_backend_usable(exported):  # noqa: F811
    with LlamaCppBackend(_gguf(exported, "Q4_K_M"), threads=1) as b:
        ids = b.tokenize(PROMPT)
        whole = list(b.generate(ids, SamplingParams.greedy(N_NEW)))
        stream = b.generate(ids, SamplingParams.greedy(N_NEW))
        assert [next(stream), next(stream)] == whole[:2]
        stream.close()  # releases the lock and frees the sampler chain
        assert list(b.generate(ids, SamplingParams.greedy(N_NEW))) == whole


def test_the_gguf_says_whether_its_model_was_chat_tuned(exported, serve_gguf, tmp_path):  # noqa: F811
    """prodip.chat_tuned (issue 31): False in the pretraining run's files (Q4_K_M too: llama-quantize copies
    the metadata), True in the SFT run's, also for a copy far from its run folder."""
    import shutil

    from serving import describe
    from serving.chat_session import chat_tuned

    lone = tmp_path / "lone.gguf"
    shutil.copy(serve_gguf, lone)
    for path, tuned in ((_gguf(exported, "F16"), False), (_gguf(exported, "Q4_K_M"), False), (lone, True)):
        b = LlamaCppBackend(path, threads=1)
        try:
            assert (b.chat_tuned, chat_tuned(b), describe(b)["chat_tuned"]) == (tuned, tuned, tuned), path
        finally:
            b.close()
