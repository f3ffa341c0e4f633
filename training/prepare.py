"""Corpus -> tokenizer + token shards + fertility/balance report, behind two tokenizer gates.

    python -m training.prepare --input CORPUS [--input ...] --out DATA_DIR [--vocab-size 8192]
           [--tokenizer FILE] [--mix bn=0.8,en=0.2] [--val-fraction 0.05] [--seed 0] [--force]

Three streaming passes over the inputs, so memory stays bounded whatever the corpus size:
  1. scan: read every file once; unreadable (binary, not UTF-8, bad JSON/gzip/Parquet) files are
     skipped and counted (fatal with --strict); count documents, splits and (for --mix) characters
     per language.
  2. sample: the k sentences of training documents with the smallest keyed hash (a deterministic,
     order-independent sample, bounded by --max-sentences) train the tokenizer; the held-out
     documents with the smallest hash (bounded by --eval-docs) feed the fertility report. The
     gates run here, before a single shard is written.
  3. encode: documents as <s> ids </s> (Tokenizer.encode(doc, bos=True, eos=True)) on --workers
     processes, collected in input order (same shards for any worker count), into fixed-size
     shards by training.data.ShardWriter.
Everything is written into a temporary folder beside DATA_DIR and renamed into place at the end: a
failed gate, an error or a crash leaves no half-written DATA_DIR.

Documents: text/markdown files split at blank lines (paragraph blocks, at most MAX_DOC_CHARS each),
JSONL records (the "text" field, or --text-field), Parquet rows (that column; needs pyarrow), the
`.gz` versions of text/JSONL, and folders (recursively, sorted, hidden files ignored). Each
document is normalized (training.text.normalize). Its split and its --mix down-sampling are decided
by keyed hashes of its text, so both are deterministic and identical documents land together.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import heapq
import io
import json
import multiprocessing as mp
import os
import shutil
import sys
import time
import zlib
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from training.fertility import (
    DEFAULT_BALANCE_RANGE,
    DEFAULT_FERTILITY_FLOOR,
    DEFAULT_FERTILITY_RATIO,
    GATE_NAMES,
    fertility_gates,
    fertility_report,
    format_table,
    plot_report,
)
from training.gates import GateReport, GateResult
from training.text import LANGUAGES, detect_language, normalize
from training.tokenizer import MAX_SENTENCE_BYTES, Tokenizer, TokenizerError, train_tokenizer

DATA_FORMAT_VERSION = 1
DEFAULT_VOCAB_SIZE = 8192
DEFAULT_VAL_FRACTION = 0.05
DEFAULT_SHARD_TOKENS = 1 << 26
DEFAULT_MAX_SENTENCES = 2_000_000
DEFAULT_EVAL_DOCS = 50_000
MAX_DOC_CHARS = 100_000  # a file without blank lines is cut into documents of about this size
CHUNK_CHARS = 1 << 20  # characters per encoding task: large enough to amortize IPC
IN_FLIGHT_PER_WORKER = 2  # bounded queue of encoding tasks: memory stays flat
TEXT_FIELD = "text"
JSONL_SUFFIXES = {".jsonl", ".ndjson", ".json"}
PARQUET_SUFFIXES = {".parquet", ".pq"}
# Distinct hash keys: the split, the --mix sample and the sentence sample must be independent.
SALT_SPLIT, SALT_MIX, SALT_SENTENCE, SALT_EVAL = b"split", b"mix", b"sentence", b"eval"
HASH_SCALE = float(1 << 64)


class PrepareError(ValueError):
    """Bad input or options: the CLI prints it as one line and exits 2."""


class GateFailed(PrepareError):
    """A tokenizer gate failed: nothing was written (exit 1). Carries the report and the gates."""

    def __init__(self, message: str, report: dict, gates: list[GateResult]):
        super().__init__(message)
        self.report, self.gates = report, gates


class _Unreadable(Exception):
    """A file that cannot be read as text documents (skipped, or fatal with --strict)."""


@dataclass
class Options:
    vocab_size: int | None = None  # None: DEFAULT_VOCAB_SIZE, or the --tokenizer's own size
    tokenizer: Path | None = None
    mix: dict[str, float] | None = None
    val_fraction: float = DEFAULT_VAL_FRACTION
    seed: int = 0
    force: bool = False
    strict: bool = False
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    workers: int | None = None  # None: all cores
    fertility_floor: float = DEFAULT_FERTILITY_FLOOR
    fertility_ratio: float = DEFAULT_FERTILITY_RATIO
    balance_range: tuple[float, float] = DEFAULT_BALANCE_RANGE
    skip_gates: list[str] = field(default_factory=list)
    text_field: str = TEXT_FIELD
    max_sentences: int = DEFAULT_MAX_SENTENCES
    eval_docs: int = DEFAULT_EVAL_DOCS
    progress: bool = True
    echo: bool = False  # print the fertility and gate tables (the CLI does)

    def validate(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:
            raise PrepareError(f"--val-fraction must be in (0, 1), got {self.val_fraction}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise PrepareError(f"--vocab-size must be positive, got {self.vocab_size}")
        if self.shard_tokens < 1:
            raise PrepareError(f"--shard-tokens must be positive, got {self.shard_tokens}")
        if self.workers is not None and self.workers < 1:
            raise PrepareError(f"--workers must be >= 1, got {self.workers}")
        lo, hi = self.balance_range
        if not 0 < lo <= 1 <= hi:
            raise PrepareError(f"--balance-range must be LO,HI with 0 < LO <= 1 <= HI, got {lo},{hi}")
        unknown = [g for g in self.skip_gates if g not in GATE_NAMES]
        if unknown:
            raise PrepareError(f"--skip-gate: unknown gate {unknown[0]!r}; known gates: {', '.join(GATE_NAMES)}")
        if self.max_sentences < 1 or self.eval_docs < 1:
            raise PrepareError("--max-sentences and --eval-docs must be positive")


# ---------------------------------------------------------------- reading documents


def _hash_key(text: str, salt: bytes, seed: int) -> int:
    """A 64-bit keyed hash of the text: deterministic across runs, machines and worker counts."""
    h = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=seed.to_bytes(8, "little"), salt=salt.ljust(16, b"\0"))
    return int.from_bytes(h.digest(), "little")


def _hash_unit(text: str, salt: bytes, seed: int) -> float:
    """A uniform number in [0, 1) from the text."""
    return _hash_key(text, salt, seed) / HASH_SCALE


def _kind(path: Path) -> tuple[str, bool]:
    suffixes = [s.lower() for s in path.suffixes]
    gz = bool(suffixes) and suffixes[-1] == ".gz"
    last = suffixes[-2] if gz and len(suffixes) > 1 else (suffixes[-1] if suffixes and not gz else "")
    if last in JSONL_SUFFIXES:
        return "jsonl", gz
    if last in PARQUET_SUFFIXES:
        return "parquet", gz
    return "text", gz


def resolve_inputs(inputs: Sequence[Path]) -> list[Path]:
    """Files to read, in a deterministic order: each input as given; folders recursively, sorted."""
    if not inputs:
        raise PrepareError("no --input given")
    files: list[Path] = []
    for raw in inputs:
        p = Path(raw)
        if not p.exists():
            raise PrepareError(f"input not found: {p}")
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file()
                           and not any(part.startswith(".") for part in f.relative_to(p).parts))
            if not found:
                raise PrepareError(f"input folder has no files: {p}")
            files.extend(found)
        else:
            files.append(p)
    return files


class _TextLines:
    """UTF-8 lines from a binary stream (strict decoding, universal newlines, NUL = binary)."""

    def __init__(self, raw):
        # Universal newlines: CRLF/CR become LF here, as normalize() would do.
        self.text = io.TextIOWrapper(raw, encoding="utf-8", errors="strict", newline=None)

    def __iter__(self) -> Iterator[str]:
        for line in self.text:
            if "\0" in line:
                raise _Unreadable("binary file (NUL bytes)")
            yield line

    def close(self) -> None:
        self.text.close()


def _paragraphs(lines: Iterator[str]) -> Iterator[str]:
    """Blank-line separated blocks (a long block is cut at a line boundary after MAX_DOC_CHARS)."""
    buf: list[str] = []
    size = 0
    for line in lines:
        if line.strip():
            buf.append(line)
            size += len(line)
            if size < MAX_DOC_CHARS:
                continue
        if buf:
            yield "".join(buf).rstrip("\n")
            buf, size = [], 0
    if buf:
        yield "".join(buf).rstrip("\n")


def _jsonl_texts(lines: Iterator[str], text_field: str) -> Iterator[str]:
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise _Unreadable(f"line {n} is not JSON ({e.msg}); JSONL needs one JSON object per line") from None
        if not isinstance(rec, dict) or text_field not in rec:
            raise _Unreadable(f"line {n} has no {text_field!r} field")
        text = rec[text_field]
        if text is None:
            continue
        if not isinstance(text, str):
            raise _Unreadable(f"line {n}: {text_field!r} is not a string")
        yield text


def _parquet_texts(path: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PrepareError(f"reading Parquet ({path}) needs pyarrow: pip install 'prodip[data]'") from None
    try:
        pf = pq.ParquetFile(path)
        if text_field not in pf.schema_arrow.names:
            raise _Unreadable(f"no {text_field!r} column (columns: {', '.join(pf.schema_arrow.names)})")
        for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
            for text in batch.column(0).to_pylist():
                if text is not None:
                    if not isinstance(text, str):
                        raise _Unreadable(f"column {text_field!r} is not text")
                    yield text
    except _Unreadable:
        raise
    except Exception as e:  # pyarrow raises ArrowInvalid/OSError with its own text
        raise _Unreadable(f"not a readable Parquet file ({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None


def _clean(text: str) -> str | None:
    """The document as stored and hashed: normalized; None when nothing but whitespace is left."""
    doc = normalize(text)
    return doc if doc.strip() else None


def iter_file_docs(path: Path, text_field: str = TEXT_FIELD, *, raw: bool = False) -> Iterator[str]:
    """The normalized, non-empty documents of one file; raises _Unreadable for bad files.

    raw=True yields the texts before normalization (pass each through _clean), so the costly
    normalization can run in the encoding workers instead of the reading process.
    """
    kind, gz = _kind(path)
    if kind == "parquet":
        if gz:
            raise _Unreadable("compressed Parquet is not supported (Parquet compresses internally)")
        texts: Iterator[str] = _parquet_texts(path, text_field)
        lines = None
    else:
        lines = _TextLines(gzip.open(path, "rb") if gz else open(path, "rb"))  # noqa: SIM115
        texts = _jsonl_texts(iter(lines), text_field) if kind == "jsonl" else _paragraphs(iter(lines))
    try:
        for text in texts:
            if raw:
                if text.strip():
                    yield text
            elif (doc := _clean(text)) is not None:
                yield doc
    except UnicodeDecodeError as e:
        raise _Unreadable(f"not UTF-8 text (invalid byte 0x{e.object[e.start]:02x})") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise _Unreadable(f"bad gzip data ({e})") from None
    finally:
        if lines is not None:
            lines.close()


# ---------------------------------------------------------------- the three passes


@dataclass
class _Scan:
    files: list[Path]
    skipped: list[dict]
    n_docs: int = 0
    n_chars: int = 0
    n_bytes: int = 0
    lang_chars: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LANGUAGES, 0))


def _split_of(doc: str, val_fraction: float, seed: int) -> str:
    return "val" if _hash_unit(doc, SALT_SPLIT, seed) < val_fraction else "train"


def _kept(doc: str, keep: dict[str, float] | None, seed: int) -> str | None:
    """The document's language if --mix keeps it ("" without --mix), None if it is sampled out."""
    if keep is None:
        return ""
    lang = detect_language(doc)
    p = keep.get(lang, 1.0)
    return lang if p >= 1.0 or _hash_unit(doc, SALT_MIX, seed) < p else None


