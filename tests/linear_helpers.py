"""Shared by the linear-layer tests (tests/quant_methods/test_linear.py, tests/tp2_worker.py)."""


def load_tensors(layer, tensors: dict, shard_id) -> None:
    """Feed checkpoint tensors to a vLLM linear layer's parameters through their weight
    loaders, as vLLM's model loader does (shard_id None for an unmerged layer)."""
    for name, t in tensors.items():
        p = getattr(layer, name)
        if shard_id is None:
            p.weight_loader(p, t)
        else:
            p.weight_loader(p, t, shard_id)
