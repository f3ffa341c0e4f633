"""--shard-index/--num-shards and `python -m training.prepare merge`: N machines encode disjoint
slices with one tokenizer; the merged folder holds exactly what one machine would have written."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
from conftest import CORPUS
from test_prepare_clean import decoded_docs

from training.data.loaders import TokenStream, read_meta
from training.prepare import PrepareError, main, merge, prepare

FAST = {"workers": 1, "progress": False, "fertility_floor": 1.5}
N = 3


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("whole") / "data"
    prepare([CORPUS], out, vocab_size=1024, **FAST)
    return out


@pytest.fixture(scope="module")
def shards(whole, tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("shards")
    outs = []
    for i in range(N):
        rc = main(["--input", str(CORPUS), "--out", str(root / f"s{i}"), "--tokenizer", str(whole / "tokenizer.model"),
                   "--shard-index", str(i), "--num-shards", str(N), "--fertility-floor", "1.5", "--workers", "1",
                   "--no-progress"])
        assert rc == 0
        outs.append(root / f"s{i}")
    return outs


def test_shards_are_disjoint_and_merge_equals_one_machine(whole, shards, tmp_path):
    per_shard = [Counter(decoded_docs(s)) for s in shards]
    for i in range(N):
        for j in range(i + 1, N):
            assert not set(per_shard[i]) & set(per_shard[j]), "a document was encoded on two machines"
    assert all(read_meta(s)["shard"] == {"index": i, "num_shards": N} for i, s in enumerate(shards))
    out = tmp_path / "merged"
    assert main(["merge", *map(str, reversed(shards)), "--out", str(out)]) == 0
    merged, one = read_meta(out), read_meta(whole)
    assert merged["tokenizer_sha256"] == one["tokenizer_sha256"]
    for split in ("train", "val"):
        for k in ("n_docs", "n_tokens", "n_chars", "n_bytes"):
            assert merged["splits"][split][k] == one["splits"][split][k], (split, k)
        assert TokenStream(out, split, tokenizer_sha256=one["tokenizer_sha256"]).n_tokens == one["splits"][split]["n_tokens"]
    assert Counter(decoded_docs(out)) == Counter(decoded_docs(whole))
    rep = json.loads((out / "report.json").read_text())
    assert rep["documents"]["raw"] == json.loads((whole / "report.json").read_text())["documents"]["raw"]
    assert all(g["passed"] for g in rep["gates"])
    assert [m["index"] for m in merged["merged_from"]] == list(range(N))


def test_merge_refuses_mismatches(shards, tmp_path):
    with pytest.raises(PrepareError, match=r"missing \[2\]"):
        merge(shards[:2], tmp_path / "a")
    with pytest.raises(PrepareError, match=r"repeated \[0\]"):
        merge([shards[0], shards[0], shards[1], shards[2]], tmp_path / "b")
    bad = tmp_path / "bad"
    shutil.copytree(shards[1], bad)
    victim = sorted((bad / "train").glob("shard_*.bin"))[0]
    victim.write_bytes(victim.read_bytes()[:-2])
    with pytest.raises(PrepareError, match="truncated"):
        merge([shards[0], bad, shards[2]], tmp_path / "c")
    other = tmp_path / "other"
    shutil.copytree(shards[2], other)
    (other / "tokenizer.model").write_bytes((other / "tokenizer.model").read_bytes() + b"\0")
    with pytest.raises(PrepareError, match="another tokenizer"):
        merge([shards[0], shards[1], other], tmp_path / "d")
    assert not any((tmp_path / x).exists() for x in "abcd")


def test_sharding_needs_a_tokenizer(tmp_path, capsys):
    rc = main(["--input", str(CORPUS), "--out", str(tmp_path / "d"), "--shard-index", "0", "--num-shards", "2"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: --num-shards needs --tokenizer") and len(err.splitlines()) == 1
