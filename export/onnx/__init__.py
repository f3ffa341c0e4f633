"""The ONNX export: the graph, its weights, its own checks, the Hugging Face files beside it, ONNX Runtime GenAI's files."""
