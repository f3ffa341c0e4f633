"""gpu_validate.py's report: OUT/gpu_validate.json and .md, rewritten at every phase's start and end."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

RESULTS_JSON, RESULTS_MD = "gpu_validate.json", "gpu_validate.md"  # in --out


class Results:
    """OUT/gpu_validate.json and .md, rewritten (atomically) at the start and end of every phase:
    a run killed by a time limit leaves every finished phase's figures and names the one it was in."""

    def __init__(self, out: Path, argv: dict):
        self.out = out
        self.data: dict = {"complete": False, "args": argv, "phases": [], "results": {}}

    @property
    def results(self) -> dict:
        return self.data["results"]

    @contextlib.contextmanager
    def phase(self, name: str):
        entry = {"name": name, "status": "running"}
        self.data["phases"].append(entry)
        self.save()
        t0 = time.time()
        try:
            yield self.results
            entry["status"] = "ok"
        except BaseException as e:  # recorded, then re-raised: KeyboardInterrupt and SystemExit included
            entry["status"] = "failed"
            entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            raise
        finally:
            entry["wall_s"] = round(time.time() - t0, 1)
            self.save()

    def skip_if_late(self, name: str, deadline: float, need_s: float) -> bool:
        """True when phase `name` still fits before `deadline`; else it is recorded as skipped."""
        if time.time() + need_s <= deadline:
            return True
        self.skip(name, "over the --budget-s")
        return False

    def skip(self, name: str, why: str) -> None:
        self.data["phases"].append({"name": name, "status": f"skipped: {why}", "wall_s": 0.0})
        self.save()

    def finish(self) -> None:
        self.data["complete"] = True
        self.save()

    def markdown(self) -> str:
        md = ["# GPU validation" + ("" if self.data["complete"] else " (incomplete)"), "",
              "| phase | status | wall s |", "|---|---|---:|"]
        md += [f"| {p['name']} | {p['status']}{': ' + p['error'] if 'error' in p else ''} | {p.get('wall_s', '')} |"
               for p in self.data["phases"]]
        md += ["", "| metric | value |", "|---|---|"]
        md += [f"| {k} | {json.dumps(v) if isinstance(v, (list, dict)) else v} |" for k, v in self.results.items()]
        return "\n".join(md) + "\n"

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        for name, text in ((RESULTS_JSON, json.dumps(self.data, indent=2)), (RESULTS_MD, self.markdown())):
            tmp = self.out / (name + ".tmp")
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, self.out / name)
