"""One-command GPU validation (about 5 minutes, at most 8 with compiles, on one H100/H200):

    python scripts/gpu_validate.py [--preset 400m] [--seq-len 2048] [--batch-size N] [--grad-accum N]
                                   [--steps 12] [--hourly-usd 3.0] [--data DATA_DIR] [--skip-1b] [--out DIR]

Phases, each written to DIR/gpu_validate.json and DIR/gpu_validate.md as it starts and ends (a run
stopped by a time limit keeps every finished phase and names the one it was in). --budget-s (450 s)
bounds the whole script: train.py gets what the later phases do not need (but at least
TRAIN_FLOOR_S, 150 s, or all that is left), and a later phase that no longer fits is recorded as skipped.

1. environment: GPU name, its dense bf16 peak (training.metrics.PEAK_BF16_FLOPS), torch, CUDA.
2. sdpa: which scaled-dot-product-attention kernel (cuDNN / flash / memory-efficient / math) one
   training step of the preset's block runs, read from the profiler's op names; then each backend
   forced in turn (torch.nn.attention.sdpa_kernel) and timed, forward + backward, at the training shape,
   with K/V shared by enable_gqa (cuDNN in torch 2.11, flash, math) and pre-expanded (every backend eligible).
   Also one block forward + backward with its projections fused (q/k/v and gate/up as one GEMM each)
   and unfused: the numbers behind training.model.FUSE_DEVICES.
3. data: prepares a folder from the shipped corpus (tokenizer + shards). The corpus is small, so the
   train split is tiled (each copy shifted by a token, so no window repeats) until the timed run
   never wraps around; --data uses a folder you prepared instead (e.g. your real 32k-vocab data).
4. train: `training/train.py` on CUDA with the pre-flight gates ON (gradient flow, compiled vs eager,
   overfit one batch, throughput with its MFU floor and backward/forward ratio, data, tokenizer),
   then a short run of the preset's recipe (its micro-batch and grad-accum: 16 x 16, 0.5 M tokens per
   optimizer step for 400m; --batch-size, --grad-accum override) with bf16 autocast, torch.compile, fused AdamW and
   SDPA, every step logged, and one validation at its last step with the recipe's validation batches
   (eager blocks: no second graph).
   Its stderr (with TORCH_LOGS=graph_breaks,recompiles) goes to DIR/run-*.stderr.log: the graph breaks
   and recompiles dynamo logged are counted (both should be 0).
5. measure: tokens/s, MFU both ways, peak memory (measured, and training.plan's estimate, the one
   `train.py --plan` prints), every gate's value against its threshold (compiled_vs_eager: the bf16
   relative errors against their tolerances), the backward/forward ratio, and the projected time and
   cost of 2 B tokens.
6. eager: the same model, micro-batch and grad-accum without torch.compile (a few optimizer steps in
   this process): eager tokens/s, MFU both ways and peak memory against the plan, and the compiled
   run's speed-up.
7. unless --skip-1b: a memory probe of the 1b preset (eager, 3 optimizer steps at seq 2048: micro-batch
   4 without, and 16 with activation checkpointing), to check it fits an 80 GB GPU.
8. preempt: train.py again (eager, gates skipped) into a new run folder, SIGTERM after its first step,
   then the same command resumed a few steps past its checkpoint (scripts/gpu_preempt.py): the exit
   code, signal-to-exit seconds against torchrun's 30 s grace, the checkpoint's step, stall, write and
   bytes, and where the resume started. Skipped when the train phase trained no step.

MFU = tokens/s x FLOPs/token / peak dense bf16 FLOP/s of the GPU, in two conventions (training.metrics):
`mfu` with FLOPs/token = 6 N' + 12 n_layers seq_len d_attn (PaLM, nanoGPT, torchtitan; the target's),
`mfu_6ltd` with 6 n_layers seq_len d_attn (Kaplan, llm.c); N' counts the non-embedding parameters
plus the output head's matmul, once. The shipped corpus supports a smaller vocabulary than the
preset's 32768, so the timed model is the preset's shape with that vocabulary: MFU is computed for the
model that actually ran, and the 2 B-token projection for the full preset assumes the same MFU (time
scales with FLOPs/token).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from training.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from training import layout  # noqa: E402  (a leaf: the standard library only, so importing it is cheap)

sys.path.insert(1, str(ROOT / "scripts"))  # gpu_preempt beside this file, also when loaded by path (the tests)

PROJECT_TOKENS = 2_000_000_000  # the reference run's budget: 2 B tokens in 54.6 h for $164 on one H100
REFERENCE_TOKENS_PER_S = 10_000
HOURLY_USD = 3.0  # the reference run's price: $164 / 54.6 h
GPU_MEMORY_TARGET_GB = 80.0  # the presets must fit an 80 GB H100/A100
TRAIN_TIMEOUT_S = 420  # the train.py phase; with data prep and the 1b probe the script stays < 8 min
# The least the train phase gets when the budget is short: on an H200 the 400m phase (start, 11 gates,
# compile, 12 steps, validation, a 4.7 GB checkpoint) took 90 s, and a --budget-s 170 run that reserved
# 135 s for the later phases left it 24 s: no step, no figure (2026-12-04, docs/scale.md#results)
TRAIN_FLOOR_S = 150
# Optimizer steps of the timed run: 400m's recipe has 0.5 M tokens per step, so 12 steps are ~42 s at the
# 150 k tokens/s target (45% MFU "by step 8"); every step is logged, and the second half is the steady state.
DEFAULT_STEPS = 12
RESULTS_JSON, RESULTS_MD = "gpu_validate.json", "gpu_validate.md"  # in --out
# the eager baseline: whole optimizer steps of at least this many micro-batches timed, after at least this
# many warming up (allocator, cuBLAS heuristics); with 400m's grad-accum 32, one step each (~12 s on an H100)
EAGER_MICRO_BATCHES, EAGER_WARMUP_MICRO_BATCHES = 5, 2
PAD_FACTOR = 2  # tile the train split to this many times the tokens the timed run reads
BOS_ID = 1

BUDGET_S = 450  # the whole script, compiles included: 7.5 min, under the 8 min a validation slot allows
EAGER_RESERVE_S = 45  # what the budget keeps for the phases after train.py: the eager probe ...
PROBE_RESERVE_S = 30  # ... and each 1b memory probe (a 1b model built on the GPU, 3 steps) ...
# ... and the preempt phase: two train.py starts (400m built, 4.4 GB checkpoint written and read back) and
# about four eager recipe steps of ~6 s
PREEMPT_RESERVE_S = 90
SDPA_REPS = 3  # timed forward+backward passes per forced SDPA backend


def estimate_memory_gb(cfg, seq_len: int, batch: int, activation_checkpointing: bool) -> dict[str, float]:
    """training.plan's estimate (what `train.py --plan` prints) for one process, bf16 autocast, in GiB."""
    from training.plan import GIB, estimate_memory

    mem = estimate_memory(cfg, seq_len, batch, dtype="bf16", activation_checkpointing=activation_checkpointing)
    return {f"{k}_gb": round(v / GIB, 2) for k, v in mem.items() if k not in ("activations_other", "distributed")}


