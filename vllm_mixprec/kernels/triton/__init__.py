"""Triton kernels: the portable path (sm80+), and what the CPU interpreter tests."""
