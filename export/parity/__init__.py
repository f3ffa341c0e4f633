"""Parity: every exported file against the PyTorch fp32 checkpoint, native, in a browser, on aarch64 kernels, adapters included."""
