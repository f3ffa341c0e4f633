"""GGUF export of an adapter run (training/sft.py --lora-rank): `python -m export gguf ADAPTER_RUN [--q4 ...]`.

Without --merge: the base's GGUF files (from the base checkpoint the adapter names, its sha256 checked)
and the adapter as a llama.cpp LoRA GGUF, which llama.cpp applies to the base at run time
(`llama-cli -m BASE.gguf --lora ADAPTER.gguf`, llama-cpp-python's `lora_path`, `python -m serving BASE.gguf
--lora ADAPTER.gguf`). With --merge: one `NAME-merged-TYPE.gguf` per type, every adapter folded into its weight.

The adapter file is what llama.cpp's convert_lora_to_gguf.py writes: general.type = "adapter",
general.architecture = the base's ("llama"), adapter.type = "lora", adapter.lora.alpha, and for each adapted
weight two tensors named after the base tensor, `<gguf name>.lora_a` (torch shape (r, in)) and `.lora_b`
((out, r)); llama.cpp computes W x + (alpha / r) * scale * B (A x) (src/llama-adapter.cpp). The rows of
lora_b of Q and K are permuted as the base's Q and K rows are (training.model.gguf_names.permute_rope). Tensors are F32:
an adapter is small, and F16 would add its rounding to the parity.

The command itself (which files, reuse of the base run's export, parity, the card): export.lora_export.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch

from export import ExportError
from export.gguf.gguf_export import ARCH, write_tensors
from export.manifest import Source, load_source
from serving.backend import CHAT_TUNED_KEY
from serving.chat_session import run_chat_tuned
from training.checkpoint import checkpoint_io as ckpt
from training.model.decoder import Transformer
from training.model.gguf_names import lookup, permute_heads, permute_rope, to_gguf
from training.model.lora import adapted_modules, merge
from training.runfiles import layout

LORA_FILE_TYPE = "F32"
MERGED_SUFFIX = "-merged"  # merged files are named apart from the base's: a base run may share the adapter run's name


@dataclass
class AdapterSource(Source):
    """An adapter checkpoint: its own files (state, tokenizer, run folder) and the base it names."""

    base: Source | None = None
    model_: torch.nn.Module | None = field(default=None, repr=False)

    def model(self) -> torch.nn.Module:
        return self.model_


@dataclass
class MergedSource(Source):
    """The adapter folded into the base: written like any checkpoint (export.gguf.gguf_export.write_gguf)."""

    weights: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    adapter_name: str = ""

    @property
    def name(self) -> str:
        return f"{self.adapter_name}{MERGED_SUFFIX}"

    def tensors(self):
        for name in self.tensor_names():
            yield name, self.weights[name].to(torch.float32)

    def model(self) -> torch.nn.Module:
        model = Transformer(self.config)
        ckpt.load_weights(model, self.weights)
        return model.eval()


def is_adapter(path: Path, step: int | None = None) -> bool:
    from training.checkpoint.adapter_io import is_adapter_run

    try:
        return is_adapter_run(ckpt.resolve(path, step))
    except (ckpt.CheckpointError, OSError, ValueError):
        return False


def load_adapter_source(path: Path, step: int | None) -> AdapterSource:
    """The adapter checkpoint, its base (unchanged since, by sha256; the same model shape and tokenizer) and
    base + adapter as one fp32 model."""
    from training.checkpoint.adapter_io import STATE_KEY, load_adapted

    c = ckpt.resolve(path, step)
    try:
        model, state = load_adapted(c)  # refuses a changed base, or one of another shape or tokenizer
        base = load_source(state[STATE_KEY]["base"]["path"])
    except ckpt.CheckpointError as e:
        raise ExportError(str(e)) from None
    return AdapterSource(c, base.config, base.tokenizer, state, layout.run_dir_of(c), dict(base.shapes),
                         base=base, model_=model)


def write_lora_gguf(src: AdapterSource, path: Path) -> Path:
    """The adapter as a llama.cpp LoRA GGUF (see the module doc), written atomically."""
    spec = src.model_.lora_spec
    w = gguf.GGUFWriter(None, ARCH)
    w.add_name(f"{src.name} (LoRA r{spec.rank} on {src.base.name})")
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(spec.alpha))
    if (tuned := run_chat_tuned(src.run_dir or src.path)) is not None:  # an SFT adapter makes its base a chat model
        w.add_bool(CHAT_TUNED_KEY, tuned)
    tensors = []
    for name, m in adapted_modules(src.model_).items():
        base_name = f"{name}.weight"
        row, _ = lookup(base_name)
        a = m.lora_A.detach().float().numpy()
        b = m.lora_B.detach().float().numpy()
        if row.permute:  # B's rows are the output rows of W: permuted as the base's Q/K rows are
            b = permute_rope(b, permute_heads(src.config, row.permute))
        tensors += [(f"{to_gguf(base_name)}.lora_a", a), (f"{to_gguf(base_name)}.lora_b", b)]
    for n, t in tensors:
        w.add_tensor_info(n, t.shape, np.dtype(np.float32), t.nbytes)
    return write_tensors(w, path, (np.ascontiguousarray(t, dtype=np.float32) for _, t in tensors))


def lora_path(out: Path, src: AdapterSource) -> Path:
    return out / layout.GGUF_DIR / f"{src.name}-lora-{LORA_FILE_TYPE}.gguf"


def merged_source(src: AdapterSource) -> MergedSource:
    import copy

    model = copy.deepcopy(src.model_)
    merge(model)
    weights = ckpt.drop_tied({k: v.detach() for k, v in model.state_dict().items()}, src.config)
    return MergedSource(src.path, src.config, src.tokenizer, src.state, src.run_dir, dict(src.shapes), weights=weights,
                        adapter_name=src.name)
