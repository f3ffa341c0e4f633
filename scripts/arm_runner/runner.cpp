// prodip-arm-runner: greedy decoding from token ids, every logit row written out.
//
//   prodip-arm-runner MODEL.gguf PROMPTS.txt N_NEW OUT.bin
//
// PROMPTS.txt holds one prompt per line as whitespace-separated token ids. Ids, not text, so a
// tokenizer difference can never hide (or fake) a kernel difference. For each prompt the runner
// decodes the prompt in one batch with every position's logits kept, then takes the argmax and
// decodes it one token at a time until N_NEW tokens exist (fewer if the context would overflow).
// One thread, F32 logits, no sampling state: the same call pattern export/arm_parity.py drives on
// x86 through llama-cpp-python, so both runs execute the same graph on different CPU kernels.
//
// OUT.bin, little-endian:
//   "PRODIPA1"  int32 n_vocab  int32 n_prompts
//   per prompt: int32 n_ids, int32 n_rows, int32 generated[n_ids], float32 logits[n_rows][n_vocab]
// where the logit rows are those of prompt + generated[:-1]: row i is the distribution of token i+1.
#include "llama.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace {

void quiet_log(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

std::vector<std::vector<llama_token>> read_prompts(const char * path) {
    std::vector<std::vector<llama_token>> prompts;
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
        std::istringstream words(line);
        std::vector<llama_token> ids;
        long id;
        while (words >> id) ids.push_back(static_cast<llama_token>(id));
        if (!ids.empty()) prompts.push_back(ids);
    }
    return prompts;
}

void put_i32(FILE * f, int32_t v) { fwrite(&v, sizeof v, 1, f); }

llama_token argmax(const float * row, int32_t n_vocab) {
    llama_token best = 0;
    for (int32_t j = 1; j < n_vocab; ++j) {
        if (row[j] > row[best]) best = j;
    }
    return best;
}

// Decode one prompt and its greedy continuation; append its record to `out`. False on a decode error.
bool run_prompt(llama_context * ctx, int32_t n_vocab, std::vector<llama_token> ids, int32_t n_new, FILE * out) {
    llama_memory_clear(llama_get_memory(ctx), true);
    const int32_t n_ctx = static_cast<int32_t>(llama_n_ctx(ctx));
    const int32_t n_prompt = static_cast<int32_t>(ids.size());
    const int32_t n_gen = std::min(n_new, n_ctx - n_prompt + 1);
    if (n_gen < 1) return false;
    std::vector<float> rows;
    std::vector<llama_token> gen;

    llama_batch batch = llama_batch_init(n_prompt, 0, 1);
    for (int32_t i = 0; i < n_prompt; ++i) {
        batch.token[i] = ids[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = n_prompt;
    const bool ok = llama_decode(ctx, batch) == 0;
    llama_batch_free(batch);
    if (!ok) return false;
    for (int32_t i = 0; i < n_prompt; ++i) {
        const float * row = llama_get_logits_ith(ctx, i);
        rows.insert(rows.end(), row, row + n_vocab);
    }
    for (;;) {
        const llama_token next = argmax(rows.data() + rows.size() - n_vocab, n_vocab);
        gen.push_back(next);
        if (static_cast<int32_t>(gen.size()) == n_gen) break;
        llama_token tok = next;
        if (llama_decode(ctx, llama_batch_get_one(&tok, 1)) != 0) return false;
        const float * row = llama_get_logits_ith(ctx, -1);
        rows.insert(rows.end(), row, row + n_vocab);
    }
    put_i32(out, n_gen);
    put_i32(out, static_cast<int32_t>(rows.size() / n_vocab));
    fwrite(gen.data(), sizeof(llama_token), gen.size(), out);
    fwrite(rows.data(), sizeof(float), rows.size(), out);
    return true;
}

}  // namespace

int main(int argc, char ** argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s MODEL.gguf PROMPTS.txt N_NEW OUT.bin\n", argv[0]);
        return 2;
    }
    const int32_t n_new = std::atoi(argv[3]);
    const auto prompts = read_prompts(argv[2]);
    if (n_new < 1 || prompts.empty()) {
        fprintf(stderr, "error: need N_NEW >= 1 and at least one prompt in %s\n", argv[2]);
        return 2;
    }
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "error: cannot load %s\n", argv[1]);
        return 1;
    }
    llama_context_params cp = llama_context_default_params();
    // As serving.llamacpp opens a prodip file on x86: the trained context, an F32 KV cache (an F16
    // cache alone moves logits by ~4e-3), no flash attention, 512-token micro-batches (one batch
    // holds the whole prompt, split at the same 512 boundaries as its n_batch=512 calls).
    cp.n_ctx = 0;
    cp.n_batch = std::max<uint32_t>(512, static_cast<uint32_t>(llama_model_n_ctx_train(model)));
    cp.n_ubatch = 512;
    cp.n_threads = cp.n_threads_batch = 1;
    cp.type_k = cp.type_v = GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "error: cannot create a context for %s\n", argv[1]);
        return 1;
    }
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    FILE * out = fopen(argv[4], "wb");
    if (!out) {
        fprintf(stderr, "error: cannot write %s\n", argv[4]);
        return 1;
    }
    fwrite("PRODIPA1", 1, 8, out);
    put_i32(out, n_vocab);
    put_i32(out, static_cast<int32_t>(prompts.size()));
    int rc = 0;
    for (size_t p = 0; p < prompts.size() && rc == 0; ++p) {
        if (!run_prompt(ctx, n_vocab, prompts[p], n_new, out)) {
            fprintf(stderr, "error: decoding prompt %zu failed\n", p + 1);
            rc = 1;
        }
    }
    fclose(out);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return rc;
}
