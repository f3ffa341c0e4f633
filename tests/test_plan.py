"""`train.py --plan`: the 400m recipe's numbers by hand, a configuration too big for its GPU refused in
one line (exit 2), nothing written, and the memory estimate checked against a real training step's
peak resident memory on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from training import run_plan as P
from training.model.decoder import count_params, preset
from training.train import main

# 400m with its recipe (training/presets/400m.toml): micro-batch 8 x 2048 = 16,384 tokens, vocab 32768.
#   N = 32 blocks x 11,274,240 + final norm 1,024 + embedding (tied to the head) 32768 x 1024 = 394,331,136
M400_N = 394_331_136
M400_BYTES = {
    "weights": 1_577_324_544,  # 4 N
    "gradients": 1_577_324_544,  # 4 N
    "optimizer": 3_154_649_088,  # 8 N
    "bf16_weights": 788_662_272,  # 2 N
    "activations": 28_454_158_336,  # 16,384 tokens x 32 layers x 53 x 1024
    # the chunked loss: 3.5 live chunks of 2^28 B + fp32 gradients of h (16,384 x 1024 x 4) and of the
    # head (32,768 x 1024 x 4) + the head's bf16 copy (32,768 x 1024 x 2)
    "logits": 1_207_959_552,
    "distributed": 0,
    "total": 36_760_078_336,  # 34.2 GiB
    "activations_other": 3_036_676_096,  # checkpointed: 16,384 x (32 x 4 + 53) x 1024
}
# The preset's micro-batch (#48): 16 x 2048 = 32,768 tokens, twice the activations (and the checkpointed
# ones) above; the loss adds the h gradient of the other 16,384 tokens (16,384 x 1024 x 4 = 67,108,864).
M400_BYTES_RECIPE = {**M400_BYTES, "activations": 56_908_316_672, "logits": 1_275_068_416,
                     "total": 65_281_345_536,  # 60.8 GiB
                     "activations_other": 6_073_352_192}
# tokens/step (the preset's 16 x 16 x 2048) = 524,288; 2 B tokens: ceil(2e9 / 524,288) = 3,815 steps = 2,000,158,720 tokens.
# Speed at the assumed 40% MFU on an H100 (989.4 TFLOP/s, 3,171,293,184 FLOPs/token): 124,794.5 tokens/s,
# so 2,000,158,720 / 124,794.5 / 3600 = 4.452 h; at $3 per GPU-hour $13.36.


def plan_argv(tmp_path: Path, *extra: str, data: Path | None = None) -> list[str]:
    return ["--preset", "400m", "--data", str(data or tmp_path / "no-data"), "--out", str(tmp_path / "run"),
            "--max-tokens", "2_000_000_000", "--gpu-hourly-usd", "3", "--plan", "--gpu", "H100", *extra]


def test_400m_plan_matches_the_hand_computation(tmp_path: Path, capsys) -> None:
    assert count_params(preset("400m")) == M400_N
    assert P.estimate_memory(preset("400m"), 2048, 8) == M400_BYTES
    assert main(plan_argv(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "16 x 16 x 2048 x 1 GPU(s) = 524,288" in out and "3,815 x 524,288 = 2.000 B tokens" in out
    assert P.estimate_memory(preset("400m"), 2048, 16) == M400_BYTES_RECIPE  # the preset's micro-batch (#48)
    assert "60.8 GiB of 78.6 usable (77%): fits" in out  # H100: 79.6 GiB, 1 GiB kept for CUDA itself
    assert "124,795 tokens/s (assumed 40% MFU of 1 x 989.4 TFLOP/s)" in out
    assert "(4.45 h), $13.36 at $3/GPU-hour" in out
    assert "with activation checkpointing: 5.7 GiB" in out  # 2 x 3,036,676,096 B


def test_the_figures_returned(tmp_path: Path) -> None:
    from training.train import build_parser, resolve

    r = P.plan(resolve(build_parser().parse_args(plan_argv(tmp_path)), 1), gpu="H100", print_=lambda *a: None)
    assert (r["params"], r["tokens_per_step"], r["steps"], r["tokens"]) == (M400_N, 524_288, 3815, 2_000_158_720)
    assert r["memory_bytes"] == M400_BYTES_RECIPE and r["dtype"] == "bf16"
    assert r["hours"] == pytest.approx(2_000_158_720 / (0.4 * 989.4e12 / 3_171_293_184) / 3600)
    assert r["usd"] == pytest.approx(r["hours"] * 3)


def test_too_big_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    assert main(plan_argv(tmp_path, "--batch-size", "64")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --plan: 400m at micro-batch 64 x 2048 needs ~")
    assert "over the H100's 78.6 usable GiB" in err and "--activation-checkpointing" in err
    # the same micro-batch fits with activation checkpointing, or on an H200
    assert main(plan_argv(tmp_path, "--batch-size", "64", "--activation-checkpointing")) == 0
    assert main(plan_argv(tmp_path, "--batch-size", "16", "--gpu", "H200")) == 0
    assert main(plan_argv(tmp_path, "--batch-size", "16", "--gpu-mem-gb", "40")) == 2
    assert not (tmp_path / "run").exists()


def test_torchrun_spreads_the_presets_accumulation(tmp_path: Path, capsys) -> None:
    """The recipe's 0.5 M tokens/step hold on 8 GPUs (16 / 8 = 2 per GPU); a given --grad-accum is per GPU."""
    assert main(plan_argv(tmp_path, "--gpus", "8")) == 0
    out = capsys.readouterr().out
    assert "16 x 2 x 2048 x 8 GPU(s) = 524,288 (DDP)" in out and "DDP buckets" in out
    assert main(plan_argv(tmp_path, "--gpus", "8", "--grad-accum", "1")) == 0
    assert "16 x 1 x 2048 x 8 GPU(s) = 262,144" in capsys.readouterr().out
    assert main(plan_argv(tmp_path, "--gpus", "8", "--fsdp")) == 0
    assert "(FSDP2)" in capsys.readouterr().out


