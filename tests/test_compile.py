"""`train.py --compile` on CPU, end to end (#32 item 5): Inductor compiles the exact object that trains,
the compiled-vs-eager gate passes on it, the per-step losses follow eager's within the gate's fp32
tolerance, the checkpoint holds the model's own names (no `_orig_mod.` prefix from the compile wrapper),
and a resumed compiled run continues bit-exactly. Validation compiles nothing mid-run (#27 item 2)."""

from __future__ import annotations

import json
from pathlib import Path

import gates_runner
import pytest
import torch
from fixtures_gates import BATCH, SEQ, SMALL
from safetensors import safe_open
from torch._dynamo.utils import counters

from training.checkpoint import checkpoint_io as ckpt
from training.gates.model_gates import TOLERANCE

pytestmark = pytest.mark.slow
STEPS = 6


def _train(run: Path, data: Path, *extra: str) -> int:
    # each CLI run starts a fresh process, with no compiled code yet; in one test process dynamo keeps
    # every earlier run's graphs, and past its cache limit a new run would silently run eager
    torch._dynamo.reset()
    counters.clear()
    model = sum((["--set", f"{k}={v}"] for k, v in SMALL.items()), [])
    return gates_runner.run("none", [
        "--preset", "tiny", "--data", str(data), "--out", str(run), "--max-steps", str(STEPS), "--batch-size",
        str(BATCH), "--seq-len", str(SEQ), "--device", "cpu", "--dtype", "fp32", "--eval-every", "0",
        "--log-every", "1", "--warmup-steps", "2", "--save-every", "3", *model, *extra])


def _losses(run: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r and "event" not in r}


def test_compiled_training_matches_eager_saves_plain_names_and_resumes_exactly(gate_data, tmp_path):
    eager, compiled, resumed = tmp_path / "eager", tmp_path / "compiled", tmp_path / "resumed"
    assert _train(eager, gate_data) == 0
    assert _train(compiled, gate_data, "--compile") == 0
    # dynamo really captured graphs (past its cache limit it falls back to eager without an error)
    assert counters["stats"]["unique_graphs"] >= 1 and counters["frames"]["ok"] >= 1, dict(counters)
    gates = {g["name"]: g for g in json.loads((compiled / "gates.json").read_text())["results"]}
    assert gates["compiled_vs_eager"]["passed"] and "torch.compile" in gates["compiled_vs_eager"]["detail"]
    want, got = _losses(eager), _losses(compiled)
    assert sorted(got) == list(range(1, STEPS + 1)) == sorted(want)
    # the suite's own model, judged within ~3x of what it measures (#46 item 2): relative differences
    # <= 5e-7 (step 1: 6.932535 compiled vs 6.932538 eager, 4.3e-7). The gate's product tolerance
    # (TOLERANCE["fp32"], 1e-3, for any user's model and kernels) is 2,000x looser: it is checked above.
    rtol = 1.5e-6
    assert rtol < TOLERANCE["fp32"][0]
    for s in want:
        assert abs(got[s] - want[s]) <= rtol * abs(want[s]), (s, got[s], want[s])
    with safe_open(ckpt.latest(compiled) / "model.safetensors", "pt") as f:
        names = set(f.keys())
    with safe_open(ckpt.latest(eager) / "model.safetensors", "pt") as f:
        assert names == set(f.keys())
    assert not [n for n in names if "_orig_mod" in n]
    # a compiled run stopped at step 3 and resumed by the same command: it compiles again, the same graphs
    assert _train(resumed, gate_data, "--compile", "--stop-at", "3") == 0
    assert _train(resumed, gate_data, "--compile") == 0
    assert _losses(resumed) == got


def test_validation_compiles_no_second_graph(gate_data, tmp_path, monkeypatch):
    """#27 item 2: the blocks are compiled once, during the gates, for training's shape and grad mode;
    validation (no_grad, eval mode) runs their eager code, so no compile happens after the gates: none
    at the first validation (step 2), none at the later ones. Counted by dynamo's own counters."""
    from training.loop.validator import Validator

    seen: list[tuple[int, int]] = []  # (graphs, frames) when each validation starts and ends
    validate = Validator.validate

    def counted(self):
        seen.append((counters["stats"]["unique_graphs"], counters["frames"]["ok"]))
        out = validate(self)
        seen.append((counters["stats"]["unique_graphs"], counters["frames"]["ok"]))
        return out

    monkeypatch.setattr(Validator, "validate", counted)
    assert _train(tmp_path / "run", gate_data, "--compile", "--eval-every", "2", "--eval-batches", "2") == 0
    end = (counters["stats"]["unique_graphs"], counters["frames"]["ok"])
    assert len(seen) == 2 * 3 and seen[0][0] >= 1, seen  # validations at steps 2, 4, 6
    assert set(seen) == {end}, (seen, end)  # nothing compiled from the first validation on
    assert end[0] == 1, end  # one graph: every block shares it (parameters are its inputs)
    assert not counters["graph_break"], dict(counters["graph_break"])