def _docs(files: list[Path], opt: Options, raw: bool = False) -> Iterator[str]:
    for f in files:
        yield from iter_file_docs(f, opt.text_field, raw=raw)


def _scan(files: list[Path], opt: Options) -> _Scan:
    scan = _Scan(files=[], skipped=[])
    bar = tqdm(files, desc="scan", unit="file", disable=not opt.progress, leave=False)
    for f in bar:
        docs = chars = nbytes = 0
        lang_chars = dict.fromkeys(LANGUAGES, 0)
        try:
            # Without --mix the scan only validates and counts: raw text, no normalization.
            for doc in iter_file_docs(f, opt.text_field, raw=opt.mix is None):
                docs += 1
                chars += len(doc)
                nbytes += len(doc.encode("utf-8"))
                if opt.mix is not None:
                    lang_chars[detect_language(doc)] += len(doc)
        except _Unreadable as e:
            if opt.strict:
                raise PrepareError(f"unreadable input {f}: {e} (--strict)") from None
            scan.skipped.append({"path": str(f), "reason": str(e)})
            continue
        scan.files.append(f)
        scan.n_docs += docs
        scan.n_chars += chars
        scan.n_bytes += nbytes
        for k in lang_chars:
            scan.lang_chars[k] += lang_chars[k]
    if scan.skipped:
        print(f"warning: skipped {len(scan.skipped)} unreadable file(s), e.g. {scan.skipped[0]['path']}: "
              f"{scan.skipped[0]['reason']}", file=sys.stderr)
    if scan.n_docs == 0:
        raise PrepareError("no documents found in the inputs" + (
            f" ({len(scan.skipped)} unreadable file(s) skipped)" if scan.skipped else " (all files empty)"))
    return scan


