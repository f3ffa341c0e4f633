"""#48's before/after figures on this machine's CPU (docs/scale.md, "The GPU path past one H200 check").

    python tests/benchmarks/bench_gpu_path.py loss [--rows 512] [--d-model 1024] [--vocab 32768]
    python tests/benchmarks/bench_gpu_path.py cast [--preset small] [--batch 4] [--seq 128] [--grad-accum 8] [--steps 3]

`loss`: the chunked loss of one chunk (forward, which computes the gradients, and backward) under bf16
autocast, eager against compiled (Inductor: the first call compiles, about a minute on 2 cores): the
peak of live tensor bytes while it runs (the profiler's allocation events), how many allocations are
a whole chunk of fp32 logits (rows x vocab x 4 B), the median seconds, and the relative differences.
`cast`: the Trainer's own step (training.loop.step.TrainStep, bf16 autocast) with the block matrices
cast once per optimizer step (CastOnce, what train.py runs) and cast at every use (autocast alone): the
median step seconds and whether the updated fp32 weights are identical.
The first save's stall is in every run's log.jsonl (`stall_ms` of its first checkpoint event).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from training import distributed as D
from training.config_sections import StepSection
from training.loop.step import RepeatBatch, TrainStep, build_views
from training.model.decoder import Transformer, chunked_cross_entropy, preset
from training.train_config import TrainConfig


def _memory(fn) -> tuple[int, list[int]]:
    """Peak live bytes while fn() runs, and every allocation's size."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak, [e.nbytes() for e in events if e.nbytes() > 0]


def loss(a: argparse.Namespace) -> dict:
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(1, a.rows, a.d_model, generator=g) * 0.5).requires_grad_()
    w = (torch.randn(a.vocab, a.d_model, generator=g) * 0.02).requires_grad_()
    y = torch.randint(0, a.vocab, (1, a.rows), generator=g)

    def run(compiled: bool):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = chunked_cross_entropy(h, w, y, chunk_rows=a.rows, compiled=compiled)
        return (out, *torch.autograd.grad(out, (h, w)))

    res: dict = {"rows": a.rows, "d_model": a.d_model, "vocab": a.vocab, "fp32_logits_MiB": a.rows * a.vocab * 4 / 2**20}
    outs = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        run(compiled)  # the compile, and the allocator's first touch
        secs = []
        for _ in range(3):
            t0 = time.perf_counter()
            outs[name] = run(compiled)
            secs.append(time.perf_counter() - t0)
        peak, sizes = _memory(lambda c=compiled: run(c))
        res[name] = {"peak_MiB": round(peak / 2**20, 1), "fp32_logit_buffers": sizes.count(a.rows * a.vocab * 4),
                     "s": round(statistics.median(secs), 3)}
    rel = lambda p, q: ((p.float() - q.float()).norm() / q.float().norm()).item()  # noqa: E731
    res["rel_loss"], res["rel_grad_h"], res["rel_grad_w"] = (rel(p, q) for p, q in zip(outs["compiled"], outs["eager"]))
    return res


def cast(a: argparse.Namespace) -> dict:
    cfg = StepSection.of(TrainConfig(preset=a.preset, batch_size=a.batch, seq_len=a.seq, device="cpu", max_steps=10**6,
                                     warmup_steps=0, dtype="bf16", grad_accum=a.grad_accum))
    res: dict = {"preset": a.preset, "micro_batch": a.batch, "seq": a.seq, "grad_accum": a.grad_accum}
    weights = {}
    for name in ("cast_every_use", "cast_once"):
        torch.manual_seed(0)
        model = Transformer(preset(a.preset))
        views = build_views(model, cfg, D.Dist(), torch.device("cpu"))
        if name == "cast_every_use":
            views.forward_model = views.wrapped
        step = TrainStep(views, cfg, D.Dist())
        x = torch.randint(0, model.cfg.vocab_size, (a.batch, a.seq + 1), generator=torch.Generator().manual_seed(1))
        batches = RepeatBatch(x[:, :-1], x[:, 1:])
        secs = []
        for i in range(a.steps):
            t0 = time.perf_counter()
            step.timed(i + 1, batches)
            secs.append(time.perf_counter() - t0)
        res[name] = {"step_s": round(statistics.median(secs), 3)}
        weights[name] = [p.detach().clone() for p in model.parameters()]
    res["weights_identical"] = all(torch.equal(p, q) for p, q in zip(*weights.values(), strict=True))
    return res


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python tests/benchmarks/bench_gpu_path.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    lp = sub.add_parser("loss", help="the chunked loss, eager vs compiled")
    lp.add_argument("--rows", type=int, default=512)
    lp.add_argument("--d-model", type=int, default=1024)
    lp.add_argument("--vocab", type=int, default=32768)
    cp = sub.add_parser("cast", help="the step, bf16 weights cast once per step vs at every use")
    cp.add_argument("--preset", default="small")
    cp.add_argument("--batch", type=int, default=4)
    cp.add_argument("--seq", type=int, default=128)
    cp.add_argument("--grad-accum", type=int, default=8)
    cp.add_argument("--steps", type=int, default=3)
    return ap


def main() -> None:
    a = build_parser().parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(json.dumps({"torch": torch.__version__, **(loss(a) if a.what == "loss" else cast(a))}))


if __name__ == "__main__":
    main()
