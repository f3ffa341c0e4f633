"""Fixtures for the ONNX export / serving tests: the suite's one trained run, exported once.

The run is conftest's `tiny_run` (training/train.py on the corpus that ships in training/assets), so
the exactness tests never skip; it is exported by export.onnx.onnx_export with the int8 and int4 variants into a
folder of its own (the run is shared by the whole suite and stays untouched).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import built_once

from training.checkpoint import checkpoint_io as checkpoint
from training.model.logprobs import kl_rows


@pytest.fixture(scope="session")
def onnx_run(tiny_run) -> Path:
    return tiny_run


@pytest.fixture(scope="session")
def onnx_export(onnx_run, tmp_path_factory) -> tuple[Path, list[Path]]:
    """(out_dir, files written) of the tiny run exported with fp32, int8 and int4."""
    from export.onnx.onnx_export import export_onnx

    def build(root: Path) -> tuple[Path, list[Path]]:
        return root / "onnx", export_onnx(onnx_run, root / "onnx", int8=True, int4=True)

    return built_once(tmp_path_factory, "onnx-export", build)


@pytest.fixture(scope="session")
def torch_model(onnx_run):
    model, ck = checkpoint.load_model(onnx_run)
    return model, ck


def probe_ids(tok) -> list[int]:
    return tok.encode("সোনার বাংলা, আমি তোমায় ভালোবাসি। আজ সকালে আকাশ মেঘলা ছিল, তবু আমরা নদীর ধারে গেলাম।", bos=True)


def kl_mean(ref: np.ndarray, q: np.ndarray) -> float:
    """Mean over positions of KL(softmax(ref) || softmax(q))."""
    return float(kl_rows(ref, q).mean())


def torch_greedy(model, ids: list[int], n: int, eos_ids: tuple[int, ...]) -> list[int]:
    """Greedy continuation by recomputing the full sequence each step (no cache): an independent reference."""
    seq, out = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(torch.tensor([seq]))[0, -1].argmax())
            if nxt in eos_ids:
                break
            seq.append(nxt)
            out.append(nxt)
    return out