def test_plan_flags_need_plan(tmp_path: Path, capsys) -> None:
    argv = [a for a in plan_argv(tmp_path) if a != "--plan"]
    assert main(argv) == 2
    assert capsys.readouterr().err == "error: --gpu only applies with --plan\n"
    assert main(plan_argv(tmp_path, "--gpu", "Z80")) == 2
    assert "--gpu 'Z80': not a GPU this plan knows" in capsys.readouterr().err


def tree(path: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*"))}


def test_plan_writes_nothing_and_reads_the_data_and_a_measured_speed(bn_data: Path, tmp_path: Path, capsys) -> None:
    before = tree(bn_data)
    assert main(plan_argv(tmp_path, "--preset", "tiny", "--seq-len", "128", data=bn_data)) == 0
    out = capsys.readouterr().out
    assert f"vocab 2,048 from {bn_data / 'meta.json'}" in out and "epochs of the data" in out
    assert not (tmp_path / "run").exists() and tree(bn_data) == before
    # a run folder with a log: its measured speed (median of the second half) replaces the MFU guess
    run = tmp_path / "run"
    run.mkdir()
    log = "".join(json.dumps({"step": i, "tokens_per_s": s}) + "\n" for i, s in enumerate([10.0, 20.0, 1000.0, 1000.0]))
    (run / "log.jsonl").write_text(log)
    snapshot = tree(run)
    assert main(plan_argv(tmp_path)) == 0
    assert f"1,000 tokens/s (measured: median of {run / 'log.jsonl'})" in capsys.readouterr().out
    assert tree(run) == snapshot


def test_gpu_memory_table() -> None:
    assert P.gpu_memory_for_name("NVIDIA H100 80GB HBM3") == 79.6
    assert P.gpu_memory_for_name("NVIDIA A100-SXM4-40GB") == 39.8
    assert P.gpu_memory_for_name("NVIDIA H200") == 140.4
    assert P.gpu_memory_for_name("NVIDIA H100 NVL") == 93.6
    assert P.gpu_memory_for_name("Tesla T4") is None
    assert P.per_gpu_grad_accum(32, 8) == 4 and P.per_gpu_grad_accum(32, 3) == 11 and P.per_gpu_grad_accum(4, 8) == 1


# One real training step (forward, backward, AdamW) of the `small` preset in a fresh process, bf16
# autocast as on the GPU, measured as the peak of live tensor bytes: what the estimate models and what
# torch.cuda.max_memory_allocated counts on the GPU. The profiler's memory events give every allocation
# and free in order; their running sum over the tensors alive before the step is the peak. (The resident
# set, used before, also counts allocator caches and oneDNN scratch space: for the same step it read
# 519 to 1002 MiB across machines and load, and failed CI; the live bytes are the same on every run.)
MEASURE = r"""
import json, sys
import torch
from torch.profiler import ProfilerActivity, profile
from training.model.decoder import Transformer, preset
torch.manual_seed(0)
torch.set_num_threads(2)
cfg = preset("small")
batch, seq, ac = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
x = torch.randint(0, cfg.vocab_size, (batch, seq + 1))
model = Transformer(cfg)
model.activation_checkpointing = ac
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for p in model.parameters():  # the moments exist before the step, as in every step after the first
    p.grad = torch.zeros_like(p)
opt.step()
opt.zero_grad(set_to_none=True)
nbytes = lambda t: t.numel() * t.element_size()
base = nbytes(x) + sum(nbytes(p) for p in model.parameters())
base += sum(nbytes(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    opt.step()
events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                key=lambda e: e.start_ns())
live = peak = 0
for e in events:  # nbytes is negative for a free
    live += e.nbytes()
    peak = max(peak, live)
print(json.dumps({"base": base, "peak": base + peak, "events": len(events)}))
"""
MEASURE_FACTOR = 1.5  # the estimate and the measured peak agree within this factor, either way


@pytest.mark.parametrize("ac", [False, True], ids=["plain", "activation-checkpointing"])
def test_estimate_matches_measured_peak_memory_on_cpu(ac: bool) -> None:
    batch, seq = 8, 256
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-c", MEASURE, str(batch), str(seq), "1" if ac else "0"],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    m = json.loads(p.stdout.strip().splitlines()[-1])
    assert m["events"] > 100, m  # the profiler saw the step's allocations: a peak of nothing is no check
    measured = m["peak"]
    est = P.estimate_memory(preset("small"), seq, batch, dtype="bf16", activation_checkpointing=ac)["total"]
    ratio = measured / est
    print(f"small, {batch} x {seq}, activation checkpointing {ac}: measured {measured / 2**20:.0f} MiB "
          f"(live tensors), estimate {est / 2**20:.0f} MiB, ratio {ratio:.2f}")
    assert 1 / MEASURE_FACTOR <= ratio <= MEASURE_FACTOR, (measured, est)


@pytest.mark.parametrize("name", ["400m", "1b"])
def test_gpu_presets_are_one_h100_recipes(name: str) -> None:
    """~0.5 M tokens per step on one GPU, a micro-batch that fits an H100 by the estimate, and the
    cadence the preset's comments state: evaluation every ~10-20 min, a checkpoint every ~20-40 min
    at 45% MFU (the issue's target) on an H100 SXM."""
    from training.telemetry.step_metrics import PEAK_BF16_FLOPS, flops_per_token
    from training.train_config import preset_train

    r, mc = preset_train(name), preset(name)
    tokens = r["batch_size"] * r["grad_accum"] * r["seq_len"]
    assert tokens == 524_288 and r["compile"] and r["dtype"] == "bf16" and r["schedule"] == "wsd"
    need = P.estimate_memory(mc, r["seq_len"], r["batch_size"])["total"] / P.GIB
    assert need < P.TIGHT_FRACTION * (P.GPU_MEMORY_GIB["H100"] - P.CUDA_RESERVED_GIB)
    step_s = tokens / (0.45 * PEAK_BF16_FLOPS["H100"] / flops_per_token(mc, r["seq_len"]))
    assert 10 <= r["eval_every"] * step_s / 60 <= 20 and 20 <= r["save_every"] * step_s / 60 <= 40
    assert r["warmup_steps"] * tokens <= 300e6  # warmup well inside a 2 B-token run


def test_a_data_url_is_named_as_given_and_not_read(tmp_path: Path, capsys) -> None:
    """--plan runs before credentials matter: a --data URL is named whole (not folded into a local path
    `s3:/…`) and the vocabulary comes from the preset."""
    argv = plan_argv(tmp_path)
    argv[argv.index("--data") + 1] = "s3://my-bucket/data/bn32k"
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "from preset 400m (s3://my-bucket/data/bn32k/meta.json not read)" in out
