"""The demo's model card: what the selected model is, read from the files its run left on disk.

Size, tokens trained, held-out bits per byte beside the random-init twin, training gates and
parity against the fp32 checkpoint, each from the run's own files (names from training.runfiles.layout).
Anything missing or unreadable reads "not measured": the card never stops the demo. A GGUF that
prodip did not write is said to be foreign, and prodip's checks are said not to apply to it.
Gradio-free, so it is tested as plain functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from demo.models import ModelEntry, parity_result
from serving import Backend, describe
from serving.chat_session import chat_tuned, run_chat_tuned
from serving.chat_session import is_prodip as serves_prodip
from training.checkpoint.checkpoint_io import latest
from training.evaluate import ALL
from training.gates import GateReport
from training.model.decoder import ModelConfig, count_params
from training.runfiles import layout
from training.runfiles.json_records import RecordError, read_records

NOT_MEASURED = "not measured"
FOREIGN_SKIP = ("file", "kind", "prodip")  # already on the card
MAX_INIT_HOPS = 8  # fine-tune of a fine-tune of ...: the chain behind a run is followed this far
EVAL_JSON = layout.EVAL_FILES[0]
TWIN_NAME, MODEL_NAME = "twin", "model"  # training.evaluate's model names in eval.json
MODEL_TYPE = {True: "chat-tuned (SFT): replies through the chat template",
              False: "base model (pretrained, not chat-tuned): the demo continues your text instead of chatting",
              None: "not recorded (no run files or GGUF metadata say): chats through the chat template"}
FOREIGN_NOTE = ("foreign GGUF (not written by prodip): prodip's checks — our tokenizer, parity against the "
                "fp32 checkpoint, training gates — do not apply to it")


@dataclass
class Card:
    label: str
    prodip: bool
    rows: list[tuple[str, str]] = field(default_factory=list)

    def get(self, what: str) -> str:
        return dict(self.rows).get(what, "")

    def markdown(self) -> str:
        kind = "prodip" if self.prodip else "foreign"
        return "\n".join([f"### {self.label}", "", f"**{kind}** model", "",
                          *(f"- **{k}:** {v}" for k, v in self.rows)])


def _json(path: Path, what: str) -> dict | None:
    """A run file or None: a missing or broken file is "not measured", never an error here."""
    try:
        return layout.read_json(path, what) if path.is_file() else None
    except layout.LayoutError:
        return None


def run_chain(run: Path | None) -> list[tuple[Path, dict]]:
    """The run and the runs it was initialized from (an SFT run's pretraining run), with their run.json."""
    chain: list[tuple[Path, dict]] = []
    for _ in range(MAX_INIT_HOPS):
        if run is None or any(run == r for r, _ in chain):
            break
        try:
            cfg = layout.read_run_config(run)
        except layout.LayoutError:
            cfg = None
        if cfg is None:
            break
        chain.append((run, cfg))
        init = (cfg.get("train") or {}).get("init") or ""
        run = layout.run_dir_of(init) if init else None
    return chain


def checkpoint_state(run: Path) -> tuple[Path | None, dict]:
    ck = latest(run)
    if ck is None:
        return None, {}
    return ck, _json(ck / layout.STATE, "checkpoint state") or {}


def size_row(run: Path | None) -> str:
    ck = latest(run) if run is not None else None
    cfg = _json(ck / layout.MODEL_CONFIG, "model config") if ck is not None else None
    try:
        mc = ModelConfig.from_dict(cfg) if cfg else None
    except (TypeError, ValueError):
        mc = None
    if mc is None:
        return NOT_MEASURED
    total, non_emb = count_params(mc), count_params(mc, non_embedding=True)
    return (f"{total / 1e6:.2f} M parameters ({non_emb / 1e6:.2f} M non-embedding; {mc.n_layers} layers, "
            f"d_model {mc.d_model}, vocabulary {mc.vocab_size:,}, context {mc.max_seq_len})")


def tokens_row(chain: list[tuple[Path, dict]]) -> str:
    parts = []
    for run, cfg in reversed(chain):  # pretraining first
        ck, state = checkpoint_state(run)
        tokens = state.get("tokens")
        if isinstance(tokens, int) and ck is not None:
            what = "chat fine-tuning" if cfg.get("kind") == "sft" else "pretraining"
            parts.append(f"{tokens:,} ({what}, step {state.get('step', '?')})")
    return " + ".join(parts) if parts else NOT_MEASURED


def last_val_bpb(run: Path) -> float | None:
    """The newest validation bits/byte the trainer logged (log.jsonl), if any; a log cut short by a
    crash still gives what it holds before the cut."""
    best = None
    try:
        for rec in read_records(run / layout.LOG, "training log"):
            v = rec.value.get("val_bpb") if isinstance(rec.value, dict) else None
            if isinstance(v, (int, float)) and math.isfinite(v):
                best = float(v)
    except RecordError:
        pass
    return best


def _bpb_of(report: dict, name: str) -> float | None:
    for m in report.get("models") or []:
        if isinstance(m, dict) and m.get("name") == name:
            v = ((m.get("lm") or {}).get(ALL) or {}).get("bits_per_byte")
            return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None
    return None


def bpb_row(chain: list[tuple[Path, dict]]) -> str:
    """training.evaluate's eval.json (model vs twin) of the nearest run that has one, else the trainer's
    own validation bits/byte (no twin beside it)."""
    for run, cfg in chain:
        rep = _json(run / layout.EVAL_DIR / EVAL_JSON, "evaluation report")
        model = _bpb_of(rep, MODEL_NAME) if rep else None
        if model is None:
            continue
        twin = _bpb_of(rep, TWIN_NAME)
        whose = "" if run == chain[0][0] else f" (of the {cfg.get('kind', 'base')} run {run.name})"
        vs = f" vs random-init twin {twin:.3f}" if twin is not None else f" (twin {NOT_MEASURED})"
        return f"{model:.3f}{vs}{whose}"
    for run, cfg in chain:
        v = last_val_bpb(run)
        if v is not None:
            whose = "" if run == chain[0][0] else f" of the {cfg.get('kind', 'base')} run {run.name}"
            return (f"{v:.3f} (validation split{whose}; twin {NOT_MEASURED}: "
                    f"python -m training.evaluate {run})")
    return NOT_MEASURED


def gates_row(chain: list[tuple[Path, dict]]) -> str:
    out = []
    for run, cfg in chain:
        path = run / layout.GATES
        if not path.is_file():
            continue
        try:
            rep = GateReport.load(path)
        except (layout.LayoutError, KeyError, TypeError):
            out.append(f"{run.name}: unreadable {layout.GATES}")
            continue
        out.append(f"{cfg.get('kind', 'run')} {run.name}: {rep.summary()}")
    return "; ".join(out) if out else NOT_MEASURED


def parity_row(entry: ModelEntry, run: Path | None) -> str:
    if entry.backend == "torch":
        return "the fp32 reference itself (PyTorch checkpoint)"
    if run is None or not isinstance(_json(run / layout.EXPORT / layout.PARITY_JSON, "parity report"), dict):
        return NOT_MEASURED  # none, or unreadable
    r = parity_result(run, entry.path)
    if r is None:
        return f"{NOT_MEASURED} for this file (python -m export parity {run})"
    verdict = "pass" if r.get("passed") else "FAIL: " + "; ".join(map(str, r.get("failures") or []))
    top1, kl = r.get("top1"), r.get("kl")
    nums = []
    if isinstance(top1, (int, float)):
        nums.append(f"top-1 agreement {top1:.1%}")
    if isinstance(kl, (int, float)):
        nums.append(f"mean KL {kl:.2e}")
    if r.get("greedy_total"):
        nums.append(f"greedy tokens {r.get('greedy_match')}/{r.get('greedy_total')}")
    return f"{verdict} ({', '.join(nums)})" if nums else verdict


def is_prodip(backend: Backend | None) -> bool:
    return serves_prodip(backend) if backend is not None else True


def file_row(entry: ModelEntry) -> str:
    p = entry.path
    try:
        size = p.stat().st_size if p.is_file() else None
    except OSError:
        size = None
    return f"{p} ({size / 2**20:.1f} MiB)" if size is not None else str(p)


def model_card(entry: ModelEntry, backend: Backend | None = None) -> Card:
    """The card of `entry`; `backend` (when loaded) tells a foreign GGUF and describes it."""
    prodip = is_prodip(backend)
    card = Card(entry.label, prodip)
    rows = card.rows
    rows.append(("runtime", f"{entry.backend}" + (f" ({backend.name}, context {backend.n_ctx})" if backend else "")))
    rows.append(("file", file_row(entry)))
    if entry.adapter is not None:  # a LoRA pair: the base above, the adapter llama.cpp applies to it at run time
        rows.append(("LoRA adapter", f"{file_row(ModelEntry(entry.label, entry.adapter, entry.backend))} "
                                     f"on the base {entry.path.name}"))
    info = describe(backend) if backend is not None else {}
    if not prodip:
        rows.append(("kind", FOREIGN_NOTE))
        rows += [(str(k), f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v))
                 for k, v in info.items() if k not in FOREIGN_SKIP and isinstance(v, (str, int, float, bool))]
        return card
    if info.get("quant"):
        rows.append(("quantization", str(info["quant"])))
    rows.append(("model type", MODEL_TYPE[chat_tuned(backend, entry.path) if backend is not None
                                          else run_chat_tuned(entry.path)]))
    run = layout.run_dir_of(entry.adapter or entry.path)  # a pair's facts are its adapter run's (and its base's)
    chain = run_chain(run)
    if chain:
        rows.append(("run", f"{run} ({chain[0][1].get('kind', '?')})"))
    rows.append(("size", size_row(run)))
    rows.append(("tokens trained", tokens_row(chain)))
    rows.append(("held-out bits/byte", bpb_row(chain)))
    rows.append(("training gates", gates_row(chain)))
    rows.append(("parity vs fp32", parity_row(entry, run)))
    if run is not None and (run / layout.EXPORT / layout.WEB_DIR / "index.html").is_file():  # `python -m export web`
        rows.append(("run it on this device", f"`python -m serving {run} --web`, then open the URL it prints: "
                                              "the chat runs in your browser (docs/web.md)"))
    return card
