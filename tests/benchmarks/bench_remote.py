"""Upload throughput of a checkpoint to an S3-compatible server, and the stall it adds to training.

    python tests/benchmarks/bench_remote.py --size-mb 256

Starts moto's server on 127.0.0.1 in its own process (its request handling must not share this
process's GIL, as a real store does not), writes a checkpoint folder of
--size-mb (three files: weights, optimizer moments, state), and runs a training-like loop (one fp32
matmul per "step") on the main thread while training.loop.mirror.Mirror uploads that checkpoint on
its thread, as train.py does. Prints one table: upload seconds and MB/s, the time the training thread
spent handing the checkpoint over (Mirror.checkpoint), the median step before and during the
upload, and the stall the upload added (the steps' time during the upload minus as many steps at
the baseline's mean, plus the hand-off), also as a
share of training time at one checkpoint per 10 minutes. moto keeps objects in memory: a full
`400m` checkpoint (~4.7 GB) is extrapolated from the rate, not uploaded.
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python tests/benchmarks/bench_remote.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=256, help="checkpoint size to upload (default 256)")
    p.add_argument("--matmul", type=int, default=384, help="the step: one NxN fp32 matmul (default 384)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    import torch
    from fixtures_remote import SECRET

    from training import distributed as D
    from training.config import TrainConfig
    from training.loop.mirror import Mirror

    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        step_dir = cache / "checkpoints" / "step_0000001"
        step_dir.mkdir(parents=True)
        size = a.size_mb << 20
        for name, share in (("model.safetensors", 1 / 3), ("optim.safetensors", 2 / 3 - 1e-3), ("state.json", 1e-3)):
            (step_dir / name).write_bytes(os.urandom(int(size * share)))
        mirror = Mirror("s3://bench/run", cache, D.Dist(), TrainConfig(keep_last=0), say=lambda m: None)
        mirror._checked = mirror.reached = True  # a fresh URL: nothing to check or pull
        mirror.start()
        x = torch.randn(a.matmul, a.matmul)

        def step() -> float:
            t = time.perf_counter()
            (x @ x).sum().item()
            return time.perf_counter() - t

        before = [step() for _ in range(2000)]  # the baseline, jitter of a shared machine included
        t0 = time.perf_counter()
        mirror.checkpoint(1)
        handoff = time.perf_counter() - t0
        during = []
        while mirror.committed_step < 1:
            during.append(step())
        upload = time.perf_counter() - t0
        mirror.close(allow_local_only=True)
    server.terminate()
    server.wait()
    med = statistics.median(before)
    stall = max(0.0, sum(during) - len(during) * statistics.mean(before)) + handoff
    mb = size / 2**20
    rate = mb / upload
    big_s = CHECKPOINT_400M_GB * 1024 / rate
    rows = [("checkpoint uploaded", f"{mb:,.0f} MB"), ("upload time", f"{upload:.2f} s"), ("throughput", f"{rate:,.0f} MB/s"),
            ("hand-off on the training thread", f"{handoff * 1e6:,.0f} us"), ("median step before", f"{med * 1e3:.2f} ms"),
            ("median step during upload", f"{statistics.median(during) * 1e3:.2f} ms" if during else "-"),
            ("steps during upload", f"{len(during)}"), ("stall added to training", f"{stall:.3f} s"),
            ("stall at 1 checkpoint / 10 min", f"{stall / 600 * 100:.3f} % of training time"),
            ("400m checkpoint (4.68 GB) at this rate", f"{big_s:.0f} s upload, stall ~{stall * big_s / upload:.1f} s "
             f"({stall * big_s / upload / 600 * 100:.2f} % at 1 / 10 min)")]
    print("| measure | value |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
