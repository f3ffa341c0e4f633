"""The runtimes behind serving.Backend: PyTorch, ONNX Runtime, llama.cpp (with LoRA adapters), transformers."""