def prepare_data(out: Path, need_tokens: int) -> Path:
    """Tokenizer + shards from the shipped corpus, the train split tiled to `need_tokens`."""
    import numpy as np

    from training.data import ShardWriter, TokenStream
    from training.tokenizer import Tokenizer

    data = out / "data"
    if (data / layout.DATA_META).is_file():
        meta = layout.read_json(data / layout.DATA_META, "data meta")
        if meta["splits"]["train"]["n_tokens"] >= need_tokens:
            return data
    subprocess.check_call([sys.executable, "-m", "training.prepare", "--input", str(ROOT / "training/assets/corpus"),
                           "--out", str(data), "--vocab-size", "32768", "--force", "--no-progress"], cwd=ROOT)
    tok = Tokenizer.load(data / layout.TOKENIZER)
    meta = layout.read_json(data / layout.DATA_META, "data meta")
    base = TokenStream(data, "train").slice(0, meta["splits"]["train"]["n_tokens"])
    # every copy starts with 1 or 2 <s> so that a copy's length is odd: windows (stride seq_len, a
    # power of two) then fall at a different offset in each copy and never repeat exactly
    prefix = [BOS_ID] * (1 if (len(base) + 1) % 2 else 2)
    copy = np.concatenate([np.array(prefix, dtype=np.int64), base])
    n_copies = -(-need_tokens // len(copy))
    w = ShardWriter(out / "pad", tok.vocab_size, tok.sha256, shard_tokens=1 << 26)
    for _ in range(n_copies):
        w.add(copy)
    w.close()
    n = meta["splits"]["train"]["n_shards"]
    for i, f in enumerate(sorted((out / "pad").glob("shard_*.bin"))):
        os.replace(f, data / "train" / f"shard_{n + i:05d}.bin")
    meta["splits"]["train"]["n_tokens"] += n_copies * len(copy)
    meta["splits"]["train"]["n_shards"] = n + w.n_shards
    (data / layout.DATA_META).write_text(json.dumps(meta, indent=2))
    return data


COMPILE_LOGS = "graph_breaks,recompiles"  # TORCH_LOGS: dynamo logs each graph break and recompile of the run
GRAPH_BREAK_LINE, RECOMPILE_LINE = "[__graph_breaks] Graph break", "[__recompiles] Recompiling function"


def run_train(cmd: list[str], timeout_s: int, stderr_log: Path | None = None) -> int:
    """train.py in its own process group: on timeout the group is stopped and what it logged is kept.
    `stderr_log`: its stderr goes there, with dynamo's graph-break and recompile logs (compile_counts)."""
    env = dict(os.environ)
    if stderr_log is not None:
        env["TORCH_LOGS"] = ",".join(x for x in (env.get("TORCH_LOGS", ""), COMPILE_LOGS) if x)
        stderr_log.parent.mkdir(parents=True, exist_ok=True)
    with open(stderr_log, "w") if stderr_log is not None else contextlib.nullcontext() as err:  # noqa: SIM115
        p = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, env=env, stderr=err)
        try:
            rc = p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            print(f"warning: train.py still running after {timeout_s} s; stopped (figures from the steps logged)",
                  file=sys.stderr)
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            rc = 124
    if rc and stderr_log is not None:  # its error, where a person looks
        print("".join(stderr_log.read_text(errors="replace").splitlines(True)[-20:]), file=sys.stderr)
    return rc


