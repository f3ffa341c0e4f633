"""The GGUF export: gguf-py writing F32/F16, llama.cpp's quantizer and tools, importance matrices, adapter GGUFs, ollama Modelfiles."""
