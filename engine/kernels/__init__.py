"""Triton kernels for the CUDA path: paged decode attention and multi-LoRA for decode steps."""
