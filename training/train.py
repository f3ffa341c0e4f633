"""prodip training: `python training/train.py --preset small --data DATA --out RUN` (or under torchrun).

Runs the same command again to resume from the newest complete checkpoint, exactly: the data
position, optimizer moments, schedule and RNG states are restored, and log.jsonl continues as if the
run had never stopped. Pre-flight gates (training.gates) must pass before step 1.
"""

from __future__ import annotations

if __package__ in (None, ""):  # run as `python training/train.py`: make the repo root importable
    import sys
    from pathlib import Path as _P

    sys.path.insert(0, str(_P(__file__).resolve().parents[1]))

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from training import checkpoint as ckpt
from training import distributed as D
from training import gates
from training.cli import guarded
from training.config import ConfigError, TrainConfig, load_toml
from training.data import DataError, TokenStream, WindowLoader, read_meta
from training.metrics import StepLog, Throughput, fmt_duration, peak_flops
from training.model import ModelConfig, Transformer, count_params, flops_per_token
from training.schedule import lr_at
from training.tokenizer import Tokenizer, TokenizerError

RUN_CONFIG = "config.json"
USER_ERRORS = (ConfigError, DataError, TokenizerError, ckpt.CheckpointError, gates.GateError)


class TrainError(ValueError):
    pass


# ---------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python training/train.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="TOML file with [train] and [model] tables; CLI flags override it")
    defaults = TrainConfig()
    for f in fields(TrainConfig):
        if f.name in ("model", "skip_gates"):
            continue
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            p.add_argument(flag, type=type(default), default=None, help=f"(default: {default})")
    p.add_argument("--skip-gate", action="append", default=None, metavar="NAME",
                   help="skip a pre-flight gate by name (emergencies only; recorded loudly in gates.json)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model config field, e.g. --set n_layers=4 (repeatable)")
    p.add_argument("--force", action="store_true", help="start over in an out dir that holds another run")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    merged: dict = load_toml(args.config) if args.config else {}
    for f in fields(TrainConfig):
        v = getattr(args, f.name, None)
        if v is not None and f.name not in ("model", "skip_gates"):
            merged[f.name] = v
    if args.skip_gate:
        merged["skip_gates"] = list(merged.get("skip_gates", [])) + args.skip_gate
    model = dict(merged.get("model", {}))
    for kv in args.set:
        k, _, v = kv.partition("=")
        if not _:
            raise ConfigError(f"--set expects KEY=VALUE, got {kv!r}")
        model[k] = json.loads(v) if v[:1] in "0123456789-[{tf" and v not in ("t", "f") else v
    merged["model"] = model
    cfg = TrainConfig(**merged)
    if not cfg.data:
        raise ConfigError("--data is required (a folder written by `python -m training.prepare`)")
    if not cfg.out:
        raise ConfigError("--out is required (the run folder)")
    return cfg.validate()


# ------------------------------------------------------------------------------------------ helpers
def pick_device(name: str, d: D.Dist) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else ("mps" if torch.backends.mps.is_available() else "cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda but no CUDA device is available")
        return torch.device("cuda", d.local_rank)
    if name == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("--device mps but MPS is not available")
    return torch.device(name)