def compile_counts(stderr_log: Path) -> dict:
    """Graph breaks and recompiles dynamo logged in the timed run (TORCH_LOGS, see run_train): both
    should be 0 (one graph per block, shared by all blocks; validation runs eagerly)."""
    text = stderr_log.read_text(errors="replace") if stderr_log.is_file() else ""
    return {"graph_breaks": text.count(GRAPH_BREAK_LINE), "recompiles": text.count(RECOMPILE_LINE),
            "compile_log": str(stderr_log)}


def trainer_step(cfg, preset_name: str, seq_len: int, batch: int, device: str, **train):
    """The Trainer's own step (training.loop.step.TrainStep: its wrapping, autocast, chunked loss,
    clipping and AdamW, fused on CUDA) over a fresh model of `cfg`, and a batch it repeats."""
    import torch

    from training import distributed as D
    from training.config import TrainConfig
    from training.loop.step import RepeatBatch, TrainStep, build_views
    from training.model import Transformer

    tcfg = TrainConfig(preset=preset_name, batch_size=batch, seq_len=seq_len, device=device, max_steps=10**6,
                       warmup_steps=0, **train)
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

    from training.metrics import mfu_flops, peak_flops
    from training.model import ModelConfig, preset

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

    from training.model import preset

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


def build_parser() -> argparse.ArgumentParser:
    from training.cli import ArgumentParser  # one `error:` line for a bad flag, no usage block
    from training.model import PRESETS
    from training.schema import NonNegFloat, PositiveInt, flag

    ap = ArgumentParser(prog="python scripts/gpu_validate.py", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="400m", choices=list(PRESETS))
    ap.add_argument("--seq-len", type=flag(PositiveInt), default=2048)
    ap.add_argument("--batch-size", type=flag(PositiveInt), default=None,
                    help="micro-batch (default: the preset's recipe: 16 x 2048 for 400m, 38.1 GiB on an H200)")
    ap.add_argument("--grad-accum", type=flag(PositiveInt), default=None,
                    help="micro-batches per optimizer step (default: the preset's recipe, training/presets/"
                         "NAME.toml [train]: 16 for 400m, 0.5 M tokens per step)")
    ap.add_argument("--steps", type=flag(PositiveInt), default=DEFAULT_STEPS,
                    help="optimizer steps of the timed run, each logged")
    ap.add_argument("--hourly-usd", type=flag(NonNegFloat), default=HOURLY_USD,
                    help="GPU price per hour (default: the reference's)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/prodip-gpu-validate"),
                    help=f"results folder: {RESULTS_JSON} and {RESULTS_MD}, rewritten after every phase (so a "
                         "run stopped by a time limit keeps what finished), and the run folder")
    ap.add_argument("--data", type=Path, default=None, help="a prepared data folder to use instead of the corpus")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--skip-1b", action="store_true", help="skip the 1b memory probe")
    ap.add_argument("--train-timeout-s", type=flag(PositiveInt), default=TRAIN_TIMEOUT_S)
    ap.add_argument("--budget-s", type=flag(PositiveInt), default=BUDGET_S,
                    help="the whole script's time: train.py gets what the later phases do not need, and a "
                         "phase that no longer fits is skipped (recorded as such)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a dry run of this script's own logic (tiny presets)")
    return ap


