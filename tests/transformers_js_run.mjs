// transformers.js (the pinned @huggingface/transformers in export/site/node_modules) opening one prodip
// ONNX export folder exactly as docs/onnx.md shows, for tests/test_transformers_js.py:
//
//   node tests/transformers_js_run.mjs RUN/export/onnx '{"prompts": [...], "new_tokens": 16}'
//
// Prints one JSON object: {"version", "model_type", "ids": [tokenizer ids per prompt],
// "generated": [greedy new ids per prompt], "generation_config": {...as transformers.js read it}}.
// Nothing is fetched: remote models are off and every file comes from the folder.
import path from 'node:path';

const [folder, request] = process.argv.slice(2);
const { prompts, new_tokens } = JSON.parse(request);
const here = path.dirname(new URL(import.meta.url).pathname);
const entry = path.join(here, '..', 'export', 'site', 'node_modules', '@huggingface', 'transformers',
                        'dist', 'transformers.node.mjs');
const { env, AutoTokenizer, AutoModelForCausalLM } = await import(entry);

// docs/onnx.md: "transformers.js" (keep the two in step)
env.allowRemoteModels = false;
env.localModelPath = path.dirname(path.resolve(folder));
env.useFSCache = false; // nothing written beside the package
const model_id = path.basename(path.resolve(folder));
const tokenizer = await AutoTokenizer.from_pretrained(model_id);
// one intra-op thread: the suite's other worker holds the other core
const model = await AutoModelForCausalLM.from_pretrained(model_id, {
    subfolder: '', session_options: { intraOpNumThreads: 1 } });

const ids = [];
const generated = [];
for (const prompt of prompts) {
    const inputs = tokenizer(prompt);
    const prompt_ids = Array.from(inputs.input_ids.data, Number);
    ids.push(prompt_ids);
    const out = await model.generate({ ...inputs, max_new_tokens: new_tokens, do_sample: false });
    generated.push(Array.from(out.data, Number).slice(prompt_ids.length));
}
const { version } = env;
console.log(JSON.stringify({ version, model_type: model.config.model_type, ids, generated,
                              generation_config: model.generation_config }));
