"""The one table of names on disk: a run folder, a checkpoint, a prepared data folder, an export.

    RUN_DIR/run.json  log.jsonl  gates.json  tokenizer.model  curves.png  nonfinite.json  (.prodip_lock while training)
    RUN_DIR/checkpoints/step_0001000/{model.safetensors, optim.safetensors, state.json, config.json, tokenizer.model}
    RUN_DIR/export/{hf/, onnx/, gguf/, parity.json, parity.md, manifest.json, README.md}
    DATA_DIR/{meta.json, report.json, report.md, tokenizer.model, train/, val/}

`run.json` is the run's configuration (model + training recipe); a checkpoint's `config.json` is the
model config alone. Every stage names these files through this module and nothing else.
A leaf: imports only the standard library, so every package may use it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

# a run folder
RUN_CONFIG = "run.json"
LEGACY_RUN_CONFIG = "config.json"  # runs written before run.json existed (read, never written)
LOG = "log.jsonl"
GATES = "gates.json"
TOKENIZER = "tokenizer.model"
CURVES = "curves.png"
NONFINITE = "nonfinite.json"
EARLY_STOP = "early_stop.json"  # written when validation stopped the run early (training.trainer)
RUN_MARKER = ".prodip_run"  # written first into a run folder: "ours" is decided from it, never from file names
# held (flock) by the process training into the folder, removed when it ends; one killed may leave it
# behind, harmlessly (training.loop.run_lock). Not a run's content: never uploaded or exported, and never
# taken for a user's file by RunFolder's "is this folder ours" check
RUN_LOCK = ".prodip_lock"
CHECKPOINTS = "checkpoints"
EXPORT = "export"
EVAL_DIR = "eval"  # RUN/eval: training.evaluate's EVAL_FILES for a run's checkpoint
EVAL_FILES = ("eval.json", "eval.md", "eval.png")  # the evaluation report: every number, the table, the chart
SFT_KIND = "sft"  # run.json's "kind" of a conversation run (training/sft.py), and its loader's position

# a checkpoint folder (RUN_DIR/checkpoints/step_NNNNNNN)
MODEL_WEIGHTS = "model.safetensors"
OPTIMIZER = "optim.safetensors"
STATE = "state.json"
MODEL_CONFIG = "config.json"
STEP_PREFIX = "step_"

# a prepared data folder (training.prepare)
DATA_META = "meta.json"
DATA_REPORT = "report.json"
DATA_REPORT_MD = "report.md"
SPLITS = ("train", "val")

# an export folder (RUN_DIR/export)
MANIFEST = "manifest.json"
PARITY_JSON = "parity.json"
PARITY_MD = "parity.md"
CARD = "README.md"
HF_DIR, ONNX_DIR, GGUF_DIR = "hf", "onnx", "gguf"
WEB_DIR = "web"  # `python -m export web`: the static site (export.web.web_export), served by `python -m serving RUN --web`


class LayoutError(ValueError):
    """A folder that is not what its name promises, or one of its JSON files is unreadable."""


def is_checkpoint_dir(path: Path) -> bool:
    return path.parent.name == CHECKPOINTS and path.name.startswith(STEP_PREFIX)


def run_dir_of(path: str | Path) -> Path | None:
    """The run folder that holds `path`: a run folder itself, a checkpoint, or a file under RUN/export."""
    p = Path(path)
    for q in [p, *list(p.parents)[:4]]:
        if (q / CHECKPOINTS).is_dir() or (q / RUN_CONFIG).is_file():
            return q
        if is_checkpoint_dir(q):
            return q.parent.parent
    return None


def run_config_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / RUN_CONFIG


# the format version each JSON file of ours carries, and the version this code reads
RUN_FORMAT = ("prodip_run", 1)
DATA_FORMAT = ("prodip_data", 1)
STATE_FORMAT = ("prodip_format", 1)
GATES_FORMAT = ("prodip_gates", 1)

Schema = Mapping[str, type | tuple[type, ...]]  # required key -> its JSON type(s)
_JSON_TYPE_NAMES = {dict: "an object", list: "an array", str: "a string", int: "an integer", float: "a number",
                    bool: "true/false"}


def _type_ok(value: object, types: type | tuple[type, ...]) -> bool:
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool):  # JSON true/false is no number, though Python's bool is an int
        return bool in types
    if float in types and isinstance(value, int):
        return True
    return isinstance(value, types)


def check_schema(obj: dict, where: str, what: str, required: Schema | None = None,
                 version: tuple[str, int] | None = None) -> dict:
    """`obj` (a JSON object read from `where`) against its required keys, their types and its format
    version; LayoutError naming the file and the first problem otherwise."""
    if version is not None:
        key, supported = version
        if key not in obj:
            raise LayoutError(f"{where}: not a prodip {what} (no {key!r} format field); wrong file?")
        if obj[key] != supported:
            raise LayoutError(f"{where}: {what} format version {obj[key]!r}; this prodip reads version {supported}")
    for key, types in (required or {}).items():
        if key not in obj:
            raise LayoutError(f"{where}: {what} lacks {key!r} (damaged, or not a prodip {what}?)")
        if not _type_ok(obj[key], types):
            want = " or ".join(_JSON_TYPE_NAMES.get(t, t.__name__) for t in (types if isinstance(types, tuple) else (types,)))
            raise LayoutError(f"{where}: {what}: {key!r} must be {want}, not {type(obj[key]).__name__} "
                              f"{json.dumps(obj[key])[:40]}")
    return obj


def read_json(path: str | Path, what: str = "JSON file", *, required: Schema | None = None,
              version: tuple[str, int] | None = None) -> dict:
    """A JSON object from `path`, or LayoutError naming the file and what is wrong with it: missing,
    unreadable, empty, truncated / not JSON, not an object, and (when given) a missing required key,
    a key of the wrong type, or another format version."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LayoutError(f"{p}: {what} not found") from None
    except IsADirectoryError:
        raise LayoutError(f"{p}: {what} is a folder, not a file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise LayoutError(f"{p}: unreadable {what} ({e})") from None
    if not text.strip():
        raise LayoutError(f"{p}: empty {what}")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise LayoutError(f"{p}: {what} is not valid JSON (truncated or corrupted? {e.msg} at line {e.lineno})") from None
    except RecursionError:
        raise LayoutError(f"{p}: {what} is nested too deeply to be ours") from None
    if not isinstance(obj, dict):
        raise LayoutError(f"{p}: {what} must hold a JSON object, not {type(obj).__name__}")
    return check_schema(obj, str(p), what, required, version)


RUN_CONFIG_SCHEMA: Schema = {"kind": str, "model": dict, "train": dict}


def read_run_config(run_dir: str | Path) -> dict | None:
    """A run's configuration ({"prodip_run", "kind", "model", "train"}), or None if the folder holds none."""
    run = Path(run_dir)
    if (run / RUN_CONFIG).is_file():
        return read_json(run / RUN_CONFIG, "run config", required=RUN_CONFIG_SCHEMA, version=RUN_FORMAT)
    legacy = run / LEGACY_RUN_CONFIG
    if legacy.is_file():
        cfg = read_json(legacy, "run config")
        if "prodip_run" in cfg:  # else a checkpoint-style model config: not a run's
            return check_schema(cfg, str(legacy), "run config", RUN_CONFIG_SCHEMA, RUN_FORMAT)
    return None


def pretraining_data_report(path: str | Path, max_hops: int = 8) -> dict | None:
    """DATA_DIR/report.json of the pretraining data behind the run holding `path`, following the
    `init` of fine-tuning runs (SFT on SFT included); None when any link is missing or unreadable.

    The tokenizer gates of SFT and the decontamination status of training.evaluate both read it."""
    current: str | Path | None = path
    for _ in range(max_hops):
        run = run_dir_of(current) if current else None
        try:
            run_cfg = read_run_config(run) if run is not None else None
        except LayoutError:
            return None
        if run_cfg is None:
            return None
        train_cfg = run_cfg.get("train", {})
        data = train_cfg.get("data", "")
        if run_cfg.get("kind") != "sft":  # a pretraining run: its data folder holds the report
            rep = Path(data) / DATA_REPORT
            try:
                return read_json(rep, "data report") if data and rep.is_file() else None
            except LayoutError:
                return None
        current = train_cfg.get("init", "")
    return None
