"""prodip export: HF safetensors, ONNX and GGUF files from a training checkpoint, verified by parity.

`python -m export {safetensors,onnx,gguf,all,parity} RUN_DIR|CHECKPOINT_DIR` (see export.__main__).
`export` imports `training` and `serving`, never the other way round.
"""


class ExportError(ValueError):
    """A clear, one-line reason why an export was refused or failed."""
