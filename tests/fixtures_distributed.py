"""torchrun entry points for tests/test_distributed.py.

`torchrun … tests/fixtures_distributed.py ARGS`: train.main with a defect on rank 1 only.

Rank 1 builds every optimizer after its training one over stale parameter copies, so its
overfit-one-batch gate (which steps the live DDP model with a fresh optimizer from the run's factory,
each rank judging its own batch's loss) fails while rank 0's passes: the gate verdicts differ between
ranks, both ranks step the gate's collectives alike until the budget ends, and both must stop together.

`torchrun … tests/fixtures_distributed.py rank0_reads ARGS`: train.main where every rank but 0 fails
if it reads a checkpoint's tensors in full (safetensors' load_file): a resume must broadcast them
from rank 0 instead of loading the whole state into every rank's memory.

`torchrun … tests/fixtures_distributed.py compile_counters ARGS`: train.main, then one JSON file per rank
(OUT.compile.rankN.json beside --out OUT) with dynamo's counters (graphs, frames, graph breaks), also
as they stood when each validation started.

`torchrun … tests/fixtures_distributed.py fused_adamw`: the fused AdamW kernel (what train.py uses on
CUDA) stepping FSDP2's DTensor parameters agrees with the unfused one; prints one JSON line per rank.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (str(HERE.parent), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import gates_plants as P  # noqa: E402

import training.train as T  # noqa: E402
from training import optim  # noqa: E402

FAULTY_RANK = 1


def plant_faulty_optimizers() -> None:
    """Every optimizer after the training one (the overfit gate's) steps stale parameter copies: the
    plant replaces training.optim.make_optimizer, the one factory the Trainer builds optimizers with."""
    real, built = optim.make_optimizer, []

    def make(module, cfg, device):
        built.append(module)
        if len(built) == 1:  # the first one is the training optimizer: left intact
            return real(module, cfg, device)
        return P.stale_optimizer(lambda m: real(m, cfg, device))(module)

    optim.make_optimizer = make


def main(argv: list[str]) -> int:
    if argv[:1] == ["fused_adamw"]:
        return fused_adamw_on_dtensors()
    if argv[:1] == ["compile_counters"]:
        return compile_counters(argv[1:])
    if argv[:1] == ["rank0_reads"]:
        if int(os.environ.get("RANK", "0")) != 0:
            from training.checkpoint import checkpoint_io as checkpoint

            def refuse(*a, **k):
                raise AssertionError(f"rank {os.environ['RANK']} read a whole tensor file: {a[:1]}")

            checkpoint.load_file = refuse  # what checkpoint.load and optimizer_and_rng read full files with
        return T.main(argv[1:])
    if int(os.environ.get("RANK", "0")) == FAULTY_RANK:
        plant_faulty_optimizers()
    return T.main(argv)


def compile_counters(argv: list[str]) -> int:
    """train.main(argv) under --compile, then what dynamo compiled on this rank (#27 item 1)."""
    import json

    from torch._dynamo.utils import counters

    from training.loop.validator import Validator

    at_validation: list[list[int]] = []
    validate = Validator.validate

    def counted(self):
        at_validation.append([counters["stats"]["unique_graphs"], counters["frames"]["ok"]])
        return validate(self)

    Validator.validate = counted
    rc = T.main(argv)
    row = json.dumps({"rank": int(os.environ.get("RANK", "0")), "rc": rc,
                      "unique_graphs": counters["stats"]["unique_graphs"], "frames_ok": counters["frames"]["ok"],
                      "graph_breaks": dict(counters["graph_break"]), "at_validation": at_validation})
    out = Path(argv[argv.index("--out") + 1])  # a file per rank beside the run: the ranks share stdout
    (out.parent / f"{out.name}.compile.rank{os.environ.get('RANK', '0')}.json").write_text(row + "\n")
    return rc


def fused_adamw_on_dtensors(steps: int = 3) -> int:
    import json

    import torch

    from training import distributed as D
    from training.model.decoder import Transformer, preset

    d = D.setup("cpu")
    cpu = torch.device("cpu")
    final = {}
    for fused in (False, True):
        torch.manual_seed(0)
        model = D.wrap(Transformer(preset("tiny")), d, fsdp=True, device=cpu)
        initial = {k: v.clone() for k, v in D.full_model_state(model).items()}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=fused)
        x = torch.randint(0, model.cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(d.rank))
        for _ in range(steps):
            _, loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        final[fused] = D.full_model_state(model)
        dtensor = all(hasattr(p, "full_tensor") for p in model.parameters())
    diff = max((final[True][k] - final[False][k]).abs().max().item() for k in final[True])
    moved = max((final[True][k] - initial[k]).abs().max().item() for k in final[True])
    # One write per line: print() writes the text and its newline separately, so two ranks sharing
    # the pipe could interleave them into "{...}{...}\n" (seen in CI).
    row = json.dumps({"rank": d.rank, "dtensor_params": dtensor, "max_diff": diff, "moved": moved})
    sys.stdout.write(row + "\n")
    sys.stdout.flush()
    D.teardown(d)
    return 0


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    sys.exit(main(sys.argv[1:]))