def parse_mix(spec: str | dict[str, float] | None) -> dict[str, float] | None:
    """'bn=0.8,en=0.2' -> {'bn': 0.8, 'en': 0.2} (normalized to sum 1 over the named languages)."""
    if spec is None or spec == "":
        return None
    if isinstance(spec, str):
        out: dict[str, float] = {}
        for part in spec.split(","):
            lang, sep, val = part.partition("=")
            try:
                out[lang.strip()] = float(val) if sep else float("nan")
            except ValueError:
                raise PrepareError(f"--mix: bad share {part!r}; expected e.g. bn=0.8,en=0.2") from None
    else:
        out = {str(k): float(v) for k, v in spec.items()}
    for lang, v in out.items():
        if lang not in LANGUAGES:
            raise PrepareError(f"--mix: unknown language {lang!r}; use {', '.join(LANGUAGES)}")
        if not v >= 0:
            raise PrepareError(f"--mix: share of {lang} must be a number >= 0, got {v}")
    total = sum(out.values())
    if total <= 0:
        raise PrepareError("--mix: shares must not all be zero")
    return {k: v / total for k, v in out.items()}


def mix_keep_probabilities(mix: dict[str, float], lang_chars: dict[str, int]) -> dict[str, float]:
    """Per-language keep probabilities so kept characters follow `mix` among the named languages.

    Keep the most text possible: the scarcest language (relative to its target) is kept whole,
    the others are down-sampled to match. Languages not named in the mix are kept whole.
    """
    for lang, share in mix.items():
        if share > 0 and lang_chars.get(lang, 0) == 0:
            raise PrepareError(f"--mix asks for {lang}={share:.2f} but the inputs hold no {lang} documents")
    total = min(lang_chars[lang] / share for lang, share in mix.items() if share > 0)
    return {lang: (share * total / lang_chars[lang] if lang_chars.get(lang) else 0.0) for lang, share in mix.items()}


