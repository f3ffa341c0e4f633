"""RUN/curves.png: drawn by the step log at each evaluation, one panel per quantity the log holds,
written atomically; a real training run leaves one behind."""

from __future__ import annotations

import json
import time
from pathlib import Path

import matplotlib.image
import pytest
from conftest import CORPUS

from training.runfiles import layout
from training.runfiles.json_records import RecordError, read_log
from training.telemetry.curves import COLUMNS, DPI, PANEL_H, PANEL_W, PANELS, TICKS, draw_curves, read_series
from training.telemetry.step_metrics import StepLog


def step(i: int, **extra) -> dict:
    return {"step": i, "loss": 8.0 - 0.1 * i, "lr": 1e-3, "grad_norm": 1.0 + 0.01 * i, "tokens": 1000 * i,
            "tokens_per_s": 5000.0, "mfu": None, "elapsed_s": 0.1 * i, **extra}


def image_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels of the PNG, decoded."""
    h, w = matplotlib.image.imread(path).shape[:2]
    return w, h


def expected_size(n_panels: int) -> tuple[int, int]:
    rows, cols = -(-n_panels // COLUMNS), min(COLUMNS, n_panels)
    return round(PANEL_W * cols * DPI), round(PANEL_H * rows * DPI)


def test_step_log_draws_at_each_evaluation_and_at_close(tmp_path: Path) -> None:
    log = StepLog(tmp_path / layout.LOG)
    curves = tmp_path / layout.CURVES
    for i in range(1, 5):
        log.write(step(i))
    assert not curves.exists()  # steps alone: no drawing (cheap until an evaluation)
    log.write(step(5, val_loss=7.0, val_bpb=2.5))
    # panels: loss (train + val), val bpb, lr, grad norm, tokens/s; no MFU on CPU
    assert image_size(curves) == expected_size(5)
    first = curves.stat().st_mtime_ns
    time.sleep(0.02)
    log.write(step(6))
    assert curves.stat().st_mtime_ns == first
    log.close()  # the steps after the last evaluation are drawn too
    assert curves.stat().st_mtime_ns > first
    assert not list(tmp_path.glob("*.tmp"))


def test_absent_keys_leave_their_panels_out(tmp_path: Path) -> None:
    (tmp_path / layout.LOG).write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 1, "loss": 5.0, "lr": 1e-3},
        {"event": "nonfinite", "step": 2, "loss": float("nan")},  # an event is not a point of the curve
        {"step": 2, "loss": 4.0, "lr": 1e-3, "val_loss": 4.5},
    ]))
    assert image_size(draw_curves(tmp_path)) == expected_size(2)  # loss (train + val), lr
    series = read_series(tmp_path / layout.LOG)
    assert series["loss"] == ([1, 2], [5.0, 4.0]) and series["val_loss"] == ([2], [4.5])


def test_all_panels_with_mfu(tmp_path: Path) -> None:
    (tmp_path / layout.LOG).write_text("".join(
        json.dumps(step(i, mfu=0.4, mfu_6ltd=0.35, val_loss=3.0, val_bpb=1.2)) + "\n" for i in range(1, 4)))
    assert image_size(draw_curves(tmp_path)) == expected_size(len(PANELS))


def test_nothing_to_plot_and_a_torn_line(tmp_path: Path) -> None:
    assert draw_curves(tmp_path) is None  # no log
    (tmp_path / layout.LOG).write_text('{"event": "start"}\n')
    assert draw_curves(tmp_path) is None and not (tmp_path / layout.CURVES).exists()
    (tmp_path / layout.LOG).write_text(json.dumps(step(1)) + "\n" + '{"step": 2, "lo')  # killed mid-line
    assert draw_curves(tmp_path) is not None
    assert read_series(tmp_path / layout.LOG)["loss"] == ([1], [7.9])


def test_one_log_reader_one_torn_line_policy(tmp_path: Path, capsys) -> None:
    """log.jsonl has one reader (training.runfiles.json_records.read_log) for the curves, --plan's measured speed and
    resume's truncation: a last line without its newline (a kill mid-write, here cut inside a Bangla
    character) is no record and no error; a damaged complete line is an error naming file:line, and
    each reader keeps what precedes it."""
    log = tmp_path / layout.LOG
    good = [json.dumps(step(i, note="বাংলা"), ensure_ascii=False) for i in (1, 2)]
    log.write_bytes(("\n".join(good) + "\n").encode() + json.dumps(step(3, note="বা"), ensure_ascii=False).encode()[:-3])  # `"}` and a byte of া
    assert [r.value["step"] for r in read_log(log)] == [1, 2]
    assert read_series(log)["loss"][0] == [1, 2]
    log.write_text(f"{good[0]}\nnot json\n{good[1]}\n", encoding="utf-8")
    with pytest.raises(RecordError, match=r"log.jsonl:2: training log: not a JSON record"):
        list(read_log(log))
    assert read_series(log)["loss"][0] == [1]  # the plot keeps what precedes the damage
    log.write_text(f"{good[0]}\n[1, 2]\n", encoding="utf-8")
    with pytest.raises(RecordError, match=r"log.jsonl:2: training log: not a JSON object"):
        list(read_log(log))
    # resume: records past the checkpoint and a torn tail go, the records kept are byte-identical
    log.write_text("\n".join(good) + "\n" + good[1][:9], encoding="utf-8")
    resumed = StepLog(log, curves=False)
    resumed.truncate_after(1)
    resumed.close()
    assert log.read_text(encoding="utf-8") == good[0] + "\n"
    with pytest.raises(RecordError, match="cannot read the training log"):
        list(read_log(tmp_path / "missing.jsonl"))


def test_a_plot_that_cannot_be_written_does_not_stop_training(tmp_path: Path, capsys) -> None:
    (tmp_path / (layout.CURVES + ".tmp")).mkdir()  # savefig cannot write its temporary file
    log = StepLog(tmp_path / layout.LOG)
    log.write(step(1, val_loss=7.0))
    log.write(step(2, val_loss=6.0))
    log.close()
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "curves not drawn" in err
    assert len((tmp_path / layout.LOG).read_text().splitlines()) == 2


def test_disabled_log_draws_nothing(tmp_path: Path) -> None:
    log = StepLog(tmp_path / layout.LOG, enabled=False)  # ranks other than 0
    log.write(step(1, val_loss=7.0))
    log.close()
    assert not list(tmp_path.iterdir())


def log_of(n_steps: int, evaluations: int = 20) -> str:
    every = max(1, n_steps // evaluations)
    return "".join(json.dumps(step(i, **({"val_loss": 3.0, "val_bpb": 1.2} if i % every == 0 else {}))) + "\n"
                   for i in range(1, n_steps + 1))


def test_drawing_stays_cheap_by_construction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Redrawing must not slow training, checked as events, not seconds (a loaded machine inflates even CPU
    time; the seconds are a benchmark's: tests/benchmarks/bench_curves.py, 0.25-0.69 CPU-s per redraw of
    this log on the 2-core machine). A 2,000-step run with 20 evaluations draws 20 times, never per step;
    and a drawing renders a bounded number of texts whatever the log's length (text is most of the
    drawing time): per panel its title, x label, legend and at most TICKS + 1 tick labels per axis
    (MaxNLocator with TICKS bins), plus the figure's title. Measured: 51-57 texts for logs of 20 to
    20,000 steps; 80-81 once the tick limit is dropped."""
    import matplotlib.text

    draws: list[Path] = []
    monkeypatch.setattr("training.telemetry.curves.draw_curves", lambda run: draws.append(run))
    log = StepLog(tmp_path / layout.LOG)
    for rec in log_of(2000).splitlines():
        log.write(json.loads(rec))
    log.close()
    assert len(draws) == 20 and len((tmp_path / layout.LOG).read_text().splitlines()) == 2000
    monkeypatch.undo()

    texts: list[str] = []
    real_draw = matplotlib.text.Text.draw
    monkeypatch.setattr(matplotlib.text.Text, "draw",
                        lambda self, r: (texts.append(self.get_text()) if self.get_visible() and self.get_text()
                                         else None, real_draw(self, r))[1])
    # the figure's title; 5 panels (no MFU on CPU) of title, x label, tick labels; the loss panel's 2-entry legend
    bound = 1 + 5 * (2 + 2 * (TICKS + 1)) + 2
    for n in (20, 2000):
        (tmp_path / layout.LOG).write_text(log_of(n))
        texts.clear()
        draw_curves(tmp_path)
        assert 5 * 4 < len(texts) <= bound, (n, len(texts), bound, texts)  # each panel's title, label, 2+ ticks


