"""Triton (CUDA) kernels registered as torch custom ops."""
