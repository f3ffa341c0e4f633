"""What each parity threshold and the fp32 compiled-vs-eager tolerance catch (#46 item 2): for each, a planted
defect it must fail, and the next smaller defect on the same ladder that it lets pass, so a threshold's
meaning is measured, not asserted. The table with the measured numbers is docs/export.md, "What each
threshold catches".

The plant is made in the cheapest place that is still real: the suite's trained tiny model (conftest's
tiny_run) is the reference, and one of its weights is changed in memory, while the candidate is the
unchanged exported file (GGUF F16/Q8_0/Q4_K_M, ONNX fp32/int8/int4) opened by serving.load, compared by
export.parity.native_parity's own logit_metrics and judged by its own failures_of against DEFAULT_THRESHOLDS. A reference
whose layer is scaled by 1+e against a faithful export is the same comparison as a faithful reference
against an export whose layer is scaled by 1/(1+e): what the threshold sees is the defect plus the
format's own rounding, as it would on a user's export.

The ladder: the down-projection of block 0's feed-forward (`PLANTED`) scaled by 1+e, e in 1-2-5 steps.
Other defects of the table (a rotary base off by 1%, another RMSNorm epsilon, one 32-weight quantization
block's scale wrong) are measured in docs/export.md, not asserted here.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import export.parity.native_parity as P
import serving
from serving.backends.onnxrt_backend import VARIANT_FILES
from serving.backends.torch_backend import TorchBackend
from training.checkpoint import checkpoint_io as checkpoint
from training.model.decoder import Transformer

PLANTED = "layers.0.feed_forward.w2.weight"
BLOCK = 32  # weights per quantization block (Q8_0, Q4_K sub-blocks)
# every check that is not a logit metric, met: the plant changes the weights only
REST = {"tokenizer_equal": 1, "tokenizer_total": 1, "greedy_equal": 0, "greedy_prompts": 0,
        "incremental": {"max_abs": 0.0, "kl": 0.0}}

# (kind, metric, e it must catch, the next smaller e on the ladder, which it lets pass), measured on the suite's
# tiny model, 2026-12-06 (docs/export.md, "What each threshold catches", has every value). Where the ladder
# step just past the crossing sits within 20% (or two positions of top-1) of the limit, the pair spans it and
# the comment gives that step's value: a test on the margin of one position would be a coin toss.
LADDER: list[tuple[str, str, float, float]] = [
    ("onnx-fp32", "max_abs", 5e-5, 1e-5),  # 2.71e-4 caught, 5.25e-5 passes (2e-5: 1.05e-4, at the limit)
    ("llama.cpp-F16", "kl", 0.05, 0.02),  # 3.81e-4 caught, 6.32e-5 passes
    ("llama.cpp-F16", "top1", 0.05, 0.01),  # 0.970 caught, 0.9965 passes (0.02: 0.9894, one position short)
    ("llama.cpp-Q8_0", "kl", 0.5, 0.1),  # 0.0227 caught, 1.51e-3 passes (0.2: 5.17e-3, 3% over)
    ("llama.cpp-Q8_0", "top1", 0.05, 0.01),  # 0.959 caught, 0.979 passes (0.02: 0.975, 1.5 positions over)
    ("llama.cpp-Q4_K_M", "kl", 1.0, 0.5),  # 0.0595 caught, 0.0231 passes
    ("llama.cpp-Q4_K_M", "top1", 0.5, 0.1),  # 0.765 caught, 0.933 passes (0.2: 0.8956, one position short)
    ("onnx-int8", "kl", 0.5, 0.2),  # 0.0227 caught, 5.19e-3 passes
    ("onnx-int4", "kl", 1.0, 0.5),  # 0.0646 caught, 0.0276 passes
    ("onnx-int4", "top1", 0.2, 0.1),  # 0.880 caught, 0.913 passes
]


def planted(model: Transformer, plant: str, size: float) -> Transformer:
    """A copy of `model` with one defect: `scale` (PLANTED times 1+size), `rope` (rotary base times 1+size),
    `eps` (RMSNorm epsilon = size) or `block` (PLANTED's first 32-weight block times size: one block whose
    scale is wrong)."""
    cfg = model.cfg
    if plant == "rope":
        cfg = dataclasses.replace(cfg, rope_theta=cfg.rope_theta * (1 + size))
    elif plant == "eps":
        cfg = dataclasses.replace(cfg, norm_eps=size)
    out = Transformer(cfg)
    out.load_state_dict(model.state_dict())
    with torch.no_grad():
        if plant == "scale":
            out.get_parameter(PLANTED).mul_(1 + size)
        elif plant == "block":
            out.get_parameter(PLANTED).view(-1)[:BLOCK].mul_(size)
    return out.eval()


def reference(model: Transformer, tok) -> P.Reference:
    """export.parity.native_parity's Reference on the prompt set, without the greedy continuations (not judged here)."""
    backend = TorchBackend.from_model(model, tok, name=P.REFERENCE_NAME)
    prompts = P.prompt_set(tok, backend.n_ctx)
    ids = [tok.encode(p, bos=True) for p in prompts]
    return P.Reference(tok, prompts, ids, [backend.logits(i) for i in ids], [], 0, [])


class Cached:
    """A candidate backend's logits, asked once per prompt: every planted reference meets the same file."""

    def __init__(self, backend) -> None:
        self.backend, self.name, self._seen = backend, backend.name, {}

    def logits(self, ids) -> np.ndarray:
        key = tuple(ids)
        if key not in self._seen:
            self._seen[key] = self.backend.logits(ids)
        return self._seen[key]