def autocast_for(cfg: TrainConfig, device: torch.device):
    use_bf16 = cfg.dtype == "bf16" or (cfg.dtype == "auto" and device.type == "cuda")
    if use_bf16:
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms (1-D params). Fused kernel on CUDA."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    extra = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, **extra)


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    out = {"torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["torch_cuda"] = torch.cuda.get_rng_state(device)
    return out


def set_rng_state(rng: dict[str, torch.Tensor], device: torch.device) -> None:
    if "torch_cpu" in rng:
        torch.set_rng_state(rng["torch_cpu"])
    if device.type == "cuda" and "torch_cuda" in rng:
        torch.cuda.set_rng_state(rng["torch_cuda"], device)


@dataclass
class Batches:
    """What the loop draws micro-batches from: pretraining windows or SFT conversations."""

    train: object  # .next_batch(b) -> (x, y) or (x, y, loss_mask); .state_dict(); .load_state_dict()
    val: Callable[[int], list[tuple]] | None  # eval batches (fixed), or None
    bytes_per_token: float | None  # val split: for bits per byte
    tokenizer: Tokenizer
    data_meta: dict
    data_report: dict | None


def pretraining_batches(cfg: TrainConfig, d: D.Dist) -> Batches:
    data = Path(cfg.data)
    meta = read_meta(data)
    tok = Tokenizer.load(data / "tokenizer.model")
    if meta.get("tokenizer_sha256") not in (None, tok.sha256):
        raise DataError(f"{data}/tokenizer.model does not match the tokenizer recorded in meta.json")
    train = WindowLoader(TokenStream(data, "train", vocab_size=tok.vocab_size, tokenizer_sha256=tok.sha256),
                         cfg.seq_len, seed=cfg.seed, rank=d.rank, world_size=d.world_size)
    val_batches = None
    bpt = None
    if (data / "val").is_dir() and any((data / "val").glob("shard_*.bin")):
        vstream = TokenStream(data, "val", vocab_size=tok.vocab_size, tokenizer_sha256=tok.sha256)
        if (vstream.n_tokens - 1) // cfg.seq_len >= d.world_size:  # every rank needs a window
            vloader = WindowLoader(vstream, cfg.seq_len, seed=0, shuffle=False, rank=d.rank, world_size=d.world_size)

            def val_batches(n: int, _v=vloader) -> list[tuple]:
                # n global batches (batch_size x grad_accum x world rows) in micro-batches, each rank
                # its share: the same windows and val_loss however a global batch is split
                _v.consumed = 0
                k = min(n * cfg.grad_accum, max(1, _v.n_windows // (cfg.batch_size * d.world_size)))
                return [_v.next_batch(min(cfg.batch_size, _v.n_windows // d.world_size)) for _ in range(k)]

            vs = meta.get("splits", {}).get("val", {})
            if vs.get("n_bytes") and vs.get("n_tokens"):
                bpt = vs["n_bytes"] / vs["n_tokens"]
    report = None
    if (data / "report.json").is_file():
        report = json.loads((data / "report.json").read_text())
    return Batches(train, val_batches, bpt, tok, meta, report)


def prepare_run_dir(cfg: TrainConfig, model_cfg: ModelConfig, tok: Tokenizer, force: bool, d: D.Dist) -> Path | None:
    """Check RUN_DIR against this run; returns the checkpoint to resume from (or None)."""
    out = Path(cfg.out)
    existing = out / RUN_CONFIG
    if existing.is_file():
        try:
            old = json.loads(existing.read_text())
        except json.JSONDecodeError:
            raise TrainError(f"{existing} is unreadable; use another --out or --force") from None
        if old.get("model") != model_cfg.to_dict():
            if not force:
                diff = {k: (old.get("model", {}).get(k), v) for k, v in model_cfg.to_dict().items()
                        if old.get("model", {}).get(k) != v}
                raise TrainError(f"{out} holds a run with another model config {diff} (old, new); "
                                 "use another --out, or --force to start over there")
            if d.is_main:
                shutil.rmtree(out / "checkpoints", ignore_errors=True)
                (out / "log.jsonl").unlink(missing_ok=True)
            d.barrier()
            return None
    elif out.exists() and any(out.iterdir()) and not force and not (out / "checkpoints").exists():
        raise TrainError(f"{out} exists and is not a prodip run folder; use another --out or --force")
    latest = ckpt.latest(out)
    if latest is None:
        return None
    st = json.loads((latest / ckpt.STATE_FILE).read_text())
    ckpt.check_readable(latest)  # a truncated checkpoint fails here, before config.json is rewritten
    if st.get("tokenizer_sha256") != tok.sha256:
        raise TrainError(f"cannot resume {latest}: it was trained with another tokenizer than {cfg.data}/tokenizer.model "
                         "(data prepared with a different tokenizer); use the original data or another --out")
    return latest


# --------------------------------------------------------------------------------------------- run
def train(cfg: TrainConfig, *, force: bool = False, batches_factory: Callable[[TrainConfig, D.Dist], Batches] | None = None,
          kind: str = "pretrain") -> dict:
    """Run (or resume) training; returns a summary dict. `batches_factory` lets SFT reuse the loop."""
    d = D.setup("cuda" if cfg.device in ("cuda", "auto") and torch.cuda.is_available() else "cpu")
    try:
        return _train(cfg, d, force, batches_factory or pretraining_batches, kind)
    finally:
        D.teardown(d)


def _train(cfg: TrainConfig, d: D.Dist, force: bool, batches_factory, kind: str) -> dict:
    device = pick_device(cfg.device, d)
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    say = print if d.is_main else (lambda *a, **k: None)

    batches = batches_factory(cfg, d)
    tok = batches.tokenizer
    model_cfg = cfg.model_config(tok.vocab_size)
    if cfg.seq_len > model_cfg.max_seq_len:
        raise ConfigError(f"--seq-len {cfg.seq_len} exceeds the model's max_seq_len {model_cfg.max_seq_len}")
    out = Path(cfg.out)
    resume_from = prepare_run_dir(cfg, model_cfg, tok, force, d)
    d.barrier()  # every rank has read the run folder before rank 0 writes into it
    if d.is_main:
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / (RUN_CONFIG + ".tmp")  # atomic: a kill mid-write must not leave an unreadable config.json
        tmp.write_text(json.dumps({"prodip_run": 1, "kind": kind, "model": model_cfg.to_dict(),
                                   "train": cfg.to_dict()}, indent=2, ensure_ascii=False))
        os.replace(tmp, out / RUN_CONFIG)
        tok.save(out / "tokenizer.model")
    d.barrier()

    # the model, the optimizer, and the exact object that trains
    with torch.device("cpu"):
        raw = Transformer(model_cfg)
    if cfg.init and resume_from is None:
        init = ckpt.load(cfg.init)
        if init.config.to_dict() != model_cfg.to_dict():
            raise TrainError(f"--init {cfg.init}: its model config differs from this run's")
        if init.tokenizer.sha256 != tok.sha256:
            raise TrainError(f"--init {cfg.init} was trained with another tokenizer than this data's")
        ckpt.load_weights(raw, init.weights)
        say(f"initialized from {init.path}")
    raw.activation_checkpointing = cfg.activation_checkpointing
    raw.to(device)
    model = D.wrap(raw, d, fsdp=cfg.fsdp, device=device)
    optimizer = make_optimizer(model, cfg, device)
    fwd = torch.compile(model) if cfg.compile else model
    autocast = autocast_for(cfg, device)

    tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len * d.world_size
    total_steps = cfg.max_steps or math.ceil(cfg.max_tokens / tokens_per_step)
    fpt = flops_per_token(model_cfg, cfg.seq_len)
    peak, gpu_name = peak_flops(device)
    say(f"prodip {kind}: {count_params(model_cfg) / 1e6:.1f} M params ({count_params(model_cfg, non_embedding=True) / 1e6:.1f} M "
        f"non-embedding), {d.world_size}x {gpu_name}, {tokens_per_step:,} tokens/step, {total_steps:,} steps, "
        f"{'FSDP2' if cfg.fsdp and d.enabled else 'DDP' if d.enabled else 'single process'}")

    start_step, tokens_seen, elapsed_before = 0, 0, 0.0
    log = StepLog(out / "log.jsonl", enabled=d.is_main)
    if resume_from is not None:
        ck = ckpt.load(resume_from)
        optim_tensors, rng = ck.optimizer_and_rng()
        groups = ck.state["optimizer_param_groups"]
        optim_sd = ckpt.unflatten_optimizer(optim_tensors, groups, None)
        D.load_full_state(model, optimizer, ck.weights, optim_sd)
        batches.train.load_state_dict(ck.state["data"])
        set_rng_state(rng, device)
        start_step, tokens_seen = ck.state["step"], ck.state["tokens"]
        elapsed_before = ck.state.get("elapsed_s", 0.0)
        log.truncate_after(start_step)
        say(f"resumed from {resume_from} (step {start_step}, {tokens_seen:,} tokens)")
    elif d.is_main:
        log.truncate_after(0)

    # pre-flight gates, on the exact object that trains
    report = gates.GateReport(skipped_by_user=list(cfg.skip_gates))
    if resume_from is None:
        ctx = gates.PreflightContext(model=fwd, raw_model=raw, optimizer_factory=lambda m: make_optimizer(m, cfg, device),
                                     batches=batches, cfg=cfg, model_cfg=model_cfg, device=device, autocast=autocast,
                                     dist=d, flops_per_token=fpt, peak_flops=peak)
        report.extend(gates.run_preflight(ctx, skip=cfg.skip_gates))
        failed_ranks = d.ranks_where(not report.passed, device)  # one verdict for all ranks
        if failed_ranks and report.passed:
            report.results.append(gates.GateResult("all_ranks", False, value=float(len(failed_ranks)), threshold="0",
                                                   detail=f"pre-flight gates failed on rank(s) {failed_ranks}; "
                                                          "see their errors"))
        if d.is_main:
            report.save(out / "gates.json")
            say(report.table())
        if not report.passed:
            raise gates.GateError(report)
        say(report.summary())

    # the loop
    if device.type == "cuda":  # peak_mem_gb in log.jsonl: the training steps' peak, not the gates'
        torch.cuda.reset_peak_memory_stats(device)
    thr = Throughput(fpt, peak, d.world_size, cfg.gpu_hourly_usd)
    thr.elapsed_before = elapsed_before
    thr.update(tokens_seen)
    monitor = gates.RuntimeMonitor(cfg)
    params = [(n, p) for n, p in raw.named_parameters() if p.requires_grad]
    last_val, rec = None, None
    step = saved_step = start_step
    skips = 0
    while step < total_steps:
        step += 1
        lr = lr_at(step, max_lr=cfg.lr, total=total_steps, warmup=cfg.warmup_steps, schedule=cfg.schedule,
                   min_ratio=cfg.min_lr_ratio, decay_frac=cfg.decay_frac)
        for g in optimizer.param_groups:
            g["lr"] = lr
        loss_sum = torch.zeros((), device=device)
        position = batches.train.state_dict()
        for micro in range(cfg.grad_accum):
            batch = batches.train.next_batch(cfg.batch_size)
            x, y = batch[0].to(device), batch[1].to(device)
            mask = batch[2].to(device) if len(batch) > 2 else None
            sync = D.grad_sync(model, d, fsdp=cfg.fsdp, last_micro=micro == cfg.grad_accum - 1)
            with sync:  # entered once: DDP's no_sync() cannot be re-entered
                with autocast():
                    _, loss = fwd(x, y, loss_mask=mask)
                (loss / cfg.grad_accum).backward()
            loss_sum += loss.detach()
        loss_val = d.mean(loss_sum / cfg.grad_accum).item()
        grad_norm = gates.clip_grad_norm_finite(model.parameters(), cfg.grad_clip)  # NaN: grads kept for the diagnostic
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)

        # runtime gates: nothing non-finite reaches the weights
        bad = not (math.isfinite(loss_val) and math.isfinite(grad_norm))
        if d.any(bad, device):
            diag = monitor.nonfinite_diagnostic(step, loss_val, grad_norm, params, position)
            if d.is_main:
                (out / "nonfinite.json").write_text(json.dumps(diag, indent=2))
                log.write({"event": "nonfinite", **diag})
            optimizer.zero_grad(set_to_none=True)
            skips += 1
            if cfg.on_nonfinite == "skip" and skips <= cfg.max_nonfinite_skips:
                say(f"warning: step {step}: non-finite loss/grad ({diag['detail']}); batch skipped ({skips}/{cfg.max_nonfinite_skips})")
                tokens_seen += tokens_per_step
                continue
            raise gates.GateError(f"step {step}: non-finite loss or gradient ({diag['detail']}); stopped before the "
                                  f"optimizer step, weights untouched; diagnostic in {out / 'nonfinite.json'}")
        if cfg.grad_flow_every and step % cfg.grad_flow_every == 0:
            gf = gates.gradient_flow_from_grads(params)
            if not gf.passed:
                raise gates.GateError(f"step {step}: runtime gradient-flow check failed: {gf.detail}")
        spike = monitor.observe(step, loss_val)
        if spike and cfg.on_spike == "skip":  # runtime gate: a spiking batch's update is dropped
            optimizer.zero_grad(set_to_none=True)
            log.write({"event": "loss_spike_skipped", "step": step, "loss": loss_val, "loss_spike_z": spike})
            say(f"warning: step {step}: loss spike (z={spike:.1f}); batch skipped (--on-spike skip)")
            tokens_seen += tokens_per_step
            continue
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens_seen += tokens_per_step
        thr.update(tokens_seen)

        rec = {"step": step, "loss": loss_val, "lr": lr, "grad_norm": grad_norm, "tokens": tokens_seen,
               "tokens_per_s": _num(thr.tokens_per_s), "mfu": thr.mfu, "elapsed_s": round(thr.elapsed, 3)}
        if device.type == "cuda":
            rec["peak_mem_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        if spike:
            rec["loss_spike_z"] = spike
            say(f"warning: step {step}: loss spike (z={spike:.1f})")
        if batches.val and cfg.eval_every and (step % cfg.eval_every == 0 or step == total_steps):
            last_val = evaluate(fwd, batches, cfg, device, autocast, d)
            rec.update(last_val)
        log.write(rec)
        if d.is_main and (step % cfg.log_every == 0 or step == total_steps or step == start_step + 1):
            say(progress_line(rec, step, total_steps, thr, last_val))
        stopping = cfg.stop_at and step >= cfg.stop_at
        if (cfg.save_every and step % cfg.save_every == 0) or step == total_steps or stopping:
            save(out, step, raw, model, optimizer, batches, cfg, tokens_seen, thr, device, d, kind)
            saved_step = step
        if stopping:
            say(f"stopping at step {step} (--stop-at); run the same command without it to continue")
            break
    if step > saved_step:  # the last step's batch was skipped (non-finite/spike): still end on a checkpoint
        save(out, step, raw, model, optimizer, batches, cfg, tokens_seen, thr, device, d, kind)
    log.close()
    summary = {"step": step, "tokens": tokens_seen, "elapsed_s": thr.elapsed, "run_dir": str(out),
               "final_loss": rec["loss"] if rec else None, **(last_val or {})}
    say(f"done: {step} steps, {tokens_seen:,} tokens in {fmt_duration(thr.elapsed)}; run folder {out}")
    return summary


def _num(x: float) -> float | None:
    return round(x, 2) if math.isfinite(x) else None


@torch.no_grad()
def evaluate(fwd, batches: Batches, cfg: TrainConfig, device, autocast, d: D.Dist) -> dict:
    was = fwd.training
    fwd.eval()
    losses = []
    for batch in batches.val(cfg.eval_batches):
        x, y = batch[0].to(device), batch[1].to(device)
        mask = batch[2].to(device) if len(batch) > 2 else None
        with autocast():
            _, loss = fwd(x, y, loss_mask=mask)
        losses.append(loss.float())
    fwd.train(was)
    val = d.mean(torch.stack(losses).mean()).item()
    out = {"val_loss": val}
    if batches.bytes_per_token:
        out["val_bpb"] = val / math.log(2) / batches.bytes_per_token
    return out


def progress_line(rec: dict, step: int, total: int, thr: Throughput, val: dict | None) -> str:
    tps = rec["tokens_per_s"] or float("nan")
    remaining = (total - step) * (thr.elapsed / max(step, 1)) if step else float("nan")
    parts = [f"step {step}/{total}", f"loss {rec['loss']:.4f}", f"lr {rec['lr']:.2e}", f"gnorm {rec['grad_norm']:.2f}",
             f"{tps:,.0f} tok/s"]
    if rec["mfu"] is not None:
        parts.append(f"MFU {rec['mfu'] * 100:.1f}%")
    if val:
        parts.append(f"val {val['val_loss']:.4f}" + (f" ({val['val_bpb']:.3f} bpb)" if "val_bpb" in val else ""))
    parts.append(f"ETA {fmt_duration(remaining)}")
    if thr.hourly:
        parts.append(f"${thr.cost(thr.elapsed):.2f} so far, ${thr.cost(thr.elapsed + remaining):.2f} projected")
    return " | ".join(parts)


def save(out: Path, step: int, raw, model, optimizer, batches: Batches, cfg: TrainConfig, tokens: int, thr: Throughput,
         device, d: D.Dist, kind: str) -> None:
    weights = D.full_model_state(model, rank0_only=True)  # collective under FSDP: every rank calls it
    optim_sd = D.full_optimizer_state(model, optimizer)
    if d.is_main:
        tensors, groups = ckpt.flatten_optimizer(optim_sd, [])
        state = {"kind": kind, "tokens": tokens, "elapsed_s": thr.elapsed, "data": batches.train.state_dict(),
                 "optimizer_param_groups": groups, "world_size": d.world_size, "train": cfg.to_dict()}
        ckpt.save(out, step, weights=ckpt.weights_for_save(weights, raw.cfg), cfg=raw.cfg, tokenizer=batches.tokenizer,
                  optim_tensors=tensors, rng=rng_state(device), state=state, keep_last=cfg.keep_last)
    d.barrier()


RESUME_HINT = "interrupted; resume by running the same command again"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def go() -> None:
        train(config_from_args(args), force=args.force)

    # OSError: e.g. a full disk or a missing path
    return guarded(go, debug=args.debug, errors=(*USER_ERRORS, TrainError, OSError), interrupted_hint=RESUME_HINT)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
