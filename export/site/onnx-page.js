// onnx.html: the chat through onnxruntime-web (wasm) on the export's ONNX decoder, the decode loop of
// serving/onnxrt.py in JS: optimum's inputs (input_ids, attention_mask, position_ids,
// past_key_values.N.key/value) -> logits, present.N.key/value fed back as the next past.
// ?model=int8 (or int4) picks another variant the export holds; fp32 by default.
import * as ort from './vendor/ort/ort.wasm.min.mjs';
import { start, sampleNext } from './common.js';

const url = (p) => new URL(p, location.href).href;
const i64 = (a) => BigInt64Array.from(a, (v) => BigInt(v));

start('onnxruntime-web', async (cfg, threads) => {
  const variant = new URLSearchParams(location.search).get('model') || 'fp32';
  const files = cfg.onnx[variant];
  if (!files) throw new Error(`?model=${variant}: this export holds ONNX ${Object.keys(cfg.onnx).join(', ')}`);
  ort.env.wasm.wasmPaths = url('vendor/ort/');
  ort.env.wasm.numThreads = threads;
  const session = await ort.InferenceSession.create(url(files.model), {
    executionProviders: ['wasm'], graphOptimizationLevel: 'all',
    externalData: files.data.map((d) => ({ path: d.split('/').pop(), data: url(d) })),
  });
  const { n_layers: L, n_kv_heads: kv, head_dim: hd, vocab_size: V } = cfg.onnx_shape;
  const pastNames = [];
  for (let i = 0; i < L; i++) pastNames.push(`past_key_values.${i}.key`, `past_key_values.${i}.value`);
  const presentNames = pastNames.map((n) => n.replace('past_key_values', 'present'));

  async function step(ids, start, past) {
    const t = ids.length;
    const feed = {
      input_ids: new ort.Tensor('int64', i64(ids), [1, t]),
      attention_mask: new ort.Tensor('int64', new BigInt64Array(start + t).fill(1n), [1, start + t]),
      position_ids: new ort.Tensor('int64', i64(ids.map((_, k) => start + k)), [1, t]),
    };
    pastNames.forEach((n, k) => { feed[n] = past[k]; });
    const out = await session.run(feed);
    const logits = out.logits.data.subarray((t - 1) * V, t * V);
    return { logits: Float32Array.from(logits), past: presentNames.map((n) => out[n]), dispose: out.logits };
  }

  return {
    file: files.model.split('/').pop(),
    threads,
    async generate(prompt, p, onId) {
      const history = [...prompt.ids];
      if (history.length >= cfg.n_ctx) throw new Error(`the prompt is ${history.length} tokens; the context is ${cfg.n_ctx}`);
      const budget = Math.min(p.max_tokens, cfg.n_ctx - history.length);
      let past = pastNames.map(() => new ort.Tensor('float32', new Float32Array(0), [1, kv, 0, hd]));
      let x = prompt.ids;
      let start = 0;
      for (let n = 0; n < budget; n++) {
        const r = await step(x, start, past);
        past.forEach((t) => t.dispose?.());
        r.dispose.dispose?.();
        past = r.past;
        start += x.length;
        const next = sampleNext(r.logits, p, history);
        if (cfg.eos_ids.includes(next)) break;
        history.push(next);
        if (onId(next)) break;
        x = [next];
      }
      past.forEach((t) => t.dispose?.());
      return { prompt_tokens: prompt.ids.length, prompt_ids: prompt.ids };
    },
  };
});
