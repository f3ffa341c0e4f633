"""What one redraw of RUN/curves.png costs (training.telemetry.curves.draw_curves, run at every evaluation).

    python tests/benchmarks/bench_curves.py --steps 2000 --evaluations 20 --repeats 5

Writes a synthetic log.jsonl of --steps step records (--evaluations of them with validation results)
into a temporary folder, draws once (matplotlib's import and font cache), then times --repeats redraws:
CPU seconds and wall seconds, median and max. The test suite checks the events that keep a redraw cheap
(tests/test_curves.py: drawn only at evaluations, a bounded number of texts); seconds live here, where
a loaded machine cannot fail a test. Measured on the 2-core test machine (2,000 steps, 20 evaluations):
0.35 CPU-s quiet and 0.45-0.69 CPU-s under other test runs (the suite's old timed test); 2026-12-06,
3 redraws at load 16: 0.25-0.27 CPU-s, 0.97-1.15 s of wall time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_curves.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--evaluations", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    return p


def write_log(path: Path, steps: int, evaluations: int) -> None:
    every = max(1, steps // max(1, evaluations))
    with open(path, "w", encoding="utf-8") as f:
        for i in range(1, steps + 1):
            rec = {"step": i, "loss": 8.0 - 0.001 * i, "lr": 1e-3, "grad_norm": 1.0 + 0.001 * i,
                   "tokens": 1000 * i, "tokens_per_s": 5000.0, "mfu": None, "elapsed_s": 0.1 * i}
            if i % every == 0:
                rec |= {"val_loss": 3.0, "val_bpb": 1.2}
            f.write(json.dumps(rec) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from training.runfiles import layout
    from training.telemetry.curves import draw_curves

    with tempfile.TemporaryDirectory() as d:
        write_log(Path(d) / layout.LOG, args.steps, args.evaluations)
        draw_curves(d)  # the first draw imports matplotlib and builds its font cache
        cpu, wall = [], []
        for _ in range(args.repeats):
            c, w = time.process_time(), time.perf_counter()
            draw_curves(d)
            cpu.append(time.process_time() - c)
            wall.append(time.perf_counter() - w)
    print(f"| steps | evaluations | redraws | CPU s median | CPU s max | wall s median | wall s max |\n"
          f"|---:|---:|---:|---:|---:|---:|---:|\n"
          f"| {args.steps:,} | {args.evaluations} | {args.repeats} | {statistics.median(cpu):.3f} | {max(cpu):.3f} "
          f"| {statistics.median(wall):.3f} | {max(wall):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