def judged(ref: P.Reference, cand: Cached, kind: str, metric: str) -> tuple[float, list[str]]:
    """(the metric's value, failures_of's verdict on that one threshold)."""
    m = P.logit_metrics(ref, cand)
    return m[metric], P.failures_of({**m, **REST}, kind, {metric: P.DEFAULT_THRESHOLDS[kind][metric]})


def candidate_files(gguf_dir: Path, onnx_dir: Path) -> dict[str, Path]:
    files = {f"llama.cpp-{t}": next(gguf_dir.glob(f"*-{t}.gguf")) for t in ("F16", "Q8_0", "Q4_K_M")}
    return {**files, **{f"onnx-{v}": onnx_dir / VARIANT_FILES[v] for v in ("fp32", "int8", "int4")}}


@contextlib.contextmanager
def opened(path: Path) -> Iterator[Cached]:
    b = serving.load(path, threads=1)  # one thread: the suite's other worker holds the other core
    try:
        yield Cached(b)
    finally:
        b.close()


@pytest.fixture(scope="module")
def trained(tiny_run):
    model, ck = checkpoint.load_model(tiny_run)
    return model, ck.tokenizer


@pytest.fixture(scope="module")
def candidates(exported, onnx_export) -> Iterator[dict[str, Cached]]:
    with contextlib.ExitStack() as stack:
        yield {k: stack.enter_context(opened(p)) for k, p in candidate_files(exported / "gguf", onnx_export[0]).items()}


@pytest.fixture(scope="module")
def references(trained) -> dict[float, P.Reference]:
    model, tok = trained
    return {e: reference(planted(model, "scale", e), tok) for e in sorted({e for *_, c, m in LADDER for e in (c, m)})}


@pytest.mark.parametrize(("kind", "metric", "caught", "missed"), LADDER, ids=[f"{k}.{m}" for k, m, *_ in LADDER])
def test_a_threshold_catches_its_planted_defect_and_lets_the_next_smaller_pass(kind, metric, caught, missed,
                                                                               candidates, references) -> None:
    cand = candidates[kind]
    assert cand.name == kind and metric in P.DEFAULT_THRESHOLDS[kind]
    value, failures = judged(references[caught], cand, kind, metric)
    assert [f.split()[0] for f in failures] == [metric], (caught, value, failures)
    value, failures = judged(references[missed], cand, kind, metric)
    assert failures == [], (missed, value, failures)


# ------------------------------------------------------------------------- compiled vs eager, fp32
def gate_ctx(model: torch.nn.Module, raw: Transformer, batch: tuple[torch.Tensor, torch.Tensor]):
    """A pre-flight context over `model` (the object under test) and `raw` (its weights), one batch."""
    from training.gates.context import PreflightContext

    class Loader:
        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state: dict) -> None:
            pass

        def next_batch(self, n: int):
            return batch

    return PreflightContext(model=model, raw_model=raw, optimizer_factory=lambda m: torch.optim.AdamW(m.parameters()),
                            batches=SimpleNamespace(train=Loader()),
                            cfg=SimpleNamespace(batch_size=batch[0].shape[0], compile=False, fsdp=False, grad_clip=0.0),
                            model_cfg=raw.cfg, device=torch.device("cpu"), autocast=contextlib.nullcontext,
                            dist=SimpleNamespace(enabled=False), flops_per_token=1.0, peak_flops=None)




class Scaled(torch.nn.Module):
    """The trained object with a planted defect in its own path: PLANTED times 1+e (a fused or compiled
    kernel that scales one matrix wrongly), the raw model's parameters still the ones that get gradients."""

    def __init__(self, raw: Transformer, e: float) -> None:
        super().__init__()
        self.raw, self.e = raw, e

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, loss_mask: torch.Tensor | None = None):
        w = self.raw.get_parameter(PLANTED)
        return torch.func.functional_call(self.raw, {PLANTED: w * (1 + self.e)}, (x, y), {"loss_mask": loss_mask})


def test_the_fp32_compiled_vs_eager_tolerance_catches_one_matrix_scaled_by_1_002() -> None:
    """The gate runs before training, so on a freshly initialized model: the tiny preset at init, one 2x64
    batch. Measured (2026-12-06, CPU): e = 2e-3 gives a worst relative error of 1.76e-3 (> 1e-3: fails, 16
    tensors named), e = 1e-3 gives 8.8e-4 (passes); an unplanted eager path measures 0, inductor on CPU <= 5e-7."""
    from training.gates.model_gates import TOLERANCE, compiled_vs_eager
    from training.model.decoder import preset

    assert TOLERANCE["fp32"] == (1e-3, 1e-3)
    torch.manual_seed(0)
    raw = Transformer(preset("tiny", vocab_size=2048))
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 2048, (2, 64), generator=g), torch.randint(0, 2048, (2, 64), generator=g))
    caught = compiled_vs_eager(gate_ctx(Scaled(raw, 2e-3), raw, batch))
    missed = compiled_vs_eager(gate_ctx(Scaled(raw, 1e-3), raw, batch))
    assert not caught.passed and 1e-3 < caught.value < 2e-3, caught.detail
    assert missed.passed and 5e-4 < missed.value <= 1e-3, missed.detail
