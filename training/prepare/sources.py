"""Where documents come from: files and folders (text, Markdown, JSONL, Parquet, .gz) and Hugging
Face datasets (`hf:NAME[:CONFIG][:SPLIT]`, from the Hub or a local folder in the hub layout).

Every source yields raw, non-blank texts in a deterministic order; the caller normalizes them (in
the worker processes, where it is parallel). A file that cannot be read raises `Unreadable` (the
pipeline skips and counts it, or stops with --strict); a dataset that cannot be loaded is a
`PrepareError` raised before anything is written.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from training.prepare.errors import PrepareError, Unreadable
from training.runfiles.file_ops import expand_files
from training.runfiles.json_records import JSONBoundError, loads
from training.runfiles.schema import HF_PREFIX, unknown_name
from training.text.normalization import normalize

MAX_DOC_CHARS = 100_000  # a file without blank lines is cut into documents of about this size
TEXT_FIELD = "text"
JSONL_SUFFIXES = {".jsonl", ".ndjson", ".json"}
PARQUET_SUFFIXES = {".parquet", ".pq"}
HF_DEFAULT_SPLIT = "train"
SOURCE_KINDS = (HF_PREFIX,)  # KIND:SPEC inputs; anything else is a file or folder


def _kind(path: Path) -> tuple[str, bool]:
    suffixes = [s.lower() for s in path.suffixes]
    gz = bool(suffixes) and suffixes[-1] == ".gz"
    last = suffixes[-2] if gz and len(suffixes) > 1 else (suffixes[-1] if suffixes and not gz else "")
    if last in JSONL_SUFFIXES:
        return "jsonl", gz
    if last in PARQUET_SUFFIXES:
        return "parquet", gz
    return "text", gz


def resolve_inputs(inputs: Sequence[str | Path]) -> list[Path]:
    """Files to read, in a deterministic order: each input as given; folders recursively, sorted."""
    if not inputs:
        raise PrepareError("no --input given")
    return expand_files(inputs, PrepareError, what="input")


class _TextLines:
    """UTF-8 lines from a binary stream (strict decoding, universal newlines, NUL = binary)."""

    def __init__(self, raw):
        # Universal newlines: CRLF/CR become LF here, as normalize() would do.
        self.text = io.TextIOWrapper(raw, encoding="utf-8", errors="strict", newline=None)

    def __iter__(self) -> Iterator[str]:
        for line in self.text:
            if "\0" in line:
                raise Unreadable("binary file (NUL bytes)")
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
            rec = loads(line)  # the one bounded reader: depth, and text that is valid Unicode
        except json.JSONDecodeError as e:
            raise Unreadable(f"line {n} is not JSON ({e.msg}); JSONL needs one JSON object per line") from None
        except JSONBoundError as e:
            raise Unreadable(f"line {n}: {e}") from None
        if not isinstance(rec, dict) or text_field not in rec:
            raise Unreadable(f"line {n} has no {text_field!r} field")
        text = rec[text_field]
        if text is None:
            continue
        if not isinstance(text, str):
            raise Unreadable(f"line {n}: {text_field!r} is not a string")
        yield text


def _parquet_texts(path: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PrepareError(f"reading Parquet ({path}) needs pyarrow: pip install 'prodip[data]'") from None
    try:
        pf = pq.ParquetFile(path)
        if text_field not in pf.schema_arrow.names:
            raise Unreadable(f"no {text_field!r} column (columns: {', '.join(pf.schema_arrow.names)})")
        for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
            for text in batch.column(0).to_pylist():
                if text is not None:
                    if not isinstance(text, str):
                        raise Unreadable(f"column {text_field!r} is not text")
                    yield text
    except Unreadable:
        raise
    except Exception as e:  # pyarrow raises ArrowInvalid/OSError with its own text
        raise Unreadable(f"not a readable Parquet file ({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None


def clean(text: str) -> str | None:
    """The document as stored and hashed: normalized; None when nothing but whitespace is left."""
    doc = normalize(text)
    return doc if doc.strip() else None


def iter_file_docs(path: Path, text_field: str = TEXT_FIELD, *, raw: bool = False) -> Iterator[str]:
    """The normalized, non-empty documents of one file; raises Unreadable for bad files.

    raw=True yields the texts before normalization (pass each through clean), so the costly
    normalization can run in the worker processes instead of the reading process.
    """
    kind, gz = _kind(path)
    if kind == "parquet":
        if gz:
            raise Unreadable("compressed Parquet is not supported (Parquet compresses internally)")
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
            elif (doc := clean(text)) is not None:
                yield doc
    except UnicodeDecodeError as e:
        raise Unreadable(f"not UTF-8 text (invalid byte 0x{e.object[e.start]:02x})") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise Unreadable(f"bad gzip data ({e})") from None
    finally:
        if lines is not None:
            lines.close()


# ---------------------------------------------------------------- sources


@dataclass
class FileSource:
    path: Path

    @property
    def name(self) -> str:
        return str(self.path)

    def texts(self, text_field: str) -> Iterator[str]:
        return iter_file_docs(self.path, text_field, raw=True)


@dataclass
class HFSource:
    """A Hugging Face dataset, streamed with `datasets` (never fully downloaded into memory)."""

    spec: str
    name_or_path: str
    config: str | None
    split: str
    dataset: object  # datasets.IterableDataset

    @property
    def name(self) -> str:
        return self.spec

    def texts(self, text_field: str) -> Iterator[str]:
        features = getattr(self.dataset, "features", None) or {}
        if features and text_field not in features:
            raise PrepareError(f"{self.spec}: no {text_field!r} column (columns: {', '.join(features)}); "
                               f"pick one with --text-field")
        for n, row in enumerate(self.dataset):  # type: ignore[attr-defined]
            if text_field not in row:
                raise PrepareError(f"{self.spec}: row {n} has no {text_field!r} column "
                                   f"(columns: {', '.join(row)}); pick one with --text-field")
            text = row[text_field]
            if isinstance(text, str) and text.strip():
                yield text


def parse_hf_spec(spec: str) -> tuple[str, str | None, str]:
    """'hf:NAME[:CONFIG][:SPLIT]' -> (NAME, CONFIG or None, SPLIT, default 'train')."""
    parts = spec[len(HF_PREFIX):].split(":")
    if not parts[0] or len(parts) > 3:
        raise PrepareError(f"--input {spec!r}: expected hf:NAME[:CONFIG][:SPLIT], "
                           f"e.g. hf:HuggingFaceFW/fineweb-2:ben_Beng:train")
    name, config, split = parts[0], (parts[1] if len(parts) > 1 and parts[1] else None), \
        (parts[2] if len(parts) > 2 and parts[2] else HF_DEFAULT_SPLIT)
    return name, config, split


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def load_hf(spec: str) -> HFSource:
    """Open `hf:NAME[:CONFIG][:SPLIT]` as a stream; one clear error if it cannot be reached."""
    name, config, split = parse_hf_spec(spec)
    try:
        import datasets
    except ImportError:
        raise PrepareError(f"--input {spec}: reading Hugging Face datasets needs `datasets`: "
                           f"pip install 'prodip[data]'") from None
    datasets.disable_progress_bars()
    local = Path(name).is_dir()
    # A CONFIG with a slash is a data folder inside the dataset (Sangraha: verified/ben).
    kw = {"data_dir": config} if config and "/" in config else {"name": config}
    try:
        ds = datasets.load_dataset(name, split=split, streaming=True, **kw)
    except Exception as e:  # datasets raises many types (ConnectionError, DatasetNotFoundError, ValueError)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        if not local and _offline():
            raise PrepareError(f"Hugging Face dataset {name!r} is not available offline (HF_HUB_OFFLINE=1 and "
                               f"it is not in the local cache); download it on a connected machine or pass a "
                               f"local folder: --input hf:PATH ({type(e).__name__})") from None
        hint = "" if local else " (no network? set HF_HUB_OFFLINE=1 and pass a local copy as --input hf:PATH)"
        raise PrepareError(f"cannot load Hugging Face dataset {name!r} config={config} split={split}: "
                           f"{first}{hint}") from None
    return HFSource(spec, name, config, split, ds)


def resolve_sources(inputs: Sequence[str | Path]) -> list[FileSource | HFSource]:
    """Every --input as sources, in order: `hf:` specs open a dataset, paths expand to files."""
    if not inputs:
        raise PrepareError("no --input given")
    out: list[FileSource | HFSource] = []
    for raw in inputs:
        if str(raw).startswith(HF_PREFIX):
            out.append(load_hf(str(raw)))
        else:
            check_source_kind(str(raw))
            out.extend(FileSource(f) for f in resolve_inputs([raw]))
    return out


def check_source_kind(raw: str) -> None:
    """'hff:NAME' or 'HF:NAME' is a mistyped source kind, not a file name to report as missing."""
    kind, sep, _ = raw.partition(":")
    if sep and len(kind) > 1 and kind.isidentifier() and not Path(raw).exists():  # len > 1: not C:\...
        raise PrepareError(f"--input {raw!r}: {unknown_name('source kind', kind + ':', SOURCE_KINDS)}")
