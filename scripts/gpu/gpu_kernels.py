"""The attention and projection kernels gpu_validate.py's sdpa phase times on the GPU: which SDPA kernel
dispatch picks for a training step, every backend forced in turn, and the block's projections fused
against unfused (the numbers behind training.model.decoder.FUSE_DEVICES)."""

from __future__ import annotations

import time

SDPA_REPS = 3  # timed forward+backward passes per forced SDPA backend
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

    from training.model.decoder import Transformer, preset

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

    from training.model.decoder import preset

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
    projections fused (q/k/v as one GEMM, gate/up as one: training.model.decoder.fused_linear) and as separate
    GEMMs: {"proj_fwd_bwd_ms": {"fused": ms, "unfused": ms}, "proj_fused_default": whether this device
    fuses by default (training.model.decoder.FUSE_DEVICES)}. The numbers that decide FUSE_DEVICES."""
    import torch

    import training.model.decoder as M

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
