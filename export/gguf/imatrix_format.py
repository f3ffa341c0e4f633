"""The importance-matrix file and its calibration text, shared by both ways prodip makes one
(llama.cpp's llama-imatrix: export.imatrix; the PyTorch checkpoint itself: export.gguf.imatrix_torch):
llama-imatrix's GGUF format (read, write, checked against the model it is for) and the calibration
text as every prodip path tokenizes it (NFC-normalized, UTF-8, not empty).
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np

from export import ExportError
from training.runfiles import layout
from training.text.normalization import normalize

IMATRIX_SUFFIX = ".imatrix.gguf"  # llama-imatrix's GGUF format (its default since 2025)
IN_SUM2, COUNTS = ".in_sum2", ".counts"  # the two tensors llama-imatrix writes per weight
DATASETS_KEY = "imatrix.datasets"
CHUNK_COUNT_KEY, CHUNK_SIZE_KEY = "imatrix.chunk_count", "imatrix.chunk_size"
IMATRIX_ARCH = "imatrix"  # gguf-py's writer needs an architecture; llama.cpp's loader reads only the keys above
# llama-imatrix splits the text into chunks of this many tokens; short enough that the shipped
# calibration text (~5k tokens with a 2k vocabulary, ~3k with 32k) gives at least a dozen chunks
DEFAULT_CHUNK_TOKENS = 256
# Tensors whose importance matrix must be present: every matmul weight. token_embd is a row lookup
# (get_rows), not a matmul, so llama-imatrix never sees activations for it.
MATMUL_WEIGHT = re.compile(r"^(blk\.\d+\.[a-z_]+|output)\.weight$")


def imatrix_path(out_dir: Path, name: str) -> Path:
    return out_dir / layout.GGUF_DIR / f"{name}{IMATRIX_SUFFIX}"


def _reader(path: Path, what: str) -> gguf.GGUFReader:
    if not path.is_file():
        raise ExportError(f"{what} not found: {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # gguf-py raises ValueError / struct.error / IndexError on foreign or truncated files
        raise ExportError(f"{path}: not a readable GGUF {what} ({type(e).__name__}: {e})") from None


def check_model(path: Path) -> gguf.GGUFReader:
    r = _reader(path, "model")
    arch = r.fields.get(gguf.Keys.General.ARCHITECTURE)
    if arch is None or arch.contents() != "llama":
        got = arch.contents() if arch is not None else None
        raise ExportError(f"{path}: architecture {got!r} is not 'llama'; prodip computes importance matrices "
                          "for GGUF files written by `python -m export gguf`")
    return r


def imatrix_entries(path: Path) -> dict[str, int]:
    """{weight name: input width} of a llama-imatrix GGUF file."""
    r = _reader(path, "importance matrix")
    if DATASETS_KEY not in r.fields and not any(t.name.endswith(IN_SUM2) for t in r.tensors):
        raise ExportError(f"{path}: not an importance matrix (no {DATASETS_KEY} and no *{IN_SUM2} tensors); "
                          "prodip reads the GGUF imatrix format llama-imatrix writes")
    return {t.name[:-len(IN_SUM2)]: int(t.shape[0]) for t in r.tensors if t.name.endswith(IN_SUM2)}


def model_matmul_widths(path: Path) -> dict[str, int]:
    """{weight name: input width (ne0)} of every matmul weight of a llama GGUF."""
    r = check_model(path)
    return {t.name: int(t.shape[0]) for t in r.tensors if len(t.shape) >= 2 and MATMUL_WEIGHT.match(t.name)}


def check_imatrix(imatrix: Path, model: Path) -> dict[str, int]:
    """Refuse an importance matrix that does not belong to `model`: every matmul weight of the model
    needs an entry of its input width, and the imatrix may name no weight the model lacks.
    (llama-quantize itself only warns about a missing entry and quantizes that tensor blind.)"""
    entries = imatrix_entries(imatrix)
    weights = model_matmul_widths(model)
    foreign = sorted(set(entries) - set(weights) - {"token_embd.weight"})
    missing = sorted(set(weights) - set(entries))
    wrong = sorted(n for n in set(weights) & set(entries) if weights[n] != entries[n])
    if foreign or wrong or missing:
        detail = (f"{len(foreign)} weights the model lacks (e.g. {foreign[0]})" if foreign else
                  f"{wrong[0]} has width {entries[wrong[0]]}, the model's {weights[wrong[0]]}" if wrong else
                  f"no entry for {len(missing)} of the model's {len(weights)} weights (e.g. {missing[0]})")
        raise ExportError(f"{imatrix} is an importance matrix of another model: {detail}")
    return entries


def read_imatrix(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{weight name: (in_sum2 (nmat, width), counts (nmat, 1))} of a llama-imatrix GGUF file."""
    imatrix_entries(path)  # refuses files that are not importance matrices
    r = gguf.GGUFReader(path)
    arrays = {t.name: np.array(t.data, dtype=np.float32).reshape(-1, int(t.shape[0])) for t in r.tensors}
    return {n[:-len(IN_SUM2)]: (a, arrays[n[:-len(IN_SUM2)] + COUNTS]) for n, a in arrays.items()
            if n.endswith(IN_SUM2) and n[:-len(IN_SUM2)] + COUNTS in arrays}


def write_imatrix(entries: dict[str, tuple[np.ndarray, np.ndarray]], out: Path, *, datasets: list[str],
                  chunk_count: int, chunk_size: int) -> Path:
    """Write `entries` in llama-imatrix's GGUF format (what llama-quantize --imatrix reads)."""
    w = gguf.GGUFWriter(out, IMATRIX_ARCH)
    w.add_string("general.type", "imatrix")
    w.add_array(DATASETS_KEY, datasets)
    w.add_uint32(CHUNK_COUNT_KEY, chunk_count)
    w.add_uint32(CHUNK_SIZE_KEY, chunk_size)
    for name in sorted(entries):  # llama-imatrix's deterministic order
        sums, counts = entries[name]
        w.add_tensor(name + IN_SUM2, np.ascontiguousarray(sums, dtype=np.float32))
        w.add_tensor(name + COUNTS, np.ascontiguousarray(counts, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def calibration_chunks(ids: list[int], bos: int, chunk_tokens: int) -> list[list[int]]:
    """The token stream cut as llama-imatrix cuts it: whole chunks of chunk_tokens (the tail is
    dropped), the first token of each replaced by BOS."""
    return [[bos, *ids[i + 1:i + chunk_tokens]] for i in range(0, len(ids) - chunk_tokens + 1, chunk_tokens)]


def mean_squares(imatrix: Path) -> dict[str, np.ndarray]:
    """{weight name: in_sum2 / counts}, what llama-quantize hands llama.cpp (tools/quantize/quantize.cpp)."""
    out = {}
    for name, (sums, counts) in read_imatrix(imatrix).items():
        c = counts.reshape(-1, 1)
        out[name] = np.where(c > 0, sums / np.maximum(c, 1), 1.0).astype(np.float32).reshape(-1)
    return out


def read_calibration(text: Path) -> str:
    if not text.is_file():
        raise ExportError(f"calibration text not found: {text}")
    try:
        body = normalize(text.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ExportError(f"{text}: calibration text is not UTF-8 ({e.reason} at byte {e.start})") from None
    if not body.strip():
        raise ExportError(f"{text}: calibration text is empty")
    return body

