"""Upload throughput of a checkpoint to an S3-compatible server, and the stall it adds to training:
the mirror's upload child process against the same work on a thread in the training process.

    python tests/benchmarks/bench_remote.py --size-mb 256                # both uploaders, one table
    python tests/benchmarks/bench_remote.py --uploader thread --repeat 3

Starts moto's server on 127.0.0.1 in its own process (its request handling must not share this
process's GIL, as a real store does not), writes a checkpoint folder of --size-mb (three files:
weights, optimizer moments, state), and runs a training-like loop (one fp32 matmul per "step") on
the main thread while training.mirror.run_mirror.Mirror uploads that checkpoint, as train.py does: with
`process` (train.py's: a child process at a lower CPU priority, training.store.mirror_worker) and
with `thread` (the same work on a thread of this process, the uploader before issue #29). Prints
one table, a column per upload: upload seconds and MB/s, the time the training thread spent
handing the checkpoint over (Mirror.checkpoint), the median step before and during the upload, and
the stall the upload added (the steps' time during the upload minus as many steps at the
baseline's mean, plus the hand-off), also as a share of training time at one checkpoint per 10
minutes. The uploaders take turns (--repeat rounds), so a machine's changing load hits both.
Here moto shares this machine's cores (--server-nice 19 makes it yield them, as a store that is
not on the machine would). moto keeps objects in memory (each upload is deleted after it): a full `400m` checkpoint (~4.7 GB)
is extrapolated from the rate, not uploaded.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

CHECKPOINT_400M_GB = 4.68  # 0.39 B params x 4 bytes x (weights + 2 AdamW moments)
BASELINE_STEPS = 2000
SETTLE_S = 1.0  # after start(): the child's start-up (imports) is not in the baseline
TARGET_PCT = 1.0  # issue #29: < 1 % of training time at one checkpoint per 10 minutes
EVERY_S = 600.0
UPLOADERS = ("thread", "process")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python tests/benchmarks/bench_remote.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=256, help="checkpoint size to upload (default 256)")
    p.add_argument("--matmul", type=int, default=384, help="the step: one NxN fp32 matmul (default 384)")
    p.add_argument("--uploader", action="append", choices=UPLOADERS,
                   help="which uploader(s), in this order (repeatable; default: thread, then process)")
    p.add_argument("--repeat", type=int, default=1, help="rounds of every uploader (default 1)")
    p.add_argument("--server-nice", type=int, default=0,
                   help="moto's niceness (default 0); 19 stands in for a store that is not on this machine")
    return p


def _upload(kind: str, tag: str, fs, size: int, n: int, torch) -> dict[str, float | int]:
    """One checkpoint of `size` bytes uploaded by uploader `kind` while the main thread "trains"."""
    from training import distributed as D
    from training.config_sections import MirrorSection
    from training.mirror.run_mirror import Mirror
    from training.run_context import RunContext

    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        step_dir = cache / "checkpoints" / "step_0000001"
        step_dir.mkdir(parents=True)
        for name, share in (("model.safetensors", 1 / 3), ("optim.safetensors", 2 / 3 - 1e-3), ("state.json", 1e-3)):
            (step_dir / name).write_bytes(os.urandom(int(size * share)))
        mirror = Mirror(MirrorSection.default(out=f"s3://bench/{tag}", cache=str(cache), keep_last=0),
                        RunContext(D.Dist(), out=cache), uploader=kind)
        mirror._checked = mirror.reached = True  # a fresh URL: nothing to check or pull
        mirror.start()
        time.sleep(SETTLE_S)
        x = torch.randn(n, n)

        def step() -> float:
            t = time.perf_counter()
            (x @ x).sum().item()
            return time.perf_counter() - t

        before = [step() for _ in range(BASELINE_STEPS)]  # the baseline, jitter of a shared machine included
        t0 = time.perf_counter()
        mirror.checkpoint(1)
        handoff = time.perf_counter() - t0
        during = []
        while mirror.committed_step < 1:
            during.append(step())
        upload = time.perf_counter() - t0
        assert mirror.close(allow_local_only=True) == ""
    assert fs.exists(f"bench/{tag}/checkpoints/step_0000001.commit.json"), "the upload was not committed"
    fs.rm(f"bench/{tag}", recursive=True)  # moto holds it in memory
    stall = max(0.0, sum(during) - len(during) * statistics.mean(before)) + handoff
    return {"upload": upload, "handoff": handoff, "before": statistics.median(before),
            "during": statistics.median(during) if during else float("nan"), "steps": len(during), "stall": stall}


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    import torch
    from fixtures_remote import SECRET

    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(["nice", "-n", str(a.server_nice), sys.executable, "-m", "moto.server", "-H",
                               "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ.update({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_EC2_METADATA_DISABLED": "true"})
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, client_kwargs={"endpoint_url": f"http://127.0.0.1:{port}"})
    for _ in range(300):  # the server is up once it answers
        try:
            fs.mkdir("bench")
            break
        except OSError:
            time.sleep(0.1)
    size = a.size_mb << 20
    kinds = a.uploader or list(UPLOADERS)
    runs: list[tuple[str, dict[str, float | int]]] = []
    try:
        for r in range(a.repeat):
            for kind in kinds:
                name = kind if a.repeat == 1 else f"{kind} #{r + 1}"
                runs.append((name, _upload(kind, f"{kind}-{r}", fs, size, a.matmul, torch)))
    finally:
        server.terminate()
        server.wait()
    mb = size / 2**20

    def col(m: dict[str, float | int]) -> list[str]:
        rate = mb / m["upload"]
        big_s = CHECKPOINT_400M_GB * 1024 / rate
        big_stall = m["stall"] * big_s / m["upload"]
        pct = m["stall"] / EVERY_S * 100
        return [f"{mb:,.0f} MB", f"{m['upload']:.2f} s", f"{rate:,.0f} MB/s", f"{m['handoff'] * 1e6:,.0f} us",
                f"{m['before'] * 1e3:.2f} ms", f"{m['during'] * 1e3:.2f} ms", f"{m['steps']}", f"{m['stall']:.3f} s",
                f"{pct:.3f} % ({'met' if pct < TARGET_PCT else 'NOT met'})",
                f"{big_s:.0f} s upload, stall ~{big_stall:.1f} s ({big_stall / EVERY_S * 100:.2f} %)"]

    measures = ["checkpoint uploaded", "upload time", "throughput", "hand-off on the training thread",
                "median step before", "median step during upload", "steps during upload", "stall added to training",
                f"stall at 1 checkpoint / 10 min (target < {TARGET_PCT:g} %)", "400m checkpoint (4.68 GB) at this rate"]
    cols = [col(m) for _, m in runs]
    print(f"moto at nice {a.server_nice}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end")
    print(f"| measure | {' | '.join(n for n, _ in runs)} |\n|---|{'---|' * len(runs)}")
    for i, k in enumerate(measures):
        print(f"| {k} | {' | '.join(c[i] for c in cols)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
