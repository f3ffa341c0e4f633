"""RunInputs (training.loop.run_inputs), built alone: what a run reads before anything is written — the
run folder's place, the data and the model shape, the first weights — with its checks, on real files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fixtures_gates import SMALL, train_cfg

from training import distributed as D
from training.checkpoint import checkpoint_io as ckpt
from training.config_sections import CheckpointSection
from training.data.loaders import pretraining_data
from training.loop.checkpointer import Checkpointer
from training.loop.run_inputs import RunInputs
from training.model.decoder import Transformer
from training.run_context import RunContext
from training.train_config import ConfigError

pytest_plugins = ("fixtures_gates",)  # gate_data
CPU = torch.device("cpu")


def _inputs(cfg) -> RunInputs:
    return RunInputs(cfg, RunContext(D.Dist(), CPU, cfg.out), data_factory=pretraining_data)


def test_reads_the_data_and_the_model_shape_and_writes_nothing(gate_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    inputs = _inputs(train_cfg(gate_data, out))
    assert inputs.open_mirror() is None  # a local --out: no mirror
    checked = []
    data, model_cfg = inputs.read_data(check=lambda: checked.append(True))
    assert checked == [True]  # the caller's check ran inside the same agreed read
    assert model_cfg.vocab_size == data.tokenizer.vocab_size == 1024  # the data's tokenizer sets the vocabulary
    assert (model_cfg.d_model, model_cfg.n_layers) == (SMALL["d_model"], SMALL["n_layers"])
    assert not out.exists() and inputs.gates == []


@pytest.mark.parametrize("over,flag", [({"seq_len": 256, "model": {**SMALL, "max_seq_len": 128}}, "--seq-len 256"),
                                       ({"early_stop_patience": 2, "eval_every": 0}, "--early-stop-patience 2")])
def test_refuses_what_the_data_and_shape_cannot_honour(gate_data: Path, tmp_path: Path, over, flag) -> None:
    with pytest.raises(ConfigError, match=flag):
        _inputs(train_cfg(gate_data, tmp_path / "run", **over)).read_data()


def test_first_weights_from_init_are_the_other_runs(gate_data: Path, tmp_path: Path) -> None:
    """--init: a fresh run starts from another run's newest checkpoint (its weights, nothing else)."""
    cfg = train_cfg(gate_data, tmp_path / "base")
    data, model_cfg = _inputs(cfg).read_data()
    torch.manual_seed(1)
    base = Transformer(model_cfg)
    ckpt.save(tmp_path / "base", 5, weights=ckpt.weights_for_save(base.state_dict(), model_cfg), cfg=model_cfg, tokenizer=data.tokenizer,
              state={"step": 5})
    fresh = Transformer(model_cfg)
    cfg2 = train_cfg(gate_data, tmp_path / "new", init=str(tmp_path / "base"))
    inputs = _inputs(cfg2)
    inputs.init_weights(fresh, data, Checkpointer(CheckpointSection.of(cfg2),
                                                  RunContext(D.Dist(), CPU, tmp_path / "new")))
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in base.state_dict().items())
