"""The web export: a static site that runs the chat in the visitor's browser (wllama, onnxruntime-web)."""