def _sample(files: list[Path], opt: Options, keep: dict[str, float] | None, want_sentences: bool
            ) -> tuple[list[str], list[str], dict[str, int]]:
    """Bottom-k (by keyed hash) sentences of train docs and docs of the held-out split."""
    sentences: list[tuple[int, int, str]] = []  # max-heap via negated key: (-key, -n, sentence)
    evals: list[tuple[int, str]] = []
    counts = {"train": 0, "val": 0}
    n = 0
    bar = tqdm(desc="sample", unit="doc", disable=not opt.progress, leave=False)
    for doc in _docs(files, opt):
        bar.update()
        if _kept(doc, keep, opt.seed) is None:
            continue
        split = _split_of(doc, opt.val_fraction, opt.seed)
        counts[split] += 1
        if split == "val":
            item = (-_hash_key(doc, SALT_EVAL, opt.seed), doc)
            if len(evals) < opt.eval_docs:
                heapq.heappush(evals, item)
            elif item > evals[0]:
                heapq.heapreplace(evals, item)
            continue
        if not want_sentences:
            continue
        for line in doc.split("\n"):
            if not line.strip() or len(line.encode("utf-8")) > MAX_SENTENCE_BYTES:
                continue
            n += 1
            # Ties (duplicate lines) are ordered by position, which is deterministic too.
            item = (-_hash_key(line, SALT_SENTENCE, opt.seed), -n, line)
            if len(sentences) < opt.max_sentences:
                heapq.heappush(sentences, item)
            elif item > sentences[0]:
                heapq.heapreplace(sentences, item)
    bar.close()
    sentences.sort(reverse=True)
    evals.sort(reverse=True)
    return [s for _, _, s in sentences], [d for _, d in evals], counts


