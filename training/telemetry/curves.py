"""RUN/curves.png: the run's curves drawn from its log.jsonl, redrawn at each evaluation.

One panel per quantity the log actually holds (a CPU run has no MFU, a run without validation no
val curves): train and validation loss, validation bits per byte, learning rate, gradient norm,
tokens/s, MFU. Drawn with matplotlib's Agg canvas (no display, no pyplot global state) and written
atomically, so a reader (the model card, a browser tab on the file) never sees half a PNG.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from training.runfiles import layout
from training.runfiles.json_records import RecordError, read_log

CURVES = layout.CURVES
PANEL_W, PANEL_H, DPI = 5.0, 2.6, 100  # inches per panel, dots per inch: ~100 KB, drawn in well under 1 s
COLUMNS = 2
TICKS = 5
LOG_Y_SPAN = 10.0  # a log-y panel goes logarithmic only when its values span more than this factor


@dataclass(frozen=True)
class Panel:
    title: str
    keys: tuple[tuple[str, str], ...]  # (log key, legend label)
    scale: float = 1.0  # values are multiplied by it (MFU as a percentage)
    log_y: bool = False


PANELS = (
    Panel("loss (nats/token)", (("loss", "train"), ("val_loss", "validation"))),
    Panel("validation bits per byte", (("val_bpb", "val bpb"),)),
    Panel("learning rate", (("lr", "lr"),)),
    Panel("gradient norm (before clipping)", (("grad_norm", "grad norm"),), log_y=True),
    Panel("tokens/s", (("tokens_per_s", "tokens/s"),)),
    Panel("MFU (%)", (("mfu", "6N' + 12 L T d"), ("mfu_6ltd", "6N' + 6 L T d")), scale=100.0),
)


def read_series(log_path: Path) -> dict[str, tuple[list[int], list[float]]]:
    """{key: (steps, values)} of every finite number the step records hold. Event records (non-finite
    diagnostics, skipped spikes) are not steps of the curve. A torn last line is no record
    (training.runfiles.json_records.read_log); a damaged line ends the reading: what precedes it is still plotted."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    try:
        for rec in read_log(log_path):
            r = rec.value
            if "event" in r or not isinstance(r.get("step"), int):
                continue
            for key, v in r.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and key != "step":
                    steps, values = series.setdefault(key, ([], []))
                    steps.append(r["step"])
                    values.append(float(v))
    except RecordError:
        pass
    return series


def draw_curves(run_dir: str | Path) -> Path | None:
    """Draw RUN/curves.png from RUN/log.jsonl; its path, or None when the log holds nothing to plot."""
    run = Path(run_dir)
    log = run / layout.LOG
    if not log.is_file():
        return None
    series = read_series(log)
    panels = [p for p in PANELS if any(k in series for k, _ in p.keys)]
    if not panels:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = math.ceil(len(panels) / COLUMNS)
    cols = min(COLUMNS, len(panels))
    width, height = PANEL_W * cols, PANEL_H * rows
    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    # fixed margins (inches), not constrained layout: that lays out every tick label twice, half the cost
    fig.subplots_adjust(left=0.75 / width, right=1 - 0.2 / width, top=1 - 0.65 / height, bottom=0.45 / height,
                        wspace=0.25, hspace=0.55)
    last = max(s[-1] for s, _ in series.values())
    fig.suptitle(f"{run.resolve().name}: step {last}", fontsize=10)
    for i, panel in enumerate(panels):
        ax = fig.add_subplot(rows, cols, i + 1)
        for key, label in panel.keys:
            if key not in series:
                continue
            steps, values = series[key]
            marker = "o" if len(steps) < 50 else None  # sparse series (validation) show their points
            ax.plot(steps, [v * panel.scale for v in values], label=label, marker=marker, markersize=3, linewidth=1)
        ax.locator_params(nbins=TICKS)  # few tick labels: text is most of the drawing time
        shown = [v for k, _ in panel.keys if k in series for v in series[k][1]]
        if panel.log_y and min(shown) > 0 and max(shown) > LOG_Y_SPAN * min(shown):  # spikes stay readable
            ax.set_yscale("log")
        ax.set_title(panel.title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if sum(k in series for k, _ in panel.keys) > 1:
            ax.legend(fontsize=7)
    out = run / CURVES
    tmp = out.with_name(out.name + ".tmp")  # atomic: a reader never sees a half-written PNG
    fig.savefig(tmp, format="png")
    os.replace(tmp, out)
    return out
