"""One-command GPU validation (about 5 minutes, at most 8 with compiles, on one H100/H200):

    python scripts/gpu_validate.py [--preset 400m] [--seq-len 2048] [--batch-size N] [--grad-accum N]
                                   [--steps 12] [--hourly-usd 3.0] [--data DATA_DIR] [--skip-1b] [--out DIR]

Phases, each written to DIR/gpu_validate.json and DIR/gpu_validate.md as it starts and ends (a run
stopped by a time limit keeps every finished phase and names the one it was in). --budget-s (450 s)
bounds the whole script: train.py gets what the later phases do not need (but at least
TRAIN_FLOOR_S, 150 s, or all that is left), and a later phase that no longer fits is recorded as skipped.

1. environment: GPU name, its dense bf16 peak (training.telemetry.step_metrics.PEAK_BF16_FLOPS), torch, CUDA.
2. sdpa: which scaled-dot-product-attention kernel (cuDNN / flash / memory-efficient / math) one
   training step of the preset's block runs, read from the profiler's op names; then each backend
   forced in turn (torch.nn.attention.sdpa_kernel) and timed, forward + backward, at the training shape,
   with K/V shared by enable_gqa (cuDNN in torch 2.11, flash, math) and pre-expanded (every backend eligible).
   Also one block forward + backward with its projections fused (q/k/v and gate/up as one GEMM each)
   and unfused: the numbers behind training.model.decoder.FUSE_DEVICES.
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
5. measure: tokens/s, MFU both ways, peak memory (measured, and training.run_plan's estimate, the one
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

MFU = tokens/s x FLOPs/token / peak dense bf16 FLOP/s of the GPU, in two conventions (training.telemetry.step_metrics):
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
    from training.train_config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from training.runfiles import layout  # noqa: E402  (a leaf: the standard library only, so importing it is cheap)

sys.path.insert(1, str(ROOT / "scripts"))  # gpu_preempt beside this file, also when loaded by path (the tests)
sys.path.insert(2, str(ROOT / "scripts" / "gpu"))  # its own modules (libraries, not commands)

from gpu_figures import environment, measure  # noqa: E402
from gpu_kernels import projection_gemms, sdpa_backends, sdpa_kernels  # noqa: E402
from gpu_probes import eager_probe, memory_probe  # noqa: E402
from gpu_results import RESULTS_JSON, RESULTS_MD, Results  # noqa: E402

HOURLY_USD = 3.0  # the reference run's price: $164 / 54.6 h
TRAIN_TIMEOUT_S = 420  # the train.py phase; with data prep and the 1b probe the script stays < 8 min
# The least the train phase gets when the budget is short: on an H200 the 400m phase (start, 11 gates,
# compile, 12 steps, validation, a 4.7 GB checkpoint) took 90 s, and a --budget-s 170 run that reserved
# 135 s for the later phases left it 24 s: no step, no figure (2026-12-04, docs/scale.md#results)
TRAIN_FLOOR_S = 150
# Optimizer steps of the timed run: 400m's recipe has 0.5 M tokens per step, so 12 steps are ~42 s at the
# 150 k tokens/s target (45% MFU "by step 8"); every step is logged, and the second half is the steady state.
DEFAULT_STEPS = 12
PAD_FACTOR = 2  # tile the train split to this many times the tokens the timed run reads
BOS_ID = 1

BUDGET_S = 450  # the whole script, compiles included: 7.5 min, under the 8 min a validation slot allows
EAGER_RESERVE_S = 45  # what the budget keeps for the phases after train.py: the eager probe ...
PROBE_RESERVE_S = 30  # ... and each 1b memory probe (a 1b model built on the GPU, 3 steps) ...
# ... and the preempt phase: two train.py starts (400m built, 4.4 GB checkpoint written and read back) and
# about four eager recipe steps of ~6 s
PREEMPT_RESERVE_S = 90


def prepare_data(out: Path, need_tokens: int) -> Path:
    """Tokenizer + shards from the shipped corpus, the train split tiled to `need_tokens`."""
    import numpy as np

    from training.data.loaders import ShardWriter, TokenStream
    from training.text.tokenizer import Tokenizer

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


def build_parser() -> argparse.ArgumentParser:
    from training.model.decoder import PRESETS
    from training.runfiles.cli_harness import (
        ArgumentParser,  # one `error:` line for a bad flag, no usage block
    )
    from training.runfiles.schema import NonNegFloat, PositiveInt, flag

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


def check_out(out: Path) -> None:
    """--out must be a folder we may write: fail before any phase (and any GPU minute) if not."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a folder")
    if not out.exists() and out.parent.exists() and not os.access(out.parent, os.W_OK):
        raise ValueError(f"--out {out}: cannot create it (no write permission in {out.parent})")


def recipe(preset_name: str) -> TrainConfig:
    """The preset's training recipe as train.py reads it: TrainConfig's defaults under its [train] table."""
    from training.train_config import TrainConfig, preset_train

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
        from training.runfiles.file_ops import Input, check_apart  # the rule of every command that writes

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


if __name__ == "__main__":
    sys.exit(main())
