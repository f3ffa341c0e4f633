"""prodip serving: one Backend interface over llama.cpp (GGUF), ONNX Runtime and PyTorch checkpoints."""

from serving.backend import Backend, SamplingParams, load

__all__ = ["Backend", "SamplingParams", "load"]
