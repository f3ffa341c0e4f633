"""The figures gpu_validate.py reports: the environment, and the timed run's speed, MFU, memory and gates
read from its run folder, with the projection to the reference run's 2 B tokens."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from training.runfiles import layout

PROJECT_TOKENS = 2_000_000_000  # the reference run's budget: 2 B tokens in 54.6 h for $164 on one H100
REFERENCE_TOKENS_PER_S = 10_000


def estimate_memory_gb(cfg, seq_len: int, batch: int, activation_checkpointing: bool) -> dict[str, float]:
    """training.run_plan's estimate (what `train.py --plan` prints) for one process, bf16 autocast, in GiB."""
    from training.run_plan import GIB, estimate_memory

    mem = estimate_memory(cfg, seq_len, batch, dtype="bf16", activation_checkpointing=activation_checkpointing)
    return {f"{k}_gb": round(v / GIB, 2) for k, v in mem.items() if k not in ("activations_other", "distributed")}


def environment(device: str) -> dict:
    import torch

    from training.telemetry.step_metrics import peak_flops

    peak, gpu = peak_flops(torch.device(device))
    return {"date": time.strftime("%Y-%m-%d"), "gpu": gpu, "peak_flops": peak, "torch": torch.__version__,
            "cuda": torch.version.cuda}


def measure(a: argparse.Namespace, run: Path) -> dict:
    """The figures of the timed run (its log, gates and config) and the projections from them."""
    import numpy as np
    import torch
    from gpu_preempt import read_log

    from training.model.decoder import ModelConfig, count_params, preset
    from training.telemetry.step_metrics import mfu_flops, peak_flops

    recs = [r for r in read_log(run) if "loss" in r]
    gates = layout.read_json(run / layout.GATES, "gates") if (run / layout.GATES).exists() else {}
    gate = {g["name"]: g for g in gates.get("results", [])}
    timed = [r for r in recs if r.get("tokens_per_s")]
    # the steady state: the second half's tokens over its seconds (past compilation, allocator warm-up).
    # Not the median of the records' tokens_per_s: train.py averages those over the last 20 steps, which
    # in a run this short reaches back to step 1
    half = timed[max(len(timed) // 2 - 1, 0):]
    if len(half) >= 2 and half[-1]["elapsed_s"] > half[0]["elapsed_s"]:
        tps = (half[-1]["tokens"] - half[0]["tokens"]) / (half[-1]["elapsed_s"] - half[0]["elapsed_s"])
    else:
        tps = float(np.median([r["tokens_per_s"] for r in timed])) if timed else float("nan")

    run_cfg = layout.read_run_config(run) if run.is_dir() else None
    ran = ModelConfig.from_dict(run_cfg["model"]) if run_cfg else preset(a.preset)
    full = preset(a.preset)
    peak, _ = peak_flops(torch.device(a.device))
    flops, flops_full = mfu_flops(ran, a.seq_len), mfu_flops(full, a.seq_len)
    measured = tps == tps
    mfu = {k: round(tps * f / peak, 4) if peak and measured else None for k, f in flops.items()}
    tps_full = tps * flops["mfu"] / flops_full["mfu"]  # the full preset (vocab 32768) at the same MFU
    hours = PROJECT_TOKENS / tps_full / 3600 if tps_full > 0 else float("nan")
    measured_mem = max((r["peak_mem_gb"] for r in recs if "peak_mem_gb" in r), default=None)  # CUDA only
    estimate = estimate_memory_gb(ran, a.seq_len, a.batch_size, a.activation_checkpointing)["total_gb"]
    return {k: None if isinstance(v, float) and v != v else v for k, v in {  # NaN is not JSON
        "preset": a.preset, "vocab_size_ran": ran.vocab_size, "params_ran": count_params(ran),
        "params_preset": count_params(full), "seq_len": a.seq_len, "micro_batch": a.batch_size,
        "grad_accum": a.grad_accum, "grad_accum_from": a.grad_accum_from,
        "tokens_per_optimizer_step": a.batch_size * a.grad_accum * a.seq_len, "eval_batches": a.eval_batches,
        "compile": not a.no_compile, "activation_checkpointing": a.activation_checkpointing,
        "steps_logged": len(recs), "gates_passed": gates.get("passed"), "gates_failed": gates.get("failed"),
        "val_loss": next((r["val_loss"] for r in reversed(recs) if "val_loss" in r), None),
        "tokens_per_s": round(tps) if measured else None,
        "flops_per_token": flops["mfu"], "flops_per_token_6ltd": flops["mfu_6ltd"],
        **mfu,
        "mfu_formula": "mfu: tokens/s x (6 N' + 12 n_layers seq_len d_attn) / peak dense bf16 FLOP/s (PaLM, nanoGPT, "
                       "torchtitan); mfu_6ltd: the same with 6 n_layers seq_len d_attn (Kaplan, llm.c); N' = "
                       "non-embedding params + the output head once (training.telemetry.step_metrics)",
        "gates": [{k: g.get(k) for k in ("name", "passed", "value", "threshold")} for g in gates.get("results", [])],
        "gate_mfu_fwd_bwd": gate.get("throughput.mfu", {}).get("value"),
        "backward_forward_ratio": gate.get("throughput.backward_ratio", {}).get("value"),
        "peak_mem_gb": measured_mem,
        "peak_mem_estimate_gb": estimate,
        "peak_mem_measured_over_estimate": round(measured_mem / estimate, 2) if measured_mem and estimate else None,
        "projected_preset_tokens_per_s": round(tps_full) if tps_full == tps_full else None,
        "projected_2B_tokens_hours": round(hours, 2), "projected_2B_tokens_usd": round(hours * a.hourly_usd, 2),
        "speedup_vs_reference": round(tps_full / REFERENCE_TOKENS_PER_S, 1) if tps_full == tps_full else None,
        "hourly_usd": a.hourly_usd,
    }.items()}
