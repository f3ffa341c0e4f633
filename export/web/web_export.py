"""`python -m export web RUN`: the run's chat as a static site that runs in the visitor's browser.

    RUN/export/web/
      index.html  wllama-page.js       the chat through wllama (llama.cpp in WebAssembly) on a GGUF
      onnx.html   onnx-page.js         the chat through onnxruntime-web on the ONNX export (when there is one)
      common.js  prodip.css            the UI, the window.prodip hook, sampling, UTF-8 stream decoding
      prodip-web.json                  what the pages read: model files, chat template parts, sampling defaults,
                                       the byte string of every token, thread rule (export.web.web_config)
      card.md                          the export's model card (RUN/export/README.md)
      tokenizer.json                   the run's tokenizer for tokenizers.js (export.hf.hf_tokenizer)
      models/                          the GGUF (split in shards under wllama's 2 GB limit) and ONNX files
      vendor/                          the runtimes' JS and .wasm, copied from export/site/node_modules

Nothing is fetched from outside the page's own origin. Every file is recorded in manifest.json
(format "web"), so `python -m export verify` covers them. The GGUF is a hard link to the export's own file
where the file system allows (a copy otherwise); ONNX files are copied (onnx.checker refuses external data
with several hard links). The export writes new files, never in place.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from export import ExportError
from export.manifest import Manifest, human_size
from training.runfiles import layout
from training.runfiles.file_ops import Input, check_apart, link_or_copy

WEB_DIR = layout.WEB_DIR
SITE = Path(__file__).resolve().parents[1] / "site"
NODE_MODULES = SITE / "node_modules"
SETUP_HINT = "run `bash scripts/setup.sh` (it installs them with `npm ci --ignore-scripts` in export/site)"
# site path -> node_modules path: what the pages import (pinned by export/site/package-lock.json)
WLLAMA_FILES = {"vendor/wllama/index.js": "@wllama/wllama/esm/index.js",
                "vendor/wllama/wllama.wasm": "@wllama/wllama/esm/wasm/wllama.wasm"}
ORT_FILES = {"vendor/ort/ort.wasm.min.mjs": "onnxruntime-web/dist/ort.wasm.min.mjs",
             "vendor/ort/ort-wasm-simd-threaded.mjs": "onnxruntime-web/dist/ort-wasm-simd-threaded.mjs",
             "vendor/ort/ort-wasm-simd-threaded.wasm": "onnxruntime-web/dist/ort-wasm-simd-threaded.wasm"}
TOKENIZER_FILES = {"vendor/tokenizers/tokenizers.mjs": "@huggingface/tokenizers/dist/tokenizers.mjs"}
COMMON_PAGES = ("common.js", "prodip.css")
WLLAMA_PAGES = ("index.html", "wllama-page.js")
ONNX_PAGES = ("onnx.html", "onnx-page.js")
DEFAULT_QUANT = "Q4_K_M"
MAX_FILE_BYTES = 2**31 - 1  # wllama reads each file into one ArrayBuffer: at most 2 GB
SPLIT_BYTES = 512 * 2**20  # wllama's advice for a file over the limit: 512 MB shards (downloaded in parallel)
ONNX_VARIANTS = ("fp32", "int8", "int4")


@dataclass
class WebPlan:
    """What `export web` reads and writes, every input checked."""

    export_dir: Path
    web_dir: Path
    gguf: Path | None
    onnx: dict[str, Path] = field(default_factory=dict)  # variant -> .onnx file (fp32 first)
    force: bool = False

    @property
    def manifest_path(self) -> Path:
        return self.export_dir / layout.MANIFEST


def export_dir_of(path: Path, out: Path | None) -> Path:
    """--out, else RUN/export (RUN given), else the export folder itself (a folder holding manifest.json)."""
    if out is not None:
        return out
    if (path / layout.MANIFEST).is_file():
        return path
    run = layout.run_dir_of(path) if layout.is_checkpoint_dir(path) else path
    return Path(run) / layout.EXPORT


def missing_runtime() -> list[str]:
    """The runtime files `npm ci` would have put in export/site/node_modules and did not."""
    wanted = {**WLLAMA_FILES, **ORT_FILES, **TOKENIZER_FILES}
    return [rel for rel in wanted.values() if not (NODE_MODULES / rel).is_file()]


def check_runtime() -> None:
    missing = missing_runtime()
    if missing:
        raise ExportError(f"the browser runtimes are not installed ({NODE_MODULES / missing[0]} is missing): "
                          f"{SETUP_HINT}; nothing was written")


def is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def pick_gguf(export_dir: Path, manifest: Manifest | None, model: Path | None) -> Path | None:
    """--model (a .gguf path, or a file name in export/gguf/), else the export's Q4_K_M GGUF, else None."""
    if model is not None:
        p = model if model.exists() or model.is_absolute() else export_dir / layout.GGUF_DIR / model
        if not p.is_file():
            raise ExportError(f"--model {model}: not found (give a .gguf file, or the name of one in "
                              f"{export_dir / layout.GGUF_DIR}); nothing was written")
        if not is_gguf(p):
            raise ExportError(f"--model {model}: not a GGUF file (it does not start with the GGUF magic); "
                              "nothing was written")
        return p
    if manifest is None:
        return None
    for rel, e in manifest.files("gguf").items():
        if e.get("type") == DEFAULT_QUANT and rel.endswith(".gguf") and (export_dir / rel).is_file():
            return export_dir / rel
    return None