class Results:
    """OUT/gpu_validate.json and .md, rewritten (atomically) at the start and end of every phase:
    a run killed by a time limit leaves every finished phase's figures and names the one it was in."""

    def __init__(self, out: Path, argv: dict):
        self.out = out
        self.data: dict = {"complete": False, "args": argv, "phases": [], "results": {}}

    @property
    def results(self) -> dict:
        return self.data["results"]

    @contextlib.contextmanager
    def phase(self, name: str):
        entry = {"name": name, "status": "running"}
        self.data["phases"].append(entry)
        self.save()
        t0 = time.time()
        try:
            yield self.results
            entry["status"] = "ok"
        except BaseException as e:  # recorded, then re-raised: KeyboardInterrupt and SystemExit included
            entry["status"] = "failed"
            entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            raise
        finally:
            entry["wall_s"] = round(time.time() - t0, 1)
            self.save()

    def skip_if_late(self, name: str, deadline: float, need_s: float) -> bool:
        """True when phase `name` still fits before `deadline`; else it is recorded as skipped."""
        if time.time() + need_s <= deadline:
            return True
        self.skip(name, "over the --budget-s")
        return False

    def skip(self, name: str, why: str) -> None:
        self.data["phases"].append({"name": name, "status": f"skipped: {why}", "wall_s": 0.0})
        self.save()

    def finish(self) -> None:
        self.data["complete"] = True
        self.save()

    def markdown(self) -> str:
        md = ["# GPU validation" + ("" if self.data["complete"] else " (incomplete)"), "",
              "| phase | status | wall s |", "|---|---|---:|"]
        md += [f"| {p['name']} | {p['status']}{': ' + p['error'] if 'error' in p else ''} | {p.get('wall_s', '')} |"
               for p in self.data["phases"]]
        md += ["", "| metric | value |", "|---|---|"]
        md += [f"| {k} | {json.dumps(v) if isinstance(v, (list, dict)) else v} |" for k, v in self.results.items()]
        return "\n".join(md) + "\n"

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        for name, text in ((RESULTS_JSON, json.dumps(self.data, indent=2)), (RESULTS_MD, self.markdown())):
            tmp = self.out / (name + ".tmp")
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, self.out / name)


