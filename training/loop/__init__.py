"""The training loop's components, one concern each, wired by training.trainer.Trainer.

    rank_agreement.py   every rank saw the same thing, or one clear error (the one rank-agreement helper)
    run_folder.py       RunFolder: is --out ours, commit (marker first, run.json last)
    checkpointer.py     Checkpointer: newest complete checkpoint, resume, save, keep-N (state from components)
    step.py             ModelViews + TrainStep: the one training step (what benchmarks time, too)
    step_reads.py       StepReads: deferred host reads of loss and grad norm
    runtime_checks.py   RuntimeChecks: non-finite, gradient flow, loss spikes on the read values
    validator.py        Validator: the validation loss on its cadence
    early_stopping.py   EarlyStopping: patience on the validation loss
    preemption.py       PreemptionStop: a signal agreed by every rank ends the run on a checkpoint
    preempt_signals.py  the SIGTERM/SIGUSR1 handlers and the agreed poll PreemptionStop reads
    run_inputs.py       RunInputs: everything a run reads before anything is written
    preflight_runner.py Preflight: the pre-flight gates on the exact object that trains
    init_from.py        HFInit: --init-from a Hugging Face Llama folder
    run_lock.py         RunLock: one advisory lock per run folder
    weight_cast.py      CastOnce: bf16 weight copies once per optimizer step

Beside the loop, in rooms of their own: the metrics logger (training.telemetry) and the mirror of a
run whose --out is a store URL (training.mirror).

Each owns its cadence (`should_*`) and its state (`state_dict`/`load_state_dict` where it outlives a
process). Each is built whole: its collaborators are constructor arguments (nothing is set on it
afterwards), with the run's frozen training.run_context.RunContext (dist, device, out, kind, log, say)
and its own frozen section of the settings (training.config_sections), so a test builds one alone.
"""
