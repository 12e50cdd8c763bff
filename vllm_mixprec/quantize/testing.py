"""Tiny random Llama / Qwen2 models and a character tokenizer for tests (no downloads)."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 128  # ASCII characters


def char_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i): i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # every character is a token
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="?", eos_token="\n")


def tiny_config(arch: str = "llama", **over):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=(arch == "llama"))
    common.update(over)
    if arch == "llama":
        cfg = LlamaConfig(**common)
        cfg.architectures = ["LlamaForCausalLM"]
    else:
        cfg = Qwen2Config(**common)
        cfg.architectures = ["Qwen2ForCausalLM"]
    return cfg


def tiny_model(arch: str = "llama", seed: int = 0, outlier_channels: int = 3, **over):
    """A random model with a few large activation channels (so smoothing has work to do)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **over), dtype=torch.float32,
                                             attn_implementation="sdpa")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.fill_(1.0)
                norm.weight[torch.randperm(norm.weight.numel())[:outlier_channels]] = 20.0
        model.model.norm.weight.fill_(1.0)
    return model.eval()


def save_tiny(path: str | Path, arch: str = "llama", seed: int = 0, dtype=torch.bfloat16, **over) -> Path:
    path = Path(path)
    model = tiny_model(arch, seed, **over).to(dtype)
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def calib_text_file(path: str | Path, chars: int = 20000, seed: int = 0) -> Path:
    """Pseudo-English text of lowercase words (deterministic)."""
    g = torch.Generator().manual_seed(seed)
    letters = "etaoinshrdlucmfwypvbgkqjxz"
    words = []
    n = 0
    while n < chars:
        length = int(torch.randint(1, 9, (1,), generator=g))
        idx = torch.randint(0, len(letters), (length,), generator=g)
        w = "".join(letters[int(i) % 13 if int(i) % 3 else int(i)] for i in idx)
        words.append(w)
        n += length + 1
    Path(path).write_text(" ".join(words) + "\n")
    return Path(path)