def check_out(out: Path) -> None:
    """--out must be a folder we may write: fail before any phase (and any GPU minute) if not."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a folder")
    if not out.exists() and out.parent.exists() and not os.access(out.parent, os.W_OK):
        raise ValueError(f"--out {out}: cannot create it (no write permission in {out.parent})")


SDPA_OPS = (  # aten op (what dispatch chose) -> kernel family, most specific first
    ("cudnn_attention", "cuDNN"), ("flash_attention_for_cpu", "flash (CPU)"), ("flash_attention", "flash"),
    ("efficient_attention", "memory-efficient"), ("attention_math", "math"),
)


def sdpa_kernels(preset_name: str, seq_len: int, device: str) -> dict:
    """The SDPA kernel one training step (forward + backward, bf16 autocast) of one block of the
    preset's shape runs, read from the profiler's aten op names: what dispatch picked, not a guess.
    {"sdpa_kernel": family of the forward op(s), "sdpa_ops": every SDPA op name seen}."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from training.model import Transformer, preset

    cfg = preset(preset_name, n_layers=1)
    dev = torch.device(device)
    model = Transformer(cfg).to(dev)
    x = torch.randint(0, cfg.vocab_size, (1, seq_len + 1), device=dev)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
    ops = sorted({e.key for e in prof.key_averages() if "scaled_dot_product" in e.key})
    forward = {next(family for op, family in SDPA_OPS if op in name)
               for name in ops if not name.endswith("_backward") and any(op in name for op, _ in SDPA_OPS)}
    return {"sdpa_kernel": " + ".join(sorted(forward)) or None, "sdpa_ops": ops}


SDPA_BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")  # torch.nn.attention.SDPBackend