def pick_onnx(export_dir: Path) -> dict[str, Path]:
    """The ONNX variants the export holds ({variant: file}), fp32 first; {} when there is none."""
    from serving.backends.onnxrt_backend import CONFIG_FILE, VARIANT_FILES

    onnx_dir = export_dir / layout.ONNX_DIR
    if not (onnx_dir / CONFIG_FILE).is_file():
        return {}
    return {v: onnx_dir / VARIANT_FILES[v] for v in ONNX_VARIANTS if (onnx_dir / VARIANT_FILES[v]).is_file()}


def plan(args: argparse.Namespace) -> WebPlan:
    """Every check `export web` makes before its first byte: runtimes installed, a model to run, no web/
    in the way (without --force), the output apart from every input."""
    path = Path(args.path)
    if not path.is_dir():
        raise ExportError(f"{path}: {'not found' if not path.exists() else 'not a folder'} (give a run folder)")
    export_dir = export_dir_of(path, args.out)
    manifest = Manifest.read(export_dir) if (export_dir / layout.MANIFEST).is_file() else None
    model = getattr(args, "model", None)
    gguf = pick_gguf(export_dir, manifest, model)
    onnx = pick_onnx(export_dir)
    if gguf is None and not onnx:
        raise ExportError(f"{export_dir} holds no {DEFAULT_QUANT} GGUF and no ONNX export: run "
                          f"`python -m export gguf {path} --q4` (or `python -m export onnx {path}`) first")
    if gguf is None:
        raise ExportError(f"{export_dir} holds no {DEFAULT_QUANT} GGUF for index.html: run "
                          f"`python -m export gguf {path} --q4` first, or give --model FILE.gguf")
    if manifest is None:
        raise ExportError(f"{export_dir} holds no {layout.MANIFEST}: export the run first "
                          f"(`python -m export gguf {path} --q4`)")
    check_runtime()
    web_dir = export_dir / WEB_DIR
    if web_dir.exists() and not args.force:
        raise ExportError(f"{web_dir} exists; use --force to overwrite (nothing was written)")
    inputs = [Input("--model", gguf), *(Input("RUN_DIR", p) for p in onnx.values()), Input("RUN_DIR", SITE)]
    check_apart("export web's output", web_dir, inputs, ExportError)
    return WebPlan(export_dir, web_dir, gguf, onnx, args.force)


