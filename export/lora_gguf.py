"""GGUF export of an adapter run (training/sft.py --lora-rank): `python -m export gguf ADAPTER_RUN [--q4 ...]`.

Without --merge: the base's GGUF files (from the base checkpoint the adapter names, its sha256 checked)
and the adapter as a llama.cpp LoRA GGUF, which llama.cpp applies to the base at run time
(`llama-cli -m BASE.gguf --lora ADAPTER.gguf`, llama-cpp-python's `lora_path`, `python -m serving BASE.gguf
--lora ADAPTER.gguf`). With --merge: one GGUF per type of the base with every adapter folded into its weight.

The adapter file is what llama.cpp's convert_lora_to_gguf.py writes: general.type = "adapter",
general.architecture = the base's ("llama"), adapter.type = "lora", adapter.lora.alpha, and for each adapted
weight two tensors named after the base tensor, `<gguf name>.lora_a` (torch shape (r, in)) and `.lora_b`
((out, r)); llama.cpp computes W x + (alpha / r) * scale * B (A x) (src/llama-adapter.cpp). The rows of
lora_b of Q and K are permuted as the base's Q and K rows are (export.names.permute_rope). Tensors are F32:
an adapter is small, and F16 would add its rounding to the parity.

Parity (always, unless --no-parity): the PyTorch fp32 base + adapter against llama.cpp's base F16 + the
adapter applied at run time (and against each merged file): greedy continuations equal on the parity
prompts, mean KL reported and bounded (export.lora_parity.LORA_THRESHOLDS); written to lora_parity.json; exit 1 on a breach.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch

from export import ExportError
from export.gguf import ARCH, canonical_type, export_gguf, gguf_path, write_tensors
from export.lora_parity import judge, measure, reference
from export.manifest import Manifest, Source, human_size, load_source, made_folder
from export.names import lookup, permute_heads, permute_rope, to_gguf
from serving.backend import CHAT_TUNED_KEY
from serving.chat_session import run_chat_tuned
from training import checkpoint as ckpt
from training import layout
from training.files import Input, check_apart
from training.lora import adapted_modules, merge

LORA_FILE_TYPE = "F32"
PARITY_FILE = "lora_parity.json"



@dataclass
class AdapterSource(Source):
    """An adapter checkpoint: its own files (state, tokenizer, run folder) and the base it names."""

    base: Source | None = None
    model_: torch.nn.Module | None = field(default=None, repr=False)

    def model(self) -> torch.nn.Module:
        return self.model_


@dataclass
class MergedSource(Source):
    """The adapter folded into the base: written like any checkpoint (export.gguf.write_gguf)."""

    weights: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def tensors(self):
        for name in self.tensor_names():
            yield name, self.weights[name].to(torch.float32)


def is_adapter(path: Path, step: int | None = None) -> bool:
    from training.lora_run import is_adapter_run

    try:
        return is_adapter_run(ckpt.resolve(path, step))
    except (ckpt.CheckpointError, OSError, ValueError):
        return False


def load_adapter_source(path: Path, step: int | None) -> AdapterSource:
    from training.lora_run import load_adapted

    c = ckpt.resolve(path, step)
    try:
        model, state = load_adapted(c)
    except ckpt.CheckpointError as e:
        raise ExportError(str(e)) from None
    base = load_source(state["lora"]["base"]["path"])
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
    return MergedSource(src.path, src.config, src.tokenizer, src.state, src.run_dir, dict(src.shapes), weights=weights)


def planned(src: AdapterSource, out: Path, types: list[str], merge_: bool) -> list[Path]:
    if merge_:
        return [gguf_path(out, src, canonical_type(t)) for t in types]
    return [gguf_path(out, src.base, canonical_type(t)) for t in types] + [lora_path(out, src)]


def export_adapter(path: Path, *, types: list[str], out: Path | None, merge_: bool, force: bool,
                   parity: bool = True, nthread: int | None = None) -> int:
    """`python -m export gguf ADAPTER_RUN`: files written, parity run; 0, or 1 on a parity breach."""
    src = load_adapter_source(path, None)
    out = out or (src.run_dir or src.path) / layout.EXPORT
    run = src.run_dir  # the rule every export keeps: never write where it reads (RUN/export is its own)
    check_apart("--out", out, [Input("CHECKPOINT_DIR", src.path), Input("RUN_DIR", run, out_inside_ok=True),
                               Input("RUN_DIR", run and run / layout.CHECKPOINTS),
                               Input("the base checkpoint", src.base.path)], ExportError)
    manifest = Manifest.open(out, src, force=force)
    existing = [p for p in planned(src, out, types, merge_) if p.exists()]
    if existing and not force:
        raise ExportError(f"{existing[0]} exists; use --force to overwrite (nothing was written)")
    with made_folder(out):
        manifest.save()
        if merge_:
            files = export_gguf(merged_source(src), out, types, manifest, force=force, nthread=nthread)
            pairs = [(p, None) for p in files]
        else:
            bases = export_gguf(src.base, out, [*types, "F16"], manifest, force=force, nthread=nthread)
            adapter = write_lora_gguf(src, lora_path(out, src))
            manifest.add(adapter, "gguf-lora", LORA_FILE_TYPE, rank=src.model_.lora_spec.rank,
                         alpha=src.model_.lora_spec.alpha, base=str(src.base.path))
            files = [*bases, adapter]
            pairs = [(p, adapter) for p in bases]
        manifest.save()
    for p in files:
        print(f"wrote {p} ({human_size(p.stat().st_size)})")
    if not parity:
        return 0
    ref = reference(src)
    results = [measure(ref, base, adapter) for base, adapter in pairs]
    report = judge(results)
    (out / PARITY_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    for r in report["results"]:
        print(f"{r['kind']:<28} greedy {r['greedy_equal']}/{r['greedy_prompts']} equal, "
              f"KL {r['kl']:.2e}, top-1 {r['top1']:.4f}: {'ok' if not r['failures'] else '; '.join(r['failures'])}")
    print(f"wrote {out / PARITY_FILE}")
    if not report["passed"]:
        print(f"error: LoRA parity thresholds breached (see {out / PARITY_FILE})", file=sys.stderr)
        return 1
    return 0


def export_adapter_run(args, types: list[str]) -> int | None:
    """`python -m export` on an adapter run: its exit code; None for any other run (export.__main__ goes on)."""
    if not is_adapter(args.path, args.step):
        if args.merge:
            raise ExportError(f"--merge: {args.path} is not an adapter run (training/sft.py --lora-rank)")
        return None
    if args.command != "gguf" or args.imatrix is not None or args.threshold or args.step is not None:
        raise ExportError(f"{args.path} is an adapter run: export it with `python -m export gguf RUN` (the base's "
                          "GGUF and the adapter as a LoRA GGUF) or `gguf RUN --merge`; no --imatrix, --threshold, --step")
    return export_adapter(args.path, types=types, out=args.out, merge_=args.merge, force=args.force,
                          parity=not args.no_parity, nthread=args.threads)
