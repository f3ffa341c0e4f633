"""`python -m export verify EXPORT_DIR` and serving's check before it loads a file of an export: the
sha256 and size manifest.json records for every exported file (export.manifest) are checked again, and a
changed byte, a missing or resized file, or weights the manifest does not list are refused by name."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from fixtures_reliability import call_main, one_error

from serving.backend import ServingError
from serving.export_files import Manifest, check_before_load, files_read_by
from training.runfiles import layout


@pytest.fixture(scope="module")
def exported_run(rel_run, tmp_path_factory) -> Path:
    """A copy of the 4-step run exported to HF and an F32 GGUF, both recorded in its export's manifest.json."""
    from export.gguf.gguf_export import export_gguf
    from export.hf.hf_export import export_hf
    from export.manifest import Manifest as Written
    from export.manifest import load_source

    run = tmp_path_factory.mktemp("verify") / "run"
    shutil.copytree(rel_run, run)
    src = load_source(run)
    man = Written.open(run / layout.EXPORT, src, force=False)
    export_hf(src, run / layout.EXPORT, man)
    export_gguf(src, run / layout.EXPORT, ["F32"], man)
    man.save()
    return run


@pytest.fixture
def run(exported_run, tmp_path) -> Path:
    """A fresh copy to damage."""
    return Path(shutil.copytree(exported_run, tmp_path / "run"))


def listed(run: Path) -> dict[str, dict]:
    return json.loads((run / layout.EXPORT / layout.MANIFEST).read_text(encoding="utf-8"))["files"]


def gguf_of(run: Path) -> str:
    [rel] = [r for r in listed(run) if r.endswith(".gguf")]
    return rel


def flip_byte(path: Path) -> None:
    """One byte in the middle of the file changed; its size unchanged."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))


def verify(path: Path, capsys, *flags: str) -> tuple[int, str, str]:
    return call_main("export.__main__", ["verify", path, *flags], capsys)


def test_an_untouched_export_verifies(run, capsys):
    files = listed(run)
    assert {r.split("/")[0] for r in files} == {"gguf", "hf"} and len(files) >= 6, files  # both formats compared
    rc, out, err = verify(run / layout.EXPORT, capsys)
    assert rc == 0 and f"verified {len(files)} files" in out and not err, (out, err)
    assert verify(run, capsys)[0] == 0  # the run folder stands for its export/


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_a_changed_file_is_named(run, damage, capsys):
    rel = gguf_of(run)
    f = run / layout.EXPORT / rel
    if damage == "flip":
        flip_byte(f)
    elif damage == "truncate":
        os.truncate(f, f.stat().st_size - 1)
    else:
        f.unlink()
    line = one_error(*verify(run / layout.EXPORT, capsys), (rel,))
    assert "1 file(s) differ" in line and {"flip": "sha256", "truncate": "bytes", "remove": "missing"}[damage] in line
    others = [r for r in listed(run) if r != rel]
    assert not any(r in line for r in others), line  # only the changed file is named


def test_weights_the_manifest_does_not_list_are_named_unless_a_listed_files_twin(run, capsys):
    export = run / layout.EXPORT
    rel = gguf_of(run)
    twin = export / "genai" / Path(rel).name  # ONNX Runtime GenAI's folders hard-link the verified files
    twin.parent.mkdir()
    os.link(export / rel, twin)
    assert verify(export, capsys)[0] == 0
    stray = export / "gguf" / "mine-Q5_K_M.gguf"
    shutil.copyfile(export / rel, stray)
    line = one_error(*verify(export, capsys), ("gguf/mine-Q5_K_M.gguf",))
    assert "does not list" in line
    stray.unlink()
    twin.unlink()
    shutil.copyfile(export / rel, twin)
    flip_byte(twin)  # a copy, no longer byte-identical to the listed file of its name
    one_error(*verify(export, capsys), (f"genai/{twin.name}",))


def test_a_manifest_that_compares_nothing_or_points_outside_is_refused(run, tmp_path, capsys):
    export = run / layout.EXPORT
    data = json.loads((export / layout.MANIFEST).read_text(encoding="utf-8"))
    (export / layout.MANIFEST).write_text(json.dumps({**data, "files": {}}), encoding="utf-8")
    assert "lists no files" in one_error(*verify(export, capsys), (layout.MANIFEST,))
    entry = next(iter(data["files"].values()))
    (export / layout.MANIFEST).write_text(json.dumps({**data, "files": {"../run.json": entry}}), encoding="utf-8")
    assert "not a path inside" in one_error(*verify(export, capsys), (layout.MANIFEST,))
    one_error(*verify(tmp_path / "nowhere", capsys), ("nowhere",))
    one_error(*verify(run / layout.CHECKPOINTS, capsys), (layout.MANIFEST,))  # a folder, but no export
    one_error(*verify(export, capsys, "--q4"), ("--q4",))  # a flag verify would ignore is refused


def test_serving_refuses_a_changed_export_file_before_loading_it(run, capsys, monkeypatch):
    """`python -m serving RUN/export/gguf/x.gguf` with one byte changed: one error naming the file, and
    the runtime never opened it (llama.cpp loads such a file and answers with the damaged weights)."""
    import serving.backends.llamacpp_backend

    opened = []
    real = serving.backends.llamacpp_backend.LlamaCppBackend
    monkeypatch.setattr(serving.backends.llamacpp_backend, "LlamaCppBackend", lambda *a, **k: opened.append(a) or real(*a, **k))
    gguf = run / layout.EXPORT / gguf_of(run)
    rc, out, err = call_main("serving.__main__", [gguf, "--prompt", "আমি", "--max-tokens", "2", "--threads", "1"], capsys)
    assert rc == 0 and opened == [(gguf,)], err  # the untouched file is checked and served
    flip_byte(gguf)
    opened.clear()
    line = one_error(*call_main("serving.__main__", [gguf, "--prompt", "আমি", "--threads", "1"], capsys), (str(gguf),))
    assert "sha256" in line and "python -m export verify" in line and opened == []
    hf = run / layout.EXPORT / layout.HF_DIR  # a folder: every listed file under it is checked
    flip_byte(hf / "config.json")
    with pytest.raises(ServingError, match="config.json"):
        check_before_load(hf)


def test_a_load_reads_the_model_its_sidecars_and_the_files_beside_it_not_the_other_models(tmp_path):
    names = ["onnx/model.onnx", "onnx/model.onnx_data", "onnx/model-int8.onnx", "onnx/model-int8.onnx_data",
             "onnx/tokenizer.model", "onnx/onnx_config.json", "gguf/r-F16.gguf", "gguf/r-Q4_K_M.gguf",
             "hf/config.json", "hf/model.safetensors"]
    for n in names:
        (tmp_path / n).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / n).touch()
    m = Manifest(tmp_path, dict.fromkeys(names, {"size": 0, "sha256": "0" * 64}))
    assert files_read_by(m, tmp_path / "onnx" / "model.onnx") == [
        "onnx/model.onnx", "onnx/model.onnx_data", "onnx/onnx_config.json", "onnx/tokenizer.model"]
    assert files_read_by(m, tmp_path / "gguf" / "r-Q4_K_M.gguf") == ["gguf/r-Q4_K_M.gguf"]
    assert files_read_by(m, tmp_path / "hf") == ["hf/config.json", "hf/model.safetensors"]
    (tmp_path / "gguf" / "mine.gguf").touch()
    assert files_read_by(m, tmp_path / "gguf" / "mine.gguf") == []  # the user's own file: nothing listed to check