# Encoding workers: the tokenizer is loaded once per process from its serialized model.
_worker_tok: Tokenizer | None = None


def _init_worker(proto: bytes) -> None:
    global _worker_tok
    _worker_tok = Tokenizer(proto)


def _encode_chunk(docs: list[str], keep: dict[str, float] | None, val_fraction: float, seed: int,
                  dtype: str) -> dict:
    """Normalize, filter (--mix) and encode a chunk of raw documents; token arrays and counts per split."""
    assert _worker_tok is not None
    out: dict[str, dict] = {}
    parts: dict[str, list[list[int]]] = {"train": [], "val": []}
    for split in parts:
        out[split] = {"n_docs": 0, "n_bytes": 0, "n_chars": 0}
    lang_chars = dict.fromkeys(LANGUAGES, 0)
    for text in docs:
        doc = _clean(text)
        if doc is None:
            continue
        lang = _kept(doc, keep, seed)
        if lang is None:
            continue
        if lang:
            lang_chars[lang] += len(doc)
        split = _split_of(doc, val_fraction, seed)
        parts[split].append(_worker_tok.encode(doc, bos=True, eos=True))
        s = out[split]
        s["n_docs"] += 1
        s["n_chars"] += len(doc)
        s["n_bytes"] += len(doc.encode("utf-8"))
    for split, ids in parts.items():
        flat = [i for doc_ids in ids for i in doc_ids]
        out[split]["tokens"] = np.asarray(flat, dtype=dtype)
    return {"splits": out, "seen_bytes": sum(len(d.encode("utf-8")) for d in docs), "lang_chars": lang_chars}


