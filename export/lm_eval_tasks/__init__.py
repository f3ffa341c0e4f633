"""lm-evaluation-harness tasks for prodip's multiple-choice sets, scored exactly as `training.evaluate`
scores them, so `lm_eval --model hf --include_path <this folder>` on RUN/export/hf reproduces
training.evaluate's acc / acc_norm_char / acc_norm_byte (as lm_eval's acc / acc_norm / acc_bytes).

Here, not in training/assets: the tasks score an export (this stage's output) and utils.py reads the
sets through training.evaluate.mc (export may import training, not the reverse); the YAML files
ship inside the package, so `--include_path "$(python -c 'import export.lm_eval_tasks as t; print(t.TASK_DIR)')"`
works from any installed prodip, not only from a clone.
"""

from __future__ import annotations

from pathlib import Path

TASK_DIR = Path(__file__).resolve().parent
GROUP = "prodip_mc"
TASKS = ("prodip_mc_bn", "prodip_mc_en")  # task name == stem of its file in training/assets/eval
