// What both pages share: prodip-web.json (written by `python -m export web`, export/web_config.py), the
// tokenizer (tokenizers.js on the run's tokenizer.json), the chat template parts, sampling, UTF-8 stream
// decoding, the Bangla chat UI and the window.prodip hook (docs/web.md). Nothing here fetches from
// another origin: every URL is relative to the page.
import { Tokenizer } from './vendor/tokenizers/tokenizers.mjs';

const REPLACEMENT = '\uFFFD';

export async function loadJSON(path) {
  const r = await fetch(new URL(path, location.href));
  if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
  return r.json();
}

export async function loadText(path) {
  const r = await fetch(new URL(path, location.href));
  return r.ok ? r.text() : '';
}

// Threads: ?threads=N asks for N; wasm threads need a cross-origin-isolated page (COOP/COEP headers,
// `python -m serving RUN --web` sends them), without them it is always 1. Default: half the logical
// cores (at least 1, at most 4), the rule wllama itself uses.
export function threadCount() {
  if (!self.crossOriginIsolated) return 1;
  const asked = parseInt(new URLSearchParams(location.search).get('threads') || '', 10);
  if (asked > 0) return asked;
  return Math.max(1, Math.min(4, Math.floor((navigator.hardwareConcurrency || 1) / 2)));
}

// training.text.normalize: no BOM, \n line ends, the normal form the tokenizer was trained on
export function normalize(text, form) {
  return text.replaceAll('\uFEFF', '').replace(/\r\n?/g, '\n').normalize(form);
}

// Native prompt encoding (serving.chat_session): user text never turns into special tokens
// (allow_special=False), the template's own markers do. So two tokenizers over one tokenizer.json:
// `special` splits out special tokens, `plain` knows none and spells "<|im_start|>" as ordinary text.
export class Tok {
  constructor(json, cfg) {
    this.cfg = cfg;
    this.special = new Tokenizer(json, {});
    this.plain = new Tokenizer({ ...json, added_tokens: json.added_tokens.filter((t) => !t.special) }, {});
    // allow_special=True turns only the chat markers into tokens (training.tokenizer's special_ids)
    const chat = new Set(cfg.chat_specials);
    this.chatSpecial = new Tokenizer({ ...json, added_tokens: json.added_tokens.filter((t) => !t.special || chat.has(t.content)) }, {});
  }
  text(s) { return s ? this.plain.encode(normalize(s, this.cfg.normal_form), { add_special_tokens: false }).ids : []; }
  template(s) { return s ? this.special.encode(s, { add_special_tokens: false }).ids : []; }
  // a raw prompt as native serving encodes it: <s> first, then the text (BOS included); `special`:
  // special-token spellings in it become those tokens (Tokenizer.encode(allow_special=True))
  raw(s, special = false) {
    if (!special) return [this.cfg.bos_id, ...this.text(s)];
    const t = normalize(s, this.cfg.normal_form);
    return [this.cfg.bos_id, ...(t ? this.chatSpecial.encode(t, { add_special_tokens: false }).ids : [])];
  }
}

// training.chat.render's text, joined from the parts export/web_config.py cut out of it
export function renderChat(parts, messages, addGenerationPrompt = true) {
  let text = parts.bos;
  for (const m of messages) text += parts.roles[m.role].prefix + m.content + parts.roles[m.role].suffix;
  return addGenerationPrompt ? text + parts.generation_prompt : text;
}

// training.chat.encode's ids: each part tokenized on its own, content without special tokens
export function encodeChat(tok, parts, messages) {
  const ids = [...tok.template(parts.bos)];
  for (const m of messages) {
    const r = parts.roles[m.role];
    ids.push(...tok.template(r.prefix), ...tok.text(m.content), ...tok.template(r.suffix));
  }
  ids.push(...tok.template(parts.generation_prompt));
  return ids;
}