def _chunks(docs: Iterator[str]) -> Iterator[list[str]]:
    chunk: list[str] = []
    size = 0
    for doc in docs:
        chunk.append(doc)
        size += len(doc)
        if size >= CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _encode_all(files: list[Path], opt: Options, keep: dict[str, float] | None, tok: Tokenizer, tmp: Path,
                total_bytes: int) -> tuple[dict[str, dict], dict[str, int]]:
    from training.data import ShardWriter  # imported here: encoding workers never need torch

    writers = {s: ShardWriter(tmp / s, tok.vocab_size, tok.sha256, opt.shard_tokens) for s in ("train", "val")}
    stats = {s: {"n_tokens": 0, "n_shards": 0, "n_docs": 0, "n_bytes": 0, "n_chars": 0} for s in writers}
    dtype = np.dtype(writers["train"].dtype).name
    workers = opt.workers or os.cpu_count() or 1
    bar = tqdm(total=total_bytes, desc="encode", unit="B", unit_scale=True, unit_divisor=1000,
               disable=not opt.progress, smoothing=0.1)
    t0 = time.perf_counter()
    n_tok = 0
    kept_chars = dict.fromkeys(LANGUAGES, 0)  # per language, counted only with --mix

    def consume(res: dict) -> None:
        nonlocal n_tok
        for split, r in res["splits"].items():
            writers[split].add(r["tokens"])
            st = stats[split]
            for k in ("n_docs", "n_bytes", "n_chars"):
                st[k] += r[k]
            n_tok += int(r["tokens"].size)
        bar.update(res["seen_bytes"])
        for lang, n in res["lang_chars"].items():
            kept_chars[lang] += n
        bar.set_postfix_str(f"{n_tok / max(time.perf_counter() - t0, 1e-9):,.0f} tok/s")

    chunks = _chunks(_docs(files, opt, raw=True))
    if workers == 1:
        _init_worker(tok.proto)
        for chunk in chunks:
            consume(_encode_chunk(chunk, keep, opt.val_fraction, opt.seed, dtype))
    else:
        # spawn, not fork: the parent holds threads (tqdm monitor, SentencePiece) that fork would copy broken.
        ctx = mp.get_context("spawn")
        with ctx.Pool(workers, initializer=_init_worker, initargs=(tok.proto,)) as pool:
            pending: deque = deque()  # bounded and consumed in order: memory flat, output deterministic
            for chunk in chunks:
                pending.append(pool.apply_async(_encode_chunk, (chunk, keep, opt.val_fraction, opt.seed, dtype)))
                if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                    consume(pending.popleft().get())
            while pending:
                consume(pending.popleft().get())
    bar.close()
    for split, w in writers.items():
        w.close()
        stats[split]["n_tokens"] = int(w.n_tokens)
        stats[split]["n_shards"] = int(w.n_shards)
    return stats, kept_chars


# ---------------------------------------------------------------- the pipeline


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--out {out} exists and is not a folder")
    if out.exists() and any(out.iterdir()) and not force:
        raise PrepareError(f"{out} already exists; pass --force to replace it")