def test_a_training_run_draws_its_curves(tiny_run: Path) -> None:
    """The suite's shared tiny run (300 steps, an evaluation every 100): the trainer needs nothing
    beyond its step log to leave curves behind."""
    assert image_size(tiny_run / layout.CURVES) == expected_size(5)  # no MFU on CPU
    assert not list(tiny_run.glob("*.tmp"))


def tiny_checkpoint(run: Path) -> None:
    """A real run folder without training: a tokenizer trained on the shipped corpus and a random
    tiny model, saved as a checkpoint (what `python -m export` reads)."""
    import torch

    from training.checkpoint import checkpoint_io as ckpt
    from training.model.decoder import Transformer, preset
    from training.text.normalization import normalize
    from training.text.tokenizer import train_tokenizer

    lines = [normalize(x) for f in sorted(CORPUS.glob("*.txt")) for x in f.read_text(encoding="utf-8").splitlines()]
    tok = train_tokenizer([x for x in lines if x.strip()][:400], vocab_size=400, num_threads=1)
    cfg = preset("tiny", vocab_size=tok.vocab_size, n_layers=1)
    torch.manual_seed(0)
    ckpt.save(run, 1, weights=ckpt.weights_for_save(Transformer(cfg).state_dict(), cfg), cfg=cfg, tokenizer=tok,
              state={"kind": "pretrain"})


def test_the_model_card_embeds_the_curves(tmp_path: Path) -> None:
    from export.manifest import Manifest, load_source
    from export.model_card import write_card

    run, out = tmp_path / "run", tmp_path / "run" / layout.EXPORT
    tiny_checkpoint(run)
    src = load_source(run)
    out.mkdir()
    card = write_card(src, out, Manifest.open(out, src, force=False))  # no curves yet: no section, no file
    assert "## Training curves" not in card.read_text() and not (out / layout.CURVES).exists()

    (run / layout.LOG).write_text("".join(json.dumps(step(i, val_loss=7.0)) + "\n" for i in (1, 2)))
    draw_curves(run)
    card = write_card(src, out, Manifest.open(out, src, force=False))
    text = card.read_text()
    assert "## Training curves" in text and f"![training curves]({layout.CURVES})" in text
    assert (out / layout.CURVES).read_bytes() == (run / layout.CURVES).read_bytes()  # the link resolves

    (run / layout.CURVES).unlink()  # re-exported from a run without curves: the stale copy goes
    write_card(src, out, Manifest.open(out, src, force=False))
    assert not (out / layout.CURVES).exists() and "## Training curves" not in card.read_text()