// serving.text_stream: the tokens' bytes (training.tokenizer.piece_bytes, from prodip-web.json) decoded
// as they come; an incomplete UTF-8 sequence is held back until it completes, bytes that never form
// UTF-8 are dropped (counted), so no U+FFFD is ever shown. Stop strings end the text, never shown.
export class TextStream {
  constructor(cfg, stops = []) {
    this.table = cfg.piece_bytes.map((h) => Uint8Array.from(h.match(/../g) || [], (b) => parseInt(b, 16)));
    this.strip = cfg.strip_leading_space;
    this.decoder = new TextDecoder('utf-8');
    this.stops = stops;
    this.text = '';
    this.shown = 0;
    this.invalid = 0;
    this.stopped = false;
  }
  clean(s) {
    const n = s.split(REPLACEMENT).length - 1;
    this.invalid += n;
    return n ? s.replaceAll(REPLACEMENT, '') : s;
  }
  // the id's bytes in; the text that may be shown now out ('' while held back)
  push(id) {
    let b = this.table[id] || new Uint8Array();
    if (this.strip && b.length) {
      if (b[0] === 0x20) b = b.subarray(1);
      this.strip = false;
    }
    this.text += this.clean(this.decoder.decode(b, { stream: true }));
    return this.release(false);
  }
  end() {
    this.text += this.clean(this.decoder.decode());
    return this.release(true);
  }
  release(final) {
    let upto = this.text.length;
    for (const s of this.stops) {
      const at = this.text.indexOf(s);
      if (at >= 0 && at < upto) { upto = at; this.stopped = true; }
    }
    if (this.stopped) this.text = this.text.slice(0, upto);
    else if (!final) {  // hold back a tail that may still become a stop string
      for (const s of this.stops) {
        for (let k = Math.min(s.length - 1, this.text.length); k > 0; k--) {
          if (this.text.endsWith(s.slice(0, k))) { upto = Math.min(upto, this.text.length - k); break; }
        }
      }
    }
    const out = this.text.slice(this.shown, upto);
    this.shown = Math.max(this.shown, upto);
    return out;
  }
}

// serving.backend.sample_next: repetition penalty over every id so far, then greedy (temperature 0)
// or temperature, top-k, top-p and a draw
export function sampleNext(logits, p, history) {
  const x = Float64Array.from(logits);
  if (p.repetition_penalty !== 1 && history.length) {
    for (const i of new Set(history)) x[i] = x[i] > 0 ? x[i] / p.repetition_penalty : x[i] * p.repetition_penalty;
  }
  let best = 0;
  for (let i = 1; i < x.length; i++) if (x[i] > x[best]) best = i;
  if (p.temperature === 0) return best;
  for (let i = 0; i < x.length; i++) x[i] /= p.temperature;
  if (p.top_k && p.top_k < x.length) {
    const kth = Float64Array.from(x).sort()[x.length - p.top_k];
    for (let i = 0; i < x.length; i++) if (x[i] < kth) x[i] = -Infinity;
  }
  const max = x[best] / 1;
  let sum = 0;
  const prob = Array.from(x, (v) => { const e = Math.exp(v - max); sum += e; return e; }).map((e) => e / sum);
  const order = prob.map((_, i) => i).sort((a, b) => prob[b] - prob[a]);
  let keep = order.length;
  if (p.top_p < 1) {
    let cum = 0;
    keep = order.findIndex((i) => (cum += prob[i]) >= p.top_p) + 1 || order.length;
  }
  const kept = order.slice(0, keep);
  const total = kept.reduce((s, i) => s + prob[i], 0);
  let r = Math.random() * total;
  for (const i of kept) if ((r -= prob[i]) <= 0) return i;
  return kept[kept.length - 1];
}

