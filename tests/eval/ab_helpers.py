"""Shared by the A/B harness tests (test_ab_checkpoints.py, test_ab_harness.py)."""
from vllm_mixprec.eval import synthetic as syn

# Llama layout at toy size: GQA 4/2, head_dim 64; K and N divisible by both group sizes
TINY = syn.LlamaShape(hidden=256, layers=2, heads=4, kv_heads=2, inter=512, vocab=1024, max_pos=4096, name="tiny")
