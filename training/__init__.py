"""prodip training: the shared base every stage stands on, and the training stage.

The base (imports no stage code; serving, export and demo stand on it):
    model/        ModelConfig and the one Llama decoder, HF/GGUF name maps, --init-from, LoRA layers, log-probs
    text/         normalization, the SentencePiece tokenizer, the chat template, fertility, well-formedness
    checkpoint/   the one checkpoint format: read, write (atomic, async, keep-N), verify, FSDP shards, adapters
    runfiles/     every file name of a run/data/export folder, the JSON record reader, the schema, the CLI harness
    store/        store URLs, run and data folders in object storage, the mirror's uploader
The training stage:
    prepare/ (corpus -> shards + tokenizer) · data/ (shards, loaders, SFT records) · loop/ (the Trainer's
    components) · gates/ · evaluate/ · telemetry/ (what a run logs) · mirror/ (a run trained into a store URL)
    · train.py, sft.py, trainer.py, train_config.py, run_plan.py, optim.py, schedule.py, distributed.py, lora_run.py

`training` imports no other prodip stage (serving, export and demo import it).
"""
