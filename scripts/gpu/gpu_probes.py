"""In-process GPU probes of gpu_validate.py through the Trainer's own step (training.loop.step.TrainStep):
the eager baseline the compiled run's speed-up is measured against, and the 1b preset's memory probe."""

from __future__ import annotations

import time
from pathlib import Path

from gpu_figures import estimate_memory_gb

from training.runfiles import layout

GPU_MEMORY_TARGET_GB = 80.0  # the presets must fit an 80 GB H100/A100
# the eager baseline: whole optimizer steps of at least this many micro-batches timed, after at least this
# many warming up (allocator, cuBLAS heuristics); with 400m's grad-accum 32, one step each (~12 s on an H100)
EAGER_MICRO_BATCHES, EAGER_WARMUP_MICRO_BATCHES = 5, 2


def trainer_step(cfg, preset_name: str, seq_len: int, batch: int, device: str, **train):
    """The Trainer's own step (training.loop.step.TrainStep: its wrapping, autocast, chunked loss,
    clipping and AdamW, fused on CUDA) over a fresh model of `cfg`, and a batch it repeats."""
    import torch

    from training import distributed as D
    from training.config_sections import StepSection
    from training.loop.step import RepeatBatch, TrainStep, build_views
    from training.model.decoder import Transformer
    from training.train_config import TrainConfig

    tcfg = StepSection.of(TrainConfig(preset=preset_name, batch_size=batch, seq_len=seq_len, device=device,
                                      max_steps=10**6, warmup_steps=0, **train))
    dev, d = torch.device(device), D.Dist()
    with torch.device("cpu"):
        model = Transformer(cfg)
    step = TrainStep(build_views(model, tcfg, d, dev), tcfg, d)
    x = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), device=dev)
    return step, RepeatBatch(x[:, :-1], x[:, 1:])


def eager_probe(run: Path, preset_name: str, seq_len: int, batch: int, device: str, grad_accum: int = 1) -> dict:
    """Tokens/s and MFU of the timed run's model, eager (no torch.compile), same micro-batch and grad-accum,
    through the Trainer's own step (bf16 autocast and fused AdamW on CUDA): the baseline the compiled
    run's speed-up is measured against."""
    import torch

    from training.model.decoder import ModelConfig, preset
    from training.telemetry.step_metrics import mfu_flops, peak_flops

    run_cfg = layout.read_run_config(run) if run.is_dir() else None
    cfg = ModelConfig.from_dict(run_cfg["model"]) if run_cfg else preset(preset_name)
    dev = torch.device(device)
    step, batches = trainer_step(cfg, preset_name, seq_len, batch, device, grad_accum=grad_accum)
    steps, warmup = (max(1, -(-n // grad_accum)) for n in (EAGER_MICRO_BATCHES, EAGER_WARMUP_MICRO_BATCHES))
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    for i in range(warmup + steps):
        if i == warmup:  # the clock starts after the warm-up steps (allocator, cuBLAS heuristics)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        step.timed(i + 1, batches)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    tps = steps * step.tokens_per_step / (time.perf_counter() - t0)
    peak, _ = peak_flops(dev)
    mem = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2) if dev.type == "cuda" else None
    del step, batches
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {"eager_tokens_per_s": round(tps),
            **{f"eager_{k}": round(tps * f / peak, 4) if peak else None for k, f in mfu_flops(cfg, seq_len).items()},
            "eager_peak_mem_gb": mem,
            "eager_peak_mem_estimate_gb": estimate_memory_gb(cfg, seq_len, batch, False)["total_gb"]}


def memory_probe(name: str, seq_len: int, batch: int, activation_checkpointing: bool, steps: int = 3) -> dict:
    """Peak GPU memory of `steps` eager optimizer steps of a preset through the Trainer's own step."""
    import torch

    from training.model.decoder import preset

    cfg = preset(name)
    dev = torch.device("cuda")
    res = {"preset": name, "batch_size": batch, "seq_len": seq_len, "activation_checkpointing": activation_checkpointing,
           "estimate": estimate_memory_gb(cfg, seq_len, batch, activation_checkpointing)}
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    step = batches = None
    try:
        step, batches = trainer_step(cfg, name, seq_len, batch, "cuda", activation_checkpointing=activation_checkpointing)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            step.timed(i + 1, batches)
        torch.cuda.synchronize()
        res["eager_tokens_per_s"] = round(steps * batch * seq_len / (time.perf_counter() - t0))
        res["peak_mem_gb"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 1)
        res["fits_80gb"] = res["peak_mem_gb"] < GPU_MEMORY_TARGET_GB
    except torch.OutOfMemoryError as e:
        res["peak_mem_gb"] = None
        res["error"] = f"out of memory: {str(e).splitlines()[0][:200]}"
    finally:
        del step, batches
        torch.cuda.empty_cache()
    return res