def split_gguf(src: Path, dst_dir: Path, max_bytes: int | None = None) -> list[Path]:
    """`src` as llama.cpp's split GGUF shards (NAME-00001-of-0000N.gguf, gguf-py's writer: the same format
    llama-gguf-split writes and llama.cpp / wllama load from the first shard's name)."""
    import gguf
    from gguf.scripts.gguf_new_metadata import copy_with_new_metadata

    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    dst_dir.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(dst_dir / src.name, arch, split_max_size=max_bytes or SPLIT_BYTES)
    copy_with_new_metadata(reader, writer, {}, [])
    n = len(writer.tensors)
    if n == 1:  # one shard: the writer keeps the plain name
        return [dst_dir / src.name]
    return [dst_dir / f"{src.stem}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]


def model_files(p: WebPlan) -> tuple[list[Path], dict[str, list[Path]]]:
    """Write the model files under web/models/: (GGUF shards in load order, {variant: [.onnx, its data]})."""
    models = p.web_dir / "models"
    shards = (split_gguf(p.gguf, models) if p.gguf.stat().st_size > MAX_FILE_BYTES
              else [link_or_copy(p.gguf, models / p.gguf.name)])
    onnx: dict[str, list[Path]] = {}
    for variant, f in p.onnx.items():
        # copies, never links: onnx.checker refuses external data with several hard links ("a potential
        # hardlink attack"), so a linked copy here would break the export's own ONNX files for it
        onnx[variant] = [link_or_copy(src, models / "onnx" / src.name, link=False) for src in onnx_with_data(f)]
    return shards, onnx


def onnx_with_data(model: Path) -> list[Path]:
    """The .onnx file and the external-data files its initializers name (export.onnx.onnx_weights reads them)."""
    from export.onnx.onnx_weights import external_data_files

    data = external_data_files(model)
    missing = [p.name for p in data if not p.is_file()]
    if missing:
        raise ExportError(f"{model}: its external data {missing[0]} is missing; re-export the ONNX")
    return [model, *data]


def copy_site(p: WebPlan) -> list[Path]:
    """The pages and the runtimes' files (ONNX ones only when there is an ONNX export)."""
    pages = [*COMMON_PAGES, *WLLAMA_PAGES, *(ONNX_PAGES if p.onnx else ())]
    runtime = {**WLLAMA_FILES, **TOKENIZER_FILES, **(ORT_FILES if p.onnx else {})}
    out = []
    for name in pages:
        (p.web_dir / name).parent.mkdir(parents=True, exist_ok=True)
        out.append(Path(shutil.copyfile(SITE / name, p.web_dir / name)))
    for dst, src in runtime.items():
        (p.web_dir / dst).parent.mkdir(parents=True, exist_ok=True)
        out.append(Path(shutil.copyfile(NODE_MODULES / src, p.web_dir / dst)))
    return out


def record(manifest: Manifest, web_dir: Path, paths: list[Path]) -> None:
    """Every web file in the manifest (format "web"; type: model, runtime, page or config)."""
    for rel in [r for r in manifest.data["files"] if r.startswith(f"{WEB_DIR}/")]:
        del manifest.data["files"][rel]  # --force: the old site's entries go with its files
    for f in sorted(paths):
        rel = f.relative_to(web_dir).as_posix()
        kind = ("model" if rel.startswith("models/") else "runtime" if rel.startswith("vendor/")
                else "page" if f.suffix in (".html", ".js", ".css") else "config")
        manifest.add(f, "web", kind)


def write_site(p: WebPlan) -> list[Path]:
    """The whole site into a fresh web/ (an old one is replaced only after the new one is complete)."""
    from export.web.web_config import write_config

    final = p.web_dir
    p.web_dir = final.with_name(f".{WEB_DIR}.tmp")
    shutil.rmtree(p.web_dir, ignore_errors=True)
    try:
        shards, onnx = model_files(p)
        paths = [*shards, *(f for fs in onnx.values() for f in fs), *copy_site(p)]
        paths += write_config(p, shards, onnx)
        if final.exists():
            shutil.rmtree(final)
        p.web_dir.rename(final)
    except BaseException:
        shutil.rmtree(p.web_dir, ignore_errors=True)
        raise
    finally:
        tmp, p.web_dir = p.web_dir, final
    return [final / f.relative_to(tmp) for f in paths]


def export_web(p: WebPlan) -> list[Path]:
    manifest = Manifest.read(p.export_dir)
    paths = write_site(p)
    record(manifest, p.web_dir, paths)
    manifest.save()
    return paths


def report(p: WebPlan, paths: list[Path]) -> None:
    size = sum(f.stat().st_size for f in paths)
    print(f"wrote {p.web_dir} ({len(paths)} files, {human_size(size)}): index.html runs {p.gguf.name} "
          "through wllama" + (f"; onnx.html runs ONNX {', '.join(p.onnx)} through onnxruntime-web" if p.onnx else
                              "; no ONNX export, so no onnx.html (`python -m export onnx RUN` adds it)"))
    if not p.onnx:
        print(f"note: {p.export_dir} has no ONNX export: onnx.html was not written", file=sys.stderr)
    run = p.export_dir.parent
    print(f"open it: python -m serving {run} --web   (any static host works: docs/web.md)")


def run_web(args: argparse.Namespace) -> int:
    """The `web` command (and `all --web` after the other exports)."""
    p = plan(args)
    report(p, export_web(p))
    return 0


def add_web_flags(p: argparse.ArgumentParser) -> None:
    from training.store.urls import local_path

    w = p.add_argument_group("web (export.web.web_export)")
    w.add_argument("--web", action="store_true", help="`all`: also write export/web/ (the chat in the browser)")
    w.add_argument("--model", type=local_path, help="`web`: the GGUF index.html runs (default: the export's Q4_K_M)")


WEB_FLAGS = ("command", "path", "out", "force", "model", "debug")


def web_command(args: argparse.Namespace, defaults: dict) -> int | None:
    """`web`: run it (other export flags refused by name); `all --web`: its web checks, before anything is
    written (the runtimes installed, no web/ in the way); None: not a web command, go on."""
    if args.command != "web":
        if args.model is not None:
            raise ExportError("--model applies to `python -m export web` only")
        if args.web and args.command != "all":
            raise ExportError(f"--web applies to `python -m export all` only (use `python -m export web RUN` "
                              f"after `{args.command}`)")
        if args.web:
            check_runtime()
            if isinstance(args.path, Path):
                web = export_dir_of(args.path, args.out) / WEB_DIR
                if web.exists() and not args.force:
                    raise ExportError(f"{web} exists; use --force to overwrite (nothing was written)")
        return None
    unused = [k for k, v in vars(args).items() if k not in WEB_FLAGS and v != defaults.get(k)]
    if unused:
        raise ExportError(f"--{unused[0].replace('_', '-')} does not apply to `web` (it takes RUN_DIR, --out, "
                          "--model and --force)")
    if isinstance(args.path, str):
        raise ExportError(f"web {args.path}: takes a local run or export folder, not a store URL")
    return run_web(args)


def web_after_all(args: argparse.Namespace, out: Path) -> None:
    """`all --web`: the site of what `all` just wrote (its existing web/ was refused or --force given)."""
    if args.web:
        run_web(argparse.Namespace(path=out, out=out, model=None, force=True))
