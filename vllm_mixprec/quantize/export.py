"""Write a checkpoint folder atomically: safetensors shards, config.json, tokenizer files.

Everything is written into a hidden temp folder next to the target, flushed to disk
(fsync), and renamed into place at the end, so a crash, a full disk or a power loss never
leaves a complete-looking output: the target either does not exist (or still holds the
previous output, with --overwrite) or holds the whole new checkpoint.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from .models import fix_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "chat_template.jinja", "added_tokens.json")
SHARD_BYTES = 2 * 1024**3
DISK_MARGIN = 64 * 1024**2


class ExportError(RuntimeError):
    pass


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _shards(tensors: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    shards, cur, size = [], {}, 0
    for name in sorted(tensors):
        t = tensors[name]
        b = t.numel() * t.element_size()
        if cur and size + b > limit:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = t.contiguous()
        size += b
    if cur or not shards:
        shards.append(cur)
    return shards


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """Flush every file of `folder`, then the folder itself (its directory entries)."""
    for f in sorted(folder.iterdir()):
        if f.is_file():
            _fsync_path(f)
    _fsync_path(folder)


def write_checkpoint(out_dir: str | Path, tensors: dict[str, torch.Tensor], config: dict,
                     source_dir: str | Path, quantization_config: dict | None,
                     overwrite: bool = False, shard_bytes: int = SHARD_BYTES) -> Path:
    """Write the folder; `config` is the source config.json content (modified copy written)."""
    out = Path(out_dir).resolve()
    if out.exists() and not overwrite:
        raise ExportError(f"output {out} already exists (pass --overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    need = tensor_bytes(tensors) + DISK_MARGIN
    free = shutil.disk_usage(out.parent).free
    if free < need:
        raise ExportError(f"not enough disk space in {out.parent}: {free / 2**20:.0f} MiB free, "
                          f"{need / 2**20:.0f} MiB needed")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        shards = _shards(tensors, shard_bytes)
        weight_map = {}
        for i, shard in enumerate(shards):
            fn = "model.safetensors" if len(shards) == 1 else \
                f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / fn), metadata={"format": "pt"})
            weight_map.update({name: fn for name in shard})
        if len(shards) > 1:
            index = {"metadata": {"total_size": tensor_bytes(tensors)}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        cfg = dict(config)
        cfg.pop("quantization_config", None)
        if quantization_config is not None:
            cfg["quantization_config"] = quantization_config
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        for fn in TOKENIZER_FILES:
            if (Path(source_dir) / fn).exists():
                shutil.copy2(Path(source_dir) / fn, tmp / fn)
        fix_config(tmp)  # rope_theta / torch_dtype / tokenizer_class fix-ups
        tmp.chmod(0o755)
        _fsync_tree(tmp)  # the data is on disk before the name says "complete"
        if out.exists():  # overwrite: move the old one aside first, so a crash keeps one of them
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            try:
                tmp.rename(out)
            except BaseException:
                old.rename(out)  # put the previous output back
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
        _fsync_path(out.parent)  # the rename itself
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
