"""`--input hf:NAME[:CONFIG][:SPLIT]`: a Hugging Face dataset read with the real `datasets` library
from a local folder in the hub layout (no network), and the one-line error on an offline machine."""

from __future__ import annotations

import json
from pathlib import Path

import datasets  # noqa: F401  (dev dependencies, as pyarrow: absent, this module fails, never skips)
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import CORPUS

from training.data.loaders import TokenStream
from training.prepare import PrepareError, iter_file_docs, main, prepare, resolve_inputs

FAST = {"workers": 1, "progress": False, "fertility_floor": 1.5}


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return [d for f in resolve_inputs([CORPUS]) for d in iter_file_docs(f)]


@pytest.fixture(scope="module")
def hub_folder(docs, tmp_path_factory) -> Path:
    """A dataset folder as `huggingface-cli download` leaves it: data/{split}-0000N-of-0000M.parquet."""
    root = tmp_path_factory.mktemp("hub") / "prodip-bn-corpus"
    (root / "data").mkdir(parents=True)
    half = len(docs) // 2
    for i, part in enumerate((docs[:half], docs[half:])):
        pq.write_table(pa.table({"id": list(range(len(part))), "body": part}),
                       root / "data" / f"train-{i:05d}-of-00002.parquet")
    pq.write_table(pa.table({"id": [0], "body": ["a validation split, not read"]}),
                   root / "data" / "validation-00000-of-00001.parquet")
    (root / "README.md").write_text("---\nlicense: apache-2.0\n---\nShipped prodip corpus, for tests.\n")
    return root


def tokens(data: Path) -> dict[str, np.ndarray]:
    return {s: np.concatenate([np.asarray(p) for p in TokenStream(data, s).parts]) for s in ("train", "val")}


def test_hf_local_folder_equals_the_same_text_as_jsonl(hub_folder, docs, tmp_path):
    jsonl = tmp_path / "same.jsonl"
    jsonl.write_text("".join(json.dumps({"body": d}, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    a, b = tmp_path / "from_hf", tmp_path / "from_jsonl"
    meta = prepare([f"hf:{hub_folder}::train"], a, vocab_size=1024, text_field="body", **FAST)
    prepare([jsonl], b, vocab_size=1024, text_field="body", **FAST)
    assert meta["inputs"] == [f"hf:{hub_folder}::train"]
    assert (a / "tokenizer.model").read_bytes() == (b / "tokenizer.model").read_bytes()
    ta, tb = tokens(a), tokens(b)
    for split in ta:
        assert np.array_equal(ta[split], tb[split]), split
    report = json.loads((a / "report.json").read_text())
    assert report["documents"]["raw"] == len(docs)  # the validation split was not read


def test_hf_missing_column_names_the_columns(hub_folder, tmp_path):
    with pytest.raises(PrepareError, match=r"no 'text' column \(columns: id, body\)"):
        prepare([f"hf:{hub_folder}"], tmp_path / "d", vocab_size=1024, **FAST)
    assert not (tmp_path / "d").exists()


def test_offline_hub_dataset_is_one_line_naming_it_and_hf_hub_offline(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "data"
    rc = main(["--input", "hf:prodip-no-such-org/no-such-dataset:ben_Beng", "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("error: ")
    assert "prodip-no-such-org/no-such-dataset" in err and "HF_HUB_OFFLINE" in err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_bad_hf_spec(tmp_path):
    with pytest.raises(PrepareError, match=r"hf:NAME\[:CONFIG\]\[:SPLIT\]"):
        prepare(["hf:a:b:c:d"], tmp_path / "d", **FAST)
