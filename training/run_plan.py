"""`train.py ... --plan`: what a run will need and cost, printed before anything is allocated.

The same command line as the run, plus --plan: parameters, tokens per step, steps, memory per GPU
(weights, gradients, AdamW moments, autocast's bf16 weight copies, activations with and without
activation checkpointing, logits), and hours and dollars at a measured or assumed speed. Nothing is
built (no model, no tensor, no CUDA context beyond reading the device's name and size) and nothing
is written. A configuration whose estimate does not fit its GPU is refused with one line (exit 2).

Memory per GPU, bytes (N = parameters, tokens = micro-batch x seq_len; docs/scale.md):

    weights 4 N, gradients 4 N, AdamW moments 8 N      fp32; / GPUs under FSDP2
    bf16 weight copies 2 N                             autocast's cast cache, alive through backward
    activations  tokens x n_layers x 53 d_model        bf16 autocast (fp32: 80 d_model)
                 checkpointed: tokens x n_layers x 4 d_model + one block's full activations
    loss         training.model.decoder's chunked cross-entropy: 3.5 x CE_CHUNK_BYTES of live fp32 chunk
                 logits (bf16 product, fp32 copy, log-softmax, scaled gradient), capped at the whole
                 batch's, + its saved fp32 gradients of h (tokens x d_model x 4) and of the head
                 (vocab x d_model x 4) + the head's bf16 cast (vocab x d_model x 2)
                 (a model without the chunked loss: tokens x vocab x 10, bf16 logits 2 + their fp32
                 copy 4 + fp32 gradient 4; fp32 compute: 4 + 4)
    DDP          + 4 N gradient buckets; FSDP2 (bf16 MixedPrecisionPolicy): the root (embedding and
                 head) and 2 blocks gathered in bf16, no autocast weight copies

The activation bytes were measured by counting the distinct storages autograd saves
(torch.autograd.graph.saved_tensors_hooks) on CPU, for one and two blocks, batch 1 and 2 (docs/scale.md):
an upper bound for the compiled CUDA run, which fuses pointwise chains and saves less. tests/test_plan.py
checks the whole estimate against a real forward/backward/AdamW step's peak of live tensor bytes on CPU.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from training.model import decoder as _model
from training.model import hf_import
from training.model.decoder import ModelConfig, count_params, preset
from training.runfiles import layout
from training.runfiles.json_records import RecordError, read_log
from training.runfiles.schema import URL_SCHEME, NonNegFloat, PositiveFloat, PositiveInt, Probability, flag
from training.telemetry.step_metrics import PEAK_BF16_FLOPS, fmt_duration, lookup_by_name, mfu_flops
from training.train_config import ConfigError, TrainConfig

GIB = 2**30
# Bytes per parameter of the training state (fp32 master weights; torch.optim.AdamW's two moments).
WEIGHT_BYTES, GRAD_BYTES, ADAM_BYTES = 4, 4, 8
BF16_COPY_BYTES = 2  # autocast caches each weight's bf16 cast for the step (torch.autocast's weight cache)
DDP_BUCKET_BYTES = 4  # DDP (gradient_as_bucket_view=False) keeps its own fp32 copy of the gradients
FSDP_GATHERED_BLOCKS = 2  # FSDP2: the block being computed and the one prefetched, unsharded, fp32
# Saved activations per token, block and d_model (measured, see the docstring and docs/scale.md).
ACT_BYTES_PER_D = {"bf16": 53, "fp32": 80}
CHECKPOINTED_BYTES_PER_D = 4  # activation checkpointing keeps only each block's fp32 input
# Per token and vocabulary entry when the logits are whole: logits (compute dtype) + the loss's fp32
# copy + the fp32 logits gradient (a model without the chunked loss).
LOGITS_BYTES_PER_V = {"bf16": 2 + 4 + 4, "fp32": 4 + 4}
# The chunked loss (training.model.decoder.chunked_cross_entropy, written in parallel with this module: read
# where present) holds CE_CHUNK_BYTES of fp32 logits per chunk; with the bf16 product, the
# log-softmax and the scaled gradient alive at once, 3.5 times that.
CE_CHUNK_BYTES: int | None = getattr(_model, "CE_CHUNK_BYTES", None)
CE_LIVE_CHUNKS = 3.5
HEAD_GRAD_BYTES = 4  # the chunked loss saves fp32 gradients of h and of the head weight
CUDA_RESERVED_GIB = 1.0  # CUDA context, cuBLAS/cuDNN workspaces: not available to tensors
TIGHT_FRACTION = 0.9  # above this share of the usable memory the plan warns (fragmentation, compile's buffers)
DEFAULT_MFU = 0.40  # the speed assumed when none is given or measured (12 L T d convention)

# GPU memory in GiB as the device reports it (torch.cuda.get_device_properties().total_memory,
# nvidia-smi's MiB / 1024), matched on the device name's words like training.telemetry.step_metrics.PEAK_BF16_FLOPS.
# A name that carries its size ("A100-SXM4-40GB", "H100 80GB HBM3") wins over the table.
GPU_MEMORY_GIB: dict[str, float] = {
    "H200": 140.4, "H200 NVL": 140.4, "H100": 79.6, "H100 NVL": 93.6, "H100 PCIe": 79.6, "GH200": 95.6,
    "B200": 179.1, "A100": 80.0, "L40S": 45.0, "L40": 45.0, "L4": 22.5, "A10": 22.5, "RTX 4090": 24.0,
}
NAMED_SIZE = re.compile(r"(\d+)\s*GB\b", re.I)
NAMED_SIZE_USABLE = 0.995  # a part sold as "80GB" (80 GiB of HBM) reports a little less: 79.6 GiB for an H100


class PlanError(ConfigError):
    """A configuration that cannot run on its GPU: one line, exit 2 (training.runfiles.cli_harness)."""


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float | None  # None: unknown, nothing to check against
    peak_flops: float | None  # dense bf16 FLOP/s; None: no MFU-based speed
    source: str  # where the numbers came from, for the printout


def gpu_memory_for_name(name: str) -> float | None:
    m = NAMED_SIZE.search(name)
    if m:
        return round(int(m.group(1)) * NAMED_SIZE_USABLE, 1)
    return lookup_by_name(name, GPU_MEMORY_GIB)


def pick_gpu(cfg: TrainConfig, gpu: str | None, mem_gib: float | None) -> Gpu | None:
    """The GPU to plan for: --gpu NAME, else the CUDA device present, else an H100 (the presets' target).
    --gpu-mem-gb overrides the memory. None for a CPU run (--device cpu)."""
    if cfg.device == "cpu" and not gpu:
        return None
    if gpu:
        name, source, mem = gpu, "--gpu", gpu_memory_for_name(gpu)
        if mem is None and lookup_by_name(gpu, PEAK_BF16_FLOPS) is None and mem_gib is None:
            raise PlanError(f"--gpu {gpu!r}: not a GPU this plan knows ({', '.join(GPU_MEMORY_GIB)}); "
                            "give its memory with --gpu-mem-gb")
    else:
        import torch  # only to read the device's name and size: no tensor, no allocation

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(torch.device(cfg.device if cfg.device.startswith("cuda") else "cuda"))
            name, source, mem = props.name, "this machine", props.total_memory / GIB
        else:
            name, source, mem = "H100", "assumed: no CUDA here; --gpu NAME to change", GPU_MEMORY_GIB["H100"]
    if mem_gib is not None:
        mem, source = mem_gib, source + ", memory from --gpu-mem-gb"
    return Gpu(name, mem, lookup_by_name(name, PEAK_BF16_FLOPS), source)


def compute_dtype(cfg: TrainConfig, gpu: Gpu | None) -> str:
    """What the matmuls run in: training.loop.step.autocast_for's rule (auto = bf16 on CUDA)."""
    if cfg.dtype != "auto":
        return cfg.dtype
    return "bf16" if gpu is not None else "fp32"


def block_params(mc: ModelConfig) -> int:
    return (count_params(mc, non_embedding=True) - mc.d_model) // mc.n_layers


def estimate_memory(mc: ModelConfig, seq_len: int, batch_size: int, *, dtype: str = "bf16",
                    activation_checkpointing: bool = False, world_size: int = 1, fsdp: bool = False) -> dict[str, int]:
    """Bytes per GPU of one training step, by part (the module docstring); "total" sums the parts in use.
    "activations_other" is the activation term of the other activation-checkpointing setting."""
    n = count_params(mc)
    sharded = fsdp and world_size > 1
    shards = world_size if sharded else 1
    tokens = batch_size * seq_len
    full = tokens * mc.n_layers * ACT_BYTES_PER_D[dtype] * mc.d_model
    checkpointed = tokens * (mc.n_layers * CHECKPOINTED_BYTES_PER_D + ACT_BYTES_PER_D[dtype]) * mc.d_model
    compute_bytes = BF16_COPY_BYTES if dtype == "bf16" else WEIGHT_BYTES
    head = mc.vocab_size * mc.d_model
    if CE_CHUNK_BYTES is None:
        logits = tokens * mc.vocab_size * LOGITS_BYTES_PER_V[dtype]
    else:
        chunk = min(CE_CHUNK_BYTES, tokens * mc.vocab_size * 4)
        logits = (int(CE_LIVE_CHUNKS * chunk) + tokens * mc.d_model * HEAD_GRAD_BYTES + head * HEAD_GRAD_BYTES
                  + (head * BF16_COPY_BYTES if dtype == "bf16" else 0))
    if sharded:  # the root stays gathered (reshard_after_forward=False); blocks one or two at a time
        distributed = (FSDP_GATHERED_BLOCKS * block_params(mc) + head) * compute_bytes
    else:
        distributed = n * DDP_BUCKET_BYTES if world_size > 1 else 0
    out = {
        "weights": n * WEIGHT_BYTES // shards,
        "gradients": n * GRAD_BYTES // shards,
        "optimizer": n * ADAM_BYTES // shards,
        # autocast's cast cache; FSDP2's MixedPrecisionPolicy computes in bf16 parameters instead
        "bf16_weights": n * BF16_COPY_BYTES if dtype == "bf16" and not sharded else 0,
        "activations": checkpointed if activation_checkpointing else full,
        "logits": logits,
        "distributed": distributed,
    }
    out["total"] = sum(out.values())
    out["activations_other"] = full if activation_checkpointing else checkpointed
    return out


def measured_tokens_per_s(out: Path) -> float | None:
    """The median tokens/s of the second half of RUN/log.jsonl's timed steps (past compilation), if any."""
    log = out / layout.LOG
    if not log.is_file():
        return None
    speeds = []
    try:
        for rec in read_log(log):
            v = rec.value.get("tokens_per_s")
            if isinstance(v, int | float) and math.isfinite(v) and v > 0:
                speeds.append(float(v))
    except RecordError:
        pass  # damage mid-log: the speeds logged before it still measure the run
    return statistics.median(speeds[len(speeds) // 2:]) if speeds else None


def data_vocab(cfg: TrainConfig) -> tuple[int, int | None, str]:
    """(vocab size, train tokens or None, where from): the data folder's meta.json when it is there."""
    if URL_SCHEME.match(cfg.data):  # the plan reads no store: it runs before credentials matter
        meta_path: Path | str = f"{cfg.data.rstrip('/')}/{layout.DATA_META}"
    else:
        meta_path = Path(cfg.data) / layout.DATA_META
    if isinstance(meta_path, Path) and meta_path.is_file():
        meta = layout.read_json(meta_path, "data meta")
        vocab = meta.get("vocab_size")
        train = meta.get("splits", {}).get("train", {}).get("n_tokens")
        if isinstance(vocab, int) and vocab > 0:
            return vocab, train if isinstance(train, int) else None, str(meta_path)
    if cfg.init_from:  # the imported model's own vocabulary (hf_import.planned_config reads it)
        return 0, None, f"--init-from {cfg.init_from} ({meta_path} not read)"
    return cfg.model.get("vocab_size", preset(cfg.preset).vocab_size), None, f"preset {cfg.preset} ({meta_path} not read)"


def planned_model(cfg: TrainConfig, vocab: int) -> tuple[ModelConfig, str]:
    """(the model the run trains, what its shape comes from): the preset's, or with --init-from the folder's
    config.json over the data's vocabulary (an extended tokenizer's rows included); vocab 0: the folder's."""
    if not cfg.init_from:
        return cfg.model_config(vocab), f"preset {cfg.preset}"
    return hf_import.planned_config(cfg.init_from, vocab or None), f"--init-from {cfg.init_from}"


def world_size() -> int:
    """The number of processes torchrun starts (WORLD_SIZE), 1 outside torchrun."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def per_gpu_grad_accum(preset_accum: int, gpus: int) -> int:
    """A preset's grad_accum is written for one GPU (its tokens/step is the recipe): on `gpus` GPUs
    each accumulates 1/gpus of it, so the global batch (and the schedule it was tuned for) stays."""
    return max(1, round(preset_accum / gpus))


def add_plan_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--plan (print the run's size, memory, time and cost; allocate and write nothing)")
    g.add_argument("--plan", action="store_true", help="print the plan and exit: 0 if it fits its GPU, 2 if not")
    g.add_argument("--gpu", metavar="NAME", default=None,
                   help=f"plan for this GPU ({', '.join(GPU_MEMORY_GIB)}; default: the CUDA device here, else H100)")
    g.add_argument("--gpu-mem-gb", type=flag(PositiveFloat), default=None, metavar="GIB",
                   help="the GPU's memory in GiB (overrides the table)")
    g.add_argument("--gpus", type=flag(PositiveInt), default=None,
                   help="GPUs to plan for (default: torchrun's WORLD_SIZE, else 1)")
    g.add_argument("--tokens-per-s", type=flag(NonNegFloat), default=None,
                   help="speed for the time and cost (default: measured in --out's log.jsonl, else --mfu)")
    g.add_argument("--mfu", type=flag(Probability), default=None,
                   help=f"MFU to assume for the speed (12 L T d convention; default {DEFAULT_MFU})")


def _gib(b: float) -> str:
    return f"{b / GIB:7.1f} GiB"


def plan(cfg: TrainConfig, *, gpu: str | None = None, gpu_mem_gb: float | None = None, gpus: int | None = None,
         tokens_per_s: float | None = None, mfu: float | None = None, print_=print) -> dict:
    """Print the plan of `cfg` (already resolved, grad_accum per GPU) and return its figures; raises
    PlanError when the estimate does not fit the GPU. Reads the data folder's meta.json and the run's
    log.jsonl when present; writes nothing and allocates nothing."""
    world = gpus or world_size()
    vocab, train_tokens, vocab_from = data_vocab(cfg)
    mc, shape_from = planned_model(cfg, vocab)
    vocab = mc.vocab_size
    if cfg.seq_len > mc.max_seq_len:
        raise PlanError(f"--seq-len {cfg.seq_len} exceeds the model's max_seq_len {mc.max_seq_len}")
    device = pick_gpu(cfg, gpu, gpu_mem_gb)
    dtype = compute_dtype(cfg, device)
    tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len * world
    steps = cfg.max_steps or math.ceil(cfg.max_tokens / tokens_per_step)
    total_tokens = steps * tokens_per_step
    flops = mfu_flops(mc, cfg.seq_len)
    mem = estimate_memory(mc, cfg.seq_len, cfg.batch_size, dtype=dtype, activation_checkpointing=cfg.activation_checkpointing,
                          world_size=world, fsdp=cfg.fsdp)
    speed, speed_from = _speed(cfg, device, flops, world, tokens_per_s, mfu)
    hours = total_tokens / speed / 3600 if speed else None
    usd = hours * cfg.gpu_hourly_usd * world if hours is not None and cfg.gpu_hourly_usd else None

    p = print_
    mode = "FSDP2" if cfg.fsdp and world > 1 else "DDP" if world > 1 else "one process"
    p(f"plan: {shape_from}, {count_params(mc) / 1e6:,.1f} M parameters "
      f"({count_params(mc, non_embedding=True) / 1e6:,.1f} M non-embedding), vocab {vocab:,} from {vocab_from}")
    p(f"  tokens/step   {cfg.batch_size} x {cfg.grad_accum} x {cfg.seq_len} x {world} GPU(s) = {tokens_per_step:,} ({mode})")
    epochs = f", {total_tokens / train_tokens:.2f} epochs of the data" if train_tokens else ""
    p(f"  steps         {steps:,} x {tokens_per_step:,} = {total_tokens / 1e9:,.3f} B tokens{epochs}; warmup {cfg.warmup_steps}, "
      f"{cfg.schedule}, peak lr {cfg.lr:g}")
    p(f"  FLOPs/token   {flops['mfu'] / 1e9:.3f} G (mfu, 12 L T d); {flops['mfu_6ltd'] / 1e9:.3f} G (mfu_6ltd, 6 L T d)")
    if device is not None:
        mem_s = f"{device.memory_gib:.1f} GiB" if device.memory_gib else "memory unknown"
        peak_s = f"{device.peak_flops / 1e12:.1f} TFLOP/s bf16 peak" if device.peak_flops else "peak unknown"
        p(f"  GPU           {device.name}: {mem_s}, {peak_s} ({device.source})")
    else:
        p("  device        cpu (no GPU to check the memory against)")
    usable = _print_memory(p, cfg, mem, dtype, device)
    if speed:
        cost = f", ${usd:,.2f} at ${cfg.gpu_hourly_usd:g}/GPU-hour" if usd is not None else \
            " (--gpu-hourly-usd for the cost)"
        p(f"  speed         {speed:,.0f} tokens/s ({speed_from})")
        p(f"  time          {fmt_duration(hours * 3600)} ({hours:.2f} h){cost}")
    else:
        p("  time          unknown: give --tokens-per-s, or --gpu NAME for an MFU-based estimate")
    if usable is not None and mem["total"] / GIB > usable:
        raise PlanError(_does_not_fit(cfg, mem, world, device.name, usable))
    return {"params": count_params(mc), "vocab_size": vocab, "tokens_per_step": tokens_per_step, "steps": steps,
            "tokens": total_tokens, "gpus": world, "dtype": dtype, "memory_bytes": mem,
            "gpu": None if device is None else device.name,
            "gpu_memory_gib": None if device is None else device.memory_gib,
            "tokens_per_s": speed, "hours": hours, "usd": usd}


def _speed(cfg: TrainConfig, device: Gpu | None, flops: dict[str, float], world: int,
           tokens_per_s: float | None, mfu: float | None) -> tuple[float | None, str]:
    """(tokens/s, where from): --tokens-per-s, else measured in --out's log.jsonl, else an assumed MFU."""
    if tokens_per_s:
        return tokens_per_s, "--tokens-per-s"
    measured = measured_tokens_per_s(Path(cfg.out))
    if measured:
        return measured, f"measured: median of {Path(cfg.out) / layout.LOG}"
    if device is not None and device.peak_flops:
        assumed = mfu or DEFAULT_MFU
        return (assumed * device.peak_flops * world / flops["mfu"],
                f"assumed {assumed:.0%} MFU of {world} x {device.peak_flops / 1e12:.1f} TFLOP/s")
    return tokens_per_s, "--tokens-per-s"


def _print_memory(p, cfg: TrainConfig, mem: dict[str, int], dtype: str, device: Gpu | None) -> float | None:
    """The memory table per GPU; returns the GiB usable on the GPU (None when unknown)."""
    ac = "on" if cfg.activation_checkpointing else "off"
    p(f"  memory per GPU ({dtype} compute, activation checkpointing {ac}):")
    p(f"    weights       {_gib(mem['weights'])}   fp32")
    p(f"    gradients     {_gib(mem['gradients'])}   fp32")
    p(f"    optimizer     {_gib(mem['optimizer'])}   AdamW exp_avg + exp_avg_sq")
    if mem["bf16_weights"]:
        p(f"    bf16 copies   {_gib(mem['bf16_weights'])}   autocast's weight casts")
    other = "with" if not cfg.activation_checkpointing else "without"
    p(f"    activations   {_gib(mem['activations'])}   ({other} activation checkpointing: "
      f"{mem['activations_other'] / GIB:.1f} GiB)")
    p(f"    logits, loss  {_gib(mem['logits'])}   " + ("whole logits, their fp32 copy and gradient" if CE_CHUNK_BYTES is None
                                                 else "chunked cross-entropy: live chunks + saved head gradients"))
    if mem["distributed"]:
        p(f"    {'FSDP2 gather' if cfg.fsdp else 'DDP buckets':13} {_gib(mem['distributed'])}")
    usable = device.memory_gib - CUDA_RESERVED_GIB if device is not None and device.memory_gib else None
    total_gib = mem["total"] / GIB
    verdict = "" if usable is None else (f" of {usable:.1f} usable ({total_gib / usable:.0%})" + (
        ": does NOT fit" if total_gib > usable else ": tight" if total_gib > TIGHT_FRACTION * usable else ": fits"))
    p(f"    total         {_gib(mem['total'])}{verdict}")
    return usable


def _does_not_fit(cfg: TrainConfig, mem: dict[str, int], world: int, gpu_name: str, usable: float) -> str:
    biggest = max(("activations", "logits", "optimizer", "weights"), key=lambda k: mem[k])
    hint = ("lower --batch-size and raise --grad-accum" +
            ("" if cfg.activation_checkpointing else ", or add --activation-checkpointing") +
            ("" if cfg.fsdp or world == 1 else ", or --fsdp"))
    what = f"--init-from {Path(cfg.init_from).name}" if cfg.init_from else cfg.preset
    return (f"--plan: {what} at micro-batch {cfg.batch_size} x {cfg.seq_len} needs ~{mem['total'] / GIB:.1f} GiB "
            f"per GPU ({biggest} {mem[biggest] / GIB:.1f} GiB), over the {gpu_name}'s {usable:.1f} "
            f"usable GiB; {hint}")
