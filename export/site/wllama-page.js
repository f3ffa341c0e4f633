// index.html: the chat through wllama 3 (llama.cpp's server in WebAssembly) on the export's GGUF.
// wllama takes prompts as text (it tokenizes them itself, adding <s> as the GGUF says), so a chat
// prompt is training.chat's rendered text less its leading "<s>"; the generated ids come back as the
// logprobs' token ids (`logprobs: 1`). n_gpu_layers 0: CPU only (wllama's default means WebGPU).
import { Wllama } from './vendor/wllama/index.js';
import { start } from './common.js';

const url = (p) => new URL(p, location.href).href;

// the ids of a streamed chunk: OpenAI completion logprobs as llama-server writes them
function chunkIds(chunk) {
  const lp = chunk?.choices?.[0]?.logprobs;
  const content = lp?.content ?? (Array.isArray(lp) ? lp : null);
  return (content || []).map((c) => c.id).filter((i) => Number.isInteger(i));
}

start('wllama', async (cfg, threads) => {
  const wllama = new Wllama({ default: url('vendor/wllama/wllama.wasm') }, { suppressNativeLog: true });
  // the first shard's URL: wllama finds the others by their -0000i-of-0000N names
  await wllama.loadModelFromUrl(url(cfg.gguf.shards[0]), {
    n_threads: threads, n_gpu_layers: 0, n_ctx: cfg.n_ctx, n_parallel: 1, useCache: false,
  });
  const bosText = cfg.chat.bos;
  return {
    file: cfg.gguf.file,
    threads: wllama.getNumThreads(),
    wllama,
    async generate(prompt, p, onId) {
      // the runtime adds <s> itself (the GGUF's add_bos_token): the rendered chat's own "<s>" is left out
      const text = !prompt.raw && prompt.text.startsWith(bosText) ? prompt.text.slice(bosText.length) : prompt.text;
      const abort = new AbortController();
      let promptTokens = null;
      let timings = null;
      let ended = false;  // llama.cpp's own decode timing: chunks reach JS in batches, so JS clocks cannot time tokens
      const done = () => ({ prompt_tokens: promptTokens, tokens_per_s: timings?.predicted_per_second ?? null });
      const stream = await wllama.createCompletion({
        prompt: text, stream: true, max_tokens: p.max_tokens, temperature: p.temperature, top_k: p.top_k,
        top_p: p.top_p, min_p: 0, repeat_penalty: p.repetition_penalty,
        repeat_last_n: cfg.sampling.llama_penalty_last_n, logprobs: 1, cache_prompt: false,
        abortSignal: abort.signal,
      });
      try {
        for await (const chunk of stream) {
          if (chunk?.usage?.prompt_tokens != null) promptTokens = chunk.usage.prompt_tokens;
          if (chunk?.timings?.prompt_n != null) promptTokens = chunk.timings.prompt_n;
          if (chunk?.timings) timings = chunk.timings;
          for (const id of chunkIds(chunk)) {
            if (ended || cfg.eos_ids.includes(id)) { ended = true; continue; }  // end of turn: read on, timings come last
            if (onId(id)) { abort.abort(); return done(); }
          }
        }
      } catch (e) {
        if (abort.signal.aborted) return done();
        // wllama 3.13.0 fails this way when a reply holds bytes that never form UTF-8 (a lone continuation
        // byte): its result message comes back garbled. Native serving drops such bytes; say what happened.
        if (String(e?.message || e).includes('Invalid typed array length')) {
          throw new Error('wllama 3.13.0 cannot return this reply: the model produced bytes that are not UTF-8 '
                          + '(native serving drops them; onnx.html runs this model)');
        }
        throw e;
      }
      return done();
    },
  };
});
