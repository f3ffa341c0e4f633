"""The training loop's components, one concern each, wired by training.trainer.Trainer.

    ranks.py            every rank saw the same thing, or one clear error (the one rank-agreement helper)
    run_folder.py       RunFolder: is --out ours, commit (marker first, run.json last)
    checkpointer.py     Checkpointer: newest complete checkpoint, resume, save, keep-N (state from components)
    step.py             ModelViews + TrainStep: the one training step (what benchmarks time, too)
    step_reads.py       StepReads: deferred host reads of loss and grad norm
    checks.py           RuntimeChecks: non-finite, gradient flow, loss spikes on the read values
    validator.py        Validator: the validation loss on its cadence
    early_stopping.py   EarlyStopping: patience on the validation loss
    metrics_logger.py   MetricsLogger: log.jsonl, tracking, curves, throughput, progress lines
    preemption.py       PreemptionStop: a signal agreed by every rank ends the run on a checkpoint

Each owns its cadence (`should_*`) and its state (`state_dict`/`load_state_dict` where it outlives a
process); collaborators are constructor arguments, so a test builds one alone.
"""