def _finish(tmp: Path, out: Path) -> None:
    """Move the finished folder into place; an old DATA_DIR (with --force) goes only after that."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def prepare(inputs: list[Path], out: Path, **options) -> dict:
    """Build DATA_DIR from `inputs`; return its meta.json content. Raises PrepareError/GateFailed."""
    try:
        opt = Options(**options)
    except TypeError as e:
        raise PrepareError(f"prepare(): {e}") from None
    opt.mix = parse_mix(opt.mix)
    opt.balance_range = tuple(opt.balance_range)  # type: ignore[assignment]
    opt.skip_gates = list(opt.skip_gates or [])
    opt.validate()
    out = Path(out)
    _check_out(out, opt.force)
    files = resolve_inputs([Path(p) for p in inputs])
    given_tok = None
    if opt.tokenizer is not None:
        try:
            given_tok = Tokenizer.load(opt.tokenizer)
        except TokenizerError as e:
            raise PrepareError(str(e)) from None
        if opt.vocab_size is not None and opt.vocab_size != given_tok.vocab_size:
            raise PrepareError(f"--vocab-size {opt.vocab_size} differs from the --tokenizer's {given_tok.vocab_size}")
    vocab_size = opt.vocab_size or DEFAULT_VOCAB_SIZE

    scan = _scan(files, opt)
    keep = None
    if opt.mix is not None:
        keep = mix_keep_probabilities(opt.mix, scan.lang_chars)
    sentences, eval_docs, split_docs = _sample(scan.files, opt, keep, want_sentences=given_tok is None)
    if sum(split_docs.values()) == 0:
        raise PrepareError("no documents found in the inputs (all empty or sampled out by --mix)")
    for split, n in split_docs.items():
        if n == 0:
            raise PrepareError(f"the {split} split is empty ({sum(split_docs.values())} documents kept); "
                               f"add text or change --val-fraction")

    if given_tok is None:
        if not sentences:
            raise PrepareError("no training sentences to train the tokenizer on")
        try:
            tok = train_tokenizer(sentences, vocab_size, seed=opt.seed, num_threads=opt.workers)
        except RuntimeError as e:  # SentencePiece: e.g. vocab_size too large for the text
            msg = str(e).strip().splitlines()[-1]
            raise PrepareError(f"tokenizer training failed: {msg.split('] ', 1)[-1]}") from None
    else:
        tok = given_tok
    del sentences

    report = fertility_report(tok, eval_docs, target_char_share=opt.mix)
    report["held_out_docs"] = len(eval_docs)
    del eval_docs
    gates = fertility_gates(report, floor=opt.fertility_floor, ratio=opt.fertility_ratio,
                            balance_range=opt.balance_range)
    for g in gates:
        if g.name in opt.skip_gates:
            g.skipped = True
    greport = GateReport(gates, skipped_by_user=list(opt.skip_gates))
    if opt.echo:
        print(format_table(report))
        print()
        print(greport.table())
    if not greport.passed:
        msgs = "; ".join(f"{g.name}: {g.detail}" for g in greport.failed)
        raise GateFailed(f"tokenizer gate failed, nothing written: {msgs} "
                         f"(change the tokenizer/vocabulary, or --skip-gate NAME to override)", report, gates)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        tok.save(tmp / "tokenizer.model")
        stats, kept_chars = _encode_all(scan.files, opt, keep, tok, tmp, scan.n_bytes)
        for split, st in stats.items():
            if st["n_docs"] == 0:
                raise PrepareError(f"the {split} split is empty; add text or change --val-fraction")
        meta = {
            "prodip_data": DATA_FORMAT_VERSION,
            "vocab_size": tok.vocab_size,
            "tokenizer_sha256": tok.sha256,
            "splits": stats,
            "inputs": [str(Path(p).resolve()) for p in inputs],
            "n_files": len(scan.files),
            "skipped_files": scan.skipped,
            "options": {"mix": opt.mix, "val_fraction": opt.val_fraction, "seed": opt.seed,
                        "shard_tokens": opt.shard_tokens, "text_field": opt.text_field,
                        "max_sentences": opt.max_sentences, "trained_tokenizer": given_tok is None},
        }
        if opt.mix is not None:
            named = sum(kept_chars[k] for k in opt.mix)
            meta["mix"] = {"target_char_share": opt.mix, "keep_probability": keep,
                           "kept_chars": kept_chars,
                           "kept_char_share": {k: kept_chars[k] / named if named else 0.0 for k in opt.mix}}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
        full = {"fertility": report, "gates": [g.to_dict() for g in gates],
                "gate_options": {"fertility_floor": opt.fertility_floor, "fertility_ratio": opt.fertility_ratio,
                                 "balance_range": list(opt.balance_range), "skip_gates": opt.skip_gates},
                "splits": stats}
        (tmp / "report.json").write_text(json.dumps(full, indent=2, ensure_ascii=False) + "\n")
        (tmp / "report.md").write_text(_report_md(report, greport, stats))
        plot_report(report, tmp / "fertility.png", floor=opt.fertility_floor)
        _finish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _report_md(report: dict, greport: GateReport, stats: dict) -> str:
    lines = ["# Tokenizer fertility and balance (held-out split)", "",
             f"Vocabulary {report['vocab_size']}, tokenizer sha256 `{report['tokenizer_sha256'][:16]}`, "
             f"{report['held_out_docs']:,} held-out documents.", "", format_table(report), "",
             "## Gates", "", greport.table(), "", greport.summary(), "", "## Splits", "",
             "| split | documents | characters | bytes | tokens | shards |", "|---|---:|---:|---:|---:|---:|"]
    for split, st in stats.items():
        lines.append(f"| {split} | {st['n_docs']:,} | {st['n_chars']:,} | {st['n_bytes']:,} | {st['n_tokens']:,} | "
                     f"{st['n_shards']} |")
    lines += ["", "![fertility](fertility.png)", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- CLI


def _pair(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI like 0.8,1.25, got {text!r}") from None
    return lo, hi


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training.prepare", description=__doc__.split("\n")[0])
    p.add_argument("--input", action="append", required=True, type=Path, metavar="PATH",
                   help="file or folder (repeatable): .txt/.md, .jsonl, .parquet, .gz versions")
    p.add_argument("--out", required=True, type=Path, metavar="DATA_DIR")
    p.add_argument("--vocab-size", type=int, default=None, metavar="N", help=f"tokenizer vocabulary (default {DEFAULT_VOCAB_SIZE})")
    p.add_argument("--tokenizer", type=Path, default=None, metavar="FILE", help="use this tokenizer.model instead of training one")
    p.add_argument("--mix", default=None, metavar="LANG=SHARE,...", help="target character shares, e.g. bn=0.8,en=0.2 (down-samples)")
    p.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION, metavar="F",
                   help="share of documents held out (by hash of their text)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="replace an existing DATA_DIR")
    p.add_argument("--strict", action="store_true", help="an unreadable input file is an error, not skipped")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, metavar="N",
                   help="tokens per shard file")
    p.add_argument("--workers", type=int, default=None, metavar="N", help="encoding processes (default: all cores)")
    p.add_argument("--text-field", default=TEXT_FIELD, help="JSONL field / Parquet column holding the text")
    p.add_argument("--max-sentences", type=int, default=DEFAULT_MAX_SENTENCES,
                   help="sentences sampled to train the tokenizer")
    p.add_argument("--eval-docs", type=int, default=DEFAULT_EVAL_DOCS,
                   help="held-out documents sampled for the fertility report")
    p.add_argument("--fertility-floor", type=float, default=DEFAULT_FERTILITY_FLOOR,
                   help="minimum Bangla characters/token")
    p.add_argument("--fertility-ratio", type=float, default=DEFAULT_FERTILITY_RATIO,
                   help="minimum Bangla fertility as a fraction of English's")
    p.add_argument("--balance-range", type=_pair, default=DEFAULT_BALANCE_RANGE, metavar="LO,HI",
                   help="allowed token share / character share per language (LO,HI)")
    p.add_argument("--skip-gate", action="append", default=[], metavar="NAME", choices=GATE_NAMES,
                   help="record this gate as skipped instead of failing (repeatable)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    opts = {k: v for k, v in vars(args).items() if k not in ("input", "out", "skip_gate", "no_progress", "debug")}
    opts.update(skip_gates=args.skip_gate, progress=not args.no_progress, echo=True)
    t0 = time.perf_counter()
    try:
        meta = prepare(args.input, args.out, **opts)
    except GateFailed as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (PrepareError, TokenizerError, OSError) as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    tr, va = meta["splits"]["train"], meta["splits"]["val"]
    print(f"\nwrote {args.out}: train {tr['n_tokens']:,} tokens in {tr['n_shards']} shard(s) ({tr['n_docs']:,} docs), "
          f"val {va['n_tokens']:,} tokens ({va['n_docs']:,} docs), vocab {meta['vocab_size']}, "
          f"{len(meta['skipped_files'])} file(s) skipped, {time.perf_counter() - t0:.1f} s")
    if "mix" in meta:
        kept = ", ".join(f"{k} {v:.1%} (target {meta['mix']['target_char_share'][k]:.1%})"
                         for k, v in meta["mix"]["kept_char_share"].items())
        print(f"--mix: character shares of all kept documents: {kept}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