def sdpa_backends(preset_name: str, seq_len: int, batch: int, device: str, reps: int = SDPA_REPS) -> dict:
    """Each SDPA backend forced in turn (torch.nn.attention.sdpa_kernel) on the training call (causal,
    bf16 q/k/v of the preset's heads), forward + backward milliseconds or why it cannot run, in the two
    forms GQA can take: K/V shared by `enable_gqa=True` (what the model runs in bf16; cuDNN (torch 2.11),
    flash and math accept it) and K/V pre-expanded to every query head by repeat_interleave (what the model runs in fp32
    on CUDA; every backend eligible), the expansion and its backward inside the timing.

    {"sdpa_fwd_bwd_ms": {backend: ms | "unavailable: ..."} (enable_gqa), "sdpa_expanded_fwd_bwd_ms": the
    same for expanded K/V (null without GQA: the forms coincide), "sdpa_fastest" and "sdpa_fastest_expanded":
    each form's fastest backend, "sdpa_best": "<backend> (<form>)" over both, "sdpa_shape"}."""
    import torch

    from training.model import preset

    cfg = preset(preset_name)
    dev = torch.device(device)
    rep = cfg.n_heads // cfg.n_kv_heads
    shape = (batch, cfg.n_heads, seq_len, cfg.head_dim)
    kv = (batch, cfg.n_kv_heads, seq_len, cfg.head_dim)
    q = torch.randn(shape, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(kv, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def gqa():
        return sdpa(q, k, v, is_causal=True, enable_gqa=rep > 1)

    def expanded():
        return sdpa(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), is_causal=True)

    shared = _time_backends(gqa, (q, k, v), dev, reps)
    wide = _time_backends(expanded, (q, k, v), dev, reps) if rep > 1 else None
    forms = {"enable_gqa": shared, **({"expanded": wide} if wide else {})}
    timed = {(b, f): ms for f, res in forms.items() for b, ms in res.items() if isinstance(ms, float)}
    best = min(timed, key=timed.get) if timed else None
    return {"sdpa_fwd_bwd_ms": shared, "sdpa_expanded_fwd_bwd_ms": wide,
            "sdpa_fastest": _fastest(shared), "sdpa_fastest_expanded": _fastest(wide) if wide else None,
            "sdpa_best": f"{best[0]} ({best[1]})" if best else None,
            "sdpa_shape": f"batch {batch} x heads {cfg.n_heads} (kv {cfg.n_kv_heads}) x seq {seq_len} x {cfg.head_dim}"}


def _fastest(res: dict) -> str | None:
    timed = {k: v for k, v in res.items() if isinstance(v, float)}
    return min(timed, key=timed.get) if timed else None


def _time_backends(call, leaves: tuple, dev, reps: int) -> dict[str, float | str]:
    """{backend: forward + backward ms of `call()` with only that SDPA backend allowed | why it cannot}."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    out: dict[str, float | str] = {}
    for name in SDPA_BACKENDS:
        try:
            with sdpa_kernel(getattr(SDPBackend, name)):
                for i in range(reps + 1):  # the first pass warms up (kernel selection, workspace)
                    if i == 1:
                        sync()
                        t0 = time.perf_counter()
                    call().sum().backward()
                sync()
            out[name.lower()] = round((time.perf_counter() - t0) / reps * 1e3, 3)
        except (RuntimeError, NotImplementedError) as e:  # "No available kernel" and its reasons
            out[name.lower()] = f"unavailable: {str(e).splitlines()[0][:160] if str(e) else type(e).__name__}"
        for t in leaves:
            t.grad = None
    return out


def projection_gemms(preset_name: str, seq_len: int, batch: int, device: str, reps: int = SDPA_REPS) -> dict:
    """One block of the preset, forward + backward under bf16 autocast at the training shape, with its
    projections fused (q/k/v as one GEMM, gate/up as one: training.model.fused_linear) and as separate
    GEMMs: {"proj_fwd_bwd_ms": {"fused": ms, "unfused": ms}, "proj_fused_default": whether this device
    fuses by default (training.model.FUSE_DEVICES)}. The numbers that decide FUSE_DEVICES."""
    import torch

    import training.model as M

    cfg = M.preset(preset_name)
    dev = torch.device(device)
    block = M.Block(cfg).to(dev)
    x = torch.randn(batch, seq_len, cfg.d_model, device=dev, requires_grad=True)
    cos, sin = M.rope_cos_sin(torch.arange(seq_len, device=dev), cfg.head_dim, cfg.rope_theta)
    default, min_rows = M.FUSE_DEVICES, M.FUSE_MIN_ROWS
    out: dict[str, float] = {}
    try:
        for form, devices in (("fused", (dev.type,)), ("unfused", ())):
            M.FUSE_DEVICES, M.FUSE_MIN_ROWS = devices, 0  # fused at any size: the form is what is timed
            for i in range(reps + 1):  # the first pass warms up
                if i == 1:
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                with torch.autocast(dev.type, dtype=torch.bfloat16):
                    y, _ = block(x, cos, sin)
                y.float().sum().backward()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            out[form] = round((time.perf_counter() - t0) / reps * 1e3, 3)
            block.zero_grad(set_to_none=True)
            x.grad = None
    finally:
        M.FUSE_DEVICES, M.FUSE_MIN_ROWS = default, min_rows
    return {"proj_fwd_bwd_ms": out, "proj_fused_default": dev.type in default}


def recipe(preset_name: str) -> TrainConfig:
    """The preset's training recipe as train.py reads it: TrainConfig's defaults under its [train] table."""
    from training.config import TrainConfig, preset_train

    return TrainConfig(preset=preset_name, **preset_train(preset_name))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, with what they leave to the preset's recipe filled in from it: the micro-batch (unless
    --batch-size), grad-accum (unless --grad-accum) and the validation batches."""
    a = build_parser().parse_args(argv)
    r = recipe(a.preset)
    a.batch_size = a.batch_size or r.batch_size
    a.grad_accum_from = "--grad-accum" if a.grad_accum else f"training/presets/{a.preset}.toml [train]"
    a.grad_accum = a.grad_accum or r.grad_accum
    a.eval_batches = r.eval_batches
    return a


def main(argv: list[str] | None = None) -> int:
    try:
        a = parse_args(argv)
    except SystemExit as e:  # the parser printed its one error line (2), or --help (0)
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    try:
        check_out(a.out)
        from training.files import Input, check_apart  # the rule of every command that writes

        check_apart("--out", a.out, [Input("--data", a.data)], ValueError)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device; this script validates the GPU path (--device cpu: a dry run)", file=sys.stderr)
        return 2
    rep = Results(a.out, {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()})
    try:
        return run_phases(a, rep)
    except Exception as e:  # recorded in the results by its phase; one line here
        print(f"error: {rep.data['phases'][-1]['name']} phase failed: {type(e).__name__}: {e}; "
              f"what finished is in {a.out / RESULTS_JSON}", file=sys.stderr)
        return 1


def train_cmd(a: argparse.Namespace, data: Path, run: Path, steps: int, *, compiled: bool, eval_every: int) -> list[str]:
    """train.py on the timed run's shape and recipe: every step logged, no periodic checkpoint."""
    return [sys.executable, str(ROOT / "training/train.py"), "--preset", a.preset, "--data", str(data),
            "--out", str(run), "--max-steps", str(steps), "--batch-size", str(a.batch_size),
            "--grad-accum", str(a.grad_accum), "--seq-len", str(a.seq_len), "--lr", "1e-3", "--warmup-steps", "5",
            "--eval-every", str(eval_every), "--eval-batches", str(a.eval_batches), "--save-every", "0",
            "--log-every", "1", "--device", a.device, "--gpu-hourly-usd", str(a.hourly_usd),
            # explicit both ways: a preset's recipe may set compile (400m does), which --no-compile must override
            "--compile" if compiled else "--no-compile",
            *(["--activation-checkpointing"] if a.activation_checkpointing else [])]


def train_timeout(left_s: float, reserve_s: float, cap_s: int) -> int:
    """The train phase's seconds: what the later phases' reserve leaves, but never less than
    TRAIN_FLOOR_S (or all that is left): the headline figure is not starved to keep time for optional
    phases, which are then skipped if the time is gone (Results.skip_if_late). At most `cap_s`, at least 1."""
    return max(1, min(cap_s, round(max(left_s - reserve_s, min(TRAIN_FLOOR_S, left_s)))))


def run_phases(a: argparse.Namespace, rep: Results) -> int:
    t_start = time.time()
    deadline = t_start + a.budget_s
    with rep.phase("environment") as res:
        res.update(environment(a.device))
    with rep.phase("sdpa") as res:
        res.update(sdpa_kernels(a.preset, a.seq_len, a.device))
        res.update(sdpa_backends(a.preset, a.seq_len, a.batch_size, a.device))
        res.update(projection_gemms(a.preset, a.seq_len, a.batch_size, a.device))
    with rep.phase("data"):
        need = a.steps * a.batch_size * a.grad_accum * (a.seq_len + 1) * PAD_FACTOR
        data = a.data or prepare_data(a.out, need)
    run = a.out / f"run-{time.strftime('%Y%m%d-%H%M%S')}"
    cmd = train_cmd(a, data, run, a.steps, compiled=not a.no_compile, eval_every=a.steps)
    print("$ " + " ".join(cmd), flush=True)
    probes = [] if a.skip_1b or a.device != "cuda" else [(4, False), (16, True)]
    reserve = EAGER_RESERVE_S + PROBE_RESERVE_S * len(probes) + PREEMPT_RESERVE_S
    timeout = train_timeout(deadline - time.time(), reserve, a.train_timeout_s)
    with rep.phase("train") as res:
        t0 = time.time()
        res["train_timeout_s"] = timeout
        rc = run_train(cmd, timeout, stderr_log=a.out / f"{run.name}.stderr.log")
        res.update({"run_dir": str(run), "train_exit_code": rc, "train_wall_s": round(time.time() - t0, 1),
                    **compile_counts(a.out / f"{run.name}.stderr.log")})
    if rc:
        rep.data["phases"][-1]["status"] = "timed out" if rc == 124 else f"exit code {rc}"
        rep.save()
    with rep.phase("measure") as res:
        res.update(measure(a, run))
    if rep.skip_if_late("eager", deadline, EAGER_RESERVE_S / 2):
        with rep.phase("eager") as res:
            res.update(eager_probe(run, a.preset, a.seq_len, a.batch_size, a.device, a.grad_accum))
            if res.get("tokens_per_s") and not a.no_compile:
                res["compile_speedup"] = round(res["tokens_per_s"] / res["eager_tokens_per_s"], 2)
    for batch, ac in probes:
        name = f"memory_1b_b{batch}{'_ac' if ac else ''}"
        if rep.skip_if_late(name, deadline, PROBE_RESERVE_S):
            with rep.phase(name):
                rep.results.setdefault("memory_1b", []).append(memory_probe("1b", a.seq_len, batch, ac))
    preempted_ok = preempt_phase(a, rep, data, run, deadline)
    rep.results["script_wall_s"] = round(time.time() - t_start, 1)
    rep.finish()
    print(rep.markdown())
    print(f"written: {a.out / RESULTS_JSON} and {a.out / RESULTS_MD}")
    return rc or (0 if preempted_ok else 1)


def preempt_phase(a: argparse.Namespace, rep: Results, data: Path, run: Path, deadline: float) -> bool:
    """SIGTERM and resume (scripts/gpu_preempt.py) on the timed run's data and recipe, eager; False when
    it ran and a check failed (skipped: True, nothing to report against)."""
    if not rep.results.get("steps_logged"):  # train.py refused its input or failed a gate: so would this run
        rep.skip("preempt", "the train phase trained no step")
        return True
    if not rep.skip_if_late("preempt", deadline, PREEMPT_RESERVE_S):
        return True
    from gpu_preempt import MAX_STEPS, preempt_and_resume

    def save(figures: dict) -> None:  # the preempted run's figures on disk before the resume starts
        rep.results.update(figures)
        rep.save()

    target = run.with_name(f"{run.name}-preempt")
    with rep.phase("preempt") as res:
        cmd = train_cmd(a, data, target, MAX_STEPS, compiled=False, eval_every=0)
        res.update(preempt_and_resume(cmd, ROOT, target, a.out / f"{target.name}.log", deadline, save=save))
    if not res["preempt_ok"]:
        rep.data["phases"][-1]["status"] = f"failed: {res['preempt_error']}"
        rep.save()
    return res["preempt_ok"]


def environment(device: str) -> dict:
    import torch

    from training.metrics import peak_flops

    peak, gpu = peak_flops(torch.device(device))
    return {"date": time.strftime("%Y-%m-%d"), "gpu": gpu, "peak_flops": peak, "torch": torch.__version__,
            "cuda": torch.version.cuda}


def measure(a: argparse.Namespace, run: Path) -> dict:
    """The figures of the timed run (its log, gates and config) and the projections from them."""
    import numpy as np
    import torch
    from gpu_preempt import read_log

    from training.metrics import mfu_flops, peak_flops
    from training.model import ModelConfig, count_params, preset

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
                       "non-embedding params + the output head once (training.metrics)",
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


if __name__ == "__main__":
    sys.exit(main())