// The request's sampling settings: serving's defaults, what the caller gave, and temperature 0 as
// serving's greedy (SamplingParams.greedy: no top-k/top-p, no repetition penalty unless asked for)
export function samplingFor(cfg, opts = {}) {
  const d = cfg.sampling;
  const greedy = opts.temperature === 0;
  return {
    max_tokens: opts.max_tokens ?? d.max_tokens,
    temperature: opts.temperature ?? d.temperature,
    top_k: opts.top_k ?? (greedy ? 0 : d.top_k),
    top_p: opts.top_p ?? (greedy ? 1 : d.top_p),
    repetition_penalty: opts.repetition_penalty ?? (greedy ? 1 : d.repetition_penalty),
  };
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

// The chat UI (Bangla) over a runtime: {name, file, threads, generate(prompt, params, onPiece)}
function startUI(cfg, runtime, hook) {
  const log = document.getElementById('log');
  const form = document.getElementById('ask');
  const input = document.getElementById('message');
  const history = [];
  document.getElementById('reset').onclick = () => { history.length = 0; log.replaceChildren(); };
  form.onsubmit = async (ev) => {
    ev.preventDefault();
    const text = input.value.trim();
    if (!text || form.dataset.busy) return;
    form.dataset.busy = '1';
    input.value = '';
    log.append(el('div', 'msg user', text));
    const reply = el('div', 'msg assistant', '');
    log.append(reply);
    try {
      const messages = [...history, { role: 'user', content: text }];
      const r = await hook.chat(messages, {}, (piece) => { reply.textContent += piece; });
      history.push({ role: 'user', content: text }, { role: 'assistant', content: r.text });
      reply.after(el('div', 'stats', `${r.ids.length} টোকেন · ${r.tokens_per_s.toFixed(1)} টোকেন/সেকেন্ড`));
    } catch (e) {
      reply.textContent = `ত্রুটি: ${e.message || e}`;
      reply.classList.add('error');
    } finally {
      delete form.dataset.busy;
    }
  };
  form.querySelector('button[type=submit]').disabled = false;
}

// Fit the conversation as serving.chat_session does: room for the reply (serving's reply_reserve), then
// the oldest non-system turns dropped until the prompt fits; the message being answered always stays
function fitHistory(cfg, tok, messages, maxTokens) {
  const reserve = Math.max(1, Math.min(maxTokens, Math.floor(cfg.n_ctx * cfg.sampling.max_reply_share)));
  const budget = cfg.n_ctx - reserve;
  const msgs = [...messages];
  while (encodeChat(tok, cfg.chat, msgs).length > budget) {
    const oldest = msgs.findIndex((m) => m.role !== 'system');
    if (oldest < 0 || oldest === msgs.length - 1) throw new Error('বার্তাটি মডেলের কনটেক্সটের চেয়ে লম্বা; ছোট করুন');
    msgs.splice(oldest, 1);
  }
  return msgs;
}

// The page's entry: load config + tokenizer + card, start the runtime (`load(cfg, threads)` resolves to
// the runtime object), define window.prodip and the UI
export function start(runtimeName, load) {
  let resolveReady, rejectReady;
  const ready = new Promise((res, rej) => { resolveReady = res; rejectReady = rej; });
  const status = document.getElementById('status');
  const hook = { ready, info: { runtime: runtimeName, model: null, threads: null } };
  window.prodip = hook;
  (async () => {
    const cfg = await loadJSON('prodip-web.json');
    const tok = new Tok(await loadJSON(cfg.tokenizer), cfg);
    loadText(cfg.card).then((t) => { document.getElementById('card').textContent = t; });
    document.getElementById('name').textContent = cfg.name;
    if (!Object.keys(cfg.onnx).length) document.querySelectorAll('a[data-onnx]').forEach((a) => a.remove());
    const threads = threadCount();
    const rt = await load(cfg, threads, tok);
    Object.assign(hook.info, { runtime: runtimeName, model: rt.file, threads: rt.threads,
                               cross_origin_isolated: !!self.crossOriginIsolated });
    const run = async (prompt, params, onPiece, stops) => {
      const stream = new TextStream(cfg, stops);
      const t0 = performance.now();
      let first = null;
      const ids = [];
      const info = await rt.generate(prompt, params, (id) => {
        if (first === null) first = performance.now();
        ids.push(id);
        const piece = stream.push(id);
        if (piece && onPiece) onPiece(piece);
        return stream.stopped;
      });
      const rest = stream.end();
      if (rest && onPiece) onPiece(rest);
      const last = performance.now();
      const tps = info.tokens_per_s ?? (ids.length > 1 ? (ids.length - 1) / ((last - first) / 1000) : 0);
      return { ids, text: stream.text, tokens_per_s: tps, prompt_tokens: info.prompt_tokens,
               prompt_ids: info.prompt_ids ?? null, invalid_bytes: stream.invalid,
               seconds: (last - t0) / 1000 };
    };
    hook._runtime = rt;  // the runtime object (its wllama / ort session), for debugging only
    hook.tokenize = async (text, opts = {}) => tok.raw(text, !!opts.special);
    hook.chat = async (messages, opts = {}, onPiece) => {
      const p = samplingFor(cfg, opts);
      const msgs = fitHistory(cfg, tok, messages.map((m) => ({ role: m.role, content: normalize(m.content, cfg.normal_form) })), p.max_tokens);
      const prompt = { text: renderChat(cfg.chat, msgs), ids: encodeChat(tok, cfg.chat, msgs) };
      return run(prompt, p, onPiece, cfg.chat.stop);
    };
    hook.generate = async (prompt, opts = {}) => {
      if (opts.raw) {
        // as native serving's completion: the text normalized, <s> first (wllama adds it), no template
        return run({ text: normalize(prompt, cfg.normal_form), ids: tok.raw(prompt, !!opts.special), raw: true },
                   samplingFor(cfg, opts), opts.onPiece, []);
      }
      return hook.chat([{ role: 'user', content: prompt }], opts, opts.onPiece);
    };
    status.textContent = `${runtimeName} · ${rt.file} · ${rt.threads} থ্রেড${self.crossOriginIsolated ? '' : ' (COOP/COEP হেডার নেই: এক থ্রেড)'}`;
    startUI(cfg, rt, hook);
    resolveReady(hook.info);
  })().catch((e) => {
    status.textContent = `মডেল লোড হয়নি: ${e.message || e}`;
    status.classList.add('error');
    rejectReady(e);
  });
}
