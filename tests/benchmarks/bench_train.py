"""Training-step throughput: prodip's Transformer vs transformers.LlamaForCausalLM, same config and
batch, same process, on this machine's CPU (or CUDA with --device cuda). Prints a Markdown table.

prodip's side is the Trainer's own step (training.loop.step.TrainStep: the same wrapping, autocast,
chunked loss, gradient clipping and AdamW as train.py, built from a TrainConfig), never a copy; the
transformers side is the plain loop with the same clipping (what HF's Trainer does by default).

    python tests/benchmarks/bench_train.py [--preset tiny|small] [--batch 8] [--seq 256] [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers

from training import distributed as D
from training.config_sections import StepSection
from training.loop.step import RepeatBatch, TrainStep, build_views
from training.model.decoder import Transformer, count_params, preset
from training.train_config import TrainConfig


def hf_model(cfg) -> torch.nn.Module:
    hc = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings,
        attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(hc)


def prodip_step(model: Transformer, a: argparse.Namespace):
    """The Trainer's step over `model`, configured as train.py would be with these flags."""
    cfg = StepSection.of(TrainConfig(preset=a.preset, batch_size=a.batch, seq_len=a.seq, device=a.device, max_steps=10**6,
                                     warmup_steps=0))
    d = D.Dist()
    step = TrainStep(build_views(model, cfg, d, torch.device(a.device)), cfg, d)
    return lambda i, batches: step.timed(i + 1, batches)


def hf_step(model: torch.nn.Module):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(i: int, batches: RepeatBatch) -> torch.Tensor:
        x, y = batches.next_batch(0)
        loss = torch.nn.functional.cross_entropy(model(x).logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def measure(step, batches: RepeatBatch, steps: int, warmup: int = 2) -> float:
    x = batches.batch[0]
    for i in range(warmup + steps):
        if i == warmup:
            if x.is_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        step(i, batches)
    if x.is_cuda:
        torch.cuda.synchronize()
    return x.numel() * steps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3, help="alternate the two models this many times; report the best")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    cfg = preset(a.preset)
    torch.manual_seed(0)
    ours, theirs = prodip_step(Transformer(cfg), a), hf_step(hf_model(cfg).to(a.device))
    x = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), device=a.device)
    y = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), device=a.device)
    batches = RepeatBatch(x, y)
    best = {"prodip": 0.0, "transformers": 0.0}
    for _ in range(a.rounds):  # alternate, so drift in machine load hits both sides alike
        best["prodip"] = max(best["prodip"], measure(ours, batches, a.steps))
        best["transformers"] = max(best["transformers"], measure(theirs, batches, a.steps))
    print(f"preset {a.preset} ({count_params(cfg) / 1e6:.1f} M params), batch {a.batch} x seq {a.seq}, {a.device}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads\n")
    print("| model | train tokens/s | ratio |")
    print("|---|---:|---:|")
    for k, v in best.items():
        print(f"| {k} | {v:,.0f} | {v / best['transformers']:.2f} |")


if __name__ == "__main__":
    main()
