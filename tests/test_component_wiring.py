"""[house-3] #43 item 2, components built whole: each component of the training loop receives its
collaborators in its constructor (nothing is set on it from outside afterwards), the run's shared
facts in one frozen RunContext, and its own frozen section of the settings, while TrainConfig stays
the flat form the user writes (TOML keys, flags, `--set`, run.json's "train")."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
from conftest import REPO

from training.config_sections import (
    CheckpointSection,
    MetricsSection,
    MirrorSection,
    Section,
    StepSection,
    ValidationSection,
)
from training.run_context import RunContext
from training.train_config import TrainConfig

SECTIONS = (CheckpointSection, MetricsSection, ValidationSection, MirrorSection, StepSection)
# values filled in as they are made, not components: a step's StepResult (computed, then read) and a pre-flight
# GateReport (a rerun's keeps the earlier reports and the step it resumed at)
RECORDS = {"r", "report"}


def set_from_outside(path: Path) -> list[tuple[int, str]]:
    """`self.x.y = …` and `x.y = …` (plain, tuple or augmented targets; `self.y = …` is an object's own)
    and `….register(…)` calls in a module: a component changed after it was built."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            owner = node.value
            if isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name) and owner.value.id == "self":
                found.append((node.lineno, f"self.{owner.attr}.{node.attr} ="))
            elif isinstance(owner, ast.Name) and owner.id not in {"self", *RECORDS}:
                found.append((node.lineno, f"{owner.id}.{node.attr} ="))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "register":
            found.append((node.lineno, "register(...)"))
    return sorted(found)


def test_set_from_outside_sees_each_form_of_a_late_assignment(tmp_path: Path) -> None:
    src = ("class T:\n    def f(self, m):\n        self.a.b = 1\n        self.a.c, x = 2, 3\n        self.a.d += 1\n"
           "        self.e = 4\n        self.cp.register(None, x)\n        m.keep = x\n")
    (tmp_path / "t.py").write_text(src)
    assert set_from_outside(tmp_path / "t.py") == [(3, "self.a.b ="), (4, "self.a.c ="), (5, "self.a.d ="),
                                                   (7, "register(...)"), (8, "m.keep =")]


@pytest.mark.parametrize("module", ["training/trainer.py", "training/lora_run.py", "training/loop/checkpointer.py",
                                    "training/loop/run_inputs.py", "training/loop/preflight_runner.py",
                                    "training/mirror/run_mirror.py",
                                    "training/telemetry/metrics_logger.py"])
def test_no_component_is_wired_after_it_was_built(module: str) -> None:
    """Before #43 item 2 the Trainer set checkpointer.mirror, checkpointer.keep, metrics.peak_flops and
    folder.gate_report, called checkpointer.register three times, and replaced its data bundle's loader
    with a Prefetcher when the loop started (data.train); the checkpointer set mirror.keep; Mirror.open
    set the remote on the mirror it had built."""
    assert set_from_outside(REPO / module) == []


@pytest.mark.parametrize("section", SECTIONS)
def test_a_section_is_a_frozen_view_of_the_flat_config_under_the_users_names(section: type[Section]) -> None:
    cfg = TrainConfig(out="s3://b/run", cache="/tmp/c", seq_len=64, batch_size=3, seed=7, keep_last=5, eval_every=9,
                      log_every=4, fsdp=True, async_checkpoints=False, gpu_hourly_usd=2.5)
    view = section.of(cfg)
    user_names = {f.name for f in dataclasses.fields(TrainConfig)}
    for f in dataclasses.fields(section):
        if "from_config" in f.metadata:
            continue
        assert f.name in user_names, f"{section.__name__}.{f.name} is not a TrainConfig setting"
        assert getattr(view, f.name) == getattr(cfg, f.name), f.name
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.seq_len = 1  # type: ignore[misc]


def test_the_checkpoint_section_records_the_users_whole_config_as_a_copy() -> None:
    """state.json's "train" stays the flat TrainConfig (a resume reads it back); a later change of the
    config does not reach a section already built."""
    cfg = TrainConfig(seq_len=64, skip_gates=["data"])
    view = CheckpointSection.of(cfg)
    assert view.settings == cfg.to_dict() and TrainConfig(**view.settings) == cfg
    cfg.skip_gates.append("gradient_flow")
    cfg.seq_len = 32
    assert view.settings["skip_gates"] == ["data"] and view.settings["seq_len"] == view.seq_len == 64


def test_the_run_context_is_frozen() -> None:
    ctx = RunContext(out="run")
    assert ctx.out == Path("run") and ctx.dist.is_main and ctx.device.type == "cpu"
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.kind = "sft"  # type: ignore[misc]


# the components that still take the whole TrainConfig, each for the reason its constructor gives
WHOLE_CONFIG = {"Trainer": "the user's config, split into sections for its components",
                "RunInputs": "its data factory is handed the TrainConfig; the model's shape is derived from it",
                "Preflight": "the gates' PreflightContext hands it to each gate"}


def takes_the_whole_config(path: Path) -> list[str]:
    """The classes of a module whose __init__ has a parameter annotated TrainConfig."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ClassDef):
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name == "__init__" and any(
                        a.annotation is not None and "TrainConfig" in ast.unparse(a.annotation)
                        for a in f.args.args + f.args.kwonlyargs):
                    found.append(node.name)
    return found


def test_only_the_named_components_take_the_whole_config() -> None:
    """Before #43 item 2's sections TrainStep, RunInputs and Preflight (and before them about nine components)
    were handed the whole TrainConfig; TrainStep and build_views now take training.config_sections.StepSection."""
    modules = [REPO / "training" / name for name in ("trainer.py", "lora_run.py")]
    modules += sorted(p for room in ("loop", "mirror", "telemetry", "data") for p in (REPO / "training" / room).glob("*.py"))
    found = {name: str(p.relative_to(REPO)) for p in modules for name in takes_the_whole_config(p)}
    assert set(found) == set(WHOLE_CONFIG), found
    tree = ast.parse((REPO / "training/loop/step.py").read_text(encoding="utf-8"))
    step_fns = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    assert "StepSection" in ast.unparse(step_fns["build_views"].args.args[1].annotation)
